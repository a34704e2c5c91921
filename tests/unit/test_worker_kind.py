"""engine/choice/worker_kind.py and engine/worker/gil.py: the GIL probe against real threads
(beside thread workers, and inside a process worker), and the rule that reads it."""

from __future__ import annotations

import mmap
import sys
import threading
import time

import numpy as np
import pytest
import torch

from steadyload.engine.choice import worker_kind
from steadyload.engine.choice.worker_kind import live_choice
from steadyload.engine.worker import gil, status
from steadyload.engine.worker.gil import GilProbe, ProbeFigures, WorkerGilProbe


def _probe_while(work: object, probes: int = 30) -> float:
    """The share of ``probes`` probes that found the GIL held while two threads run ``work``
    (a busy GIL makes each probe wait some 15 ms: counted, not timed)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()  # type: ignore[operator]

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    probe = GilProbe()
    probe.start()
    probe.counting = True
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while probe.probes < probes and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    probe.stop()
    for t in threads:
        t.join(timeout=5)
    assert not probe._thread.is_alive() and not any(t.is_alive() for t in threads)
    assert probe.probes >= probes, probe.probes
    return probe.figures().held_share


def _python_loop() -> None:
    total = 0
    for k in range(200_000):  # some 10 ms in one stretch with the GIL held
        total += k


@pytest.mark.timeout(60)
def test_the_probe_tells_a_busy_gil_from_a_free_one() -> None:
    free = _probe_while(lambda: time.sleep(0.002))  # releases the GIL, as I/O or decode do
    busy = _probe_while(_python_loop)
    # A GIL held for 10 ms at a stretch is found held by nearly every probe; how rarely a
    # free one is depends on the machine's load, so only its order is asserted (the line
    # between them is the rule's, tested with injected figures below).
    assert worker_kind.BUSY_SHARE <= busy and free < busy / 2, (free, busy)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")
def test_the_run_queue_clock_reads_this_threads_wait_for_a_cpu() -> None:
    clock = gil._RunQueueClock()
    try:
        first = clock()
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:  # run, and be preempted now and then
            pass
        second = clock()
    finally:
        clock.close()
    # This thread's total so far, in seconds: it never goes back, and 0.2 s of running
    # cannot have waited a second for a CPU.
    assert 0.0 <= first <= second < first + 1.0, (first, second)
    assert clock() == second  # closed (or unreadable): it stands still, nothing taken out


def _probe(probes: int, share: float, wait_s: float = 0.001) -> ProbeFigures:
    return ProbeFigures(probes, round(probes * share), probes * wait_s)


def test_the_rule_waits_for_enough_batches_probes_and_time() -> None:
    assert live_choice((5, 20, 1.0), 2, _probe(100, 0.0)) is None  # 3 batches per thread
    assert live_choice((6, 24, 0.1), 2, _probe(100, 0.0)) is None  # nor a blink of loading
    assert live_choice((6, 24, 1.0), 2, _probe(10, 0.0)) is None  # nor a handful of probes
    busy = live_choice((6, 24, 1.0), 2, _probe(100, 0.6, 0.0025))
    free = live_choice((6, 24, 1.0), 2, _probe(100, 0.1))
    assert busy is not None and busy.kind == "process"
    assert "found it held by another in 60% of 100 probes (it waited 2.50 ms on average)" in (
        busy.reason)
    assert free is not None and free.kind == "thread"
    assert "the GIL was mostly free, so threads load in parallel" in free.reason


def test_near_the_line_the_rule_waits_for_more_probes() -> None:
    line, near, most = worker_kind.BUSY_SHARE, worker_kind.NEAR_LINE, worker_kind.MAX_PROBES
    enough = worker_kind.MIN_PROBES
    just_over = line + near / 2
    assert live_choice((6, 24, 1.0), 2, _probe(enough, just_over)) is None
    late = live_choice((6, 24, 1.0), 2, _probe(most, just_over))
    assert late is not None and late.kind == "process"
    clear = live_choice((6, 24, 1.0), 2, _probe(enough, line + near * 1.5))
    assert clear is not None and clear.kind == "process"
    under = live_choice((6, 24, 1.0), 2, _probe(most, line - near / 2))
    assert under is not None and under.kind == "thread"


def test_cheap_samples_are_decided_by_the_batch_whatever_the_probe() -> None:
    for probe in (_probe(100, 0.05), _probe(100, 0.9), _probe(0, 0.0)):
        cheap = live_choice((600, 600 * 64, 0.6), 2, probe)  # 16 us a sample
        assert cheap is not None and cheap.kind == "process"
        assert "a sample took 16 us: samples this cheap are mostly interpreter work" in (
            cheap.reason)
        assert "and a batch (1.0 ms) is worth sending, so processes load faster" in (
            cheap.reason)
        one_a_batch = live_choice((12000, 12000, 0.24), 2, probe)  # batch_size=None: 20 us
        assert one_a_batch is not None and one_a_batch.kind == "thread"
        assert "a sample took 20 us, but a batch only 20 us, less than a process worker's" in (
            one_a_batch.reason)
    at_the_line = (600, 600 * 64, 600 * 64 * worker_kind.CHEAP_SAMPLE_S)  # the probe decides
    free = live_choice(at_the_line, 2, _probe(100, 0.05))
    assert free is not None and free.kind == "thread"


def test_the_first_figures_lean_to_processes_before_they_decide() -> None:
    lean = worker_kind.LEAN_PROBES
    busy = _probe(lean, 0.9)
    assert worker_kind.leans_to_processes((0, 0, 0.0), busy)
    assert live_choice((0, 0, 0.0), 2, busy) is None  # too few figures to decide yet
    assert not worker_kind.leans_to_processes((0, 0, 0.0), _probe(lean - 1, 1.0))
    assert not worker_kind.leans_to_processes((2, 64, 0.064), _probe(lean, 0.0))  # free GIL
    assert worker_kind.leans_to_processes((2, 128, 0.002), _probe(lean, 0.0))  # cheap, 1 ms
    assert not worker_kind.leans_to_processes((2, 2, 0.00002), _probe(lean, 1.0))  # tiny tasks


def test_a_clearly_busy_gil_decides_after_one_batch_per_thread() -> None:
    """A short epoch cannot wait for the full figures: far past the line, toward processes,
    the rule decides on the early ones (one measured batch per thread, `EARLY_WALL_S`)."""
    clear = worker_kind.CLEAR_PROBES
    early = (2, 64, worker_kind.EARLY_WALL_S)  # one batch past its first on each thread
    busy = live_choice(early, 2, _probe(clear, worker_kind.CLEAR_BUSY_SHARE))
    assert busy is not None and busy.kind == "process"
    assert live_choice(early, 2, _probe(clear - 1, 1.0)) is None  # too few probes yet
    assert live_choice((1, 32, 1.0), 2, _probe(100, 1.0)) is None  # one thread's batch
    assert live_choice((2, 64, worker_kind.EARLY_WALL_S / 2), 2, _probe(100, 1.0)) is None
    # Busy, but not clearly: the full figures as before; and a free GIL never early.
    assert live_choice(early, 2, _probe(100, worker_kind.CLEAR_BUSY_SHARE - 0.1)) is None
    assert live_choice(early, 2, _probe(100, 0.0)) is None


def test_cheap_samples_in_batches_clearly_worth_sending_decide_early() -> None:
    """A GIL-bound collate of many small samples (batch 256 of 16 floats and an int) goes
    to processes after one batch per thread when a batch costs twice the line."""
    line, wall = worker_kind.MIN_PROCESS_BATCH_S, worker_kind.EARLY_WALL_S
    tasks = round(wall / (2 * line))  # batches of twice the line, for EARLY_WALL_S
    heavy = live_choice((tasks, tasks * 256, wall), 2, _probe(0, 0.0))
    assert heavy is not None and heavy.kind == "process"
    assert "and a batch (1.0 ms) is worth sending" in heavy.reason
    tasks = round(wall / (1.5 * line))
    assert live_choice((tasks, tasks * 256, wall), 2, _probe(0, 0.0)) is None  # not clearly


def _wait_for(check: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.005)
    return bool(check())  # type: ignore[operator]


@pytest.mark.timeout(60)
def test_a_process_workers_probe_ends_at_once_when_the_parent_settles_the_choice() -> None:
    """The parent's choice (`StatusBlock.settle`, the `SETTLED` field) ends the probe: once
    chosen, each further probe would only cost the worker GIL hand-overs."""
    fields = np.zeros(status.SETTLED + 1, np.int64)
    probe = WorkerGilProbe(fields)
    fields[status.TASK], fields[status.STAGE] = 0, status.LOADING
    probe.start()
    try:
        time.sleep(0.05)  # the first task: set-up, not counted
        fields[status.TASK] = 1  # a later task loads: counted
        assert _wait_for(lambda: fields[status.GIL_PROBES] > 0)
        fields[status.SETTLED] = 1
        assert _wait_for(lambda: not probe._thread.is_alive())
        counted = int(fields[status.GIL_PROBES])
        time.sleep(0.05)
        assert fields[status.GIL_PROBES] == counted < gil.MAX_WORKER_PROBES
    finally:
        probe.stop()
    block = status.StatusBlock.create(0)
    try:
        assert block._fields[status.SETTLED] == 0
        block.settle()  # what the worker's mapping of the same memfd reads
        view = np.frombuffer(mmap.mmap(block.fd, 4096), np.int64, status.SETTLED + 1)
        assert view[status.SETTLED] == 1
        del view
    finally:
        block.close()


def test_a_process_workers_probe_counts_its_loading_past_the_first_task_into_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside a process worker the probe counts only while a task after the first loads
    (the first is the set-up; idle time is not loading), writes its counts where the parent
    reads them (`Progress.gil_probes`/`gil_held`), and ends by itself."""
    monkeypatch.setattr(gil, "MAX_WORKER_PROBES", 40)
    fields = np.zeros(status.SETTLED + 1, np.int64)
    probe = WorkerGilProbe(fields)
    fields[status.TASK], fields[status.STAGE] = 0, status.LOADING  # the first task: set-up
    probe.start()
    try:
        time.sleep(0.1)
        assert fields[status.GIL_PROBES] == 0
        fields[status.TASK], fields[status.STAGE] = 1, status.IDLE  # idle between tasks
        time.sleep(0.1)
        assert fields[status.GIL_PROBES] == 0
        fields[status.STAGE] = status.LOADING  # the second task loads: counted
        assert _wait_for(lambda: not probe._thread.is_alive())  # 40 probes, then it ends
    finally:
        probe.stop()
    assert fields[status.GIL_PROBES] == 40
    assert 0 <= fields[status.GIL_HELD] <= 40  # this thread slept: how many is the machine's
    reader = status.StatusBlock.create(0)
    try:
        reader._fields[status.GIL_PROBES], reader._fields[status.GIL_HELD] = 40, 30
        progress = reader.progress()
        assert (progress.gil_probes, progress.gil_held) == (40, 30)
    finally:
        reader.close()


