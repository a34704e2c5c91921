"""``worker_type="auto"``: thread workers at once, process workers when the work needs them.

A `HandoverPool` is one `WorkerPool` over two, a `RoutedPool` (engine/routed.py) whose
route is the phase: a `ThreadPool`, started at once (the first batch in milliseconds, no
fork server to wait for), and, when the measurement leans to the work holding the GIL
(worker_kind.py), a process `ProcessPool`, started by a helper thread from the zygote the
loader forked when it was built (milliseconds) or the fork server (whose imports, about a
second for torch, overlap with the threads still loading); it takes tasks once the choice
is processes, and is stopped if it is threads. The hand-over is per task, so it needs no
pause and loses nothing:

- A task goes to the thread of its worker id until the processes have started, and to the
  process of that id from then on. The task table (iterators/) still sees one worker per
  id and yields in task order, so the order is torch's and every task runs on exactly one
  of the two (a task a dead worker held is re-sent to its replacement, as always; if it
  also finishes elsewhere, the second outcome finds its task settled and is dropped).
- While a thread still holds tasks, its id's progress, hang watch and stack are the
  thread's; then the process's. When no thread holds a task, the threads are stopped.
- A hung thread's replacement is the process of its id once that exists.

The helper thread only runs `ProcessPool.start`; the iterating thread takes the pool
over once the helper has finished (one owner at a time, as `ProcessPool` requires). If the
processes cannot start (a dataset that does not pickle, a start that fails), the loader
stays on threads and says why.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from multiprocessing.context import BaseContext
from typing import Any

from ...start import zygote
from ..config import WorkerConfig
from ..events import Died, GlobalRngDrawn, Received, WorkersChosen
from ..pool import WorkerPool, wait_any
from ..process.pool import ProcessPool
from ..protocol import Empty, Exhausted, Failed
from ..routed import RoutedPool
from ..thread.pool import ThreadPool
from .worker_kind import GilProbe, WorkerChoice, chose, leans_to_processes, live_choice

_LOG = logging.getLogger(__name__)
_OUTCOMES = (Received, Failed, Empty, Exhausted)
CHOSEN = -1  # the "worker id" of the WorkersChosen event
_HELPERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_helpers(timeout_s: float = 30.0) -> None:
    """At exit, let a process start still under way finish and stop its workers: killed
    half-way (a daemon thread at exit), it would leave the fork server reading a truncated
    request, which prints a traceback after a good run. Bounded. [Unit: second]"""
    deadline = time.monotonic() + timeout_s
    for helper in list(_HELPERS):
        helper.join(max(deadline - time.monotonic(), 0.0))


class _LiveViews(Sequence[Any]):
    """``iterator._workers``: the threads' views until the hand-over, then the processes'."""

    def __init__(self, pool: HandoverPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return len(self._pool._lead().views)

    def __getitem__(self, i: Any) -> Any:
        return self._pool._lead().views[i]


class HandoverPool(RoutedPool):
    """Thread workers first, process workers once the measurement asks for them: a
    `RoutedPool` whose route is the phase (`_owner`), plus the hooks where the hand-over
    differs (which pool a task goes to, respawn, the bookkeeping of what threads hold)."""

    def __init__(
        self,
        config: WorkerConfig,
        num_workers: int,
        processes: Callable[[], tuple[BaseContext, Any]],
        prepare: Callable[[str], None],
    ) -> None:
        """``processes``: the start context, resolved only if processes are needed;
        ``prepare``: the checks a process start needs, given its method."""
        self._config = config
        self._num_workers = num_workers
        self._processes = processes
        self._prepare = prepare
        self._threads = ThreadPool(config, num_workers)
        self._procs: ProcessPool | None = None
        self._helper: threading.Thread | None = None
        self._started: ProcessPool | None = None  # set by the helper once its start succeeded
        self._start_failure: str | None = None  # why the processes could not start
        self._lock = threading.Lock()  # between the helper's result and `shutdown`
        self._unwanted = False  # the iterator is gone or threads were chosen: no processes
        self._method, self._preload = "", ()  # of the processes, once chosen
        self._held = [0] * num_workers  # tasks each thread holds
        self._thread_died: set[int] = set()  # ids whose latest death was their thread's
        self._choice: WorkerChoice | None = None
        self._probe = GilProbe()  # until the choice is made
        self._announce: list[tuple[int, object]] = []  # WorkersChosen, for the next wait
        super().__init__((self._threads,), self._owner)  # the processes join on adoption
        self.views = _LiveViews(self)

    def _lead(self) -> WorkerPool:
        """The pool new tasks go to: the threads until the processes run, then those (so
        `kind`, `start_method`, `preload` and `pids` are theirs)."""
        return self._procs if self._procs is not None else self._threads

    def _owner(self, worker_id: int) -> WorkerPool:
        """The route: whose pid, progress, stack and kill ``worker_id`` means now: the
        thread while it holds tasks (they are the oldest of that id), else the process."""
        if self._procs is None or self._held[worker_id] > 0:
            return self._threads
        return self._procs

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread workers, and the probe that watches the GIL while they load."""
        super().start()
        self._probe.start()

    def respawn(self, worker_id: int) -> None:
        """A fresh worker for ``worker_id``: a thread until the processes run; then the
        process of that id (itself, if only its thread died)."""
        if worker_id in self._thread_died:
            self._thread_died.discard(worker_id)
            self._held[worker_id] = 0  # what the thread held is re-sent (and counted) anew
            if self._procs is None:
                self._threads.respawn(worker_id)
            return
        assert self._procs is not None
        self._procs.respawn(worker_id)

    def shutdown(self) -> None:
        """Stop both pools. A process start still under way is not waited for (the fork
        server may be importing torch): the helper stops those workers itself (and the
        exit waits for it, `_join_helpers`)."""
        self._probe.stop()
        with self._lock:
            self._unwanted = True
            self._drop_started()
            if self._helper is not None and not self._helper.is_alive():
                self._adopt()
        super().shutdown()

    # -- the hand-over -----------------------------------------------------------------------
    def _decide(self, draws_globally: bool = False) -> None:
        if self._choice is not None:
            return
        measured, probe = self._threads.measured(), self._probe
        # Counted once every thread is past its first task (the set-up: imports, caches).
        probe.counting = probe.counting or self._threads.past_set_up()
        choice = (
            chose(
                "process",
                "the dataset draws from the process-wide random generators, "
                "which thread workers share",
            )
            if draws_globally
            else live_choice(measured, self._num_workers, probe.figures())
        )
        if choice is None:
            if self._helper is None and leans_to_processes(measured, probe.figures()):
                self._start_processes()  # ahead of the choice: ready when it is made
            return
        self._choice = choice
        probe.stop()
        # Said now: the next iterator starts on the chosen kind even if this one ends first.
        self._announce.append((CHOSEN, WorkersChosen(choice.kind, choice.reason, None, ())))
        if choice.kind == "thread":
            with self._lock:
                self._unwanted = True  # processes started ahead are stopped (now or by the helper)
                self._drop_started()
            return
        if self._helper is None and self._started is None and self._start_failure is None:
            self._start_processes()
        elif self._start_failure is not None and self._helper is None:
            self._stay_failed()

    def _start_processes(self) -> None:
        """Start the process workers on a helper thread (the fork server or zygote answers
        while the threads go on loading); a failure is kept for when they are chosen."""
        try:
            ctx, info = self._processes()
            if info.method == "fork" or (info.method == "zygote" and zygote.pid() is None):
                raise RuntimeError(
                    f"start_method={info.method!r} would fork this process "
                    "while its thread workers run (a lock one holds would "
                    "stay locked in the child)"
                )
            self._prepare(info.method)
        except Exception as exc:  # stay on threads: they work
            self._start_failure = (
                f"process workers cannot start here ({type(exc).__name__}: {exc})"
            )
            if self._choice is not None:
                self._stay_failed()
            return
        supervisor = ProcessPool(
            ctx, replace(self._config, preload=info.preload), self._num_workers
        )
        self._method, self._preload = info.method, info.preload

        def start() -> None:  # the helper: the pool is its own until it returns
            try:
                supervisor.start()
            except BaseException as exc:
                self._start_failure = (
                    f"starting process workers failed ({type(exc).__name__}: {exc})"
                )
            with self._lock:
                if self._unwanted:  # the iterator is gone, or threads were chosen
                    supervisor.shutdown()
                elif self._start_failure is None:
                    self._started = supervisor
            self._threads.wake()  # the iterating thread adopts the result at once

        self._helper = threading.Thread(target=start, name="steadyload-handover", daemon=True)
        _HELPERS.add(self._helper)
        self._helper.start()

    def _drop_started(self) -> None:
        """Stop processes that were started ahead but are not wanted (holding the lock)."""
        if self._started is not None:
            self._started.shutdown()
            self._started = None

    def _stay(self, why: str) -> None:
        reason = f"{self._choice.reason if self._choice else ''}; but {why}, so it stays on threads"
        _LOG.warning("%s", reason)
        self._announce.append((CHOSEN, WorkersChosen("thread", reason, None, ())))

    def _stay_failed(self) -> None:
        self._stay(self._start_failure or "")
        self._start_failure = None  # said once

    def _adopt(self) -> None:
        """Take the processes over once the helper has started them and they are chosen."""
        if self._helper is None or self._helper.is_alive():
            return
        if self._choice is None or self._choice.kind != "process":
            return  # started ahead: kept until the choice (or stopped by it)
        self._helper = None
        if self._started is None:
            if self._unwanted:
                return  # the helper stopped what it started: the iterator is gone
            self._stay_failed()
            return
        self._procs, self._started = self._started, None
        self._pools.append(self._procs)  # routed to, polled and stopped from now on
        self._announce.append(
            (
                CHOSEN,
                WorkersChosen(
                    "process",
                    self._choice.reason + "; the first batches came from thread workers "
                    "while the processes started",
                    self._method,
                    self._preload,
                ),
            )
        )

    # -- where hand-over differs from the route ----------------------------------------------
    def started_at(self, worker_id: int) -> float | None:
        """When the latest worker of ``worker_id`` was asked for. [Unit: second]"""
        return self._lead().started_at(worker_id)

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """To the thread of ``worker_id`` until the processes run, then to its process."""
        self._adopt()
        if self._procs is not None:
            self._procs.send_task(worker_id, task_id, indices, epoch)
        else:
            self._held[worker_id] += 1
            self._threads.send_task(worker_id, task_id, indices, epoch)

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Never needed: a stream, or a dataset with its own state, never starts on threads
        (worker_kind.static_choice)."""
        raise RuntimeError("[steadyload internal error] a dataset position in a hand-over pool")

    def send_reset(self) -> None:
        """A new epoch (persistent workers): to whichever pools run."""
        self._adopt()
        super().send_reset()

    def waitables(self) -> list[Any]:
        """The running pools' waitables (the processes' too, once adopted)."""
        self._adopt()
        return super().waitables()

    def pending(self) -> bool:
        """An announcement to make, or events queued."""
        return bool(self._announce) or super().pending()

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """Events of both pools, and `WorkersChosen` once; decides and adopts as they come."""
        from_threads = self._threads.collect(ready) if self._threads.running else []
        events = self._procs.collect(ready) if self._procs is not None else []
        draws_globally = False
        for worker_id, event in from_threads:
            if isinstance(event, _OUTCOMES) and self._held[worker_id] > 0:
                self._held[worker_id] -= 1
            elif isinstance(event, Died):
                self._thread_died.add(worker_id)
            draws_globally |= isinstance(event, GlobalRngDrawn)
        self._decide(draws_globally)
        self._adopt()
        if self._procs is not None and not any(self._held) and self._threads.running:
            self._threads.shutdown()  # every task is the processes' now
        return from_threads + events + self._announce_now()

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """Events of both pools, and `WorkersChosen` once: the poll goes through this
        pool's own `collect`, which keeps the books. [Unit: second]"""
        return wait_any((self,), timeout_s)

    def _announce_now(self) -> list[tuple[int, object]]:
        events, self._announce = self._announce, []
        return events

    def on_its_way(self, worker_id: int) -> bool:
        """Whether an outcome is waiting in either pool."""
        return any(pool.on_its_way(worker_id) for pool in self._live())
