"""`PinnedPool`: page-locked host buffers, reused, within a cap.

A batch is packed into one buffer (its tensors side by side) and copied to the device
from there. Pinning memory is slow (``cudaHostAlloc`` maps and locks every page), so
buffers are kept and reused; a buffer goes back to the pool only with the event that
follows its copy, and is handed out again only once that event is done: until then the
copy may still be reading it. Reuse is oldest-first. The pool never holds more than its
cap: a batch that does not fit waits for the oldest copy to finish, and one bigger than
the cap alone is copied from unpinned memory (slower, never wrong), which the report
counts.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .backends import Backend, Event

ALIGN = 512  # each tensor starts at a multiple of this in its buffer (any dtype's alignment)
GRAIN = 1 << 20
"""Buffers are made in whole multiples of this, so that batches of varying size can reuse
them. [Unit: byte]"""


def packed_size(sizes: list[int]) -> int:
    """The bytes tensors of ``sizes`` take packed in one buffer. [Unit: byte]"""
    return sum(_round_up(n, ALIGN) for n in sizes)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(slots=True)
class PoolFigures:
    """What the pool holds and did (for ``report()``)."""

    cap_bytes: int
    buffers: int = 0
    held_bytes: int = 0
    """Pinned bytes the pool holds (free or in use). [Unit: byte]"""
    peak_bytes: int = 0
    allocations: int = 0
    """Buffers pinned (each a ``cudaHostAlloc``); the rest of the batches reused one."""
    reuses: int = 0
    unpinned: int = 0
    """Batches bigger than the cap, copied from unpinned memory."""
    waits: int = 0
    """Times a batch waited for an earlier copy to free a buffer (the cap was reached)."""


class PinnedPool:
    """Pinned buffers for the stage's thread; released ones carry the event of their copy."""

    def __init__(self, backend: Backend, cap_bytes: int) -> None:
        self._backend = backend
        self._free: collections.deque[torch.Tensor] = collections.deque()
        self._busy: collections.deque[tuple[torch.Tensor, Event]] = collections.deque()
        self._lock = threading.Lock()  # figures are read by report() on the training thread
        self.figures = PoolFigures(cap_bytes)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of at least ``nbytes``; None when ``nbytes`` exceeds the cap (copy from
        unpinned memory then). May wait for the oldest busy buffer's copy."""
        figures = self.figures
        size = _round_up(max(nbytes, 1), GRAIN)
        if size > figures.cap_bytes:
            figures.unpinned += 1
            return None
        while True:
            self._collect_done()
            for i, buffer in enumerate(self._free):  # oldest first
                if buffer.numel() >= nbytes:
                    del self._free[i]
                    figures.reuses += 1
                    return buffer
            if figures.held_bytes + size <= figures.cap_bytes:
                return self._allocate(size)
            if self._free:  # too small: make room for a bigger one
                self._drop(self._free.popleft())
                continue
            if not self._busy:  # (cannot happen: every held byte is free or busy)
                figures.unpinned += 1
                return None
            # Every byte is in copies still running: wait for the oldest.
            figures.waits += 1
            self._busy[0][1].synchronize()

    def give_back(self, buffer: torch.Tensor, after: Event) -> None:
        """``buffer`` is free again once ``after`` (the event after its copy) is done."""
        self._busy.append((buffer, after))

    def _collect_done(self) -> None:
        # Oldest first: the copies run in order on one stream, so the first event not done
        # ends the scan (and reuse stays oldest-first).
        while self._busy and self._busy[0][1].query():
            self._free.append(self._busy.popleft()[0])

    def _allocate(self, size: int) -> torch.Tensor:
        buffer = self._backend.pinned(size)
        with self._lock:
            figures = self.figures
            figures.allocations += 1
            figures.buffers += 1
            figures.held_bytes += size
            figures.peak_bytes = max(figures.peak_bytes, figures.held_bytes)
        return buffer

    def _drop(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.figures.buffers -= 1
            self.figures.held_bytes -= buffer.numel()

    def snapshot(self) -> PoolFigures:
        """A copy of the figures (safe from another thread)."""
        with self._lock:
            return dataclasses.replace(self.figures)

    def close(self) -> None:
        """Wait for the copies still running, then let every buffer go."""
        for _, event in self._busy:
            event.synchronize()
        self._busy.clear()
        self._free.clear()
        with self._lock:
            self.figures.buffers = self.figures.held_bytes = 0


def pack(batch_tensors: list[torch.Tensor], buffer: torch.Tensor) -> list[torch.Tensor]:
    """Copy each tensor into ``buffer`` (side by side, `ALIGN`ed); returns their views."""
    views, offset = [], 0
    for t in batch_tensors:
        n = nbytes(t)
        flat = buffer[offset : offset + n]
        view = flat.view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
        view.copy_(t)
        views.append(view)
        offset += _round_up(n, ALIGN)
    return views


def nbytes(t: Any) -> int:
    """A tensor's bytes. [Unit: byte]"""
    return int(t.numel() * t.element_size())
