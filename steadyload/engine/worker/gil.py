"""The GIL probe: how often a thread that wants the GIL finds it held by another.

A probe thread sleeps a millisecond at a time and times how late it wakes. Waking needs
the GIL back: a free GIL is taken at once (the timer's slack and a wake-up: tens of
microseconds), a held one only when its holder lets go, at its next torch call or I/O, or
when CPython makes it (after the switch interval, 5 ms). A probe that waits longer than
`HELD_WAIT_S` found the GIL held. ``worker_type="auto"`` reads the share of such probes
(engine/choice/worker_kind.py) in one of two places:

- beside thread workers, in the training process (`GilProbe`): how often the threads take
  turns at the GIL;
- inside each process worker (`WorkerGilProbe`, started by serve.py when the worker's
  configuration asks): how much of its loading holds the GIL, which is what threads would
  take turns at. It counts only while the worker loads a task after its first (the first
  is its set-up: imports, caches), writes its counts to the worker's status block, which
  the parent reads, and ends once its figures suffice for the choice.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from .status import COLLATING, GIL_HELD, GIL_PROBES, LOADING, SETTLED, STAGE, TASK

HELD_WAIT_S = 150e-6
"""A probe's wait for the GIL (past its sleep, net of any wait for a CPU) from which the GIL
was held by another thread: a free one costs the timer's slack (50 us on Linux) and a
wake-up."""
PROBE_SLEEP_S = 0.001
BUSY_SHARE = 0.35
"""The share of probes that found the GIL held from which threads take turns at it
(between GIL-free work and Python that lets go of the GIL every sample, as measured)."""
NEAR_LINE = 0.1  # a share this close to BUSY_SHARE waits for more probes ...
MIN_PROBES = 50  # the probes the choice needs, far from the line
MAX_WORKER_PROBES = 200
"""A process worker's probe ends after this many counted probes (what the choice needs at
most is worker_kind.MAX_PROBES over all workers)."""
BUSY_STOP = (10, 0.8)
"""A process worker's probe that found the GIL held in this share of at least this many
probes ends early: the choice is clear then (worker_kind.CLEAR_PROBES, CLEAR_BUSY_SHARE),
and each further probe would make the worker's thread hand the GIL over."""
MAX_WORKER_PROBE_S = 30.0
"""A process worker's probe ends this long after its start whatever it counted (a worker
that rarely loads: the choice is made on the figures there are). [Unit: second]"""


@dataclass(frozen=True, slots=True)
class ProbeFigures:
    """The GIL probe's counts."""

    probes: int
    held: int
    """Probes that found the GIL held by another thread (waited over `HELD_WAIT_S`)."""
    waited_s: float
    """Their total wait. [Unit: second]"""

    @property
    def held_share(self) -> float:
        """The share of probes that found the GIL held."""
        return self.held / max(self.probes, 1)


class GilProbe:
    """A thread that measures how often a thread wanting the GIL finds it held (see above).

    A probe also wakes late when every CPU is busy (GIL-free decode on all cores, another
    job beside the loader): that is the machine's contention, not the GIL's, and it would
    read GIL-free work as GIL-bound on a busy machine. Where Linux tells (the thread's
    run-queue wait in ``/proc/thread-self/schedstat``), each probe's time spent waiting for
    a CPU is taken out, so what remains is its wait for the GIL.
    """

    def __init__(self, name: str = "steadyload-gil-probe") -> None:
        self._stop = threading.Event()
        self.counting = False  # set once the workers are past their set-up
        self.probes, self.held, self.waited_s = 0, 0, 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def figures(self) -> ProbeFigures:
        """What the probe has counted so far."""
        return ProbeFigures(self.probes, self.held, self.waited_s)

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
        queued = _RunQueueClock()
        try:
            while not self._stop.is_set():
                began, queued_before = clock(), queued()
                sleep(PROBE_SLEEP_S)
                late = clock() - began - PROBE_SLEEP_S - (queued() - queued_before)
                if self._counts():
                    self._count(late)
        finally:
            queued.close()

    def _counts(self) -> bool:
        return self.counting

    def _count(self, late: float) -> None:
        # Plain updates: only this thread writes them.
        self.probes += 1
        self.held += late > HELD_WAIT_S
        self.waited_s += max(late, 0.0)


class WorkerGilProbe(GilProbe):
    """A process worker's probe: counts while the worker loads a task after its first, into
    the worker's status fields (`StatusBlock.progress` reads them); it ends once its own
    figures would be enough for the choice: `MIN_PROBES` far from the line (`NEAR_LINE` of
    `BUSY_SHARE`), `BUSY_STOP`, `MAX_WORKER_PROBES`, or `MAX_WORKER_PROBE_S` after its
    start; or at once when the parent made the choice (the `SETTLED` field). Each probe
    costs the worker a wake-up (and, where its code holds the GIL, a hand-over of it)."""

    def __init__(self, fields: Any) -> None:
        super().__init__("steadyload-worker-gil-probe")
        self._fields = fields
        self._first_task: int | None = None
        self._until = time.monotonic() + MAX_WORKER_PROBE_S

    def _counts(self) -> bool:
        fields = self._fields
        if fields[SETTLED] or time.monotonic() > self._until:  # chosen, or out of time
            self._stop.set()
            return False
        if fields[STAGE] not in (LOADING, COLLATING):
            return False  # idle: the parent is not asking for more
        task = int(fields[TASK])
        if self._first_task is None:
            self._first_task = task
        return task != self._first_task

    def _count(self, late: float) -> None:
        super()._count(late)
        self._fields[GIL_PROBES] = self.probes  # a reader may see one ahead of the other
        self._fields[GIL_HELD] = self.held
        enough, busy = BUSY_STOP
        share = self.held / self.probes
        if (
            self.probes >= MAX_WORKER_PROBES
            or (self.probes >= enough and share >= busy)
            or (self.probes >= MIN_PROBES and abs(share - BUSY_SHARE) >= NEAR_LINE)
        ):
            self._stop.set()


class _RunQueueClock:
    """This thread's total wait for a CPU so far (Linux schedstat); where unknown it stands
    still, so nothing is taken out. [Unit: second]"""

    def __init__(self) -> None:
        self._last = 0.0
        self._fd: int | None = None
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:  # not Linux (or before 3.17): it stands still
            pass

    def __call__(self) -> float:
        if self._fd is not None:
            try:
                self._last = int(os.pread(self._fd, 64, 0).split()[1]) * 1e-9
            except (OSError, IndexError, ValueError):
                self.close()
        return self._last

    def close(self) -> None:
        """Close the schedstat file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
