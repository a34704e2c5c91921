"""The multi-worker iterator's task table: which worker holds which batch, and its outcome.

Task ids grow across epochs; an `EpochTable` holds the tasks of one epoch that were not yet
yielded (docs/design/protocol.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EMPTY = object()
"""The outcome of a task whose every sample was skipped."""


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


@dataclass(slots=True)
class EpochTable:
    """The task table of one epoch: task id -> `TaskEntry`, for tasks not yet yielded."""

    tasks: dict[int, TaskEntry] = field(default_factory=dict)
    rcvd: int = 0
    outstanding: int = 0  # tasks sent whose outcome has not arrived (torch's _tasks_outstanding)
    restarts: int = 0
