"""What the device stage needs of a device: a side stream, events, pinned memory, copies.

`CudaBackend` is CUDA's (and ROCm's: torch.cuda is HIP there); `HostBackend` is
``device="cpu"``'s, where the same stage runs with nothing to copy: its events are done at
once. Tests give the stage a backend of their own (events they complete themselves) to
check that a pinned buffer is never reused while its copy may still read it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class Event(Protocol):
    """A point on a stream: done once the work queued before it has run."""

    def query(self) -> bool:
        """Whether it is done (never blocks)."""

    def synchronize(self) -> None:
        """Wait until it is done."""


class Backend(Protocol):
    """A device, as the stage uses it (one instance per iterator)."""

    device: torch.device
    copies: bool
    """Whether batches are copied (False: ``device="cpu"``, the batch stays where it is)."""

    def bind(self) -> None:
        """On the stage's own thread, before its first batch (sets the thread's device)."""

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        """Work queued inside runs on the stage's stream, not the training loop's."""

    def record(self) -> Event:
        """An event on the stage's stream, after what is queued on it so far."""

    def wait(self, event: Event) -> Any:
        """The training loop's current stream waits for ``event`` (no host wait); returns
        that stream, for `keep_for`."""

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor`` (made on the stage's stream) is used on ``stream`` too: its memory is
        not reused before that stream's work on it has run."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A new pinned host buffer of ``nbytes`` (uint8)."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (pinned) copied to the device, queued on the current stream."""

    def elapsed_s(self, start: Event, end: Event) -> float:
        """The time between two done events of `record`. [Unit: second]"""


class _Done:
    """An event that is done when made (it keeps the time, for `elapsed_s`)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostBackend:
    """``device="cpu"``: nothing to copy, no stream; the stage runs its transform ahead."""

    copies = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def bind(self) -> None:
        """Nothing to set."""

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """No stream: work runs as it is called."""
        yield

    def record(self) -> Event:
        """Done at once."""
        return _Done()

    def wait(self, event: Event) -> Any:
        """Nothing to wait for."""
        return None

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """Nothing to keep."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """Plain host memory (never asked for: nothing is copied)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` itself."""
        return host

    def elapsed_s(self, start: Event, end: Event) -> float:
        """Wall time between the two (the work ran as it was called). [Unit: second]"""
        return float(end.at - start.at)  # type: ignore[attr-defined]


class CudaBackend:
    """A CUDA (or ROCm) device: a stream of the stage's own, pinned memory, async copies."""

    copies = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    def bind(self) -> None:
        """Set the thread's device and make the stage's stream on it."""
        torch.cuda.set_device(self.device)
        self._stream = torch.cuda.Stream(self.device)

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        """``torch.cuda.stream`` of the stage's stream."""
        return torch.cuda.stream(self._stream)

    def record(self) -> Event:
        """A CUDA event recorded on the stage's stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def wait(self, event: Event) -> Any:
        """The current stream (of this thread, on the device) waits for ``event``."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)  # type: ignore[arg-type]
        return stream

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """``record_stream``: the caching allocator waits for ``stream`` before reuse."""
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory (one allocation; the pool reuses it)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy: ``host`` must stay untouched until the copy's event."""
        return host.to(self.device, non_blocking=True)

    def elapsed_s(self, start: Event, end: Event) -> float:
        """The device's time between the two events. [Unit: second]"""
        return float(start.elapsed_time(end)) / 1e3  # type: ignore[attr-defined]
