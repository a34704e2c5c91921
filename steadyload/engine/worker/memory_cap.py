"""`MemoryCap`: whether a worker's memory passed ``max_worker_memory``, read cheaply after
each task (every kind whose worker has a process of its own)."""

from __future__ import annotations

import os
import time

_MEMORY_CHECK_INTERVAL_S = 0.25


def uss_bytes() -> int:
    """This process's unique memory (reads smaps: milliseconds). [Unit: byte]"""
    import psutil

    return int(psutil.Process().memory_full_info().uss)  # reads smaps: milliseconds


def rss_bytes() -> int:
    """This process's resident memory (reads statm: microseconds). [Unit: byte]"""
    with open("/proc/self/statm", "rb") as f:  # microseconds
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryCap:
    """Decides after each task whether the worker's USS passed the cap, cheaply.

    RSS >= USS, so while RSS (cheap to read) is under the cap nothing more is needed. Above
    it, USS (costly: it reads smaps) is measured when RSS grew by 5% of the cap since the
    last measurement, or after _MEMORY_CHECK_INTERVAL_S.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._measured_at = 0.0
        self._rss_then = 0

    def exceeded(self) -> int | None:
        """The USS when it is above the cap, else None."""
        rss = rss_bytes()
        if rss <= self.cap:
            return None
        now = time.monotonic()
        grown = rss - self._rss_then >= 0.05 * self.cap
        if not grown and now - self._measured_at < _MEMORY_CHECK_INTERVAL_S:
            return None
        self._measured_at, self._rss_then = now, rss
        uss = uss_bytes()
        return uss if uss > self.cap else None
