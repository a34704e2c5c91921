"""What the pool reports besides workers' other messages: received batches, deaths (one
`Died` for every kind, its `Cause` the kind's own) and failures to receive.

`ProcessPool.wait` returns ``(worker_id, event)`` pairs; these are the events the parent
itself makes (the workers' own messages are in protocol.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .. import diagnosis
from ..diagnosis import Evidence
from ..errors import WorkerDiedError
from .protocol import Done
from .worker.status import Progress


@dataclass(frozen=True, slots=True)
class Received:
    """Event: a worker's finished task, with its batch rebuilt from shared memory here."""

    done: Done
    batch: Any


@dataclass(frozen=True, slots=True)
class WorkersChosen:
    """Event (worker id -1): ``worker_type="auto"`` decided (engine/choice/handover.py)."""

    kind: str
    """"thread" or "process"."""
    reason: str
    method: str | None
    """The processes' start method (None: threads)."""
    preload: tuple[str, ...]
    now: bool = False
    """The workers are of ``kind`` from now on (the hand-over made, or the kind kept);
    False: the choice is said, the workers not changed yet."""


@dataclass(frozen=True, slots=True)
class GlobalRngDrawn:
    """Event: a thread worker's dataset drew from the process-wide random generators."""

    dataset_type: type


Lost = tuple[tuple[int, int | None, Progress | None], ...]
"""(worker id, pid, what it was doing) of each worker a group death took."""


@dataclass(frozen=True, slots=True)
class Loss:
    """What a death cost, as recovery counts it: what `Cause.explain` words."""

    worker_id: int
    pid: int | None
    sample: Any
    """The sample the worker was loading, when known."""
    sample_indices: list[Any]
    batches_held: int
    stream_batches: list[int]
    """A stream's held batches by their number in the epoch (its items have no indices)."""
    evidence: Evidence
    """What the machine and the memory sampler say (memory, OOM kills, /dev/shm, stage)."""
    outcome: str = ""
    """What steadyload did about it (a restart, a skip, nothing), as the message's last line."""

    def worker_died(
        self, exitcode: int | None, start_method: str, evidence: Evidence | None = None
    ) -> WorkerDiedError:
        """The death worded as a worker's exit (`diagnosis.worker_died`): for causes that
        are an exit status, or have none (an abandoned thread)."""
        return diagnosis.worker_died(
            worker_id=self.worker_id,
            pid=self.pid,
            exitcode=exitcode,
            sample_indices=self.sample_indices,
            batches_held=self.batches_held,
            start_method=start_method,
            evidence=evidence or self.evidence,
            sample=self.sample,
            outcome=self.outcome,
            stream_batches=self.stream_batches,
        )


@runtime_checkable
class Cause(Protocol):
    """Why a worker, or a group of workers, is gone. Each kind has its own, in its
    ``liveness`` module (a process's exit status or signal, a thread's escaped exception or
    abandonment, a Ray actor's or node's death, a fork server's death); recovery reads only
    these fields, so it is one code for every kind."""

    @property
    def short(self) -> str:
        """What happened, for the restart list and the log: "killed by SIGKILL"."""

    @property
    def name(self) -> str:
        """The shortest form, in a skipped sample's reason: "SIGKILL", "exit status 3"."""

    @property
    def blames_sample(self) -> bool:
        """Whether the batch it was loading may have caused it (only then does a death
        count toward "killed a worker twice"; a lost node or fork server does not)."""

    @property
    def clean(self) -> bool:
        """Whether the worker ended of its own accord (after it said `Retire`)."""

    @property
    def group(self) -> Lost:
        """The workers lost with it (a fork server's, a Ray node's); empty for one worker."""

    def heal(self, pool: Any) -> tuple[str, ...]:
        """Restart what the group came from (a fork server) before its workers are
        replaced; the preloads the new one was asked for (empty: nothing to restart)."""

    def explain(self, loss: Loss) -> WorkerDiedError:
        """The error that says what happened, why and what to do, for this ``loss``."""


@dataclass(frozen=True, slots=True)
class Died:
    """Event: a worker (``worker_id`` -1: a group of them, listed in ``cause.group``) is
    gone, with what the parent knows about its last moments. One event for every kind."""

    kind: str
    """The kind of worker that died: "process", "thread", "remote" (after auto's hand-over
    a thread may die while processes run, and the reverse)."""
    worker_id: int
    pid: int | None
    progress: Progress | None
    cause: Cause

    @property
    def workers(self) -> list[int]:
        """Every worker id this death took, in order."""
        ids = {w for w, _, _ in self.cause.group}
        if self.worker_id >= 0:
            ids.add(self.worker_id)
        return sorted(ids)


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

    def __init__(self, event: Died) -> None:
        super().__init__(f"{event.cause.short} (pid {event.pid})")
        self.event = event
