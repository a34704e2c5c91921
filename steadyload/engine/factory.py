"""`make_pool`: the one place a loader's `WorkerPool` is built, from a `PoolPlan`.

The loader decides the plan (the kind of worker, and for processes how they start); the
iterator asks for a started pool and drives it through the protocol alone (pool.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Literal

from ..start.context import StartInfo
from .choice.handover import HandoverPool
from .config import WorkerConfig
from .events import ServerGone
from .pool import WorkerPool
from .process.pool import ProcessPool
from .remote.pool import RemotePool
from .remote.spec import RemoteWorkers
from .remote.warm import Prestarted
from .routed import by_id
from .thread.pool import ThreadPool


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """What kind of pool a loader's iterator starts."""

    kind: Literal["process", "thread", "auto", "remote"]
    """"auto": threads at once, processes when the work needs them (choice/); "remote":
    remote workers only."""
    context: BaseContext | None = None
    """The processes' multiprocessing context ("process")."""
    start: StartInfo | None = None
    """How the processes start, and the fork server's preloads ("process")."""
    processes: Callable[[], tuple[BaseContext, StartInfo]] | None = None
    """"auto": the processes' context and start, resolved only if they are needed."""
    release: Callable[[], None] | None = None
    """"auto": called once its iterator will start no more processes (threads chosen)."""
    remote: RemoteWorkers | None = None
    """Remote workers (Ray actors) beside the local ones, with the ids after theirs."""
    prestarted: Prestarted | None = None
    """The loader's remote workers started when it was built (engine/remote/warm.py)."""

    @property
    def start_method(self) -> str | None:
        """The processes' start method; None for threads or an undecided "auto"."""
        return self.start.method if self.start is not None else None

    @property
    def preload(self) -> tuple[str, ...]:
        """What the fork server was asked to import (empty: none yet)."""
        return self.start.preload if self.start is not None else ()


THREADS = PoolPlan("thread")


def make_pool(
    plan: PoolPlan,
    config: WorkerConfig,
    num_workers: int,
    process_checks: Callable[[str], None],
) -> WorkerPool:
    """A started pool for ``plan`` (``num_workers``: local and remote together).
    ``process_checks(start_method)`` runs before processes start under "auto" (the checks
    "process" plans had when the loader was built)."""
    if plan.remote is not None:
        local_count = num_workers - plan.remote.maximum
        remote = RemotePool(config, plan.remote, local_count, prestarted=plan.prestarted)
        if local_count == 0:
            return _started(remote)
        local = _local_pool(plan, config, local_count, process_checks, start=False)
        return _started(by_id(local, remote, local_count))  # remote started first, then local
    return _local_pool(plan, config, num_workers, process_checks, start=True)


def _started(pool: WorkerPool) -> WorkerPool:
    try:
        pool.start()
    except BaseException:
        pool.shutdown()  # threads or actors started before the failure, the sockets
        raise
    return pool


def _local_pool(
    plan: PoolPlan,
    config: WorkerConfig,
    num_workers: int,
    process_checks: Callable[[str], None],
    *,
    start: bool,
) -> WorkerPool:
    pool: WorkerPool
    if plan.kind == "auto":
        assert plan.processes is not None
        pool = HandoverPool(config, num_workers, plan.processes, process_checks, plan.release)
    elif plan.kind == "thread":
        pool = ThreadPool(config, num_workers)
    else:
        assert plan.context is not None
        process_pool = ProcessPool(plan.context, config, num_workers)
        if not start:
            return process_pool
        try:
            process_pool.start()
        except ServerGone as gone:  # found dead at the start: one restart, then as usual
            gone.event.cause.heal(process_pool)
            process_pool = ProcessPool(plan.context, config, num_workers)
            process_pool.start()
        return process_pool
    return _started(pool) if start else pool
