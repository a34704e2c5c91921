"""The stall rule of remote_workers=(min, max), fed injected figures (no cluster, no clock)."""

from __future__ import annotations

from steadyload.engine.remote.scaling import StallScaler


def _feed(scaler: StallScaler, *steps: tuple[float, float, int, int, int, int]) -> list[int]:
    return [scaler.observe(*step)[0] for step in steps]


def test_it_grows_while_the_loop_waits_and_not_past_the_maximum() -> None:
    s = StallScaler(1, 2, interval_s=1.0)
    # (now, total wait s, batches, live, ready, unplaced)
    assert _feed(s, (0, 0, 0, 1, 0, 0), (1, 0.9, 5, 1, 0, 0)) == [0, 1]
    assert _feed(s, (2, 1.0, 5, 2, 0, 1)) == [0]  # the added actor is not placed: wait
    assert _feed(s, (3, 1.0, 15, 2, 0, 0), (4, 1.9, 25, 2, 0, 0)) == [0, 0]  # helped; at max


def test_an_added_worker_that_does_not_help_is_taken_back_and_not_tried_again() -> None:
    s = StallScaler(1, 4, interval_s=1.0)
    assert _feed(s, (0, 0, 0, 1, 0, 0), (1, 0.9, 5, 1, 0, 0)) == [0, 1]
    change, _, _, reason = s.observe(2, 1.8, 10, 2, 0, 0)  # same rate, still waiting
    assert change == -1 and "did not help" in reason
    assert _feed(s, (3, 2.7, 15, 1, 0, 0)) == [0]  # the ceiling holds while the load lasts


def test_it_shrinks_when_batches_pile_up_and_keeps_the_minimum() -> None:
    s = StallScaler(1, 3, interval_s=1.0)
    assert _feed(s, (0, 0, 0, 3, 6, 0), (1, 0.0, 2, 3, 6, 0)) == [0, -1]
    assert _feed(s, (2, 0.0, 4, 2, 4, 0), (3, 0.0, 6, 1, 4, 0)) == [-1, 0]  # the minimum
    assert _feed(s, (4, 0.0, 8, 2, 1, 0)) == [0]  # nothing piles up: no change


def test_nothing_is_decided_inside_a_window() -> None:
    s = StallScaler(1, 3, interval_s=2.0)
    assert _feed(s, (0, 0, 0, 1, 0, 0), (1, 1.0, 1, 1, 0, 0), (2, 2.0, 2, 1, 0, 0)) == [0, 0, 1]
