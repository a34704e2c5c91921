"""A device for the device stage's tests on a CPU-only machine: copies that run later.

`LazyDevice` stands in for a GPU: ``to_device`` returns a tensor that is filled only when
an event recorded after the copy is done, as a copy queued on a CUDA stream lands only when
the stream gets to it. An event is done when the training loop's stream waits on it (the
stage's ``wait``), when something synchronizes it, or after ``lag`` queries (time passing).
A pinned buffer reused before its copy's event is done therefore shows up as wrong data in
an earlier batch: what the pool must never allow. The training loop's stream waiting on
an event (``wait``) does not run the copies either (on a GPU the stream gets to them later):
`LazyDevice.flush` lands every copy, after which a test compares what was yielded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch


class LazyEvent:
    """An event on the fake stream; done once `LazyDevice.complete` reached it."""

    def __init__(self, device: LazyDevice, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self._device, self.copies, self.done, self.queries = device, copies, False, 0
        self.at = time.perf_counter()

    def query(self) -> bool:
        self.queries += 1
        if not self.done and self.queries > self._device.lag:
            self._device.complete(self)
        return self.done

    def synchronize(self) -> None:
        self._device.complete(self)
        self._device.synchronized += 1


class LazyDevice:
    """A fake CUDA device (see the module's docstring); batches end up as CPU tensors."""

    copies = True

    def __init__(self, lag: int = 1_000_000, lazy: bool = True) -> None:
        self.device = torch.device("cpu")
        self.lag, self.lazy = lag, lazy
        self._lock = threading.Lock()
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._events: list[LazyEvent] = []  # in record order: the stream runs them in order
        self.pinned_made: list[int] = []
        self.threads: set[str] = set()
        self.waited = self.synchronized = 0
        self.kept: list[tuple[torch.Tensor, Any]] = []  # (tensor, stream) of keep_for
        self.made: list[torch.Tensor] = []  # what to_device returned

    def bind(self) -> None:
        self.threads.add(threading.current_thread().name)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        self.threads.add(threading.current_thread().name)
        yield

    def record(self) -> LazyEvent:
        with self._lock:
            event = LazyEvent(self, self._pending)
            self._pending = []
            self._events.append(event)
        if not self.lazy:
            self.complete(event)
        return event

    def complete(self, event: LazyEvent) -> None:
        """Run the stream up to ``event``: the copies queued before it land."""
        with self._lock:
            while self._events:
                first = self._events.pop(0)
                for host, dst in first.copies:
                    dst.copy_(host)
                first.done = True
                if first is event:
                    return

    def wait(self, event: LazyEvent) -> str:
        self.waited += 1  # the loop's stream waits on the device, not here
        return "loop-stream"

    def flush(self) -> None:
        """The stream runs to its end: every copy lands."""
        with self._lock:
            last = self._events[-1] if self._events else None
        if last is not None:
            self.complete(last)

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        self.kept.append((tensor, stream))

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        dst = torch.empty_like(host)
        with self._lock:
            self._pending.append((host, dst))
            self.made.append(dst)
        return dst

    def elapsed_s(self, start: LazyEvent, end: LazyEvent) -> float:
        return end.at - start.at
