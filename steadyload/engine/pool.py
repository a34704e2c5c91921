"""`WorkerPool`: everything the iterators (and the hand-over) ask of a kind of worker.

`process.pool.ProcessPool`, `thread.pool.ThreadPool` and `remote.pool.RemotePool` provide
it, and `routed.RoutedPool` over several of them (auto's hand-over, remote workers beside
local ones); iterators/ is written against it alone, so dispatch, recovery, the hang watch
and checkpoints are one code for every kind. A pool's waiting is split in three
(`waitables`, `pending`, `collect`) so that `wait_any` can wait for several pools in one
poll.
Pools whose workers come from a fork server also provide `ServerPool`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from .interrupts import interrupts_allowed
from .transport import channel
from .worker.status import Progress

Kind = Literal["process", "thread", "remote"]
PROCESS: Kind = "process"
THREAD: Kind = "thread"
REMOTE: Kind = "remote"


class WorkerPool(Protocol):
    """The workers of one iterator: start, message, watch, stop."""

    running: bool

    @property
    def kind(self) -> Kind:
        """The kind of worker that runs new tasks now ("process", "thread"; "remote" for a
        pool of remote workers only)."""

    @property
    def start_method(self) -> str | None:
        """How process workers start ("forkserver", "spawn", "fork", "zygote"); None for
        threads and remote workers (no process starts here)."""

    @property
    def preload(self) -> tuple[str, ...]:
        """Modules the fork server was asked to import (empty: none, or not ours)."""

    @property
    def views(self) -> Sequence[Any]:
        """Each worker id's latest process or thread, as ``iterator._workers`` shows it."""

    @property
    def stopped(self) -> bool:
        """Whether every worker has been stopped."""

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the pool measures with."""

    def start(self) -> None:
        """Start all workers."""

    def respawn(self, worker_id: int) -> None:
        """Start a fresh worker for ``worker_id`` (same id, same seed)."""

    def shutdown(self) -> None:
        """Stop every worker; idempotent."""

    def pid(self, worker_id: int) -> int | None:
        """The worker's process id."""

    def pids(self) -> dict[int, int]:
        """worker id -> pid of the live workers whose memory is their own."""

    def host(self, worker_id: int) -> str | None:
        """The machine the worker runs on (an address), or None for this one."""

    def started_at(self, worker_id: int) -> float | None:
        """When the worker was asked for, on `clock`. [Unit: second]"""

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Send a task."""

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Tell a worker where its dataset replica resumes (`Fetcher.position`): a
        replacement, or a worker of a resumed checkpoint."""

    def send_reset(self) -> None:
        """Tell every worker a new epoch begins."""

    def waitables(self) -> list[Any]:
        """What a poll must watch for this pool's events (sockets, sentinels, pidfds);
        arms whatever must signal while the caller waits. Call before `pending`."""

    def pending(self) -> bool:
        """Whether events are already queued (the poll must not block)."""

    def exit_unreported(self) -> bool:
        """Whether a worker is known to have exited whose `Died` has not come out of
        `collect` yet (a fork server reports its workers' exit status a moment after they
        exit); the epoch's end waits a moment for it."""

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """The events behind ``ready`` (what the poll returned) and any queued; never
        blocks. Events are ``(worker_id, event)``: a protocol message (a `Done` comes back
        as `Received`), `Died` (worker id -1: a group of workers died together), `ReceiveFailed`,
        or pool-wide events with worker id -1."""

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """Block until events arrive or ``timeout_s`` passes (`wait_any`). [Unit: second]"""

    def progress(self, worker_id: int) -> Progress | None:
        """What the worker is doing now."""

    def on_its_way(self, worker_id: int) -> bool:
        """Whether an outcome of the worker is waiting to be read."""

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """The (hung) worker's Python stacks."""

    def kill(self, worker_id: int) -> None:
        """Stop the worker now (a thread: abandon it); its `Died` event follows."""


@runtime_checkable
class ServerPool(Protocol):
    """A pool whose workers come from a fork server (or zygote) that can die under them."""

    def restart_server(self, method: str, pid: int) -> tuple[str, ...]:
        """Start a new server in place of the dead one (``method``, ``pid``); the preloads
        it was asked for."""


def wait_any(pools: Sequence[WorkerPool], timeout_s: float | None) -> list[tuple[int, object]]:
    """Block until any of ``pools`` has events or ``timeout_s`` passes; their events.
    The poll is the one place Ctrl-C may land (engine/interrupts.py). [Unit: second]"""
    armed = [pool.waitables() for pool in pools]  # each pool armed before it is asked
    queued = [pool.pending() for pool in pools]
    if any(queued):  # collect those now: poll only the others, without waiting
        timeout_s = 0.0
        armed = [objs for objs, q in zip(armed, queued, strict=True) if not q]
    watched = [obj for objs in armed for obj in objs]
    ready: Collection[Any] = ()
    if watched:
        with interrupts_allowed():  # a dequeue never runs here: nothing is lost to Ctrl-C
            ready = set(channel.ready(watched, timeout_s))
    elif timeout_s != 0.0:
        return []
    return [event for pool in pools for event in pool.collect(ready)]
