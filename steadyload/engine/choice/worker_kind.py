"""``worker_type="auto"``: threads or processes, decided by watching the first batches.

Threads win where the work releases the GIL (image decode, numpy, tokenizers in Rust, big
tensor copies, I/O): no start-up, no transport, one copy of every resource. Processes win
where it holds the GIL (pure-Python transforms): threads would take turns. Which one a
dataset is cannot be read from its code, so "auto" starts thread workers at once (the first
batch in milliseconds) and measures how busy they keep the GIL, directly: a probe thread
sleeps a millisecond at a time and times how late it wakes. Waking needs the GIL back; a
free GIL is taken at once (tens of microseconds), a busy one only when its holder lets go
(CPython asks it to after the switch interval, 5 ms). So the probe's mean delay, as a share
of the switch interval, is how much a thread that wants the GIL waits for it. A busy GIL
(threads that hold it, or the training loop itself competing with them) means the threads
take turns: the loader starts process workers and hands the next batches over to them
(handover.py). Otherwise threads are kept: they cost less (no start-up, no transport,
one copy of the dataset) for the same speed.

Why not their CPU share (CPU time over wall time, times the threads), tried first: it reads
a machine busy with other processes, or memory-bound copies, as waiting, and GIL-holding
Python overlapped GIL-free decode on it; the probe's delays stay apart.

Cheap samples are the exception the probe cannot see: a sample of a few microseconds (16
floats and a label) is interpreter work in short stretches, and every torch call hands
the GIL over, so the probe finds it free at once while the threads still take turns at it
(two such thread workers loaded fewer samples per second than one thread alone). So when
the threads' samples cost less than `CHEAP_SAMPLE_S` each, processes are chosen too,
provided a batch costs the threads at least `MIN_PROCESS_BATCH_S` (a process worker's
batch has a cost of its own to receive).

Every constant below is a line drawn between measured figures; the figures are in
docs/design/figures.md#auto, and the rule is tested with injected measurements
(tests/unit/test_worker_kind.py).

Some loaders are never started on threads: a stream (its position lives in the replica
that reads it, which cannot move to a process), a ``worker_init_fn`` (it would run in this
process), ``max_worker_memory``, and ``on_error="skip"`` (data expected to be partly bad:
a sample that crashes native code ends the process that loads it, which with threads is
the training process).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

_LOG = logging.getLogger(__name__)

BUSY_SHARE = 0.2
"""The probe's mean delay, as a share of the switch interval, from which the GIL is busy
(between GIL-free work and pure Python as measured)."""
PROBE_SLEEP_S = 0.001
CHEAP_SAMPLE_S = 50e-6
"""A thread's cost per sample below which processes load faster though the GIL looks free
(between tiny samples and every other workload as measured)."""
MIN_PROCESS_BATCH_S = 0.5e-3
"""The cost of a batch to the threads from which cheap samples go to processes: a process
worker's batch has a cost of its own to the main process (receive, rebuild, bookkeeping),
so below this threads stay ahead."""
MIN_PROBES = 30
LEAN_PROBES = 5  # probes that may already lean to processes (the fork server starts then)
MIN_TASKS_PER_WORKER = 3  # batches measured per thread before deciding
MIN_WALL_S = 0.2  # and this much loading time, summed over the threads: a pause of this
# process (a busy machine, a garbage collection) must not decide it


@dataclass(frozen=True, slots=True)
class WorkerChoice:
    """What ``worker_type="auto"`` chose, and why (shown by `report()`)."""

    kind: str
    """"thread" or "process"."""
    reason: str


def chose(kind: str, why: str) -> WorkerChoice:
    """The choice of ``kind`` workers because ``why``, logged at INFO."""
    choice = WorkerChoice(kind, f"worker_type='auto' chose {kind} workers: {why}")
    _LOG.info("%s", choice.reason)
    return choice


def gil_enabled() -> bool:
    """False on a free-threaded interpreter running without the GIL (3.13t, 3.14t)."""
    check = getattr(sys, "_is_gil_enabled", None)
    return bool(check()) if check is not None else True


class GilProbe:
    """A thread that measures how long a thread wanting the GIL waits for it (see above)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.counting = False  # set once the workers are past their set-up
        self.probes, self.waited_s = 0, 0.0
        self._thread = threading.Thread(target=self._run, name="steadyload-gil-probe",
                                        daemon=True)  # fmt: skip

    def start(self) -> None:
        """Start probing (not counting yet)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the probe thread; bounded: it sleeps a millisecond at a time."""
        self._stop.set()
        if self._thread.is_alive():  # never started: nothing to join
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        clock, sleep = time.perf_counter, time.sleep
        while not self._stop.is_set():
            began = clock()
            sleep(PROBE_SLEEP_S)
            late = clock() - began - PROBE_SLEEP_S
            if self.counting:  # two int/float updates: only this thread writes them
                self.probes += 1
                self.waited_s += max(late, 0.0)


