"""Messages between the pool (parent) and a worker (child).

Each worker has one duplex Unix socketpair of its own (framing: `channel.py`). Parent ->
worker: `Task`, `Reset`, `Restore`, `Stop`. Worker -> parent: `Ready`, `Done`, `Empty`,
`Exhausted`, `Failed`, `Retire`, `StartFailed`. The shared-memory segments a `Done`
announces ride with it as SCM_RIGHTS file descriptors, attached to its first byte (see
`transport.py`). State diagram: docs/design/protocol.md.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, TypeVar, dataclass_transform

from ..report import SkippedSample, StreamCut

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def message(cls: type[_T]) -> type[_T]:
    """A frozen, slotted dataclass that pickles as its class and field values.

    The default pickling of a slotted dataclass goes through ``dataclasses.fields()`` on
    every load and dump: a message is pickled at least twice per batch, so this keeps it
    to one C-level attribute read and the constructor.
    """
    made: Any = dataclasses.dataclass(frozen=True, slots=True)(cls)
    names = tuple(f.name for f in dataclasses.fields(made))
    get = operator.attrgetter(*names) if names else None
    if len(names) == 1:
        made.__reduce__ = lambda self: (made, (get(self),))  # type: ignore[misc]
    else:
        made.__reduce__ = lambda self: (made, get(self) if get else ())
    return made


@message
class Task:
    """Load one batch. ``indices`` is what the sampler yielded (a list for a batch)."""

    task_id: int
    indices: object
    freed: tuple[int, ...] = ()
    """Ids of this worker's shared-memory segments that the parent no longer uses."""
    epoch: int = 0
    """The loader's epoch number (seeds samples with ``sample_seeds=True``)."""


@message
class Reset:
    """A new epoch with persistent workers: recreate the fetcher (a new ``iter(dataset)``)."""

    freed: tuple[int, ...] = ()


@message
class Restore:
    """A worker resumes from ``state``: a `Fetcher.position` (a replacement where the dead
    worker's last batch ended, a resumed checkpoint where the saved worker's did)."""

    state: bytes


@message
class Stop:
    """Exit the worker loop."""


@message
class NewSegment:
    """A shared-memory segment whose file descriptor follows the message."""

    segment_id: int
    nbytes: int


@message
class Done:
    """A batch: ``payload`` is pickled with tensors replaced by segment descriptors."""

    task_id: int
    payload: bytes
    segments: tuple[int, ...]
    """Segments the payload's tensors live in."""
    new_segments: tuple[NewSegment, ...] = ()
    retired: tuple[int, ...] = ()
    """Segments the worker closed: the parent may drop its mapping once unused."""
    skipped: tuple[SkippedSample, ...] = ()
    """Samples left out of the batch because loading them raised (on_error="skip")."""
    stream_state: bytes | None = None
    """A stateful IterableDataset's pickled ``state_dict()`` after this batch."""
    samples: int = 0
    """Samples in the batch."""
    load_s: float = 0.0
    """Time from the task's start to the batch packed in shared memory. [Unit: second]"""
    rss_bytes: int = 0
    """The worker's resident memory after the batch (remote workers; 0: not sent). [Unit: byte]"""
    span: tuple[int, int] | None = None
    """A stream's batch: the items of the worker's stream it read, [first, end) (the ledger)."""


@message
class Empty:
    """Every sample of the task was skipped: there is no batch (on_error="skip")."""

    task_id: int
    skipped: tuple[SkippedSample, ...]
    position: bytes | None = None
    """The replica's `Fetcher.position` after it (the bad items count as read)."""


@message
class Exhausted:
    """The worker's IterableDataset replica is exhausted; the task produced nothing."""

    task_id: int
    skipped: tuple[SkippedSample, ...] = ()
    cut: StreamCut | None = None
    """Set when the stream ended at an item that raised (on_error="skip"): what was lost."""
    position: bytes | None = None
    """The replica's `Fetcher.position` at the end (an epoch counter it keeps, say)."""


@message
class Retire:
    """The worker's memory passed ``max_worker_memory``; it exits after this message."""

    uss_bytes: int


@message
class Failed:
    """The dataset, collate_fn or worker_init_fn raised while the worker ran the task.

    ``exception`` is the pickled exception, or None when it does not survive pickling;
    then ``exception_type`` (the pickled class, when it pickles) rebuilds it from ``text``,
    as torch does, and failing that ``type_name`` and ``text`` stand in for it. A worker in
    this process (a thread) sends the exception object itself, ``error``: nothing pickled.
    """

    task_id: int
    exception: bytes | None
    type_name: str
    text: str
    traceback: str
    where: str
    """Which sample: "while loading sample 17", "while collating samples [..]"."""
    exception_type: bytes | None = None
    error: BaseException | None = None


@message
class Ready:
    """The worker is set up (seeded, worker_init_fn run) and waits for tasks."""

    pid: int
    preload_missing: tuple[str, ...] | None
    """Requested fork-server preloads the server did not import; None when unknown."""
    node: str = ""
    """A remote worker's Ray node: "<node id> (<address>)"."""


@message
class StartFailed:
    """The worker could not set itself up (its arguments did not unpickle, or it ran out of
    descriptors receiving them)."""

    type_name: str
    text: str
    traceback: str
    errno: int | None = None
    """The OSError's errno when that was the failure (EMFILE: out of descriptors)."""
