"""The multi-worker iterator: torch's dispatch order over a pool of supervised workers.

Dispatch is torch's (round-robin over active workers, ``prefetch_factor`` tasks per worker,
yield in task order), so a worker sees the same samples in the same order as under torch
and random values drawn inside ``__getitem__`` match too. The iterator drives any kind of
worker through the pool protocol (engine/pool.py), and hands its collaborators the task
table (`tasks.TaskTable`): `Outcomes` applies the pool's events, `Recovery` replaces dead,
hung and over-memory workers, `Watchdog` finds hangs and lost results; checkpoint
bookkeeping is `progress.EpochProgress`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .. import diagnosis
from ..engine import interrupts
from ..engine.config import WorkerConfig
from ..engine.factory import PoolPlan, make_pool
from ..engine.interrupts import held_interrupts
from ..engine.pool import WorkerPool
from ..engine.remote.spec import all_workers
from ..engine.worker.fetch import ITERABLE, stateful
from ..memory.sampler import MemorySampler
from ..options import LoaderOptions
from ..resume.checkpoint import Checkpoints
from ..resume.progress import EpochProgress, carried, position_blobs
from ..start import guards
from .common import DatasetError, EmptyBatches, SkipGuard, flat_indices, refuse_datapipes
from .delivery import commit, record_step, take_back
from .feeding import WorkerFeeding
from .hangs import Watchdog
from .outcomes import Outcomes
from .record import History, RunRecord
from .recovery import Recovery
from .scaling import RemoteScaling
from .tasks import EMPTY, TaskEntry, TaskTable

_LOG = logging.getLogger(__name__)


class WorkerIterator(WorkerFeeding, _BaseDataLoaderIter):
    """num_workers>0: batches from steadyload's supervised workers (any kind)."""

    def __init__(
        self,
        loader: DataLoader[Any],
        options: LoaderOptions,
        plan: PoolPlan,
        checkpoints: Checkpoints,
        history: History,
    ) -> None:
        super().__init__(loader)
        self._local_workers = loader.num_workers
        self._num_workers = all_workers(loader)  # remote workers take the ids after local ones
        self._prefetch_factor: int = loader.prefetch_factor or 2
        self._in_order = loader.in_order
        self._opts = options
        self._checkpoints = checkpoints
        self._plan = plan
        refuse_datapipes(self._dataset)
        if plan.start_method is not None:  # processes start now
            guards.check_process_start(self._dataset, self._local_workers, plan.start_method)
        checkpoints.apply_base_seed(loader, self)  # before the workers are configured with it
        self.record = RunRecord(plan.kind, plan.start_method, plan.preload, history)
        self.record.ledger = self._ledger = checkpoints.ledger  # (told of skipped samples)
        self._config = WorkerConfig(
            dataset_kind=self._dataset_kind,
            dataset=self._dataset,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=int(self._base_seed),
            worker_init_fn=loader.worker_init_fn,
            num_workers=self._num_workers,
            preload=plan.preload,
            skip_errors=self._opts.on_error == "skip",
            max_memory_bytes=self._opts.max_worker_memory_bytes,
            sample_seeds=self._opts.sample_seeds,
            hang_timeout_s=self._opts.hang_timeout,
            lazy_iter=checkpoints.pending is not None
            and checkpoints.pending.dataset_states is not None,
        )
        self._stream_state: dict[int, bytes] = {}  # worker -> state after its last batch
        self._ended: dict[int, bytes | None] = {}  # worker -> its stream's position at its end
        self._empty = EmptyBatches(self._collate_fn)
        self._pool: WorkerPool | None = None
        self._error: BaseException | None = None
        self._table = TaskTable(self._num_workers, in_order=self._in_order)
        self._cycle = itertools.cycle(range(self._num_workers))
        self._guard = SkipGuard()
        self._watchdog = Watchdog(self._table, options.hang_timeout, self._num_workers)
        remote = options.remote
        self._scaling = (
            None
            if remote is None or not remote.scales
            else RemoteScaling(
                remote,
                loader.num_workers,
                self._table,
                self.record,
                fixed_workers=self._dataset_kind == ITERABLE or stateful(self._dataset),
            )
        )
        self._parked = self._scaling.parked if self._scaling else set()  # ids without actors
        self._recovery = Recovery(
            self._table,
            options,
            self.record,
            stream=self._dataset_kind == ITERABLE,
            stateful_stream=self._dataset_kind == ITERABLE and stateful(self._dataset),
            hung=self._watchdog.hung,
            stream_state=self._stream_state,
        )
        self._outcomes = Outcomes(
            self._table,
            self.record,
            self._recovery,
            guard=self._guard,
            empty=self._empty,
            stream_state=self._stream_state,
            ended=self._ended,
            in_flight=(self._prefetch_factor, self._num_workers),
            scaling=self._scaling,
        )
        self._awaiting: tuple[int, float] | None = None  # (task id, torch's timeout deadline)
        self._stash: tuple[Any, TaskEntry] | None = None  # a batch held back by Ctrl-C
        self._handing: tuple[Any, TaskEntry, tuple[Any, int | None]] | None = None
        self._views: Sequence[Any] = []  # WorkerView or ThreadView (or None), by worker id
        self._attached = False  # to engine/interrupts.py, while workers run
        self._start_workers()
        self._reset(loader, first_iter=True)
        self._start_feed(options)  # after the workers: a fork comes before any CUDA use here

    # -- lifecycle ---------------------------------------------------------------------------
    def _start_workers(self) -> None:
        checks = functools.partial(guards.check_process_start, self._dataset, self._local_workers)
        self._pool = pool = make_pool(self._plan, self._config, self._num_workers, checks)
        self._views = pool.views
        self.record.started(pool, self._plan.kind)
        if not self._attached:  # Ctrl-C held at safe points for this iterator's life
            self._attached = True
            interrupts.attach()
        self._memory = self._recovery.memory = MemorySampler(pool.pids)
        self.record.memory = self._memory.snapshot
        if self._scaling is not None:  # a new pool starts at the range's minimum
            self._scaling.reset()

    def _shutdown_workers(self) -> None:
        memory = getattr(self, "_memory", None)
        if memory is not None:
            memory.stop()
        pool = self._pool
        try:
            if pool is not None:
                pool.shutdown()  # a held Ctrl-C is raised once it has finished
        finally:
            if pool is not None and pool.stopped:
                self._pool = None
            if self._attached and self._pool is None:
                self._attached = False
                interrupts.detach()

    @property
    def _workers(self) -> list[Any]:
        """The workers by id (as torch's iterator has them), with pid and exit code."""
        return list(self._views)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # Bound at definition: at exit this module's globals (``sys`` too) may be None by
        # the time a loader kept in a global is collected.
        if _finalizing():  # workers have their own finalizers (atexit, process reapers)
            return
        if getattr(self, "_pool", None) is not None or getattr(self, "_attached", False):
            self._shutdown_workers()  # (__init__ may have failed half-way)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        with held_interrupts():  # a task recorded but never sent would wait forever
            self._reset_epoch(loader, first_iter)

    def _reset_epoch(self, loader: Any, first_iter: bool) -> None:
        super()._reset(loader, first_iter)
        self._stash = self._handing = None  # a batch held back by Ctrl-C was last epoch's
        if self._feed is not None:
            self._feed.reset()  # and so are the batches on their way to the device
        previous = None if first_iter else self._progress  # persistent workers: last epoch's
        self._progress: EpochProgress = self._checkpoints.begin_epoch(loader, self)
        if first_iter:
            self.record.epoch = self._progress.epoch
        else:  # persistent workers: the record's epoch closes
            self.record.begin_epoch(self._progress.epoch)
        if self._pool is None:
            # Persistent workers that were stopped by an error: start afresh.
            self._error = None
            self._table.clear()
            self._start_workers()
        elif not first_iter:
            self._pool.send_reset()
        # Tasks still in flight from the last epoch are discarded when they arrive.
        self._table.new_epoch(self._progress.epoch)
        self._cycle = itertools.cycle(range(self._num_workers))
        self._stream_state.clear()  # each epoch's streams start afresh (Reset)
        self._ended.clear()
        if self._progress.resume_streams is not None:
            self._resume_streams(self._progress.resume_streams)
        elif previous is not None:  # persistent workers keep their replicas (progress.carried)
            for worker_id, blob in carried(previous, self._dataset_kind == ITERABLE).items():
                self._stream_state[worker_id] = self._progress.streams[worker_id] = blob
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _resume_streams(self, resume: dict[str, Any]) -> None:
        """Resume each worker's replica of the dataset where the saved worker's stood
        (checkpoint.py); a worker without a position starts afresh."""
        self._progress.resume_streams = None
        assert self._pool is not None
        for worker_id, blob in position_blobs(resume).items():
            self._pool.send_restore(worker_id, blob)
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
        table, parked = self._table, self._parked
        max_tasks = self._prefetch_factor * (self._num_workers - len(parked))
        if (table.outstanding >= max_tasks and not force) or self._pool is None:
            return False
        try:
            index = self._next_index()
        except StopIteration:
            return False
        for _ in range(self._num_workers):
            worker_id = next(self._cycle)
            if table.active(worker_id) and worker_id not in parked:
                if self._in_order or force:
                    break
                if table.load(worker_id) < max_tasks // (table.active_workers() - len(parked)):
                    break
        else:
            return False
        task_id = table.add(worker_id, index, self._sampler_iter.ordinal)
        self._pool.send_task(worker_id, task_id, index, self._progress.epoch)
        return True

    # -- results -----------------------------------------------------------------------------
    def _next_data_timed(self) -> Any:
        if self._pool is not None and not self._pool.running:
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
                got = stash if stash is not None else self._next_data_inner()
                assert got is not None  # (it waits)
                data, task = got
                before = commit(self._progress, task, self._dataset_kind == ITERABLE)
                self._handing = (data, task, before)
            self._handing = None
            if self._ledger is not None:  # (a stream's batch: for its samples' keys)
                stream = data if self._dataset_kind == ITERABLE else None
                record_step(self._ledger, self._progress, task, self._pool, self.record, stream)
            if self._scaling is not None and self._pool is not None:  # a grown pool: fill it
                for _ in range(self._scaling.after_batch(self._pool) * self._prefetch_factor):
                    self._try_put_index()
        except StopIteration:
            self._finish_epoch(dict(self._ended))
            raise
        except KeyboardInterrupt:
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

    def _next_data_inner(self, block: bool = True) -> tuple[Any, TaskEntry] | None:
        """The next batch to yield and its task; None if ``block`` is False and it has not
        arrived. StopIteration at the end (`_finish_epoch` then marks it)."""
        table = self._table
        while True:
            head = table.next_to_yield()
            if head is None:
                for warning in self._memory.end_epoch():
                    _LOG.warning(warning)
                if not self._persistent_workers:
                    self._read_last_events()
                    self._shutdown_workers()
                raise StopIteration
            task_id, task = head
            if task.has_outcome and self._can_deliver(task):
                table.yielded(task_id)
                return self._deliver(task), task
            while (early := table.first_arrived()) is not None:  # in_order=False: first come
                tid, arrived = early
                if arrived is None:
                    table.drop_arrived()  # yielded in order meanwhile
                    continue
                if not self._can_deliver(arrived):
                    break
                table.yielded(tid)
                return self._deliver(arrived), arrived
            if table.outstanding == 0 and not self._try_put_index(force=True):
                # Only batches whose every sample was skipped, and nothing left to load.
                raise self._guard.nothing_loaded()
            came = self._collect(task_id, block)
            if not (block or came):
                return None  # not here yet: the device stage looks ahead without waiting

    def _can_deliver(self, task: TaskEntry) -> bool:
        # A batch whose samples were all skipped is yielded empty, shaped like one that
        # loaded; until one has, it waits (and _next_data_inner loads further).
        return task.outcome is not EMPTY or self._empty.ready

    def _deliver(self, task: TaskEntry) -> Any:
        self._try_put_index()
        if task.outcome is EMPTY:
            return self._empty.make()
        if task.failed:
            raise DatasetError(task.outcome)
        return task.outcome

    def _hold_back(self) -> None:
        """Ctrl-C while a batch was being handed over: keep it for the next call."""
        if self._handing is None:
            return
        data, task, before = self._handing
        self._handing = None
        if before is not None:  # (None: taken for the device stage, not yet handed over)
            take_back(self._progress, task, before)
        self._stash = (data, task)

    def _collect(self, awaited: int, block: bool = True) -> bool:
        """Record pool events in the task table: waited for (`_wait`), or with ``block``
        False only those there now. Returns whether any came."""
        pool = self._pool
        assert pool is not None
        events = self._wait(pool, awaited) if block else pool.wait(0)
        for worker_id, event in events:
            for _ in range(self._outcomes.on_event(pool, worker_id, event)):
                self._try_put_index()
        return bool(events)

    def _wait(self, pool: WorkerPool, awaited: int) -> list[tuple[int, object]]:
        """Wait for pool events, or a hang (handled). torch's ``timeout`` counts from when
        the loop began waiting for the batch it yields next (``awaited``), across the
        events of other batches that arrive meanwhile."""
        watchdog, deadline = self._watchdog, None
        if self._timeout > 0:
            if self._awaiting is None or self._awaiting[0] != awaited:
                self._awaiting = (awaited, time.monotonic() + self._timeout)
            deadline = self._awaiting[1]
        while True:
            wakes = [deadline, watchdog.next_hang_deadline(pool), watchdog.next_lost_check()]
            wake = min((w for w in wakes if w is not None), default=None)
            remaining = None if wake is None else max(0.0, wake - time.monotonic())
            events = pool.wait(remaining)  # Ctrl-C goes through in its wait
            if events:
                return events
            watchdog.check_hangs(pool)
            watchdog.check_lost_results(pool)
            if deadline is not None and time.monotonic() >= deadline:
                task = self._table.get(awaited)
                worker_id = task.worker_id if task else None
                raise diagnosis.timed_out(
                    timeout_s=self._timeout,
                    worker_id=worker_id,
                    pid=pool.pid(worker_id) if worker_id is not None else None,
                    sample_indices=flat_indices(task.indices) if task else [],
                )
