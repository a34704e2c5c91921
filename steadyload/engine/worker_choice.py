"""``worker_type="auto"``: threads or processes, decided by watching the first batches.

Threads win where the work releases the GIL (image decode, numpy, tokenizers in Rust, big
tensor copies, I/O): no start-up, no transport, one copy of every resource. Processes win
where it holds the GIL (pure-Python transforms): threads would take turns. Which one a
dataset is cannot be read from its code, so "auto" starts thread workers at once (the first
batch in milliseconds) and measures them: the share of their loading time each thread
spent on a CPU (each thread's first batch left out: lazy set-up). Times the number of
threads, that is how many CPUs' worth they loaded at once: threads that hold the GIL take
turns, so at most one together; threads that release it run at once (up to one each);
threads that wait for I/O use little CPU. About one CPU's worth means GIL turns: the
loader starts process workers and hands the next batches over to them
(engine/handover.py). In between, threads are kept: they cost less (no start-up, no
transport, one copy of the dataset) for about the same speed.

Some loaders are never started on threads: a stream (its position lives in the replica
that reads it, which cannot move to a process), a ``worker_init_fn`` (it would run in this
process: a common one reseeds this process's numpy), ``max_worker_memory``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

_LOG = logging.getLogger(__name__)

PARALLEL_CPUS = 1.3
"""CPUs' worth of loading the threads did at once (CPU share x threads) above which they ran
in parallel: threads that hold the GIL do at most one CPU's worth together."""
WAITING_SHARE = 0.3
"""CPU share below which threads mostly wait (I/O): threads overlap the waits."""
MIN_TASKS_PER_WORKER = 3  # batches measured per thread before deciding
MIN_WALL_S = 0.2  # and this much loading time, summed over the threads: a pause of this
# process (a busy machine, a garbage collection) must not decide it


@dataclass(frozen=True, slots=True)
class WorkerChoice:
    """What ``worker_type="auto"`` chose, and why (shown by `report()`)."""

    kind: str
    """"thread" or "process"."""
    reason: str


def chose(kind: str, why: str) -> WorkerChoice:
    """The choice of ``kind`` workers because ``why``, logged at INFO."""
    choice = WorkerChoice(kind, f"worker_type='auto' chose {kind} workers: {why}")
    _LOG.info("%s", choice.reason)
    return choice


def gil_enabled() -> bool:
    """False on a free-threaded interpreter running without the GIL (3.13t, 3.14t)."""
    check = getattr(sys, "_is_gil_enabled", None)
    return bool(check()) if check is not None else True


def static_choice(loader: Any, max_worker_memory: int | None) -> WorkerChoice | None:
    """The choice when it needs no measurement, else None (start on threads and watch)."""
    from torch.utils.data import IterableDataset

    if max_worker_memory is not None:
        return chose("process", "max_worker_memory needs workers with memory of their own")
    if not gil_enabled():
        return chose("thread", "this interpreter runs without the GIL")
    if isinstance(loader.dataset, IterableDataset):
        return chose("process", "an IterableDataset's stream cannot move from a thread "
                                 "to a process, so it is not tried on threads")
    if loader.worker_init_fn is not None:
        return chose("process", "a worker_init_fn would run in this process on threads "
                                 "(it may seed this process's random generators)")
    return None


def live_choice(measured: tuple[int, float, float], workers: int) -> WorkerChoice | None:
    """Decide from the thread workers' ``(tasks, wall s, CPU s)``; None: not enough yet."""
    tasks, wall, cpu = measured
    if tasks < MIN_TASKS_PER_WORKER * workers or wall < MIN_WALL_S:
        return None
    share = cpu / wall
    parallel = share * workers
    figures = (
        f"{workers} thread workers spent {share:.0%} of {tasks} batches' loading time on a "
        f"CPU ({parallel:.2f} CPUs' worth at once)"
    )
    if share < WAITING_SHARE:
        return chose("thread", f"{figures}: they mostly wait (I/O), and threads overlap waits")
    if parallel >= PARALLEL_CPUS and workers >= 2:
        return chose("thread", f"{figures}: they ran in parallel (the work releases the GIL)")
    if workers < 2:
        return chose("process", f"{figures}: with one thread, work that holds the GIL "
                                "cannot be told from work that releases it")
    return chose("process", f"{figures}: they took turns (the work holds the GIL)")
