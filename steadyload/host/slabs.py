"""Big batches' memory in this process, given again to the next batch: `BatchSlabs`.

Thread workers collate into this process's memory. A batch of many megabytes freed by the
training loop and allocated afresh for the next one costs a page fault per page (or per
huge page) every batch, and on a host whose memory is backed lazily (a virtual machine
whose free memory goes back to the host) the first touch of a page is many times dearer
than a write to it (docs/design/figures.md#threads). A slab given again costs neither.

A slab is lent as a view; when the last reference to the view goes (the batch, every
tensor sharing its storage, anything built on it), a finalizer gives the slab back. So a
slab is never lent twice at once, whatever the training loop keeps. What is kept between
batches is bounded by what was in use at once: a new slab is made only when none is free,
and a miss evicts a free slab that did not fit, so the count never exceeds the most batches
alive together. Free slabs are dropped when the last user (a pool of thread workers)
closes, and a slab coming back after that is dropped too.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from .heap import HeapFit

__all__ = ["SLAB_FROM", "BatchSlabs", "SLABS"]

SLAB_FROM = 4 << 20
"""Batches from this size are lent slabs; below, a fault per batch costs too little to
matter. It is also where numpy advises its memory for transparent huge pages. [Unit: byte]"""


class BatchSlabs:
    """Slabs of memory lent to batches and taken back when a batch is gone; one per
    process (`SLABS`). While no user is open, `take` lends fresh memory and keeps none."""

    def __init__(self, heap: HeapFit | None = None) -> None:
        # Reentrant: a finalizer can run inside this lock's holder (a garbage collection
        # triggered while it holds it).
        self._lock = threading.RLock()
        self._free: list[np.ndarray] = []
        self._users: weakref.WeakSet[object] = weakref.WeakSet()
        self._heap = heap or HeapFit()
        self.made = 0
        """Slabs made while open (a test's and a benchmark's count)."""
        self.lent_again = 0
        """Takes served by a free slab."""

    def open(self, user: object) -> None:
        """``user`` (a pool of thread workers) starts: slabs are kept from now on. Opening
        twice is opening once; a user dropped without `close` stops counting."""
        with self._lock:
            self._users.add(user)

    def close(self, user: object) -> None:
        """``user`` stops (again is a no-op): with the last one, the free slabs go."""
        with self._lock:
            self._users.discard(user)
            if not self._users:
                self._free.clear()

    @property
    def free_bytes(self) -> int:
        """Bytes kept in free slabs. [Unit: byte]"""
        with self._lock:
            return sum(slab.nbytes for slab in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes``: a free slab of at most a quarter more if
        there is one, else a new one. It goes back when it and every view of it are gone."""
        with self._lock:
            if not self._users:
                self._free.clear()  # its users went without closing
                return np.empty(nbytes, np.uint8)
            slab = self._pop_fitting(nbytes)
            if slab is None:
                self.made += 1
                # The samples of a batch this big would otherwise be mapped and faulted in
                # one by one every batch: glibc's thresholds fitted, as in worker processes.
                self._heap.batch(nbytes)
            else:
                self.lent_again += 1
        if slab is None:
            slab = np.empty(nbytes, np.uint8)
        view = slab[:nbytes]
        weakref.finalize(view, self._give_back, slab).atexit = False
        return view

    def _pop_fitting(self, nbytes: int) -> np.ndarray | None:
        # The latest given back first: of the free slabs, the likeliest still in a cache.
        for i in range(len(self._free) - 1, -1, -1):
            if nbytes <= self._free[i].nbytes <= nbytes + nbytes // 4:
                return self._free.pop(i)
        if self._free:  # none fits: the oldest goes, so misses never pile slabs up
            self._free.pop(0)
        return None

    def _give_back(self, slab: np.ndarray) -> None:
        with self._lock:
            if self._users:
                self._free.append(slab)
            else:
                self._free.clear()


SLABS = BatchSlabs()
