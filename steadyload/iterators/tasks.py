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
    answered: bool = False  # its outcome came, or its worker's stream ended at it (none will)
    failed: bool = False
    stream_state: bytes | None = None  # a stateful stream's state after this batch
    events: list[str] | None = None  # what touched it before it was yielded (a re-run)
    span: tuple[int, int] | None = None  # a stream's: the items of its worker's stream read


class TaskTable:
    """The tasks of one iterator: added at dispatch, settled when their outcome arrives,
    removed when yielded. Per epoch: which workers' streams are still active, how many
    tasks each worker holds, and the restarts used. Its fields are its own: the iterator
    and its collaborators change it only through these operations (a test checks that
    nothing else assigns to them)."""

    def __init__(self, num_workers: int, *, in_order: bool = True) -> None:
        self._tasks: dict[int, TaskEntry] = {}  # the current epoch's tasks not yet yielded
        self._next_id = 0
        self._rcvd = 0  # the next task id to yield (in order)
        self._outstanding = 0  # sent, no outcome yet (torch's ``_tasks_outstanding``)
        self._restarts = 0  # used this epoch (``max_restarts``)
        self._epoch = 0
        self._num_workers = num_workers
        self._active = [True] * num_workers  # per worker: its stream has not ended
        self._load = [0] * num_workers  # per worker: sent and not yet yielded
        self._stale: dict[int, int] = {}  # task id -> worker, of abandoned epochs
        self._arrived: collections.deque[int] | None = None if in_order else collections.deque()

    # -- reading -----------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The loader's epoch number, which tasks carry (``sample_seeds``)."""
        return self._epoch

    @property
    def outstanding(self) -> int:
        """Tasks sent whose outcome has not arrived."""
        return self._outstanding

    @property
    def restarts(self) -> int:
        """Restarts used this epoch."""
        return self._restarts

    def get(self, task_id: int) -> TaskEntry | None:
        """The current epoch's task ``task_id``, if not yet yielded."""
        return self._tasks.get(task_id)

    def active(self, worker_id: int) -> bool:
        """Whether the worker's stream has not ended this epoch."""
        return self._active[worker_id]

    def active_workers(self) -> int:
        """How many workers' streams have not ended this epoch."""
        return sum(self._active)

    def load(self, worker_id: int) -> int:
        """Tasks sent to the worker and not yet yielded (``in_order=False``'s limit)."""
        return self._load[worker_id]

    def settled(self) -> int:
        """Tasks whose outcome arrived and that wait to be yielded."""
        return sum(1 for t in self._tasks.values() if t.has_outcome)

    def held_by(self, worker_id: int) -> list[tuple[int, TaskEntry]]:
        """The tasks ``worker_id`` holds (not answered yet), oldest first."""
        return sorted(
            (tid, t)
            for tid, t in self._tasks.items()
            if t.worker_id == worker_id and not t.answered
        )

    def oldest_awaited(self) -> dict[int, int]:
        """worker id -> the oldest task it holds that was not answered (a task its worker's
        stream ended at has no outcome, and none is awaited)."""
        awaited: dict[int, int] = {}
        for tid, task in self._tasks.items():
            if not task.answered:
                awaited[task.worker_id] = min(awaited.get(task.worker_id, tid), tid)
        return awaited

    # -- an epoch ----------------------------------------------------------------------------
    def new_epoch(self, epoch: int) -> None:
        """Begin epoch ``epoch``: tasks still in flight become stale; counters start afresh."""
        self._epoch = epoch
        self._stale.update(
            {tid: t.worker_id for tid, t in self._tasks.items() if not t.answered}
        )
        self._tasks = {}
        self._rcvd = self._next_id
        self._outstanding = self._restarts = 0
        self._active = [True] * self._num_workers
        self._load = [0] * self._num_workers
        if self._arrived is not None:
            self._arrived.clear()

    def clear(self) -> None:
        """Every worker was started afresh: nothing is in flight any more."""
        self._tasks.clear()
        self._stale.clear()

    def add(self, worker_id: int, indices: Any, ordinal: int) -> int:
        """A task dispatched to ``worker_id``; its id."""
        task_id = self._next_id
        self._next_id += 1
        self._tasks[task_id] = TaskEntry(worker_id, indices, ordinal)
        self._load[worker_id] += 1
        self._outstanding += 1
        return task_id

    def settle(
        self,
        task_id: int,
        outcome: Any = _NONE,
        *,
        failed: bool = False,
        stream_state: bytes | None = None,
        span: tuple[int, int] | None = None,
    ) -> TaskEntry | None:
        """An outcome for ``task_id`` arrived (a batch, `EMPTY`, or the exception to raise;
        none: its worker's stream ended), with the stream's state after it: the task, or
        None if it is stale or already settled (a second outcome of a re-run task is
        dropped)."""
        if task_id in self._stale:
            del self._stale[task_id]
            return None
        task = self._tasks.get(task_id)
        if task is None or task.answered:
            return None
        task.answered = True
        self._outstanding -= 1
        if stream_state is not None:
            task.stream_state = stream_state
        if span is not None:
            task.span = span
        if outcome is not _NONE:
            task.outcome, task.has_outcome, task.failed = outcome, True, failed
            if self._arrived is not None:
                self._arrived.append(task_id)
        return task

    def end_stream(self, worker_id: int, task_id: int) -> bool:
        """The worker's stream ended at ``task_id`` (it produced nothing): no more tasks go
        to it this epoch. False when that task is stale or already settled."""
        if self.settle(task_id) is None:
            return False
        self._active[worker_id] = False
        return True

    def skip(self, task_id: int) -> None:
        """Settle ``task_id`` as a batch whose every sample was left out."""
        self.settle(task_id, EMPTY)

    def leave_out(self, task_id: int, sample: Any) -> None:
        """Re-run ``task_id`` without ``sample`` (it killed workers)."""
        task = self._tasks[task_id]
        task.indices = [i for i in task.indices if i != sample]

    def rerun(self, task_id: int, cause: str) -> None:
        """Task ``task_id`` is sent again (its worker died or hung): ``cause`` goes with it."""
        task = self._tasks.get(task_id)
        if task is not None:
            task.events = [*(task.events or ()), f"re-run: {cause}"]

    def spend_restart(self) -> int:
        """One restart of this epoch's budget is used; how many are used now."""
        self._restarts += 1
        return self._restarts

    def forget(self, workers: Collection[int]) -> None:
        """Those workers died: their stale tasks will never be answered (none is re-run)."""
        self._stale = {t: w for t, w in self._stale.items() if w not in workers}

    # -- yielding ----------------------------------------------------------------------------
    def next_to_yield(self) -> tuple[int, TaskEntry] | None:
        """The next task in order (passing over tasks whose worker's stream ended first:
        they will never have an outcome), or None when every task was yielded."""
        while self._rcvd < self._next_id:
            task = self._tasks.get(self._rcvd)
            if task is not None:
                if task.has_outcome or self._active[task.worker_id]:
                    return self._rcvd, task
                del self._tasks[self._rcvd]  # its worker's stream ended first
            self._rcvd += 1
        return None

    def first_arrived(self) -> tuple[int, TaskEntry | None] | None:
        """``in_order=False``: the earliest-arrived outcome not yet yielded (its task None
        when it was yielded in order meanwhile), or None."""
        if not self._arrived:
            return None
        tid = self._arrived[0]
        return tid, self._tasks.get(tid)

    def yielded(self, task_id: int) -> TaskEntry:
        """Remove a task whose outcome is being handed to the caller."""
        task = self._tasks.pop(task_id)
        self._load[task.worker_id] -= 1
        if task_id == self._rcvd:
            self._rcvd += 1
        if self._arrived and self._arrived[0] == task_id:
            self._arrived.popleft()
        return task

    def drop_arrived(self) -> None:
        """``in_order=False``: pass over an arrival whose task was yielded in order."""
        assert self._arrived is not None
        self._arrived.popleft()
