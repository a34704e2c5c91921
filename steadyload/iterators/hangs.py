"""Watching workers that send nothing: hung tasks (``hang_timeout``) and lost results.

`Watchdog` is a collaborator of `WorkerIterator`, handed the task table; the pool is passed
to each call (a pool is replaced when persistent workers restart). Wake-ups are scheduled
for the earliest ``started + hang_timeout`` among busy workers and ``now + hang_timeout``
for idle ones, which may start a task without telling anyone; an overdue worker's stack is
dumped and the worker killed, and its death is then handled by `Recovery`, which finds the
hang in `hung`. Independently, whenever tasks are outstanding the parent wakes every few
seconds to check that no result went missing: a worker whose status says it finished a
task the parent still awaits, with nothing on its way, means a lost message, which is
reported instead of waited on forever (docs/design/recovery.md#hangs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..engine.pool import WorkerPool
from ..engine.worker.status import IDLE
from .tasks import TaskTable

_LOG = logging.getLogger(__name__)
LOST_CHECK_S = 5.0
"""While tasks are outstanding, look for lost results at least this often. [Unit: second]"""


class Watchdog:
    """Finds hung workers and lost results; kills the former, reports the latter."""

    def __init__(
        self,
        table: TaskTable,
        hang_timeout_s: float | None,
        num_workers: int,
        *,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._table = table
        self._limit = hang_timeout_s
        self._num_workers = num_workers
        self._clock_ns = clock_ns  # the workers' status fields are on the monotonic clock
        self.hung: dict[int, tuple[int, str]] = {}
        """worker id -> (task id, stack) of a hung worker being killed; `Recovery` takes it."""

    def next_hang_deadline(self, pool: WorkerPool) -> float | None:
        """When a busy worker would pass ``hang_timeout`` first (monotonic seconds)."""
        limit = self._limit
        if limit is None:
            return None
        now = self._clock_ns() / 1e9
        soonest = None
        for worker_id in range(self._num_workers):
            progress = pool.progress(worker_id)
            if progress is None or worker_id in self.hung:
                continue
            if progress.stage == IDLE:
                # It may start a task right after this look, without a message to wake us;
                # such a task cannot be overdue before now + limit, so look again then.
                at = now + limit
            else:
                at = progress.started_ns / 1e9 + limit
            soonest = at if soonest is None else min(soonest, at)
        return soonest

    def check_hangs(self, pool: WorkerPool) -> None:
        """Dump the stack of every worker past ``hang_timeout`` and kill it."""
        limit = self._limit
        if limit is None:
            return
        now_ns = self._clock_ns()
        for worker_id in range(self._num_workers):
            progress = pool.progress(worker_id)
            if progress is None or progress.stage == IDLE or worker_id in self.hung:
                continue
            if now_ns - progress.started_ns < limit * 1e9:
                continue
            stack = pool.dump_stack(worker_id)
            self.hung[worker_id] = (progress.task_id, stack)
            _LOG.info(
                "worker %d (pid %s) has run task %d for more than hang_timeout=%s s; its "
                "stack:\n%s",
                worker_id,
                pool.pid(worker_id),
                progress.task_id,
                limit,
                stack,
            )
            pool.kill(worker_id)  # its death arrives as a Died event

    def next_lost_check(self) -> float | None:
        """When to look for lost results next: soon while tasks are outstanding."""
        return self._clock_ns() / 1e9 + LOST_CHECK_S if self._table.outstanding else None

    def check_lost_results(self, pool: WorkerPool) -> None:
        """Raise if a worker finished a task whose outcome never arrived.

        The status fields keep the last task a worker began; once it is idle, that task's
        outcome was sent before. Nothing readable and nothing half-received (the wait just
        timed out) then means the message was lost.

        Raises:
            RuntimeError: an internal error, with what was expected.
        """
        for worker_id, oldest in self._table.oldest_awaited().items():
            progress = pool.progress(worker_id)
            if progress is None:
                lost = f"its worker {worker_id} is gone and was not replaced"
            elif progress.stage != IDLE or progress.task_id < oldest:
                continue
            # The status first, the socket then: a worker that sends its outcome and goes
            # idle in between is seen readable here, never taken for a lost message.
            elif pool.on_its_way(worker_id):
                continue
            else:
                lost = (
                    f"worker {worker_id} (pid {pool.pid(worker_id)}) finished "
                    f"task {progress.task_id}, and nothing is on its way"
                )
            raise RuntimeError(
                f"[steadyload internal error] the outcome of task {oldest} never arrived: "
                f"{lost}; steadyload stops instead of waiting forever. Please report with "
                "the output of `steadyload doctor`"
            )