def test_the_rule_reads_a_probe_inside_process_workers_the_same_way() -> None:
    """Measured on processes (the zygote's fast start), the same lines decide; the reason
    says where the figures were taken."""
    busy = live_choice((6, 24, 1.0), 2, _probe(100, 0.9), on="process")
    assert busy is not None and busy.kind == "process"
    assert "while 2 process workers loaded 6 batches, a probe inside each found its GIL held" in (
        busy.reason)
    free = live_choice((6, 24, 1.0), 2, _probe(100, 0.05), on="process")
    assert free is not None and free.kind == "thread"
    cheap = live_choice((600, 600 * 64, 0.6), 2, _probe(100, 0.05), on="process")
    assert cheap is not None and cheap.kind == "process"
    assert cheap.reason.startswith(
        "worker_type='auto' chose process workers: while 2 process workers loaded 600 batches")


def test_on_processes_cheap_samples_have_their_own_batch_line() -> None:
    """Inside a process a tiny sample costs a fraction of what threads taking turns at the
    GIL pay: the steady tiny row's batches of 64 (5-6 us a sample, 0.32-0.39 ms a batch
    inside processes) went to threads against the threads' line, though processes loaded
    them faster. Against the processes' own line they stay, from the first figures."""
    batch_of_64 = (4, 4 * 64, 4 * 0.35e-3)  # two batches each, past the set-up
    kept = live_choice(batch_of_64, 2, _probe(0, 0.0), on="process")
    assert kept is not None and kept.kind == "process"
    assert "and a batch (0.3 ms) is worth sending" in kept.reason
    line = worker_kind.MIN_PROCESS_BATCH_ON_PROCESSES_S
    assert line < 0.35e-3 < worker_kind.MIN_PROCESS_BATCH_S  # on threads it would not be
    # Below the processes' line: threads, but only on the full figures (never a pause's).
    small = (4, 4 * 16, 4 * 0.08e-3)  # batches of 16: 80 us inside processes
    assert live_choice(small, 2, _probe(0, 0.0), on="process") is None
    full = (3000, 3000 * 16, 3000 * 0.08e-3)  # past MIN_WALL_S of loading time
    handed = live_choice(full, 2, _probe(0, 0.0), on="process")
    assert handed is not None and handed.kind == "thread"
    assert "a sample took 5 us, but a batch only 80 us, less than" in handed.reason


