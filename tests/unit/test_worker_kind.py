"""engine/choice/worker_kind.py: the GIL probe against real threads, and the rule that reads it."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from steadyload.engine.choice import worker_kind
from steadyload.engine.choice.worker_kind import GilProbe, live_choice


def _probe_while(work: object, probes: int = 30) -> float:
    """The probe's mean delay (s) over ``probes`` probes while two threads run ``work``
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
    return probe.waited_s / probe.probes


def _python_loop() -> None:
    total = 0
    for k in range(200_000):  # some 10 ms in one stretch with the GIL held
        total += k


@pytest.mark.timeout(60)
def test_the_probe_tells_a_busy_gil_from_a_free_one() -> None:
    interval = sys.getswitchinterval()
    free = _probe_while(lambda: time.sleep(0.002))  # releases the GIL, as I/O or decode do
    busy = _probe_while(_python_loop)
    # A GIL held for 10 ms at a stretch makes every probe wait for the switch interval;
    # how little a free one waits depends on the machine's load, so only its order is
    # asserted (the line between them is the rule's, tested with injected figures below).
    assert worker_kind.BUSY_SHARE * interval <= busy and free < busy / 2, (free, busy)


def test_the_rule_waits_for_enough_batches_probes_and_time() -> None:
    interval = sys.getswitchinterval()
    assert live_choice((5, 20, 1.0), 2, (100, 0.0)) is None  # 3 batches per thread first
    assert live_choice((6, 24, 0.1), 2, (100, 0.0)) is None  # nor a blink of loading
    assert live_choice((6, 24, 1.0), 2, (10, 0.0)) is None  # nor a handful of probes
    busy = live_choice((6, 24, 1.0), 2, (100, 100 * 0.5 * interval))
    free = live_choice((6, 24, 1.0), 2, (100, 100 * 0.02 * interval))
    assert busy is not None and busy.kind == "process"
    assert "waited 2.50 ms for it on average (50% of the 5 ms switch interval" in busy.reason
    assert free is not None and free.kind == "thread"
    assert "the GIL was mostly free, so threads load in parallel" in free.reason


def test_cheap_samples_go_to_processes_though_the_gil_looks_free() -> None:
    interval = sys.getswitchinterval()
    free_gil = (100, 100 * 0.02 * interval)
    cheap = live_choice((600, 600 * 64, 0.6), 2, free_gil)  # 16 us a sample
    assert cheap is not None and cheap.kind == "process"
    assert "but a sample took 16 us: samples this cheap are mostly interpreter work" in (
        cheap.reason)
    assert "and a batch (1.0 ms) is worth sending, so processes load faster" in cheap.reason
    at_the_line = live_choice((600, 600 * 64, 600 * 64 * worker_kind.CHEAP_SAMPLE_S), 2,
                              free_gil)  # fmt: skip
    assert at_the_line is not None and at_the_line.kind == "thread"
    one_a_batch = live_choice((12000, 12000, 0.24), 2, free_gil)  # batch_size=None: 20 us
    assert one_a_batch is not None and one_a_batch.kind == "thread"
    assert "a sample took 20 us, but a batch only 20 us, less than a process worker's" in (
        one_a_batch.reason)


def test_the_first_figures_lean_to_processes_before_they_decide() -> None:
    interval = sys.getswitchinterval()
    busy = (worker_kind.LEAN_PROBES, worker_kind.LEAN_PROBES * interval)  # a busy GIL
    assert worker_kind.leans_to_processes((0, 0, 0.0), busy)
    assert live_choice((0, 0, 0.0), 2, busy) is None  # too few figures to decide yet
    assert not worker_kind.leans_to_processes((0, 0, 0.0), (worker_kind.LEAN_PROBES - 1, 1.0))
    assert not worker_kind.leans_to_processes((2, 64, 0.064), (10, 0.0))  # free, 1 ms samples
    assert worker_kind.leans_to_processes((2, 128, 0.002), (10, 0.0))  # cheap, 1 ms batches
    assert not worker_kind.leans_to_processes((2, 2, 0.00002), (10, 0.0))  # cheap, tiny tasks
