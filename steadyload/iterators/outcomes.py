"""What each message from a worker does to the multi-worker iterator's task table.

A mixin of `WorkerIterator`: a batch, an error, an empty batch, an exhausted stream, a
retirement, a start failure, a death (handed to `Recovery`), the fork server's death, or a
batch that could not be received here (`limits.shared_memory_exhausted`).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

from .. import limits
from ..engine.events import (
    Died,
    GlobalRngDrawn,
    Received,
    ReceiveFailed,
    ServerDied,
    WorkersChosen,
)
from ..engine.pool import WorkerPool
from ..engine.protocol import Empty, Exhausted, Failed, Ready, Retire, StartFailed
from ..engine.worker_info import warn_global_draws
from ..errors import SharedMemoryError
from ..memory.advice import check_in_flight
from ..report import RunRecord, SkippedSample, WorkerReport, summarize_modules
from .common import EmptyBatches, SkipGuard
from .tasks import EMPTY, EpochTable, TaskEntry
from .worker_errors import rebuild_exception

if TYPE_CHECKING:
    from ..start.context import StartInfo

_LOG = logging.getLogger(__name__)


class Outcomes:
    """Records worker messages in the task table (owned by `WorkerIterator`)."""

    _epoch: EpochTable
    _supervisor: WorkerPool | None
    _stale: dict[int, int]
    _stream_state: dict[int, bytes]
    _active: list[bool]
    _arrived: collections.deque[int]
    _in_order: bool
    _guard: SkipGuard
    _empty: EmptyBatches
    _checked_in_flight: bool
    _prefetch_factor: int
    _num_workers: int
    _retiring: dict[int, int]
    _start_info: StartInfo
    record: RunRecord

    if TYPE_CHECKING:  # the other mixins' methods: declared, never stubs that could shadow
        def _on_died(self, worker_id: int, died: Died) -> None: ...
        def _on_server_died(self, died: ServerDied, also: tuple[int, ...] = ()) -> None: ...
        def _try_put_index(self, force: bool = False) -> bool: ...

    def _on_event(self, worker_id: int, event: Any) -> None:
        if isinstance(event, Received):
            done, batch = event.done, event.batch
            task = self._settle(done.task_id)
            self._record_skips(done.skipped)
            self._guard.delivered()
            if done.stream_state is not None and task is not None:
                self._stream_state[worker_id] = done.stream_state
            if task is not None:
                self.record.loaded(worker_id, done.samples, done.load_s)
                task.outcome, task.has_outcome = batch, True
                task.stream_state = done.stream_state
                self._empty.learn(batch)
                self._note_arrival(done.task_id)
                if not self._checked_in_flight:
                    self._checked_in_flight = True
                    advice = check_in_flight(batch, self._prefetch_factor, self._num_workers)
                    if advice:
                        _LOG.warning(advice)
        elif isinstance(event, Ready):
            self._on_ready(worker_id, event)
        elif isinstance(event, Died):
            self._on_died(worker_id, event)
        elif isinstance(event, ServerDied):
            self._on_server_died(event)
        elif isinstance(event, ReceiveFailed):
            raise limits.shared_memory_exhausted(
                worker_id=worker_id, error=event.errno, detail=event.detail,
                where="main process", segments=event.segments,
            )
        elif isinstance(event, Failed):
            task = self._settle(event.task_id)
            if task is not None:
                pid = self._supervisor.pid(worker_id) if self._supervisor else None
                task.outcome = rebuild_exception(worker_id, pid, event)
                if isinstance(task.outcome, SharedMemoryError):
                    raise task.outcome  # the worker ran out: no batch can cross any more
                task.has_outcome = task.failed = True
                self._note_arrival(event.task_id)
        elif isinstance(event, Empty):
            self._record_skips(event.skipped)
            task = self._settle(event.task_id)
            if task is not None:
                task.outcome, task.has_outcome = EMPTY, True
                self._note_arrival(event.task_id)
        elif isinstance(event, Exhausted):
            self._record_skips(event.skipped)
            if self._settle(event.task_id) is not None:
                self._active[worker_id] = False
                self._try_put_index()
        elif isinstance(event, WorkersChosen):
            self.record.worker_type_choice, self.record.worker_kind = event.reason, event.kind
            if event.method is not None:  # handed over to processes
                self.record.start_method, self.record.preload = event.method, event.preload
        elif isinstance(event, GlobalRngDrawn):
            warn_global_draws(event.dataset_type)
        elif isinstance(event, Retire):
            self._retiring[worker_id] = event.uss_bytes
        elif isinstance(event, StartFailed):
            assert self._supervisor is not None
            pid = self._supervisor.pid(worker_id)
            raise limits.start_failed(
                worker_id=worker_id, pid=pid, method=self._start_info.method,
                type_name=event.type_name, text=event.text, traceback=event.traceback,
                error=event.errno,
            )
        else:
            raise RuntimeError(
                f"[steadyload internal error] unexpected message {event!r} from worker "
                f"{worker_id}; please report with the output of `steadyload doctor`"
            )

    def _note_arrival(self, task_id: int) -> None:
        if not self._in_order:
            self._arrived.append(task_id)

    def _record_skips(self, skipped: tuple[SkippedSample, ...]) -> None:
        self._guard.record(self.record, skipped)

    def _on_ready(self, worker_id: int, ready: Ready) -> None:
        assert self._supervisor is not None
        asked = self._supervisor.started_at(worker_id)
        start_s = self._supervisor.clock() - asked if asked is not None else None
        record = self.record
        record.workers[worker_id] = WorkerReport(worker_id, ready.pid, start_s)
        record.ready_at.setdefault(worker_id, time.perf_counter())  # a replacement continues
        if ready.preload_missing and record.preload_missing is None:
            _LOG.warning(
                "the fork server could not import %s (CPython skips failed preloads "
                "silently); every worker imports them itself, which is slower",
                summarize_modules(ready.preload_missing),
            )
        if ready.preload_missing is not None:
            record.preload_missing = ready.preload_missing

    def _settle(self, task_id: int) -> TaskEntry | None:
        """An outcome for ``task_id`` arrived: the task, or None if it is stale."""
        if task_id in self._stale:
            del self._stale[task_id]
            return None
        task = self._epoch.tasks.get(task_id)
        if task is not None and not task.has_outcome:
            self._epoch.outstanding -= 1
            return task
        return None
