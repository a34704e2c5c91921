"""Watching workers that send nothing: hung tasks (``hang_timeout``) and lost results.

A mixin of `WorkerIterator`. Wake-ups are scheduled for the earliest ``started + hang_timeout``
among busy workers and ``now + hang_timeout`` for idle ones, which may start a task without
telling anyone; an overdue worker's stack is dumped (faulthandler) and the worker killed, and
its death is then handled by `Recovery`. Independently, whenever tasks are outstanding the
parent wakes every few seconds to check that no result went missing: a worker whose status
says it finished a task the parent still awaits, with nothing on its way, means a lost
message, which is reported instead of waited on forever (docs/design/recovery.md#hangs).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..engine.pool import WorkerPool
from ..engine.status import IDLE
from .tasks import EpochTable

if TYPE_CHECKING:
    from ..options import LoaderOptions

_LOG = logging.getLogger(__name__)
LOST_CHECK_S = 5.0
"""While tasks are outstanding, look for lost results at least this often. [Unit: second]"""


class Watchdog:
    """Finds hung workers and lost results; kills the former, reports the latter."""

    # Owned by WorkerIterator.
    _epoch: EpochTable
    _opts: LoaderOptions
    _supervisor: WorkerPool | None
    _num_workers: int
    _hung: dict[int, tuple[int, str]]

    def _next_hang_deadline(self) -> float | None:
        limit = self._opts.hang_timeout
        if limit is None or self._supervisor is None:
            return None
        soonest = None
        for worker_id in range(self._num_workers):
            progress = self._supervisor.progress(worker_id)
            if progress is None or worker_id in self._hung:
                continue
            if progress.stage == IDLE:
                # It may start a task right after this look, without a message to wake us;
                # such a task cannot be overdue before now + limit, so look again then.
                at = time.monotonic() + limit
            else:
                at = progress.started_ns / 1e9 + limit
            soonest = at if soonest is None else min(soonest, at)
        return soonest

    def _check_hangs(self) -> None:
        limit = self._opts.hang_timeout
        if limit is None or self._supervisor is None:
            return
        now_ns = time.monotonic_ns()
        for worker_id in range(self._num_workers):
            progress = self._supervisor.progress(worker_id)
            if progress is None or progress.stage == IDLE or worker_id in self._hung:
                continue
            if now_ns - progress.started_ns < limit * 1e9:
                continue
            stack = self._supervisor.dump_stack(worker_id)
            self._hung[worker_id] = (progress.task_id, stack)
            _LOG.info(
                "worker %d (pid %s) has run task %d for more than hang_timeout=%s s; its "
                "stack:\n%s", worker_id, self._supervisor.pid(worker_id), progress.task_id,
                limit, stack,
            )
            self._supervisor.kill(worker_id)  # its death arrives as a Died event

    def _next_lost_check(self) -> float | None:
        """When to look for lost results next: soon while tasks are outstanding."""
        return time.monotonic() + LOST_CHECK_S if self._epoch.outstanding else None

    def _check_lost_results(self) -> None:
        """Raise if a worker finished a task whose outcome never arrived.

        The status block's task field keeps the last task a worker began; once it is idle,
        that task's outcome was sent before. Nothing readable and nothing half-received
        (the wait just timed out) then means the message was lost.

        Raises:
            RuntimeError: an internal error, with what was expected.
        """
        if self._supervisor is None:
            return
        awaited: dict[int, int] = {}
        for tid, task in self._epoch.tasks.items():
            if not task.has_outcome:
                awaited[task.worker_id] = min(awaited.get(task.worker_id, tid), tid)
        for worker_id, oldest in awaited.items():
            progress = self._supervisor.progress(worker_id)
            if progress is None:
                lost = f"its worker {worker_id} is gone and was not replaced"
            elif progress.stage != IDLE or progress.task_id < oldest:
                continue
            # The status first, the socket then: a worker that sends its outcome and goes
            # idle in between is seen readable here, never taken for a lost message.
            elif self._supervisor.on_its_way(worker_id):
                continue
            else:
                lost = (
                    f"worker {worker_id} (pid {self._supervisor.pid(worker_id)}) finished "
                    f"task {progress.task_id}, and nothing is on its way"
                )
            raise RuntimeError(
                f"[steadyload internal error] the outcome of task {oldest} never arrived: "
                f"{lost}; steadyload stops instead of waiting forever. Please report with "
                "the output of `steadyload doctor`"
            )
