"""What the pool reports besides workers' other messages: received batches, deaths
and failures to receive.

`ProcessPool.wait` returns ``(worker_id, event)`` pairs; these are the events the parent
itself makes (the workers' own messages are in protocol.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .protocol import Done
from .worker.status import Progress


@dataclass(frozen=True, slots=True)
class Received:
    """Event: a worker's finished task, with its batch rebuilt from shared memory here."""

    done: Done
    batch: Any


@dataclass(frozen=True, slots=True)
class WorkersChosen:
    """Event (worker id -1): ``worker_type="auto"`` decided (engine/handover.py)."""

    kind: str
    """"thread" or "process"."""
    reason: str
    method: str | None
    """The start method of the workers from now on; None: unchanged (yet)."""
    preload: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GlobalRngDrawn:
    """Event: a thread worker's dataset drew from the process-wide random generators."""

    dataset_type: type


@dataclass(frozen=True, slots=True)
class Died:
    """Event: the worker process exited, with what the parent knows about its last moments."""

    exitcode: int | None
    pid: int | None
    progress: Progress | None = None
    stacks: str = ""
    """What faulthandler wrote: a native crash's stack, or a hang dump."""
    libraries: tuple[str, ...] = ()
    """Crash-prone native libraries the worker had loaded."""
    kind: str = "process"
    """The kind of worker that died: "process", or "thread" (an escaped exception or an
    abandoned hang; ``exitcode`` None)."""
    raised: str = ""
    """A thread's: what escaped the dataset's code ("SystemExit: 3"); empty for a hang."""
    remote: Any = None
    """A remote worker's (``kind`` "remote"): why it is gone (`remote.causes.RemoteCause`)."""


@dataclass(frozen=True, slots=True)
class ServerDied:
    """Event (worker id -1): the fork server (or zygote) the workers come from has exited.

    Every worker started by it is reported gone at once (their exit codes, which only the
    server knew, are lost); none of them is a `Died` of its own.
    """

    method: str
    """"forkserver" or "zygote"."""
    pid: int
    exitcode: int | None
    """Its exit code (negative: the signal); None when unknown (reaped by someone else)."""
    workers: tuple[tuple[int, int | None, Progress | None], ...]
    """(worker id, pid, what it was doing) of each worker it took with it."""


@dataclass(frozen=True, slots=True)
class NodeLost:
    """Event (worker id -1): a Ray node left the cluster with remote workers on it: one
    event for all of them, not one death each."""

    cause: Any
    """Why (`remote.causes.RemoteCause`): the node, its address, Ray's reason."""
    workers: tuple[tuple[int, int | None, Progress | None], ...]
    """(worker id, pid, what it was doing) of each remote worker it took with it."""


@dataclass(frozen=True, slots=True)
class ReceiveFailed:
    """Event: a worker's message (and the batch in it) could not be received here.

    ``errno`` EMFILE/ENFILE: this process ran out of file descriptors (the kernel dropped
    the ones the batch's new segments came with); ENOMEM: mapping a segment failed (out of
    memory mappings, ``vm.max_map_count``, or address space).
    """

    task_id: int | None
    errno: int
    detail: str
    segments: int
    """How many new shared-memory segments the message brought (descriptors needed)."""


class ServerGone(Exception):
    """Internal: a worker could not start because its fork server died; carries the event."""

    def __init__(self, event: ServerDied) -> None:
        super().__init__(f"the {event.method} (pid {event.pid}) died")
        self.event = event