def static_choice(loader: Any, max_worker_memory: int | None) -> WorkerChoice | None:
    """The choice when it needs no measurement, else None (start on threads and watch)."""
    from torch.utils.data import IterableDataset

    if max_worker_memory is not None:
        return chose("process", "max_worker_memory needs workers with memory of their own")
    if getattr(loader, "on_error", "raise") == "skip":
        return chose("process", "on_error='skip' expects bad samples, and one that crashes "
                                "native code (a corrupt file in a C decoder) would end this "
                                "process under thread workers; a process worker is replaced "
                                "and the sample skipped")
    if not gil_enabled():
        return chose("thread", "this interpreter runs without the GIL")
    if isinstance(loader.dataset, IterableDataset):
        return chose("process", "an IterableDataset's stream cannot move from a thread "
                                 "to a process, so it is not tried on threads")
    if loader.worker_init_fn is not None:
        return chose("process", "a worker_init_fn would run in this process on threads "
                                 "(it may seed this process's random generators)")
    return None


def leans_to_processes(measured: tuple[int, int, float], probe: tuple[int, float]) -> bool:
    """Whether the first figures, too few to decide, already point to processes: then the
    fork server is started (a cold one imports torch for seconds), so that the processes,
    if chosen, start at once; GIL-free work never pays for one."""
    tasks, samples, wall = measured
    probes, waited = probe
    if probes >= LEAN_PROBES and waited / probes >= BUSY_SHARE * sys.getswitchinterval():
        return True
    cheap = wall / max(samples, 1) < CHEAP_SAMPLE_S
    return tasks > 0 and cheap and wall / tasks >= MIN_PROCESS_BATCH_S


def live_choice(measured: tuple[int, int, float], workers: int,
                probe: tuple[int, float]) -> WorkerChoice | None:  # fmt: skip
    """Decide from the thread workers' ``(tasks, samples, wall s)`` and the probe's
    ``(probes, waited s)``; None: not enough yet."""
    tasks, samples, wall = measured
    probes, waited = probe
    if tasks < MIN_TASKS_PER_WORKER * workers or wall < MIN_WALL_S or probes < MIN_PROBES:
        return None
    wait, interval = waited / probes, sys.getswitchinterval()
    figures = (
        f"while {workers} thread workers loaded {tasks} batches, a thread wanting the GIL "
        f"waited {wait * 1e3:.2f} ms for it on average ({wait / interval:.0%} of the "
        f"{interval * 1e3:g} ms switch interval, {probes} probes)"
    )
    if wait >= BUSY_SHARE * interval:
        return chose("process", f"{figures}: the GIL was busy, so threads take turns "
                                "(the work holds it)")
    per_sample, per_batch = wall / max(samples, 1), wall / tasks
    if per_sample < CHEAP_SAMPLE_S:
        if per_batch >= MIN_PROCESS_BATCH_S:
            return chose("process", f"{figures}, but a sample took {per_sample * 1e6:.0f} us: "
                                    "samples this cheap are mostly interpreter work, which "
                                    "threads take turns at (they hand the GIL over at every "
                                    f"torch call), and a batch ({per_batch * 1e3:.1f} ms) is "
                                    "worth sending, so processes load faster")
        return chose("thread", f"{figures}; a sample took {per_sample * 1e6:.0f} us, but a "
                               f"batch only {per_batch * 1e6:.0f} us, less than a process "
                               "worker's batch costs to receive, so threads stay ahead")
    return chose("thread", f"{figures}: the GIL was mostly free, so threads load in parallel "
                           "(the work releases it or waits)")
