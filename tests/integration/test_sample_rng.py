"""`steadyload.sample_rng()` (#40 item 1): a sample's draws from torch, `random` and numpy
are the same with num_workers=0 and with 2 workers of every kind, under sample_seeds=True;
real workers, real draws."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import steadyload as sl
from tests.datasets import MapDS


class DrawsThree(MapDS):
    """Sample i: (i, a draw from each of the sample's generators)."""

    def __getitem__(self, i: int) -> Any:
        rng = sl.sample_rng()
        return torch.tensor([
            float(i),
            torch.rand(1, generator=rng.torch_generator).item(),
            rng.random_generator.random(),
            float(rng.numpy_generator.random()),
        ], dtype=torch.float64)  # fmt: skip


def _draws(**kwargs: Any) -> list[list[float]]:
    loader = sl.DataLoader(DrawsThree(24), batch_size=4, sample_seeds=True,
                           generator=torch.Generator().manual_seed(7), **kwargs)  # fmt: skip
    return [row for batch in loader for row in batch.tolist()]


@pytest.mark.timeout(120)
def test_sample_rng_draws_the_same_in_every_layout() -> None:
    alone = _draws(num_workers=0)
    assert [row[0] for row in alone] == list(range(24))
    assert len({tuple(row[1:]) for row in alone}) == 24  # every sample draws its own
    for worker_type in ("thread", "process", "auto"):
        assert _draws(num_workers=2, worker_type=worker_type) == alone, worker_type
    assert _draws(num_workers=3, worker_type="thread") == alone
    # The next epoch draws anew, the same way in every layout again.
    loader = sl.DataLoader(DrawsThree(8), batch_size=4, sample_seeds=True, num_workers=2,
                           generator=torch.Generator().manual_seed(7))  # fmt: skip
    first, second = [torch.cat(list(loader)).tolist() for _ in range(2)]
    assert first != second


def test_outside_a_worker_sample_rng_is_this_processes_own() -> None:
    rng = sl.sample_rng()
    state = torch.get_rng_state()
    torch.rand(3, generator=rng.torch_generator)
    assert torch.equal(torch.get_rng_state(), state)  # not the process-wide generator
    assert sl.sample_rng() is rng
