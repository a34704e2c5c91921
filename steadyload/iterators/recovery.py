"""Recovery policy of the multi-worker iterator: dead, hung and retired workers.

When a worker dies, the pool reports it at once with what its status block says it
was doing; `blame` turns that into the sample it was loading and `gather_evidence` adds what
the machine says (memory, OOM kills, /dev/shm). If the restart budget allows, a fresh worker
with the same id (and seed) takes over and re-runs every task the dead one held, in the same
order, so the caller sees the same batches as without the fault. A sample that kills a
worker twice is not tried a third time: it raises, or with ``on_error="skip"`` it is left
out of its batch and recorded. A task that outlives ``hang_timeout`` has the worker's stack
dumped, the worker killed and the task retried once; a second hang raises
`WorkerHangError` with the stack (docs/design/recovery.md). `Recovery` is a collaborator
of `WorkerIterator` (workers.py), handed the task table; the pool is passed to each call.
Every kind of death is one `Died` event whose cause (each kind's ``liveness`` module) words
it, says whether the sample is to blame, and names the group of workers lost with it (a
fork server's, a Ray node's): one handler, one budget check, for every kind.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from .. import diagnosis
from ..engine.events import Died, Loss, ServerGone
from ..engine.pool import THREAD, WorkerPool
from ..engine.worker.status import IDLE, LOADING, STAGES, STARTING, Progress
from ..host import system
from ..report import RestartReport, SkippedSample
from .common import flat_indices
from .record import RunRecord
from .tasks import TaskEntry, TaskTable

if TYPE_CHECKING:
    from ..memory.sampler import MemorySampler
    from ..options import LoaderOptions

_LOG = logging.getLogger(__name__)


def blame(progress: Progress | None, table: TaskTable, held: set[int]) -> tuple[Any, int | None]:
    """(the sample a dead worker was loading, the task it was running), when known.

    ``held`` are the ids of the tasks the worker held. A worker that was collating or
    sending is blamed on the task, not a sample.
    """
    if progress is None or progress.stage == IDLE or progress.task_id not in held:
        return None, None
    task = table.get(progress.task_id)
    if task is None:
        return None, None
    indices = task.indices
    if progress.stage == LOADING and progress.position >= 0:
        if isinstance(indices, list) and progress.position < len(indices):
            return indices[progress.position], progress.task_id
        if not isinstance(indices, list):
            return indices, progress.task_id
    return None, progress.task_id


def gather_evidence(
    progress: Progress | None, oom_kills_before: int | None, rss_bytes: int | None
) -> diagnosis.Evidence:
    """What the machine, the memory sampler and the worker's status say about a death."""
    memory = system.cgroup_memory()
    return diagnosis.Evidence(
        rss_bytes=rss_bytes,
        memory_limit_bytes=memory.limit_bytes or system.total_memory_bytes(),
        oom_kills_before=oom_kills_before,
        oom_kills_after=memory.oom_kills,
        shm=system.shm_space(),
        stage=STAGES.get(progress.stage, "") if progress else "",
    )


