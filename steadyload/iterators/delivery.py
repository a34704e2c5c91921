"""A batch handed to the caller: what it marks in the epoch's progress, its undo, and its
line in the ledger."""

from __future__ import annotations

from typing import Any

from ..resume.ledger.record import Recorder
from ..resume.progress import EpochProgress
from .tasks import TaskEntry

_ABSENT = object()  # a worker with no stream position recorded yet (commit)


def commit(progress: EpochProgress, task: TaskEntry, stream: bool) -> tuple[Any, int | None]:
    """The batch of ``task`` is handed to the caller: it counts as yielded (``stream``: the
    dataset is an IterableDataset). Returns what `take_back` needs to undo that (a Ctrl-C
    at the last moment keeps the batch)."""
    before = (progress.streams.get(task.worker_id, _ABSENT), progress.last_worker)
    progress.yielded.mark(task.ordinal)
    if task.stream_state is not None:
        progress.streams[task.worker_id] = task.stream_state
    elif stream:
        progress.streams[task.worker_id] = None  # its stream cannot say where it stands
    progress.last_worker = task.worker_id
    return before


def take_back(progress: EpochProgress, task: TaskEntry, before: tuple[Any, int | None]) -> None:
    """Undo `commit` of ``task`` with what it returned: the batch was not handed over."""
    stream, last = before
    progress.yielded.unmark(task.ordinal)
    if stream is not _ABSENT:
        progress.streams[task.worker_id] = stream
    else:
        progress.streams.pop(task.worker_id, None)
    progress.last_worker = last


def record_step(
    ledger: Recorder, progress: EpochProgress, task: TaskEntry, pool: Any, record: Any, stream: Any
) -> None:
    """The ledger's line for the batch of ``task``, just handed over (``record``: the run's
    `RunRecord`, for the workers' kind; ``stream``: a stream's batch, for its samples' keys,
    else None)."""
    worker = task.worker_id
    host = pool.host(worker) if pool is not None else None  # (only a remote worker's)
    ledger.step(
        progress.step_base + task.ordinal,
        task.indices,
        worker,
        pool.pid(worker) if pool is not None else None,
        "remote" if host is not None else record.worker_kind,
        task.events,
        stream,
        host,
        task.span,
    )
