"""Live worker memory: USS/PSS of every worker, sampled on a thread, with per-epoch growth.

Feeds ``report()`` (current, peak and per-epoch figures) and the diagnosis of a dead worker
(its last RSS). See docs/design/recovery.md.
"""

from __future__ import annotations

import threading
from typing import Any

from ..host.system import gib


class MemorySampler:
    """Samples each worker's USS and PSS every ``interval_s`` on a thread of its own.

    One psutil ``memory_full_info()`` per worker per interval (it reads
    /proc/PID/smaps_rollup: about a millisecond), so the cost stays far below 1% of a
    core. Owned by the iterator, which starts it with the workers and stops it (joining the
    thread) at shutdown. Thread-safe reads through `snapshot`.
    """

    def __init__(self, pids: Any, interval_s: float = 2.0) -> None:
        self._pids = pids  # callable -> {worker_id: pid}
        self._interval = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.current: dict[int, tuple[int, int]] = {}  # worker -> (uss, pss)
        self.rss: dict[int, int] = {}  # worker -> resident memory, for death diagnoses
        self.peak: dict[int, int] = {}  # worker -> peak uss
        self.epochs: dict[int, list[int]] = {}  # worker -> uss at the end of each epoch
        self._thread = threading.Thread(
            target=self._run, name="steadyload-memory", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> None:
        """Take one sample of every worker now."""
        import psutil

        for worker_id, pid in dict(self._pids()).items():
            try:
                info = psutil.Process(pid).memory_full_info()
            except (psutil.Error, OSError):
                continue
            uss, pss = int(info.uss), int(getattr(info, "pss", 0))
            with self._lock:
                self.current[worker_id] = (uss, pss)
                self.rss[worker_id] = int(info.rss)
                self.peak[worker_id] = max(self.peak.get(worker_id, 0), uss)

    def end_epoch(self) -> list[str]:
        """Record each worker's USS at an epoch's end; warnings for workers that keep growing."""
        self.sample()
        warnings_out = []
        with self._lock:
            for worker_id, (uss, _) in self.current.items():
                history = self.epochs.setdefault(worker_id, [])
                history.append(uss)
                last = history[-3:]
                if len(last) == 3 and last[0] * 1.05 < last[1] * 1.0 < last[2] / 1.05:
                    warnings_out.append(
                        f"worker {worker_id} grows epoch after epoch: "
                        + " -> ".join(gib(x) for x in last)
                        + " (USS). A cache or list that grows in the dataset, or Python "
                        "metadata copied on read; see report() and SharedList."
                    )
        return warnings_out

    def snapshot(self) -> dict[int, tuple[int, int, int, list[int]]]:
        """worker -> (uss, pss, peak uss, uss at each epoch end); samples now if never yet."""
        if not self.current and not self._stop.is_set():
            self.sample()
        with self._lock:
            return {
                w: (u, p, self.peak.get(w, u), list(self.epochs.get(w, [])))
                for w, (u, p) in self.current.items()
            }

    def last_rss(self, worker_id: int) -> int | None:
        """The worker's resident memory at the last sample (also after it died)."""
        with self._lock:
            return self.rss.get(worker_id)

    def stop(self) -> None:
        """Stop and join the thread. Safe to call more than once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