def test_on_processes_a_clearly_free_gil_hands_over_after_one_measured_batch_each() -> None:
    """Every batch more on processes is one on the slower kind for GIL-free work: a share
    far below the line (`CLEAR_FREE_SHARE`) decides once each worker loaded one measured
    batch, without the full figures; near the line, or on threads, the full figures."""
    one_each = (2, 8, 0.1)  # one batch per worker past its set-up, 0.1 s in all
    early = live_choice(one_each, 2, _probe(worker_kind.MIN_PROBES, 0.08), on="process")
    assert early is not None and early.kind == "thread"
    assert live_choice(one_each, 2, _probe(worker_kind.MIN_PROBES - 1, 0.08), on="process") is None
    assert live_choice(one_each, 2, _probe(100, 0.2), on="process") is None  # not clear
    assert live_choice((1, 4, 0.05), 2, _probe(100, 0.05), on="process") is None  # not each
    assert live_choice(one_each, 2, _probe(100, 0.05), on="thread") is None  # threads: full


class _Done:
    def __init__(self, samples: int, load_s: float) -> None:
        self.samples, self.load_s = samples, load_s


class _Batch:
    """A `Received`-like event: what `ProcessFigures.note` reads."""

    def __init__(self, nbytes: int, samples: int = 16, load_s: float = 0.01) -> None:
        self.done = _Done(samples, load_s)
        self.batch = {"x": torch.empty(nbytes, dtype=torch.uint8), "y": [torch.zeros(0)]}


