"""The multi-worker iterator: torch's dispatch order over supervised worker processes.

Dispatch is torch's (round-robin over active workers, ``prefetch_factor`` tasks per worker,
yield in task order), so a worker sees the same samples in the same order as under torch
and random values drawn inside ``__getitem__`` match too. The task table is `tasks.py`;
recovery from dead, hung and over-memory workers is the `Recovery` mixin (`recovery.py`);
checkpoint bookkeeping is `checkpoint.EpochProgress`.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import multiprocessing.context
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .. import _system, diagnosis
from ..checkpoint import Checkpoints, EpochProgress
from ..engine import interrupts
from ..engine.config import WorkerConfig
from ..engine.events import ServerGone
from ..engine.fetch import ITERABLE
from ..engine.handover import HandoverPool
from ..engine.interrupts import held_interrupts
from ..engine.pool import WorkerPool
from ..engine.supervisor import Supervisor
from ..engine.threads import ThreadSupervisor
from ..epoch_order import stateful
from ..memory.sampler import MemorySampler
from ..options import LoaderOptions
from ..report import RunRecord
from ..start import guards
from ..start.context import THREAD, StartInfo
from .common import (
    DatasetError,
    EmptyBatches,
    SkipGuard,
    TimedNext,
    flat_indices,
    refuse_datapipes,
)
from .hangs import Watchdog
from .outcomes import Outcomes
from .recovery import Recovery
from .tasks import EMPTY, EpochTable, TaskEntry

_LOG = logging.getLogger(__name__)


class WorkerIterator(TimedNext, Outcomes, Recovery, Watchdog, _BaseDataLoaderIter):
    """num_workers>0: batches from steadyload's supervised worker processes."""

    def __init__(
        self,
        loader: DataLoader[Any],
        options: LoaderOptions,
        start: tuple[multiprocessing.context.BaseContext | None, StartInfo],
        checkpoints: Checkpoints,
        processes: Callable[[], tuple[Any, StartInfo]] | None = None,
    ) -> None:
        super().__init__(loader)
        self._prefetch_factor: int = loader.prefetch_factor or 2
        self._in_order = loader.in_order
        self._opts = options
        self._checkpoints = checkpoints
        self._ctx, self._start_info = start
        refuse_datapipes(self._dataset)
        self._threads = self._start_info.method == THREAD
        self._processes = processes  # "auto": threads first, these when the work needs them
        if not self._threads:
            guards.check_process_start(self._dataset, self._num_workers, self._start_info.method)
        self._checked_in_flight = False
        checkpoints.apply_base_seed(loader, self)  # before the workers are configured with it
        self.record = RunRecord(self._start_info.method, self._start_info.preload)
        self._config = WorkerConfig(
            dataset_kind=self._dataset_kind,
            dataset=self._dataset,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=int(self._base_seed),
            worker_init_fn=loader.worker_init_fn,
            num_workers=self._num_workers,
            preload=self._start_info.preload,
            skip_errors=self._opts.on_error == "skip",
            max_memory_bytes=self._opts.max_worker_memory_bytes,
            stateful_stream=self._dataset_kind == ITERABLE and stateful(self._dataset),
            sample_seeds=self._opts.sample_seeds,
        )
        self._stream_state: dict[int, bytes] = {}  # worker -> state after its last batch
        self._empty = EmptyBatches(self._collate_fn)
        self._supervisor: WorkerPool | None = None
        self._error: BaseException | None = None
        self._next_task_id = 0
        self._stale: dict[int, int] = {}  # task id -> worker, for tasks of abandoned epochs
        self._arrived: collections.deque[int] = collections.deque()
        self._epoch = EpochTable()
        self._active = [True] * self._num_workers
        self._per_worker = [0] * self._num_workers
        self._cycle = itertools.cycle(range(self._num_workers))
        self._kills: collections.Counter[Any] = collections.Counter()  # sample -> deaths
        self._hangs: collections.Counter[int] = collections.Counter()  # task id -> hangs
        self._hung: dict[int, tuple[int, str]] = {}  # worker -> (task id, stack) being killed
        self._retiring: dict[int, int] = {}  # worker -> USS that passed max_worker_memory
        self._guard = SkipGuard()
        self._oom_kills = _system.cgroup_memory().oom_kills
        self._stash: tuple[Any, TaskEntry] | None = None  # a batch held back by Ctrl-C
        self._handing: tuple[Any, TaskEntry, tuple[Any, int | None]] | None = None
        self._views: Sequence[Any] = []  # WorkerView or ThreadView (or None), by worker id
        self._attached = False  # to engine/interrupts.py, while workers run
        self._start_workers()
        self._reset(loader, first_iter=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def _start_workers(self) -> None:
        started = time.monotonic()
        supervisor: WorkerPool
        if self._processes is not None:
            checks = functools.partial(guards.check_process_start, self._dataset, self._num_workers)
            supervisor = HandoverPool(self._config, self._num_workers, self._processes, checks)
            supervisor.start()
        elif self._threads or self._ctx is None:
            supervisor = ThreadSupervisor(self._config, self._num_workers)
            supervisor.start()
        else:
            supervisor = Supervisor(self._ctx, self._config, self._num_workers)
            try:
                supervisor.start()
            except ServerGone as gone:  # found dead at the start: one restart, then as usual
                supervisor.restart_server(gone.event)
                supervisor = Supervisor(self._ctx, self._config, self._num_workers)
                supervisor.start()
        self._supervisor = supervisor
        self._views = supervisor.views
        if not self._attached:  # Ctrl-C held at safe points for this iterator's life
            self._attached = True
            interrupts.attach()
        self._memory = MemorySampler(supervisor.pids)
        self.record.memory = self._memory.snapshot
        _LOG.debug(
            "started %d workers with %s in %.3f s",
            self._num_workers, self._start_info.method, time.monotonic() - started,
        )  # fmt: skip

    def _shutdown_workers(self) -> None:
        memory = getattr(self, "_memory", None)
        if memory is not None:
            memory.stop()
        supervisor = self._supervisor
        try:
            if supervisor is not None:
                supervisor.shutdown()  # a held Ctrl-C is raised once it has finished
        finally:
            if supervisor is not None and supervisor.stopped:
                self._supervisor = None
            if self._attached and self._supervisor is None:
                self._attached = False
                interrupts.detach()

    @property
    def _workers(self) -> list[Any]:
        """The worker processes, by worker id (as torch's iterator has them); they keep
        their pid and exit code after the workers stopped."""
        return list(self._views)

    def __del__(self) -> None:
        if sys.is_finalizing():  # globals are gone; process workers have their own finalizer
            return
        if getattr(self, "_supervisor", None) is not None or getattr(self, "_attached", False):
            self._shutdown_workers()  # (__init__ may have failed half-way)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        with held_interrupts():  # a task recorded but never sent would wait forever
            self._reset_epoch(loader, first_iter)

    def _reset_epoch(self, loader: Any, first_iter: bool) -> None:
        super()._reset(loader, first_iter)
        self._stash = self._handing = None  # a batch held back by Ctrl-C was last epoch's
        self._progress: EpochProgress = self._checkpoints.begin_epoch(loader, self)
        if self._supervisor is None:
            # Persistent workers that were stopped by an error: start afresh.
            self._error = None
            self._stale.clear()
            self._epoch.tasks.clear()
            self._start_workers()
        elif not first_iter:
            self._supervisor.send_reset()
        # Tasks still in flight from the last epoch are discarded when they arrive.
        self._stale.update(
            {tid: t.worker_id for tid, t in self._epoch.tasks.items() if not t.has_outcome}
        )
        self._epoch = EpochTable(rcvd=self._next_task_id)
        self._arrived.clear()
        self._active = [True] * self._num_workers
        self._per_worker = [0] * self._num_workers
        self._cycle = itertools.cycle(range(self._num_workers))
        self._stream_state.clear()  # each epoch's streams start afresh (Reset)
        if self._progress.resume_streams is not None:
            self._resume_streams(self._progress.resume_streams)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _resume_streams(self, resume: dict[str, Any]) -> None:
        """Resume each worker's stream where its last yielded batch ended (checkpoint.py)."""
        self._progress.resume_streams = None
        assert self._supervisor is not None
        for worker_id, blob in resume["workers"].items():
            self._supervisor.send_restore(worker_id, blob)
            self._stream_state[worker_id] = self._progress.streams[worker_id] = blob
        last = resume["last_worker"]
        if last is not None:
            while next(self._cycle) != last:  # dispatch goes on after the last yielded
                pass
            self._progress.last_worker = last

    # -- dispatch ----------------------------------------------------------------------------
    def _try_put_index(self, force: bool = False) -> bool:
        # torch's policy, kept exactly: see _MultiProcessingDataLoaderIter._try_put_index.
        # ``force``: one task beyond the window (to find a batch's structure, see _deliver).
        epoch = self._epoch
        max_tasks = self._prefetch_factor * self._num_workers
        if (epoch.outstanding >= max_tasks and not force) or self._supervisor is None:
            return False
        try:
            index = self._next_index()
        except StopIteration:
            return False
        for _ in range(self._num_workers):
            worker_id = next(self._cycle)
            if self._active[worker_id]:
                if self._in_order or force:
                    break
                if self._per_worker[worker_id] < max_tasks // sum(self._active):
                    break
        else:
            return False
        task_id = self._next_task_id
        self._next_task_id += 1
        epoch.tasks[task_id] = TaskEntry(worker_id, index, self._sampler_iter.ordinal)
        self._per_worker[worker_id] += 1
        epoch.outstanding += 1
        self._supervisor.send_task(worker_id, task_id, index, self._progress.epoch)
        return True

    # -- results -----------------------------------------------------------------------------
    def _next_data_timed(self) -> Any:
        if self._supervisor is not None and not self._supervisor.running:
            self._shutdown_workers()  # finish a teardown that was interrupted
        if self._error is not None:
            # Never resume silently after a fatal error: the lost batches would go unnoticed.
            raise self._error
        failure: BaseException | None = None
        try:
            # Ctrl-C only inside waits (see engine/interrupts.py); one that comes while a
            # batch is being taken out gives the batch back for the next call: none is lost.
            with held_interrupts(before_delivery=self._hold_back):
                stash, self._stash = self._stash, None
                data, task = stash if stash is not None else self._next_data_inner()
                self._handing = (data, task, self._commit(task))
            self._handing = None
        except (StopIteration, KeyboardInterrupt):
            raise  # after Ctrl-C the workers go on, as torch's do
        except DatasetError as wrapped:
            failure = wrapped.exc
        except BaseException as exc:
            # Worker death, hang, time-out: stop the workers now.
            self._error = exc
            self._shutdown_workers()
            raise
        if failure is None:
            return data
        # Raised outside the handler: inside it, the exception's __context__ would be the
        # wrapper that holds it, a cycle that keeps this iterator and its workers alive
        # until the garbage collector runs.
        try:
            raise failure
        finally:
            del failure

    def _next_data_inner(self) -> tuple[Any, TaskEntry]:
        epoch = self._epoch
        while True:
            while epoch.rcvd < self._next_task_id:
                task = epoch.tasks.get(epoch.rcvd)
                if task is not None:
                    if task.has_outcome or self._active[task.worker_id]:
                        break
                    del epoch.tasks[epoch.rcvd]  # its worker's stream ended first
                epoch.rcvd += 1
            else:
                for warning in self._memory.end_epoch():
                    _LOG.warning(warning)
                if not self._persistent_workers:
                    self._shutdown_workers()
                self._progress.finished = True
                raise StopIteration
            task = epoch.tasks[epoch.rcvd]
            if task.has_outcome and self._can_deliver(task):
                del epoch.tasks[epoch.rcvd]
                epoch.rcvd += 1
                return self._deliver(task), task
            while self._arrived:  # in_order=False: whatever came first
                tid = self._arrived[0]
                early = epoch.tasks.get(tid)
                if early is not None and not self._can_deliver(early):
                    break
                self._arrived.popleft()
                if early is not None:
                    del epoch.tasks[tid]
                    return self._deliver(early), early
            if epoch.outstanding == 0 and not self._try_put_index(force=True):
                # Only batches whose every sample was skipped, and nothing left to load.
                raise self._guard.nothing_loaded()
            self._collect(epoch.rcvd)

    def _can_deliver(self, task: TaskEntry) -> bool:
        # A batch whose samples were all skipped is yielded empty, shaped like one that
        # loaded; until one has, it waits (and _next_data_inner loads further).
        return task.outcome is not EMPTY or self._empty.ready

    def _deliver(self, task: TaskEntry) -> Any:
        if task.outcome is EMPTY:
            self._release(task)
            return self._empty.make()
        return self._process(task)

    def _commit(self, task: TaskEntry) -> tuple[Any, int | None]:
        """The batch of ``task`` is handed to the caller: it counts as yielded. Returns what
        `_hold_back` needs to undo that (a Ctrl-C at the last moment keeps the batch)."""
        progress = self._progress
        before = (progress.streams.get(task.worker_id), progress.last_worker)
        progress.yielded.mark(task.ordinal)
        if task.stream_state is not None:
            progress.streams[task.worker_id] = task.stream_state
        progress.last_worker = task.worker_id
        return before

    def _hold_back(self) -> None:
        """Ctrl-C while a batch was being handed over: keep it for the next call."""
        if self._handing is None:
            return
        data, task, (stream, last) = self._handing
        self._handing = None
        progress = self._progress
        progress.yielded.unmark(task.ordinal)
        if stream is not None:
            progress.streams[task.worker_id] = stream
        else:
            progress.streams.pop(task.worker_id, None)
        progress.last_worker = last
        self._stash = (data, task)

    def _collect(self, awaited: int) -> None:
        """Wait for worker events (or a hang) and record them in the task table."""
        assert self._supervisor is not None
        timeout = self._timeout if self._timeout > 0 else None
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            wakes = [deadline, self._next_hang_deadline(), self._next_lost_check()]
            wake = min((w for w in wakes if w is not None), default=None)
            remaining = None if wake is None else max(0.0, wake - time.monotonic())
            events = self._supervisor.wait(remaining)  # Ctrl-C goes through in its wait
            if events:
                break
            self._check_hangs()
            self._check_lost_results()
            if deadline is not None and time.monotonic() >= deadline:
                task = self._epoch.tasks.get(awaited)
                worker_id = task.worker_id if task else None
                raise diagnosis.timed_out(
                    timeout_s=self._timeout,
                    worker_id=worker_id,
                    pid=self._supervisor.pid(worker_id) if worker_id is not None else None,
                    sample_indices=flat_indices(task.indices) if task else [],
                )
        for worker_id, event in events:
            self._on_event(worker_id, event)

    def _release(self, task: TaskEntry) -> None:
        self._per_worker[task.worker_id] -= 1
        self._try_put_index()

    def _process(self, task: TaskEntry) -> Any:
        self._release(task)
        if task.failed:
            raise DatasetError(task.outcome)
        data = task.outcome
        if self._pin_memory:
            data = _pin_memory(data, self._pin_memory_device)
        return data

