"""The `WorkerPool` contract (engine/pool.py): what every kind of pool must do, driven
through the protocol alone, as the iterators drive it.

Each test runs on every kind in `KINDS` (a further kind is one line there). Every wait is
bounded: events are collected with ``pool.wait`` until a predicate holds or a deadline
passes (a failsafe, never a timing under test).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from steadyload import diagnosis
from steadyload.engine.config import WorkerConfig
from steadyload.engine.events import Cause, Died, Loss, Received
from steadyload.engine.pool import WorkerPool
from steadyload.engine.process.pool import ProcessPool
from steadyload.engine.protocol import Ready
from steadyload.engine.thread.pool import ThreadPool
from steadyload.engine.worker.fetch import MAP
from steadyload.errors import WorkerDiedError
from steadyload.start.context import resolve_context
from tests import fake_kind
from tests.datasets import MapDS

Event = tuple[int, object]
WAIT_S = 30.0  # a failsafe for a stuck pool on a loaded 2-core box, not a timing


def _process_pool(config: WorkerConfig, num_workers: int) -> WorkerPool:
    ctx, _start = resolve_context("forkserver", None, __name__)
    return ProcessPool(ctx, config, num_workers)


KINDS: dict[str, Callable[[WorkerConfig, int], WorkerPool]] = {
    "process": _process_pool,
    "thread": lambda config, num_workers: ThreadPool(config, num_workers),
    fake_kind.KIND: fake_kind.pool,  # a test-only kind: a link and a cause (tests/fake_kind.py)
}
"""kind -> build an unstarted pool of ``num_workers`` for ``config``."""


def _config(dataset: Dataset[Any], num_workers: int) -> WorkerConfig:
    """As iterators/workers.py builds it for a map-style dataset with batches."""
    return WorkerConfig(
        dataset_kind=MAP, dataset=dataset, auto_collation=True, collate_fn=default_collate,
        drop_last=False, base_seed=1234, worker_init_fn=None, num_workers=num_workers,
    )  # fmt: skip


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_pool(kind: str) -> Iterator[Callable[..., WorkerPool]]:
    """``make_pool(dataset, num_workers=2)``: a started pool of this test's kind; each one
    is shut down after the test (again: shutdown is idempotent)."""
    made: list[WorkerPool] = []

    def make(dataset: Dataset[Any], num_workers: int = 2) -> WorkerPool:
        pool = KINDS[kind](_config(dataset, num_workers), num_workers)
        made.append(pool)
        pool.start()
        return pool

    yield make
    for pool in made:
        pool.shutdown()


def _collect(
    pool: WorkerPool, done: Callable[[list[Event]], bool], what: str, timeout_s: float = WAIT_S
) -> list[Event]:
    """The pool's events until ``done(events)`` holds; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    events: list[Event] = []
    while not done(events):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what} not seen within {timeout_s} s; events: {events}")
        events += pool.wait(min(left, 0.5))
    return events


def _readies(events: list[Event]) -> list[int]:
    return [w for w, e in events if isinstance(e, Ready)]


def _death_of(event: Event) -> int | None:
    """The worker id of a death event, or None: the one place that knows its shape."""
    w, e = event
    return w if isinstance(e, Died) else None


def _received(events: list[Event], task_id: int) -> Received | None:
    return next((e for _, e in events if isinstance(e, Received) and e.done.task_id == task_id),
                None)  # fmt: skip


def _started(pool: WorkerPool, num_workers: int = 2) -> list[Event]:
    """The start's events: one `Ready` per worker."""
    return _collect(pool, lambda ev: sorted(_readies(ev)) == list(range(num_workers)),
                    f"a Ready from each of {num_workers} workers")  # fmt: skip


def _run(pool: WorkerPool, worker_id: int, task_id: int, indices: list[int]) -> Any:
    pool.send_task(worker_id, task_id, indices)
    events = _collect(pool, lambda ev: _received(ev, task_id) is not None,
                      f"task {task_id} from worker {worker_id}")  # fmt: skip
    got = _received(events, task_id)
    assert got is not None
    return got.batch


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else bool(a == b)


class Naps(Dataset[Any]):
    """Sample ``at`` naps in `nap_in_getitem` until a gate file exists (at most 60 s)."""

    def __init__(self, n: int, at: int, gate: str) -> None:
        self.n, self.at, self.gate = n, at, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.at:
            nap_in_getitem(self.gate)
        return torch.tensor(i)


def nap_in_getitem(gate: str) -> None:
    until = time.monotonic() + 60
    while not Path(gate).exists() and time.monotonic() < until:
        time.sleep(0.01)


