"""worker_type="auto" where a process worker is a fork away (the zygote runs, as it does
for the whole test session): it starts on processes, measures inside them, and keeps them
or hands over to threads, losing and repeating nothing.

The choice is forced (`force_auto`) where the hand-over is what is tested; the rule is
tested with injected measurements (tests/unit/test_worker_kind.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import get_worker_info

import steadyload as sl
from steadyload.engine.worker.status import SETTLED
from tests.datasets import KillsInAProcess, MapDS

pytestmark = pytest.mark.timeout(120)


class WhereLoaded(MapDS):
    """Sample i: (i, 1 if a process worker loaded it else 0)."""

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        return torch.tensor([i, int(info is not None and info.worker_method == "multiprocessing")])


def _loaded(loader: Any) -> tuple[list[int], list[int]]:
    rows = [row for batch in loader for row in batch.tolist()]
    return [i for i, _ in rows], [p for _, p in rows]


def test_auto_starts_on_processes_and_hands_over_to_threads(force_auto: Any) -> None:
    force_auto("thread")
    loader = sl.DataLoader(WhereLoaded(160), batch_size=4, num_workers=2, worker_type="auto")
    order, in_process = _loaded(loader)
    assert order == list(range(160))  # every sample once, in order, across the hand-over
    assert in_process[0] == 1 and in_process[-1] == 0, in_process  # processes, then threads
    report = loader.report()
    assert report.worker_kind == "thread" and report.start_method is None, report
    assert report.worker_type_choice == (
        "worker_type='auto' chose thread workers: forced by the test (thread); the first "
        "batches came from process workers while it measured"
    )
    # The next epoch starts on threads at once: the choice is kept.
    order, in_process = _loaded(loader)
    assert order == list(range(160)) and not any(in_process)


def test_auto_keeps_the_processes_it_measured_on(force_auto: Any) -> None:
    force_auto("process")
    loader = sl.DataLoader(WhereLoaded(64), batch_size=4, num_workers=2, worker_type="auto")
    order, in_process = _loaded(loader)
    assert order == list(range(64)) and all(in_process)
    report = loader.report()
    assert report.worker_kind == "process" and report.start_method == "zygote", report
    choice = report.worker_type_choice or ""
    assert choice == "worker_type='auto' chose process workers: forced by the test (process)"
    assert all(w.pid != os.getpid() for w in report.workers)


def test_the_kept_choice_stops_every_process_workers_measuring(force_auto: Any) -> None:
    """Once auto keeps processes their GIL probes and draw checks stop (`SETTLED` in each
    status block), also in a worker respawned after the choice."""
    force_auto("process")
    loader = sl.DataLoader(WhereLoaded(64), batch_size=4, num_workers=2, worker_type="auto")
    it = iter(loader)
    for _ in range(4):
        next(it)
    pool = it._pool._procs  # type: ignore[attr-defined]
    assert it._pool._kept  # type: ignore[attr-defined]
    assert all(h.status._fields[SETTLED] == 1 for h in pool._live)
    it._pool.kill(0)  # type: ignore[attr-defined]
    rest = [row[0] for row in next(it).tolist()]
    while not loader.report().restarts:
        rest += [row[0] for row in next(it).tolist()]
    assert len(pool._live) == 2  # the respawned worker runs
    assert all(h.status._fields[SETTLED] == 1 for h in pool._live)
    rest += [row[0] for batch in it for row in batch.tolist()]
    assert rest == list(range(16, 64))  # nothing lost or repeated across the death


def test_a_process_killed_before_the_hand_over_to_threads_loses_and_repeats_nothing(
    force_auto: Any, tmp_path: Path
) -> None:
    force_auto("thread")
    ds = KillsInAProcess(80, 0, str(tmp_path))  # the first sample a process loads
    want = [b.tolist() for b in torch.utils.data.DataLoader(ds, batch_size=4)]  # no worker
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, worker_type="auto")
    assert [b.tolist() for b in loader] == want
    report = loader.report()
    assert [r.cause for r in report.restarts] == ["killed by SIGKILL"]
    assert report.worker_kind == "thread" and (tmp_path / "k").exists()


class BigSamples(MapDS):
    """Sample i: 5 MiB of float i (a batch of 2 is 10 MiB, past `BIG_BATCH_BYTES`)."""

    def __getitem__(self, i: int) -> Any:
        return torch.full((5 << 18,), float(i))


def test_auto_keeps_processes_for_big_batches_once_each_worker_loaded_one() -> None:
    """No GIL figures are waited for: one batch from each worker decides, and the probes
    and draw checks stop there (`SETTLED`)."""
    loader = sl.DataLoader(BigSamples(16), batch_size=2, num_workers=2, worker_type="auto")
    it = iter(loader)
    firsts = [next(it)[:, 0].tolist() for _ in range(2)]  # one from each worker
    assert it._pool._kept  # type: ignore[attr-defined]
    assert all(h.status._fields[SETTLED] == 1 for h in it._pool._procs._live)  # type: ignore[attr-defined]
    rest = [batch[:, 0].tolist() for batch in it]
    assert firsts + rest == [[float(i), float(i + 1)] for i in range(0, 16, 2)]
    report = loader.report()
    assert report.worker_kind == "process" and report.start_method == "zygote", report
    assert re.fullmatch(  # 2, or more if one worker ran ahead of the other
        r"worker_type='auto' chose process workers: the first \d batches average 10 MiB: "
        r"process workers deliver batches this big about as fast as thread workers \(each "
        r"is written once, into shared memory\) and a hand-over's stop costs more than "
        r"threads would save, so processes are kept whatever the GIL does",
        report.worker_type_choice or "",
    ), report.worker_type_choice


class WaitsAndDraws(MapDS):
    """Leaves the GIL free (it waits), but draws from torch's process-wide generator."""

    def __getitem__(self, i: int) -> Any:
        import time

        time.sleep(0.002)
        return torch.rand(1)


def test_auto_keeps_processes_for_a_dataset_that_draws_from_the_global_generators() -> None:
    """Measured on processes, the draw is seen there (the next event after it): thread
    workers would share those generators, so the GIL-free work stays on processes."""
    loader = sl.DataLoader(WaitsAndDraws(400), batch_size=4, num_workers=2, worker_type="auto")
    assert len(list(loader)) == 100  # and no warning: a process's generators are its own
    report = loader.report()
    assert report.worker_kind == "process", report
    assert report.worker_type_choice == (
        "worker_type='auto' chose process workers: the dataset draws from the process-wide "
        "random generators, which thread workers share"
    )


def test_auto_with_sample_seeds_keeps_processes_and_says_why() -> None:
    loader = sl.DataLoader(WhereLoaded(64), batch_size=4, num_workers=2, worker_type="auto",
                           sample_seeds=True)  # fmt: skip
    order, in_process = _loaded(loader)
    assert order == list(range(64)) and all(in_process)
    assert "sample_seeds=True reseeds a process worker's process-wide random generators" in (
        loader.report().worker_type_choice or "")
