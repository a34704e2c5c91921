"""The stall rule of remote_workers=(min, max), fed injected figures, and the iterator's side
(RemoteScaling) on an injected clock: no cluster, no sleep."""

from __future__ import annotations

import types

import pytest

from steadyload.engine.remote import scaling as rule
from steadyload.engine.remote.scaling import StallScaler
from steadyload.engine.remote.spec import RemoteWorkers
from steadyload.iterators.record import RunRecord
from steadyload.iterators.scaling import RemoteScaling
from steadyload.iterators.tasks import TaskTable


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


# -- RemoteScaling: the iterator's side, on an injected clock (no cluster, no sleep) -------


class FakeRemote:
    """The remote pool as RemoteScaling sees it: actors started, ready, retired."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.retired: list[int] = []
        self.ready_ids: set[int] = set()
        self.pending = 0  # actors Ray has not placed

    def respawn(self, w: int) -> None:
        self.started.append(w)

    def ready(self, w: int) -> bool:
        return w in self.ready_ids

    def retire(self, w: int) -> None:
        self.retired.append(w)

    def unplaced(self) -> int:
        return self.pending


class Loop:
    """One local worker (id 0) and remote_workers=(1, 2) (ids 1 and 2), on a list-cell
    clock; the training loop's figures are set by the test, as the iterator records them."""

    def __init__(self) -> None:
        self.now = [0.0]
        self.table = TaskTable(3)
        self.record = RunRecord("process", "forkserver", ())
        self.remote = FakeRemote()
        self.pool = types.SimpleNamespace(remote=self.remote)
        self.scaling = RemoteScaling(RemoteWorkers((1, 2)), 1, self.table, self.record,
                                     fixed_workers=False, clock=lambda: self.now[0])  # fmt: skip

    def at(self, t: float, *, wait_s: float, batches: int) -> int:
        """A batch was taken at ``t`` seconds; the loop had waited ``wait_s`` in all."""
        self.now[0], self.record.wait_s, self.record.batches = t, wait_s, batches
        return self.scaling.after_batch(self.pool)

    def changes(self) -> list[int]:
        return [d.change for d in self.record.scaling]


def test_remote_scaling_starts_with_the_minimum_and_parks_the_rest() -> None:
    loop = Loop()
    assert loop.scaling.parked == {2} and loop.scaling.live() == 1


@pytest.mark.parametrize("t, grown", [(rule.INTERVAL_S - 0.01, False), (rule.INTERVAL_S, True)])
def test_remote_scaling_grows_only_when_a_window_has_passed_on_its_clock(
    t: float, grown: bool
) -> None:
    loop = Loop()
    loop.at(0.0, wait_s=0.0, batches=0)  # the window begins
    loop.at(t, wait_s=t / 2, batches=10)  # the loop waited half of the time
    assert loop.remote.started == ([2] if grown else [])
    assert loop.changes() == ([1] if grown else [])
    if grown:
        decision = loop.record.scaling[0]
        assert (decision.workers, decision.stall_share) == (2, 0.5)
        assert decision.reason == "the training loop waited 50% of the time"
        assert decision.batches_per_s == pytest.approx(10 / t)


def test_remote_scaling_looks_at_most_four_times_a_window() -> None:
    loop = Loop()
    loop.at(0.0, wait_s=0.0, batches=0)
    loop.at(rule.INTERVAL_S / 4 - 0.01, wait_s=0.0, batches=1)  # not looked at: no new window
    loop.at(rule.INTERVAL_S, wait_s=rule.INTERVAL_S / 2, batches=10)  # the window from 0
    assert loop.changes() == [1]


def test_remote_scaling_waits_for_an_added_actor_then_shrinks_when_batches_pile_up() -> None:
    loop = Loop()
    loop.at(0.0, wait_s=0.0, batches=0)
    loop.at(2.0, wait_s=1.0, batches=10)
    assert loop.remote.started == [2] and loop.scaling.parked == {2}  # starting: no tasks yet
    loop.remote.pending = 1  # Ray has not placed it: no window while it waits
    assert loop.at(10.0, wait_s=9.0, batches=20) == 0 and loop.changes() == [1]
    loop.remote.pending = 0
    loop.remote.ready_ids.add(2)
    for w in (1, 2, 2):  # batches pile up: ready, not yet taken
        loop.table.settle(loop.table.add(w, [0], 0), "batch")
    assert loop.at(11.0, wait_s=9.0, batches=21) == 1  # it joined: a new window begins
    assert loop.scaling.parked == set() and loop.scaling.live() == 2
    loop.at(12.99, wait_s=9.0, batches=30)
    assert loop.changes() == [1]  # 1.99 s of the window: not judged yet
    loop.at(13.49, wait_s=9.0, batches=31)  # the next look (a quarter window later)
    assert loop.changes() == [1, -1]
    assert "3 batches were ready and waiting; the loop waited 0%" in loop.record.scaling[1].reason
    assert loop.scaling.parked == {2} and loop.remote.retired == []  # it still holds 2 tasks
    for tid in range(3):  # the three batches added above
        task = loop.table.get(tid)
        if task is not None and task.worker_id == 2:
            loop.table.yielded(tid)
    loop.at(13.6, wait_s=9.0, batches=33)
    assert loop.remote.retired == [2]  # drained: its actor stops, nothing lost


def test_a_started_actor_joins_when_it_says_ready_not_when_the_next_batch_is_taken() -> None:
    # The loop may be waiting for a batch a stalled worker holds: the help joins at once.
    loop = Loop()
    loop.at(0.0, wait_s=0.0, batches=0)
    loop.at(2.0, wait_s=1.0, batches=10)
    assert loop.remote.started == [2] and loop.scaling.on_ready(loop.pool) == 0  # not yet
    loop.remote.ready_ids.add(2)
    assert loop.scaling.on_ready(loop.pool) == 1  # during the wait: no batch was taken
    assert loop.scaling.parked == set() and loop.scaling.live() == 2
    assert loop.scaling.on_ready(loop.pool) == 0  # (joins once)
    assert loop.at(2.1, wait_s=1.1, batches=11) == 0 and loop.changes() == [1]


def test_only_an_actor_the_rule_started_joins_when_one_says_ready() -> None:
    # A Ready from any other actor (a replacement after a death) leaves the parked ids be.
    loop = Loop()
    loop.remote.ready_ids.update({1, 2})
    assert loop.scaling.on_ready(loop.pool) == 0 and loop.scaling.parked == {2}
