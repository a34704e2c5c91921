"""What each event from a pool does to the multi-worker iterator's task table.

`Outcomes` is a collaborator of `WorkerIterator`, handed the task table, the run record,
`Recovery` and the remote pool's `RemoteScaling` (if it scales); the pool is passed to each
call. Events are dispatched by `match`: a batch, an error, an empty batch, an exhausted
stream, a retirement, a start failure, a death (handed to `Recovery`), the fork server's
death, auto's choice, or a batch that could not be received here
(`limits.shared_memory_exhausted`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..engine.events import Died, GlobalRngDrawn, Received, ReceiveFailed, WorkersChosen
from ..engine.pool import WorkerPool
from ..engine.protocol import Empty, Exhausted, Failed, Ready, Retire, StartFailed
from ..engine.thread.sharing import warn_global_draws
from ..errors import SharedMemoryError
from ..host import limits
from ..memory.advice import check_in_flight
from ..report import SkippedSample, WorkerReport, summarize_modules
from .common import EmptyBatches, SkipGuard, record_cut
from .record import RunRecord
from .recovery import Recovery
from .scaling import RemoteScaling
from .tasks import EMPTY, TaskTable
from .worker_errors import rebuild_exception

_LOG = logging.getLogger(__name__)


class Outcomes:
    """Records pool events in the task table and the run record."""

    def __init__(
        self,
        table: TaskTable,
        record: RunRecord,
        recovery: Recovery,
        *,
        guard: SkipGuard,
        empty: EmptyBatches,
        stream_state: dict[int, bytes],
        ended: dict[int, bytes | None],
        in_flight: tuple[int, int],
        scaling: RemoteScaling | None,
    ) -> None:
        self._table = table
        self._record = record
        self._recovery = recovery
        self._guard = guard
        self._empty = empty
        self._stream_state = stream_state  # the iterator's: worker -> state after its batch
        self._ended = ended  # the iterator's: worker -> its stream's position at its end
        self._in_flight = in_flight  # (prefetch_factor, num_workers): the in-flight check
        self._checked_in_flight = False
        self._scaling = scaling

    def on_event(self, pool: WorkerPool, worker_id: int, event: Any) -> int:
        """Apply one event of ``pool`` (``worker_id`` -1: pool-wide). Returns how many
        tasks the caller dispatches anew: one when a worker's stream ended (the window has
        room again), a joined worker's share when a started remote actor is ready.

        Holds no reference to the iterator (no callback), so that an iterator dropped after
        an error is freed by refcounting at once, and its workers with it."""
        table, record = self._table, self._record
        match event:
            case Received(done=done, batch=batch):
                self._record_skips(done.skipped)
                self._guard.delivered()
                task = table.settle(
                    done.task_id, batch, stream_state=done.stream_state, span=done.span
                )
                if task is None:
                    return 0
                if done.stream_state is not None:
                    self._stream_state[worker_id] = done.stream_state
                record.loaded(worker_id, done.samples, done.load_s)
                if done.rss_bytes:
                    record.rss[worker_id] = done.rss_bytes
                self._empty.learn(batch)
                if not self._checked_in_flight:
                    self._checked_in_flight = True
                    advice = check_in_flight(batch, *self._in_flight)
                    if advice:
                        _LOG.warning(advice)
            case Failed():
                outcome = rebuild_exception(worker_id, pool.pid(worker_id), event)
                task = table.settle(event.task_id, outcome, failed=True)
                if task is not None and isinstance(outcome, SharedMemoryError):
                    raise outcome  # the worker ran out: no batch can cross any more
            case Empty():
                self._record_skips(event.skipped)
                task = table.settle(event.task_id, EMPTY, stream_state=event.position)
                if task is not None and event.position is not None:
                    self._stream_state[worker_id] = event.position
            case Exhausted():
                self._record_skips(event.skipped)
                if event.cut is not None:
                    record_cut(record, event.cut)
                if table.end_stream(worker_id, event.task_id):
                    self._ended.setdefault(worker_id, event.position)  # the first: the end
                    return 1
            case Ready():
                self._on_ready(pool, worker_id, event)
                if self._scaling is not None:
                    return self._scaling.on_ready(pool) * self._in_flight[0]
            case Died():
                self._recovery.on_died(pool, event)
            case Retire():
                self._recovery.retiring[worker_id] = event.uss_bytes
            case WorkersChosen():
                record.worker_type_choice, record.auto_kind = event.reason, event.kind
                if event.now:  # handed over (or kept): these workers run from now on
                    record.worker_kind = event.kind
                    record.start_method, record.preload = event.method, event.preload
            case GlobalRngDrawn():
                warn_global_draws(event.dataset_type)
            case ReceiveFailed():
                raise limits.shared_memory_exhausted(
                    worker_id=worker_id,
                    error=event.errno,
                    detail=event.detail,
                    where="main process",
                    segments=event.segments,
                )
            case StartFailed():
                raise limits.start_failed(
                    worker_id=worker_id,
                    pid=pool.pid(worker_id),
                    method=pool.start_method or pool.kind,
                    type_name=event.type_name,
                    text=event.text,
                    traceback=event.traceback,
                    error=event.errno,
                )
            case _:
                raise RuntimeError(
                    f"[steadyload internal error] unexpected message {event!r} from worker "
                    f"{worker_id}; please report with the output of `steadyload doctor`"
                )
        return 0

    def _record_skips(self, skipped: tuple[SkippedSample, ...]) -> None:
        self._guard.record(self._record, skipped)

    def _on_ready(self, pool: WorkerPool, worker_id: int, ready: Ready) -> None:
        asked = pool.started_at(worker_id)
        start_s = pool.clock() - asked if asked is not None else None
        record = self._record
        record.workers[worker_id] = WorkerReport(
            worker_id, ready.pid, start_s, node=ready.node or None
        )
        record.ready_at.setdefault(worker_id, time.perf_counter())  # a replacement continues
        if ready.preload_missing and record.preload_missing is None:
            _LOG.warning(
                "the fork server could not import %s (CPython skips failed preloads "
                "silently); every worker imports them itself, which is slower",
                summarize_modules(ready.preload_missing),
            )
        if ready.preload_missing is not None:
            record.preload_missing = ready.preload_missing
