"""A fourth kind (tests/fake_kind.py: a link and a cause) heals through the one recovery.

The loader is asked for thread workers and handed wire workers instead, so the iterator,
its task table and `Recovery.on_died` run unchanged over a kind they have never seen: a
worker that dies is replaced, its batches re-run, and the cause's own words reach the
restart list.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import steadyload as sl
from steadyload.engine import factory
from steadyload.iterators import workers
from tests import fake_kind


class ExitsOnce(Dataset[torch.Tensor]):
    """Sample 5 ends its worker (SystemExit, not a dataset error) the first time only."""

    def __init__(self) -> None:
        self.exited = False

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5 and not self.exited:
            self.exited = True
            raise SystemExit(3)
        return torch.tensor([i, i * i])


def test_a_wire_worker_that_dies_is_replaced_and_its_batches_rerun(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[Any] = []

    def make_pool(plan: Any, config: Any, num_workers: int, checks: Any) -> Any:
        assert plan == factory.THREADS  # what the loader asked for; it gets wire workers
        pool = fake_kind.pool(config, num_workers)
        pool.start()
        made.append(pool)
        return pool

    monkeypatch.setattr(workers, "make_pool", make_pool)
    loader = sl.DataLoader(ExitsOnce(), batch_size=2, num_workers=2, worker_type="thread")
    with caplog.at_level(logging.WARNING, logger="steadyload"):
        got = list(loader)
    expected = [torch.tensor([[i, i * i], [i + 1, (i + 1) ** 2]]) for i in range(0, 16, 2)]
    assert len(got) == 8 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert made and made[0].kind == fake_kind.KIND
    restarts = loader.report().restarts
    assert [(r.worker_id, r.cause, r.sample) for r in restarts] == [
        (0, "its wire was cut (SystemExit: 3)", 5)
    ]
    assert "worker 0 (pid" in caplog.text and "its wire was cut (SystemExit: 3)" in caplog.text
