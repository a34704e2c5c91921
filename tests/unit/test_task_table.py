"""The task table's invariants, and the hang watch on an injected clock (no real waiting)."""

from __future__ import annotations

from typing import Any

import pytest

from steadyload.engine.worker.status import IDLE, LOADING, Progress
from steadyload.iterators.hangs import Watchdog
from steadyload.iterators.tasks import EMPTY, TaskTable


def test_outstanding_counts_tasks_sent_and_not_settled() -> None:
    table = TaskTable(2)
    a, b = table.add(0, [0, 1], 0), table.add(1, [2, 3], 1)
    assert (a, b, table.outstanding, table.load(0), table.load(1)) == (0, 1, 2, 1, 1)
    assert table.settle(a, "batch") is table.get(a) and table.outstanding == 1
    assert table.settle(a, "again") is None and table.get(a).outcome == "batch"  # once
    assert [tid for tid, _ in table.held_by(1)] == [b]
    table.skip(b)
    assert table.get(b).outcome is EMPTY and table.outstanding == 0 and table.settled() == 2
    assert table.yielded(a).outcome == "batch" and (table.load(0), table.load(1)) == (0, 1)


def test_a_new_epoch_makes_tasks_in_flight_stale_and_drops_their_outcomes() -> None:
    table = TaskTable(2, in_order=False)
    old = table.add(0, [0], 0)
    table.spend_restart()
    table.new_epoch(1)
    assert table.outstanding == 0 and table.restarts == 0 and table.next_to_yield() is None
    assert table.settle(old, "late") is None  # dropped, and only once remembered
    new = table.add(0, [1], 0)
    table.settle(new, "fresh")
    assert table.first_arrived() == (new, table.get(new)) and table.epoch == 1


def test_tasks_are_yielded_in_order_past_those_of_an_ended_stream() -> None:
    table = TaskTable(2)
    a, b, c = table.add(0, [0], 0), table.add(1, [1], 1), table.add(0, [2], 2)
    assert table.end_stream(1, b) and not table.active(1) and table.active_workers() == 1
    assert table.next_to_yield() == (a, table.get(a))  # awaited: its worker is active
    table.settle(a, "A")
    table.yielded(a)
    table.settle(c, "C")
    assert table.next_to_yield() == (c, table.get(c))  # b never comes: passed over
    table.yielded(c)
    assert table.next_to_yield() is None


def test_out_of_order_arrivals_and_the_restart_budget() -> None:
    table = TaskTable(2, in_order=False)
    a, b = table.add(0, [0, 1], 0), table.add(1, [2], 1)
    table.settle(b, "B")
    table.settle(a, "A")
    assert table.first_arrived() == (b, table.get(b))
    table.yielded(a)  # in order, while b arrived first: b stays first
    assert table.first_arrived() == (b, table.get(b))
    table.yielded(b)
    assert table.first_arrived() == (a, None)  # yielded already: passed over
    table.drop_arrived()
    assert table.first_arrived() is None
    assert (table.spend_restart(), table.spend_restart(), table.restarts) == (1, 2, 2)
    c = table.add(0, [3, 4, 5], 2)
    table.leave_out(c, 4)
    assert table.get(c).indices == [3, 5]


def test_a_dead_worker_forgets_its_stale_tasks() -> None:
    table = TaskTable(2)
    old = table.add(1, [0], 0)
    table.new_epoch(1)
    table.forget((1,))
    again = table.add(1, [0], 0)
    assert old != again and table.settle(old, "late") is None


def test_a_stream_that_ended_settles_without_an_outcome() -> None:
    table = TaskTable(1)
    tid = table.add(0, [0], 0)
    task = table.settle(tid)
    assert task is not None and not task.has_outcome and table.outstanding == 0


def test_a_task_its_workers_stream_ended_at_is_neither_awaited_nor_held() -> None:
    # Nothing more comes for it: the lost-message check must not wait for it, and a death of
    # its worker must not send it again (a restarted stream would answer with data).
    table = TaskTable(2)
    a, b, c = table.add(1, [0], 0), table.add(0, [1], 1), table.add(0, [2], 2)
    table.end_stream(0, b)
    assert table.oldest_awaited() == {1: a, 0: c} and table.held_by(0) == [(c, table.get(c))]
    assert table.settle(b, "late") is None and table.outstanding == 2  # answered once
    table.end_stream(0, c)
    assert table.held_by(0) == [] and table.oldest_awaited() == {1: a}


class _Pool:
    """The two calls of a pool the watchdog uses to find a hang, and what it killed."""

    def __init__(self, progress: dict[int, Progress]) -> None:
        self._progress = progress
        self.killed: list[int] = []

    def progress(self, worker_id: int) -> Progress | None:
        return self._progress.get(worker_id)

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        return f"stack of {worker_id}"

    def pid(self, worker_id: int) -> int:
        return 1000 + worker_id

    def kill(self, worker_id: int) -> None:
        self.killed.append(worker_id)


@pytest.mark.parametrize("elapsed_s, killed", [(2.9, []), (3.1, [0])])
def test_the_watchdog_kills_a_task_past_hang_timeout_on_its_clock(
    elapsed_s: float, killed: list[int]
) -> None:
    now = [10 * 10**9]
    table = TaskTable(2)
    watchdog = Watchdog(table, 3.0, 2, clock_ns=lambda: now[0])
    pool: Any = _Pool({0: Progress(7, 0, LOADING, now[0], 0), 1: Progress(8, -1, IDLE, 0, 0)})
    assert watchdog.next_hang_deadline(pool) == pytest.approx(13.0)  # busy: started + limit
    now[0] += int(elapsed_s * 1e9)
    watchdog.check_hangs(pool)
    assert pool.killed == killed
    assert watchdog.hung == ({0: (7, "stack of 0")} if killed else {})
