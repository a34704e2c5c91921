"""`RoutedPool`: several pools as one `WorkerPool`, each worker id's calls sent by a route.

The pool protocol (pool.py) is implemented here once for every composite pool:

- A call about one worker (`send_task`, `kill`, `progress`, ...) goes to ``route(worker_id)``,
  the pool that owns that id now. Local workers beside remote ones route by id (`by_id`);
  ``worker_type="auto"`` routes by phase, one kind then the other (choice/handover.py).
- A call about every worker (`send_reset`, `waitables`, `pending`, `collect`) goes to every
  running pool; `start` and `shutdown` reach every pool, a `shutdown` that raises included.
- One poll waits for all of them (`wait_any` over the pools), and their events come out as
  they are: the router adds, drops and reads none.
- What the iterator asks of the pool as a whole (`kind`, `start_method`, `preload`, `pids`)
  is the *lead* pool's: the first (the local workers, beside remote ones).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from .pool import REMOTE, Kind, ServerPool, WorkerPool, wait_any
from .worker.status import Progress


class _Joined(Sequence[Any]):
    """``iterator._workers``: each pool's views one after the other, in worker id order."""

    def __init__(self, pools: Sequence[WorkerPool]) -> None:
        self._pools = pools

    def __len__(self) -> int:
        return sum(len(pool.views) for pool in self._pools)

    def __getitem__(self, i: Any) -> Any:
        for pool in self._pools:  # views are read again each time: a respawn replaces one
            views = pool.views
            if i < len(views):
                return views[i]
            i -= len(views)
        raise IndexError(i)


class LeadViews(Sequence[Any]):
    """``iterator._workers`` of a pool whose lead changes (auto's hand-over): the lead's
    views, read again each time."""

    def __init__(self, lead: Callable[[], WorkerPool]) -> None:
        self._lead = lead

    def __len__(self) -> int:
        return len(self._lead().views)

    def __getitem__(self, i: Any) -> Any:
        return self._lead().views[i]


