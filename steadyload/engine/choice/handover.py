"""``worker_type="auto"``: workers of the kind that starts faster, handed over when the
work needs the other.

A `HandoverPool` is one `WorkerPool` over two, a `RoutedPool` (engine/routed.py) whose
route is the phase: the *first* pool, started at once, and the *second*, started when the
measurement (worker_kind.py) chooses the other kind. Which comes first:

- **processes**, where one is a fork away (the zygote, or ``start_method="fork"``), with a
  GIL probe inside each (``probe_gil``); if the work leaves the GIL free, thread workers
  are started (nothing to fork) and take the next tasks; once the processes are gone, the
  loader lets the zygote go unless another loader may need it (``release``, zygote.py);
- **threads** otherwise (no fork server to wait for); if the work holds the GIL, a
  `ProcessPool` is started by a helper thread from the fork server (its import of torch
  overlaps with the threads' loading), takes tasks once the choice is processes, and is
  stopped if it is threads. The helper only runs `ProcessPool.start`; the iterating
  thread takes the pool over once it has finished (one owner at a time). Processes that
  cannot start (a dataset that does not pickle) leave the loader on threads, saying why.

The hand-over is per task, so it needs no pause and loses nothing: a task goes to the
first pool's worker of its id until the second pool runs, then to the second's. The task
table (iterators/) still sees one worker per id and yields in task order, so every task
runs on exactly one of the two (a task a dead worker held is re-sent to its replacement,
the second's once that exists; an outcome for a settled task is dropped). While the first
pool's worker holds tasks, its id's progress, hang watch and stack are that worker's;
when the first pool holds none, it is stopped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from dataclasses import replace
from multiprocessing.context import BaseContext
from typing import Any

from ...start import zygote
from ..config import WorkerConfig
from ..events import Died, GlobalRngDrawn, Received, WorkersChosen
from ..pool import WorkerPool, wait_any
from ..process.pool import ProcessPool
from ..protocol import Empty, Exhausted, Failed
from ..routed import LeadViews, RoutedPool
from ..thread.pool import ThreadPool
from ..worker.gil import GilProbe, ProbeFigures
from .ahead import start_on_helper, stop_on_helper
from .worker_kind import ProcessFigures, WorkerChoice, chose, leans_to_processes, live_choice

_LOG = logging.getLogger(__name__)
_OUTCOMES = (Received, Failed, Empty, Exhausted)
CHOSEN = -1  # the "worker id" of the WorkersChosen event
_DRAWS = "the dataset draws from the process-wide random generators, which thread workers share"
_SEEDED = (
    "sample_seeds=True reseeds a process worker's process-wide random generators for every "
    "sample, so whether the dataset draws from them (thread workers would share them) "
    "cannot be checked there; processes are kept"
)


class HandoverPool(RoutedPool):
    """Workers of the kind that starts faster, then of the other if the measurement asks:
    a `RoutedPool` routed by phase (`_owner`), with the hooks where the hand-over differs."""

    def __init__(
        self,
        config: WorkerConfig,
        num_workers: int,
        processes: Callable[[], tuple[BaseContext, Any]],
        prepare: Callable[[str], None],
        release: Callable[[], None] | None = None,
    ) -> None:
        """``processes``: the start context, resolved if needed; ``prepare``: the checks a
        process start needs; ``release``: processes handed over to threads are gone."""
        self._config = config
        self._release = release
        self._num_workers = num_workers
        self._processes = processes
        self._prepare = prepare
        self._threads: ThreadPool | None = None
        self._procs: ProcessPool | None = None
        self._second: WorkerPool | None = None  # adopted: new tasks go there
        self._helper: threading.Thread | None = None
        self._stopper: threading.Thread | None = None  # stops the first pool (processes)
        self._started: ProcessPool | None = None  # set by the helper once its start succeeded
        self._start_failure: str | None = None  # why the processes could not start
        self._lock = threading.Lock()  # between the helper's result and `shutdown`
        self._unwanted = False  # the iterator is gone or threads were chosen: no processes
        self._method, self._preload = "", ()  # of the processes
        self._held = [0] * num_workers  # tasks each first-pool worker holds
        self._first_died: set[int] = set()  # ids whose latest death was their first worker's
        self._choice: WorkerChoice | None = None
        self._kept = False  # measured on processes and kept: no hand-over will come
        self._probe = GilProbe()  # beside thread workers, until the choice is made
        self._on_procs = ProcessFigures(num_workers)  # measured on processes (past set-up)
        self._announce: list[tuple[int, object]] = []  # WorkersChosen, for the next wait
        self._first: WorkerPool = self._process_first() or self._thread_pool()
        super().__init__((self._first,), self._owner)  # the second joins on adoption
        self.views = LeadViews(self._lead)

    def _process_first(self) -> ProcessPool | None:
        """Process workers with a GIL probe inside, where one is a fork away; else None."""
        try:
            ctx, info = self._processes()
            if info.method != "fork" and (info.method != "zygote" or zygote.pid() is None):
                return None  # a fork server: threads first (see above)
            self._prepare(info.method)
        except Exception:  # the threads-first path tries again, and says why if chosen
            return None
        self._method, self._preload = info.method, info.preload
        config = replace(self._config, preload=info.preload, probe_gil=True)
        self._procs = ProcessPool(ctx, config, self._num_workers)
        return self._procs

    def _thread_pool(self) -> ThreadPool:
        self._threads = ThreadPool(self._config, self._num_workers)
        return self._threads

    @property
    def _on_processes(self) -> bool:
        return self._first is self._procs

    def _lead(self) -> WorkerPool:
        """The pool new tasks go to: the first until the second runs, then that (so `kind`,
        `start_method`, `preload` and `pids` are its)."""
        return self._second if self._second is not None else self._first

    def _owner(self, worker_id: int) -> WorkerPool:
        """The route: whose pid, progress, stack and kill ``worker_id`` means now: the
        first pool's worker while it holds tasks (they are the oldest of that id), else
        the second's."""
        if self._second is None or self._held[worker_id] > 0:
            return self._first
        return self._second

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first pool; beside threads, the probe that watches the GIL. Processes
        that fail to start give way to threads (which say why if processes are chosen)."""
        if self._on_processes:
            try:
                super().start()
                return
            except Exception as exc:
                self._first.shutdown()
                self._start_failure = (
                    f"starting process workers failed ({type(exc).__name__}: {exc})"
                )
                self._procs = None
                self._first = self._pools[0] = self._thread_pool()
        super().start()
        self._probe.start()

    def respawn(self, worker_id: int) -> None:
        """A fresh worker for ``worker_id``: of the first pool until the second runs; then
        the second's worker of that id (itself, if only the first's died)."""
        if worker_id in self._first_died or self._second is None:
            self._first_died.discard(worker_id)
            self._held[worker_id] = 0  # what it held is re-sent (and counted) anew
            self._on_procs.respawned(worker_id)
            if self._second is None:
                self._first.respawn(worker_id)
                if self._choice is not None:
                    self._settle()  # a new worker of a chosen kind measures nothing
            return
        self._second.respawn(worker_id)

    def shutdown(self) -> None:
        """Stop both pools; a stop on a helper is waited for, a process start under way is
        not (the fork server may be importing torch: the helper stops them, ahead.py)."""
        self._probe.stop()
        if self._stopper is not None:
            self._stopper.join(60.0)  # bounded: the stop's own waits are
        with self._lock:
            self._unwanted = True
            self._drop_started()
            if self._helper is not None and not self._helper.is_alive():
                self._adopt()
        super().shutdown()
        self._processes_gone()

    def _processes_gone(self) -> None:
        """Processes handed over to threads are stopped: said once (the zygote may go)."""
        if self._on_processes and self._second is not None and (release := self._release):
            self._release = None
            release()

    # -- the hand-over -----------------------------------------------------------------------
    def _figures(self) -> tuple[tuple[int, int, float], ProbeFigures, str]:
        """What the choice reads: the workers' ``(tasks, samples, wall s)``, the probe's
        figures and the kind they were taken on."""
        if self._threads is not None and self._first is self._threads:
            # Counted once every thread is past its first task (the set-up: imports, caches).
            self._probe.counting = self._probe.counting or self._threads.past_set_up()
            return self._threads.measured(), self._probe.figures(), "thread"
        measured, figures = self._on_procs.figures(self._first)
        return measured, figures, "process"

    def _decide(self, draws_globally: bool = False) -> None:
        if self._choice is not None:
            return
        measured, figures, on = self._figures()
        drew = self._on_procs.drew(self._first) if on == "process" else False
        choice: WorkerChoice | None
        if on == "process" and self._config.sample_seeds:
            choice = chose("process", _SEEDED)
        elif draws_globally or drew:
            choice = chose("process", _DRAWS)
        elif on == "process" and drew is None:  # big batches decide alone; the rest waits
            choice = self._on_procs.big_batches()  # for every worker's draw check
        else:
            big = self._on_procs.big_batches() if on == "process" else None
            choice = big or live_choice(measured, self._num_workers, figures, on=on)
        if choice is None:
            ahead = on == "thread" and self._helper is None and self._start_failure is None
            if ahead and leans_to_processes(measured, figures):
                self._start_processes()  # ahead of the choice: ready when it is made
            return
        self._choice = choice
        self._probe.stop()
        if on == "process":
            self._settle()
            self._keep_or_hand_to_threads(choice)
            return
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

    def _settle(self) -> None:
        """The choice is made: the process workers stop measuring (probes, draw checks)."""
        if self._procs is not None and self._first is self._procs:
            self._procs.settle()

    def _keep_or_hand_to_threads(self, choice: WorkerChoice) -> None:
        """Measured on processes: keep them, or start thread workers and hand over."""
        if choice.kind == "process":
            event = WorkersChosen("process", choice.reason, self._method, self._preload, now=True)
            self._announce.append((CHOSEN, event))
            self._kept = True
            return
        threads = self._thread_pool()
        threads.start()  # nothing to fork: the threads run at once
        self._second = threads
        self._pools.append(threads)
        reason = choice.reason + "; the first batches came from process workers while it measured"
        self._announce.append((CHOSEN, WorkersChosen("thread", reason, None, (), now=True)))

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
            self._start_failure = f"process workers cannot start here ({type(exc).__name__}: {exc})"
            if self._choice is not None:
                self._stay_failed()
            return
        config = replace(self._config, preload=info.preload)
        supervisor = ProcessPool(ctx, config, self._num_workers)
        self._method, self._preload = info.method, info.preload
        assert self._threads is not None
        threads = self._threads

        def finished(failure: BaseException | None) -> None:  # on the helper thread
            if failure is not None:
                self._start_failure = (
                    f"starting process workers failed ({type(failure).__name__}: {failure})"
                )
            with self._lock:
                if self._unwanted:  # the iterator is gone, or threads were chosen
                    supervisor.shutdown()
                elif self._start_failure is None:
                    self._started = supervisor
            threads.wake()  # the iterating thread adopts the result at once

        self._helper = start_on_helper(supervisor, finished)

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
        if self._started is None:  # unwanted: the helper stopped what it started (gone)
            if not self._unwanted:
                self._stay_failed()
            return
        self._procs, self._started = self._started, None
        self._second = self._procs
        self._pools.append(self._procs)  # routed to, polled and stopped from now on
        reason = self._choice.reason + "; the first batches came from thread workers while"
        reason += " the processes started"
        event = WorkersChosen("process", reason, self._method, self._preload, now=True)
        self._announce.append((CHOSEN, event))

    # -- where hand-over differs from the route ----------------------------------------------
    def started_at(self, worker_id: int) -> float | None:
        """When the latest worker of ``worker_id`` was asked for. [Unit: second]"""
        return self._lead().started_at(worker_id)

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """To the first pool's worker of ``worker_id`` until the second runs, then to the
        second's."""
        if self._kept:  # measured and kept: the pool is the first alone from now on
            self._first.send_task(worker_id, task_id, indices, epoch)
            return
        self._adopt()
        if self._second is not None:
            self._second.send_task(worker_id, task_id, indices, epoch)
        else:
            self._held[worker_id] += 1
            self._first.send_task(worker_id, task_id, indices, epoch)

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Never needed: a stream or a stateful dataset never starts here (static_choice)."""
        raise RuntimeError("[steadyload internal error] a dataset position in a hand-over pool")

    def send_reset(self) -> None:
        """A new epoch (persistent workers): to whichever pools run."""
        self._adopt()
        super().send_reset()

    def waitables(self) -> list[Any]:
        """The running pools' waitables (the second's too, once adopted)."""
        self._adopt()
        return super().waitables()

    def pending(self) -> bool:
        """An announcement to make, or events queued."""
        return bool(self._announce) or super().pending()

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """Events of both pools, and `WorkersChosen` once; decides and adopts as they come."""
        if self._kept and not self._announce:
            return self._first.collect(ready)  # the first alone (a tiny batch's cost counts)
        from_first = self._first.collect(ready) if self._first.running else []
        events = self._second.collect(ready) if self._second is not None else []
        draws_globally = False
        for worker_id, event in from_first:
            if isinstance(event, _OUTCOMES) and self._held[worker_id] > 0:
                self._held[worker_id] -= 1
            elif isinstance(event, Died):
                self._first_died.add(worker_id)
            draws_globally |= isinstance(event, GlobalRngDrawn)
            if self._choice is None and self._on_processes:
                self._on_procs.note(worker_id, event)
        self._decide(draws_globally)
        self._adopt()
        if self._second is not None and not any(self._held) and self._first.running:
            if self._on_processes:  # every task is the threads' now: the loop need not wait
                self._stopper = stop_on_helper(self._first, self._processes_gone)
            else:
                self._first.shutdown()
        return from_first + events + self._announce_now()

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
