"""The multi-worker iterator's task table: which worker holds which batch, and its outcome.

`TaskTable` owns its invariants; nothing else writes its counters. Task ids grow across
epochs; the table holds the tasks of the current epoch not yet yielded, and remembers the
tasks of abandoned epochs still in flight (stale: their outcomes are dropped when they
arrive). docs/design/protocol.md.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

EMPTY = object()
"""The outcome of a task whose every sample was skipped."""
_NONE = object()  # settle() without an outcome (a stream's end)


@dataclass(slots=True)
class TaskEntry:
    """One batch sent to a worker: its indices and, once it arrived, its outcome."""

    worker_id: int
    indices: Any
    ordinal: int  # batch number in the epoch (checkpoint.py)
    outcome: Any = None
    has_outcome: bool = False
    failed: bool = False
    stream_state: bytes | None = None  # a stateful stream's state after this batch



class TaskTable:
    """The tasks of one iterator: added at dispatch, settled when their outcome arrives,
    removed when yielded. Per epoch: which workers' streams are still active, how many
    tasks each worker holds, and the restarts used."""

    def __init__(self, num_workers: int, *, in_order: bool = True) -> None:
        self.tasks: dict[int, TaskEntry] = {}
        """Task id -> entry, for the current epoch's tasks not yet yielded."""
        self.next_id = 0
        self.rcvd = 0
        """The next task id to yield (in order)."""
        self.outstanding = 0
        """Tasks sent whose outcome has not arrived (torch's ``_tasks_outstanding``)."""
        self.restarts = 0
        """Restarts used this epoch (``max_restarts``)."""
        self.epoch = 0
        """The loader's epoch number, which tasks carry (``sample_seeds``)."""
        self._num_workers = num_workers
        self.active = [True] * num_workers
        """Per worker: its stream has not ended this epoch."""
        self.load = [0] * num_workers
        """Per worker: tasks sent to it and not yet yielded (``in_order=False``'s limit)."""
        self._stale: dict[int, int] = {}  # task id -> worker, of abandoned epochs
        self.arrived: collections.deque[int] | None = None if in_order else collections.deque()
        """``in_order=False``: ids of tasks filled, in the order their outcomes came."""

    def new_epoch(self, epoch: int) -> None:
        """Begin epoch ``epoch``: tasks still in flight become stale; counters start afresh."""
        self.epoch = epoch
        self._stale.update(
            {tid: t.worker_id for tid, t in self.tasks.items() if not t.has_outcome}
        )
        self.tasks = {}
        self.rcvd = self.next_id
        self.outstanding = self.restarts = 0
        self.active = [True] * self._num_workers
        self.load = [0] * self._num_workers
        if self.arrived is not None:
            self.arrived.clear()

    def clear(self) -> None:
        """Every worker was started afresh: nothing is in flight any more."""
        self.tasks.clear()
        self._stale.clear()

    def add(self, worker_id: int, indices: Any, ordinal: int) -> int:
        """A task dispatched to ``worker_id``; its id."""
        task_id = self.next_id
        self.next_id += 1
        self.tasks[task_id] = TaskEntry(worker_id, indices, ordinal)
        self.load[worker_id] += 1
        self.outstanding += 1
        return task_id

    def settle(
        self, task_id: int, outcome: Any = _NONE, *, failed: bool = False
    ) -> TaskEntry | None:
        """An outcome for ``task_id`` arrived (a batch, `EMPTY`, or the exception to raise;
        none: its worker's stream ended): the task, or None if it is stale or already
        settled (a second outcome of a re-run task is dropped)."""
        if task_id in self._stale:
            del self._stale[task_id]
            return None
        task = self.tasks.get(task_id)
        if task is None or task.has_outcome:
            return None
        self.outstanding -= 1
        if outcome is not _NONE:
            task.outcome, task.has_outcome, task.failed = outcome, True, failed
            if self.arrived is not None:
                self.arrived.append(task_id)
        return task

    def skip(self, task_id: int) -> None:
        """Settle ``task_id`` as a batch whose every sample was left out."""
        self.settle(task_id, EMPTY)

    def yielded(self, task_id: int) -> TaskEntry:
        """Remove a task whose outcome is being handed to the caller."""
        task = self.tasks.pop(task_id)
        self.load[task.worker_id] -= 1
        return task

    def drop(self, task_id: int) -> None:
        """Remove a task that will never have an outcome (its worker's stream ended first)."""
        del self.tasks[task_id]

    def held_by(self, worker_id: int) -> list[tuple[int, TaskEntry]]:
        """The tasks ``worker_id`` holds (no outcome yet), oldest first."""
        return sorted(
            (tid, t) for tid, t in self.tasks.items()
            if t.worker_id == worker_id and not t.has_outcome
        )  # fmt: skip

    def forget(self, workers: Collection[int]) -> None:
        """Those workers died: their stale tasks will never be answered (none is re-run)."""
        self._stale = {t: w for t, w in self._stale.items() if w not in workers}

    def oldest_awaited(self) -> dict[int, int]:
        """worker id -> the oldest task it holds whose outcome has not arrived."""
        awaited: dict[int, int] = {}
        for tid, task in self.tasks.items():
            if not task.has_outcome:
                awaited[task.worker_id] = min(awaited.get(task.worker_id, tid), tid)
        return awaited