class _Pool:
    """What `ProcessFigures` reads of a pool: each worker's status fields."""

    def __init__(self, *progress: status.Progress | None) -> None:
        self._progress = progress

    def progress(self, worker_id: int) -> status.Progress | None:
        return self._progress[worker_id]


def _progress(probes: int = 0, held: int = 0, drew: int = status.UNCHECKED) -> status.Progress:
    return status.Progress(0, 0, status.LOADING, 0, 0, probes, held, drew)


def test_process_figures_count_from_each_workers_second_batch_and_read_the_status() -> None:
    figures = worker_kind.ProcessFigures(2)
    for worker_id in (0, 1, 0, 1, 0):
        figures.note(worker_id, _Batch(1 << 20))
    figures.note(1, object())  # not a batch (a death, a failure): not counted
    pool = _Pool(_progress(60, 50, status.UNDRAWN), _progress(40, 45, status.UNDRAWN))
    measured, probe = figures.figures(pool)
    assert measured == (3, 48, pytest.approx(0.03))  # the first batch of each is its set-up
    assert (probe.probes, probe.held) == (100, 90)  # held read one ahead is capped
    assert figures.drew(pool) is False
    assert figures.drew(_Pool(_progress(drew=status.UNDRAWN), _progress())) is None  # unchecked
    assert figures.drew(_Pool(_progress(drew=status.DRAWN), None)) is True
    figures.respawned(0)
    figures.note(0, _Batch(1 << 20))  # a new process's first batch is its set-up again
    assert figures.figures(pool)[0][0] == 3


def test_measured_on_processes_big_batches_stay_there_after_one_from_each_worker() -> None:
    """Batches of `BIG_BATCH_BYTES` or more keep processes whatever the GIL does, decided
    as soon as every worker has loaded one (its set-up batch counts: its size is the same)."""
    small, big = worker_kind.ProcessFigures(2), worker_kind.ProcessFigures(2)
    big.note(0, _Batch(worker_kind.BIG_BATCH_BYTES + (2 << 20)))
    assert big.big_batches() is None  # worker 1 has loaded nothing yet
    big.note(1, _Batch(worker_kind.BIG_BATCH_BYTES + (2 << 20)))
    kept = big.big_batches()
    assert kept is not None and kept.kind == "process"
    assert kept.reason.startswith(
        "worker_type='auto' chose process workers: the first 2 batches average 10 MiB: "
        "process workers deliver batches this big about as fast as thread workers"
    ), kept.reason
    assert big.figures(_Pool(None, None))[0] == (0, 0, 0.0)  # no measured batch was needed
    for worker_id in (0, 1, 0):
        small.note(worker_id, _Batch(worker_kind.BIG_BATCH_BYTES // 2))
    assert small.big_batches() is None  # the GIL decides these (live_choice)
    small.note(1, _Batch(worker_kind.BIG_BATCH_BYTES * 3))  # 3 of 4 MiB, 1 of 24: 9 on average
    assert small.big_batches() is not None