def test_start_gives_one_ready_per_worker(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(MapDS(8))
    events = _started(pool)
    assert sorted(_readies(events)) == [0, 1]
    assert pool.running and not pool.stopped
    assert all(isinstance(e, Ready) and e.pid > 0 for _, e in events if isinstance(e, Ready))


@pytest.mark.parametrize("dataset_kind", ["tensor", "dict", "tuple"])
def test_a_task_comes_back_as_the_default_collate_of_its_samples(
    make_pool: Callable[..., WorkerPool], dataset_kind: str
) -> None:
    ds = MapDS(8, dataset_kind)
    pool = make_pool(ds)
    _started(pool)
    for task_id, (w, indices) in enumerate([(0, [0, 1, 2]), (1, [5, 3]), (0, [7])]):
        batch = _run(pool, w, task_id, indices)
        want = default_collate([ds[i] for i in indices])
        if isinstance(want, dict):
            assert want.keys() == batch.keys()
            assert all(_same(batch[k], want[k]) for k in want)
        elif isinstance(want, list):
            assert len(batch) == len(want) and all(map(_same, batch, want))
        else:
            assert torch.equal(batch, want)


def test_a_killed_worker_is_reported_dead_and_its_replacement_works(
    make_pool: Callable[..., WorkerPool]
) -> None:
    pool = make_pool(MapDS(8))
    _started(pool)
    pid = pool.pid(1)
    pool.kill(1)
    events = _collect(pool, lambda ev: any(_death_of(e) == 1 for e in ev), "worker 1's death")
    assert [_death_of(e) for e in events if _death_of(e) is not None] == [1]
    died = next(e for w, e in events if _death_of((w, e)) == 1)
    assert isinstance(died, Died) and died.pid == pid and died.worker_id == 1
    assert died.kind == pool.kind and isinstance(died.cause, Cause)  # the kind's own cause
    evidence = diagnosis.Evidence()
    loss = Loss(1, pid, None, [4, 5], 1, [], evidence, outcome="steadyload re-ran it.")
    error = died.cause.explain(loss)
    assert isinstance(error, WorkerDiedError) and "steadyload re-ran it." in str(error)
    assert "worker 1" in str(error)
    pool.respawn(1)
    events = _collect(pool, lambda ev: 1 in _readies(ev), "the replacement's Ready")
    assert _readies(events) == [1]
    assert torch.equal(_run(pool, 1, 0, [4, 5]), default_collate([MapDS(8)[4], MapDS(8)[5]]))
    assert torch.equal(_run(pool, 0, 1, [6]), default_collate([MapDS(8)[6]]))  # the other


def test_after_a_reset_every_worker_still_takes_tasks(
    make_pool: Callable[..., WorkerPool]
) -> None:
    ds = MapDS(8)
    pool = make_pool(ds)
    _started(pool)
    assert torch.equal(_run(pool, 0, 0, [0]), default_collate([ds[0]]))
    pool.send_reset()
    for task_id, w in enumerate([0, 1], start=1):
        assert torch.equal(_run(pool, w, task_id, [w + 2]), default_collate([ds[w + 2]]))


def test_progress_and_stack_show_a_slow_sample(
    make_pool: Callable[..., WorkerPool], tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    pool = make_pool(Naps(8, at=3, gate=str(gate)))
    _started(pool)
    pool.send_task(1, 7, [2, 3, 4])
    deadline = time.monotonic() + WAIT_S

    def at_sample_3() -> bool:
        p = pool.progress(1)
        return p is not None and p.task_id == 7 and p.position == 1

    while not at_sample_3():  # the worker reports before the sample: wait for it (bounded)
        assert time.monotonic() < deadline, f"progress of task 7 not seen: {pool.progress(1)}"
        pool.wait(0.05)
    other = pool.progress(0)
    assert other is None or other.task_id != 7  # the task is worker 1's alone
    stack = pool.dump_stack(1, wait_s=WAIT_S)
    assert "nap_in_getitem" in stack, stack
    gate.touch()
    events = _collect(pool, lambda ev: _received(ev, 7) is not None, "task 7")
    got = _received(events, 7)
    assert got is not None and got.batch.tolist() == [2, 3, 4]


def _steadyload_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("steadyload")]


def _live_children() -> list[int]:
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_shutdown_is_idempotent_and_leaves_nothing_behind(
    make_pool: Callable[..., WorkerPool]
) -> None:
    children, threads = set(_live_children()), set(_steadyload_threads())
    pool = make_pool(MapDS(8))
    _started(pool)
    pids = {pool.pid(w) for w in (0, 1)}
    assert torch.equal(_run(pool, 0, 0, [1]), default_collate([MapDS(8)[1]]))
    pool.shutdown()
    assert pool.stopped and not pool.running
    pool.shutdown()  # again: nothing to do, nothing raised
    assert pool.stopped
    assert not multiprocessing.active_children()
    ours = pids - {None} - set(children) - {psutil.Process().pid}
    deadline = time.monotonic() + WAIT_S
    while set(_live_children()) & ours or set(_steadyload_threads()) - threads:
        assert time.monotonic() < deadline, (
            f"left behind: processes {set(_live_children()) & ours}, "
            f"threads {set(_steadyload_threads()) - threads}")
        time.sleep(0.05)