class Recovery:
    """Replaces dead, hung and over-memory workers without losing or repeating a batch."""

    def __init__(
        self,
        table: TaskTable,
        opts: LoaderOptions,
        record: RunRecord,
        *,
        stream: bool,
        stateful_stream: bool,
        hung: dict[int, tuple[int, str]],
        stream_state: dict[int, bytes],
    ) -> None:
        self._table = table
        self._opts = opts
        self._record = record
        self._stream = stream  # an IterableDataset: batches are stream positions
        # ... that resumes where a batch ended: the dataset says it can, or its iterators
        # have (their positions came with the batches: torchdata's Stateful iterators)
        self._stateful_stream = stateful_stream
        self._hung = hung  # the watchdog's: worker -> (task id, stack) being killed
        self._stream_state = stream_state  # the iterator's: worker -> state after its last batch
        self.memory: MemorySampler | None = None  # the workers' latest memory readings
        self.retiring: dict[int, int] = {}
        """worker -> USS that passed max_worker_memory (it said `Retire` and exits)."""
        self._kills: collections.Counter[Any] = collections.Counter()  # sample -> deaths
        self._hangs: collections.Counter[Any] = collections.Counter()  # task id -> hangs
        self._oom_kills = system.cgroup_memory().oom_kills
        self.epoch_over = False
        """Every batch of the epoch was yielded and its workers stop now: a death is said,
        not healed (nothing is left to re-run)."""

    @property
    def _resumable(self) -> bool:
        return self._stateful_stream or any(s is not None for s in self._stream_state.values())

    def on_died(self, pool: WorkerPool, died: Died, also: tuple[int, ...] = ()) -> None:
        """A worker, or a group of them (``also``: one whose respawn the group's death
        broke), died: replace them and re-run what they held, or raise why not."""
        table, cause, opts = self._table, died.cause, self._opts
        workers = sorted(set(died.workers) | set(also))
        held = {w: table.held_by(w) for w in workers}
        table.forget(workers)  # never answered now; no need to re-run a finished epoch
        one = len(workers) == 1 and not cause.group
        hangs = [self._hung.pop(w, None) for w in workers]  # a group's are moot
        retired = [self.retiring.pop(w, None) for w in workers]
        hung, retired_uss = (hangs[0], retired[0]) if one else (None, None)
        held_ids = {tid for h in held.values() for tid, _ in h}
        sample, blamed_task = blame(died.progress, table, held_ids) if one else (None, None)
        rss = self.memory.last_rss(workers[0]) if self.memory is not None and one else None
        tasks = [t for h in held.values() for _, t in h]
        flat = [] if self._stream else [i for t in tasks for i in flat_indices(t.indices)]
        loss = Loss(
            worker_id=died.worker_id,
            pid=died.pid,
            sample=sample,
            sample_indices=flat,
            batches_held=len(tasks),
            stream_batches=[t.ordinal for t in tasks] if self._stream else [],
            evidence=gather_evidence(died.progress, self._oom_kills, rss),
        )
        self._oom_kills = loss.evidence.oom_kills_after
        them = "it" if one else "them"

        def error(outcome: str) -> BaseException:
            return cause.explain(dataclasses.replace(loss, outcome=outcome))

        if self.epoch_over and not tasks:
            _LOG.info("%s", error(""))  # the full diagnosis (evidence, likely cause, fix)
            if died.worker_id >= 0 and one:
                what = f"was {cause.short}" if cause.short.startswith("killed") else cause.short
                who = f"worker {died.worker_id} (pid {died.pid}) {what}"
            else:
                who = f"{cause.short} with {died.kind} workers {workers}"
            _LOG.warning(
                "%s after the last batch of the epoch: nothing was lost (no batch was held), "
                "and the epoch's workers stop now.",
                who,
            )
            return

        if retired_uss is not None and cause.clean:
            why = (
                f"used {system.gib(retired_uss)} (above max_worker_memory="
                f"{system.gib(opts.max_worker_memory_bytes)})"
            )
            self._replace(pool, workers, died, held, why, None, budget=False)
            return
        stage = died.progress.stage if died.progress is not None else IDLE
        starting = STAGES[stage] if stage in STARTING else ""
        thread = died.kind == THREAD
        if hung is not None and self._stream and not self._resumable:
            raise diagnosis.worker_hung(
                worker_id=died.worker_id,
                pid=died.pid,
                hang_timeout_s=opts.hang_timeout,
                sample=None,
                sample_indices=[],
                stack=hung[1],
                times=1,
                thread=thread,
                starting=starting,
            )  # a stream cannot be replayed: no second try
        if self._stream and not self._resumable:
            raise error(
                f"steadyload did not restart {them}: an IterableDataset's stream cannot be "
                f"replayed, so the batches {them} held would be lost. A stream with "
                "state_dict()/load_state_dict() (on the dataset, or on the iterator its "
                "__iter__ returns) is resumed where its last batch ended."
            )
        if hung is not None:
            task_id, stack = hung
            hang: Any = ("start", died.worker_id) if task_id < 0 else task_id  # a start: per worker
            self._hangs[hang] += 1
            if self._hangs[hang] >= 2 or table.restarts >= opts.max_restarts:
                task = table.get(task_id)
                raise diagnosis.worker_hung(
                    worker_id=died.worker_id,
                    pid=died.pid,
                    hang_timeout_s=opts.hang_timeout,
                    sample=sample,
                    sample_indices=flat_indices(task.indices) if task else [],
                    stack=stack,
                    times=self._hangs[hang],
                    thread=thread,
                    starting=starting,
                )
            during = f" {starting}" if starting else ""
            why = f"hung{during} for more than hang_timeout={opts.hang_timeout} s"
            self._replace(pool, workers, died, held, why, sample, budget=True)
            return
        if table.restarts >= opts.max_restarts:
            raise error(
                f"steadyload did not restart {them}: max_restarts={opts.max_restarts} "
                "restarts were already used in this epoch."
            )
        key = sample if sample is not None else ("batch", blamed_task)
        if (sample is not None or blamed_task is not None) and cause.blames_sample:
            self._kills[key] += 1
        if self._kills.get(key, 0) >= 2:
            what = (
                f"sample {sample!r}"
                if sample is not None
                else f"the batch of samples {diagnosis.format_indices(flat)}"
            )
            if opts.on_error == "raise":
                raise error(
                    f"steadyload did not retry it: {what} killed a worker twice. Pass "
                    "on_error='skip' to leave it out and go on."
                )
            self._skip_killer(blamed_task, sample, cause.name)
        preload = cause.heal(pool)  # a fork server, before its workers
        if preload:
            self._record.preload = preload
        self._replace(pool, workers, died, held, cause.short, sample, budget=True, log=error(""))

    def _skip_killer(self, task_id: int | None, sample: Any, name: str) -> None:
        task = self._table.get(task_id) if task_id is not None else None
        if task is None or task_id is None:
            return
        reason = f"killed the worker twice ({name})"
        if sample is not None and isinstance(task.indices, list) and len(task.indices) > 1:
            self._table.leave_out(task_id, sample)
            skipped = [sample]
        else:
            skipped = flat_indices(task.indices)
            self._table.skip(task_id)
        for index in skipped:
            _LOG.warning("skipped sample %r: it %s", index, reason)
            self._record.skip(SkippedSample(index, "WorkerDied", reason))

    def _replace(
        self,
        pool: WorkerPool,
        workers: list[int],
        died: Died,
        held: dict[int, list[tuple[int, TaskEntry]]],
        cause: str,
        sample: Any,
        *,
        budget: bool,
        log: BaseException | None = None,
    ) -> None:
        restart = ""
        if budget:
            used = self._table.spend_restart()
            restart = f" (restart {used} of {self._opts.max_restarts} this epoch)"
        rerun = sum(1 for h in held.values() for _, t in h if not t.has_outcome)
        if log is not None:  # the full diagnosis (evidence, likely cause, fix)
            _LOG.info("%s", log)
        # One line at WARNING: Python's default logging shows it, so a healed death is
        # never silent (the report keeps it too). A worker retired at max_worker_memory was
        # asked for: INFO.
        level = logging.WARNING if budget else logging.INFO
        batches = f"{rerun} batch{'' if rerun == 1 else 'es'}"
        if died.worker_id >= 0 and len(workers) == 1:
            what = f"was {cause}" if cause.startswith("killed") else cause
            loading = f" while loading sample {sample!r}" if sample is not None else ""
            _LOG.log(
                level,
                "worker %d (pid %s) %s%s: steadyload started a replacement worker %d%s; the "
                "%s it held %s re-run in order.",
                died.worker_id,
                died.pid,
                what,
                loading,
                died.worker_id,
                restart,
                batches,
                "is" if rerun == 1 else "are",
            )
        else:  # a group: one event, one restart
            _LOG.log(
                level,
                "%s with %s workers %s: steadyload started %d replacement worker(s)%s; "
                "the %s they held are re-run in order.",
                cause,
                died.kind,
                workers,
                len(workers),
                restart,
                batches,
            )
        report = RestartReport(died.worker_id, died.pid, cause, sample, rerun)
        self._record.restarted(report)
        for w in workers:
            self._restart_worker(pool, w, cause)

    def _restart_worker(self, pool: WorkerPool, worker_id: int, cause: str = "") -> None:
        """A fresh worker for ``worker_id``, given the tasks it held, in order (each noting
        ``cause``: the ledger says what touched a batch)."""
        try:
            pool.respawn(worker_id)
        except ServerGone as gone:  # the fork server died under the respawn
            self.on_died(pool, gone.event, also=(worker_id,))
            return
        if worker_id in self._stream_state:
            pool.send_restore(worker_id, self._stream_state[worker_id])
        for tid, task in self._table.held_by(worker_id):
            self._table.rerun(tid, cause)
            pool.send_task(worker_id, tid, task.indices, self._table.epoch)