class RoutedPool:
    """Several pools as one: per-worker calls by ``route``, the others to every pool."""

    def __init__(self, pools: Sequence[WorkerPool], route: Callable[[int], WorkerPool]) -> None:
        """``pools`` in worker id order (their views are joined in that order); ``route``
        returns the pool that owns a worker id now (it may change, as under "auto")."""
        self._pools = list(pools)  # a subclass may add one later (the hand-over's processes)
        self._route = route
        self.views: Sequence[Any] = _Joined(self._pools)
        self.running = False

    def _lead(self) -> WorkerPool:
        """The pool that speaks for the whole (kind, start method, preloads, pids)."""
        return self._pools[0]

    def _live(self) -> list[WorkerPool]:
        """The pools whose workers run (a pool stopped early, like auto's threads, is out)."""
        return [pool for pool in self._pools if pool.running]

    def part(self, kind: Kind) -> WorkerPool | None:
        """The first pool whose workers are of ``kind`` now, or None."""
        return next((pool for pool in self._pools if pool.kind == kind), None)

    @property
    def remote(self) -> WorkerPool:
        """The remote workers' pool (iterators/scaling.py resizes it; `RemotePool.remote`
        is the pool itself, so either pool answers)."""
        pool = self.part(REMOTE)
        if pool is None:
            raise RuntimeError(
                "[steadyload internal error] remote workers asked of a pool without any; "
                "please report with the output of `steadyload doctor`"
            )
        return pool

    @property
    def kind(self) -> Kind:
        """The lead pool's kind (local workers beside remote ones: theirs)."""
        return self._lead().kind

    @property
    def start_method(self) -> str | None:
        """The lead pool's start method (None unless its workers are processes)."""
        return self._lead().start_method

    @property
    def preload(self) -> tuple[str, ...]:
        """What the lead pool's fork server was asked to import."""
        return self._lead().preload

    @property
    def stopped(self) -> bool:
        """Whether every pool has stopped."""
        return all(pool.stopped for pool in self._pools)

    @property
    def clock(self) -> Callable[[], float]:
        """The first pool's clock (the pools measure on one: `time.monotonic` by default)."""
        return self._pools[0].clock

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every pool, the last first: remote workers come last in id order, and Ray
        places their actors while the local workers start."""
        for pool in reversed(self._pools):
            pool.start()
        self.running = True

    def shutdown(self) -> None:
        """Stop every pool, even when stopping one raises (the first error is raised once
        all were asked); idempotent as the pools' own shutdowns are."""
        self.running = False
        first: BaseException | None = None
        for pool in self._pools:
            try:
                pool.shutdown()
            except BaseException as exc:  # the others' workers must stop all the same
                first = first or exc
        if first is not None:
            raise first

    def respawn(self, worker_id: int) -> None:
        """A fresh worker for ``worker_id``, by the pool that owns it."""
        self._route(worker_id).respawn(worker_id)

    def restart_server(self, method: str, pid: int) -> tuple[str, ...]:
        """A fork server died: the pool whose workers it forked starts a new one."""
        for pool in self._pools:
            if isinstance(pool, ServerPool):
                return pool.restart_server(method, pid)
        raise RuntimeError(
            f"[steadyload internal error] a fork server died under a {self.kind} pool; "
            "please report with the output of `steadyload doctor`"
        )

    # -- messaging ---------------------------------------------------------------------------
    def pid(self, worker_id: int) -> int | None:
        """The worker's process id."""
        return self._route(worker_id).pid(worker_id)

    def host(self, worker_id: int) -> str | None:
        """The machine the worker runs on (None: this one)."""
        return self._route(worker_id).host(worker_id)

    def pids(self) -> dict[int, int]:
        """The lead pool's pids (beside remote workers: the local ones, whose memory is
        sampled here)."""
        return self._lead().pids()

    def started_at(self, worker_id: int) -> float | None:
        """When the worker was asked for, on `clock`. [Unit: second]"""
        return self._route(worker_id).started_at(worker_id)

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Send a task to the pool that owns the worker."""
        self._route(worker_id).send_task(worker_id, task_id, indices, epoch)

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Where the worker's replica resumes, to the pool that owns it."""
        self._route(worker_id).send_restore(worker_id, state)

    def send_reset(self) -> None:
        """A new epoch, for every running pool."""
        for pool in self._live():
            pool.send_reset()

    def waitables(self) -> list[Any]:
        """The running pools' waitables (each pool armed)."""
        return [obj for pool in self._live() for obj in pool.waitables()]

    def pending(self) -> bool:
        """Whether any running pool has events queued."""
        return any([pool.pending() for pool in self._live()])  # every pool asked, as armed

    def exit_unreported(self) -> bool:
        """Whether any running pool knows of an exit it has not reported yet."""
        return any(pool.exit_unreported() for pool in self._live())

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """The running pools' events, in pool order."""
        return [event for pool in self._live() for event in pool.collect(ready)]

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """One poll over the running pools (`wait_any`: a pool with events queued never
        keeps the others from being polled). [Unit: second]"""
        return wait_any(self._live(), timeout_s)

    def progress(self, worker_id: int) -> Progress | None:
        """What the worker is doing now."""
        return self._route(worker_id).progress(worker_id)

    def on_its_way(self, worker_id: int) -> bool:
        """Whether an outcome of the worker is waiting to be read."""
        return self._route(worker_id).on_its_way(worker_id)

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """The worker's Python stacks."""
        return self._route(worker_id).dump_stack(worker_id, wait_s)

    def kill(self, worker_id: int) -> None:
        """Stop the worker now (a thread: abandon it); its `Died` event follows."""
        self._route(worker_id).kill(worker_id)


def by_id(local: WorkerPool, remote: WorkerPool, split: int) -> RoutedPool:
    """Local workers with ids below ``split`` and remote workers from ``split`` on, as one
    pool of both: torch's round-robin over all of them, one task table, one recovery."""
    return RoutedPool((local, remote), lambda worker_id: local if worker_id < split else remote)
