"""A worker process's C heap kept at its per-batch peak: glibc's thresholds fitted to batches.

glibc serves an allocation above its mmap threshold (128 KiB at first) with a fresh
mapping, and raises the threshold to the size of the largest such mapping freed so far (up
to 32 MiB); free memory at the top of the heap beyond twice the threshold goes back to the
system. A worker's samples live for one batch, so which case a worker lands in decides its
speed: if the largest mapping it has freed is about one sample, the threshold sits near one
sample, the batch's samples (freed after collate) are handed back to the system after
every batch and the next batch faults each of their pages in again; if something as big as
a batch was freed first, they stay. Which one depends on what the worker happened to free
first, so the same loader ran at two speeds from one run to the next
(docs/design/figures.md#heap). `HeapFit` takes the luck out: once a batch of at least
`FIT_FROM` bytes has gone out, the thresholds are set from its size, as glibc's own rule
would have set them had it seen a batch freed. The heap then keeps about one batch's
samples between batches, which the worker held at its peak anyway.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

__all__ = ["FIT_FROM", "HeapFit"]

FIT_FROM = 1 << 20
"""Batches from this size fit the thresholds; below, glibc's default rule is left alone."""
_MMAP_MAX = 32 << 20  # glibc's own ceiling for the mmap threshold on 64-bit systems
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``; None elsewhere (musl, macOS: their heaps work otherwise)."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):  # no such confstr name, or no mallopt
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


class HeapFit:
    """Fits a process's glibc heap thresholds to the biggest batch seen; one per worker
    process. ``mallopt`` is injectable for tests; glibc's is looked up at the first batch
    from `FIT_FROM` (a worker of small batches never loads it)."""

    def __init__(self, mallopt: Callable[[int, int], int] | None = None) -> None:
        self._mallopt = mallopt
        self._looked_up = mallopt is not None
        self.threshold = 0
        """The mmap threshold set so far (0: glibc's own rule still runs). [Unit: byte]"""

    def batch(self, nbytes: int) -> None:
        """A batch of ``nbytes`` went out: from `FIT_FROM`, allocations up to a quarter more
        than it come from the heap, and twice that may stay free there (only ever grows)."""
        if nbytes < FIT_FROM:
            return
        if not self._looked_up:
            self._mallopt, self._looked_up = _glibc_mallopt(), True
        threshold = min(_MMAP_MAX, nbytes + nbytes // 4)
        if self._mallopt is None or threshold <= self.threshold:
            return
        # Each call fixes its value and stops glibc's dynamic rule (both are needed: a
        # fixed trim threshold alone leaves samples above 128 KiB mapped one by one).
        if self._mallopt(_M_MMAP_THRESHOLD, threshold) and self._mallopt(
            _M_TRIM_THRESHOLD, 2 * threshold
        ):
            self.threshold = threshold
        else:  # refused: leave glibc as it was, and do not ask again
            self._mallopt = None
