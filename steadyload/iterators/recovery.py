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
Diagnoses follow the kind of the worker that died (`Died.kind`) and the pool's start
method, so after ``worker_type="auto"`` hands over, a process is reported as a process.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import diagnosis
from ..engine.events import Died, NodeLost, ServerDied, ServerGone
from ..engine.pool import THREAD, ServerPool, WorkerPool
from ..engine.remote.causes import remote_died
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


def blame(
    progress: Progress | None, tasks: Mapping[int, Any], held: set[int]
) -> tuple[Any, int | None]:
    """(the sample a dead worker was loading, the task it was running), when known.

    ``tasks`` maps task ids to objects with ``indices``; ``held`` are the ids the worker
    held. A worker that was collating or sending is blamed on the task, not a sample.
    """
    if progress is None or progress.stage == IDLE or progress.task_id not in held:
        return None, None
    task = tasks.get(progress.task_id)
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
    died: Died, oom_kills_before: int | None, rss_bytes: int | None
) -> diagnosis.Evidence:
    """What the machine, the memory sampler and the worker's status block say about a death."""
    memory = system.cgroup_memory()
    progress = died.progress
    return diagnosis.Evidence(
        rss_bytes=rss_bytes,
        memory_limit_bytes=memory.limit_bytes or system.total_memory_bytes(),
        oom_kills_before=oom_kills_before,
        oom_kills_after=memory.oom_kills,
        shm=system.shm_space(),
        stacks=died.stacks,
        libraries=died.libraries,
        stage=STAGES.get(progress.stage, "") if progress else "",
    )


class Recovery:
    """Replaces dead, hung and over-memory workers without losing or repeating a batch."""

    def __init__(
        self, table: TaskTable, opts: LoaderOptions, record: RunRecord, *, stream: bool,
        stateful_stream: bool, hung: dict[int, tuple[int, str]],
        stream_state: dict[int, bytes],
    ) -> None:  # fmt: skip
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

    @property
    def _resumable(self) -> bool:
        return self._stateful_stream or any(s is not None for s in self._stream_state.values())

    def on_died(self, pool: WorkerPool, worker_id: int, died: Died) -> None:
        """A worker died: replace it and re-run what it held, or raise why not."""
        table = self._table
        held = table.held_by(worker_id)
        table.forget((worker_id,))  # never answered now; no need to re-run a finished epoch
        held_ids = {tid for tid, _ in held}
        sample, blamed_task = blame(died.progress, table.tasks, held_ids)
        rss = self.memory.last_rss(worker_id) if self.memory is not None else None
        evidence = gather_evidence(died, self._oom_kills, rss)
        self._oom_kills = evidence.oom_kills_after
        hung = self._hung.pop(worker_id, None)
        retired_uss = self.retiring.pop(worker_id, None)
        stream = self._stream
        flat = [] if stream else [i for _, t in held for i in flat_indices(t.indices)]
        # The kind of the worker that died, not the pool's now: after auto's hand-over a
        # thread may still die while processes run, and the reverse.
        method = None if died.kind == THREAD else pool.start_method

        def error(outcome: str) -> BaseException:
            if died.remote is not None:
                return remote_died(
                    worker_id=worker_id, pid=died.pid, cause=died.remote, sample_indices=flat,
                    batches_held=len(held), sample=sample, outcome=outcome,
                    stream_batches=[t.ordinal for _, t in held] if stream else [],
                )  # fmt: skip
            if died.raised:
                return diagnosis.thread_died(
                    worker_id=worker_id, raised=died.raised, traceback=died.stacks,
                    sample=sample, sample_indices=flat, batches_held=len(held),
                    outcome=outcome,
                )  # fmt: skip
            return diagnosis.worker_died(
                worker_id=worker_id, pid=died.pid, exitcode=died.exitcode,
                sample_indices=flat, batches_held=len(held),
                start_method=method or THREAD, evidence=evidence, sample=sample,
                outcome=outcome, stream_batches=[t.ordinal for _, t in held] if stream else (),
            )

        if retired_uss is not None and died.exitcode == 0:
            cause = (
                f"used {system.gib(retired_uss)} (above max_worker_memory="
                f"{system.gib(self._opts.max_worker_memory_bytes)})"
            )
            self._replace(pool, worker_id, died, held, cause, None, budget=False)
            return
        stage = died.progress.stage if died.progress is not None else IDLE
        starting = STAGES[stage] if stage in STARTING else ""
        if hung is not None and stream and not self._resumable:
            raise diagnosis.worker_hung(
                worker_id=worker_id, pid=died.pid, hang_timeout_s=self._opts.hang_timeout,
                sample=None, sample_indices=[], stack=hung[1], times=1,
                thread=died.kind == THREAD, starting=starting,
            )  # a stream cannot be replayed: no second try
        if stream and not self._resumable:
            raise error(
                "steadyload did not restart it: an IterableDataset's stream cannot be "
                "replayed, so the batches it held would be lost. A stream with "
                "state_dict()/load_state_dict() (on the dataset, or on the iterator its "
                "__iter__ returns) is resumed where its last batch ended."
            )
        if hung is not None:
            task_id, stack = hung
            hang: Any = ("start", worker_id) if task_id < 0 else task_id  # a start: per worker
            self._hangs[hang] += 1
            if self._hangs[hang] >= 2 or table.restarts >= self._opts.max_restarts:
                task = table.tasks.get(task_id)
                raise diagnosis.worker_hung(
                    worker_id=worker_id, pid=died.pid, hang_timeout_s=self._opts.hang_timeout,
                    sample=sample, sample_indices=flat_indices(task.indices) if task else [],
                    stack=stack, times=self._hangs[hang], thread=died.kind == THREAD,
                    starting=starting,
                )
            during = f" {starting}" if starting else ""
            cause = f"hung{during} for more than hang_timeout={self._opts.hang_timeout} s"
            self._replace(pool, worker_id, died, held, cause, sample, budget=True)
            return
        if table.restarts >= self._opts.max_restarts:
            raise error(
                f"steadyload did not restart it: max_restarts={self._opts.max_restarts} "
                "restarts were already used in this epoch."
            )
        key = sample if sample is not None else ("batch", blamed_task)
        blames = died.remote is None or died.remote.counts  # not a lost node or object
        if (sample is not None or blamed_task is not None) and blames:
            self._kills[key] += 1
        if self._kills.get(key, 0) >= 2:
            what = (
                f"sample {sample!r}" if sample is not None
                else f"the batch of samples {diagnosis.format_indices(flat)}"
            )
            if self._opts.on_error == "raise":
                raise error(
                    f"steadyload did not retry it: {what} killed a worker twice. Pass "
                    "on_error='skip' to leave it out and go on."
                )
            self._skip_killer(blamed_task, sample, died)
        name = diagnosis.signal_name(died.exitcode)
        cause = f"killed by {name}" if name else f"exited with status {died.exitcode}"
        if died.raised:
            cause = f"ended by {died.raised}"
        if died.remote is not None:
            cause = died.remote.short
        self._replace(pool, worker_id, died, held, cause, sample, budget=True, log=error(""))

    def _skip_killer(self, task_id: int | None, sample: Any, died: Died) -> None:
        task = self._table.tasks.get(task_id) if task_id is not None else None
        if task is None or task_id is None:
            return
        name = died.raised or diagnosis.signal_name(died.exitcode) or f"exit status {died.exitcode}"
        reason = f"killed the worker twice ({name})"
        if sample is not None and isinstance(task.indices, list) and len(task.indices) > 1:
            task.indices = [i for i in task.indices if i != sample]
            skipped = [sample]
        else:
            skipped = flat_indices(task.indices)
            self._table.skip(task_id)
        for index in skipped:
            _LOG.warning("skipped sample %r: it %s", index, reason)
            self._record.skip(SkippedSample(index, "WorkerDied", reason))

    def _replace(
        self, pool: WorkerPool, worker_id: int, died: Died, held: list[tuple[int, TaskEntry]],
        cause: str, sample: Any, *, budget: bool, log: BaseException | None = None,
    ) -> None:  # fmt: skip
        if budget:
            self._table.restarts += 1
        rerun = [(tid, t) for tid, t in held if not t.has_outcome]
        if log is not None:  # the full diagnosis (evidence, likely cause, fix)
            _LOG.info("%s", log)
        # One line at WARNING: Python's default logging shows it, so a healed death is
        # never silent (the report keeps it too). A worker retired at max_worker_memory was
        # asked for: INFO.
        what = f"was {cause}" if cause.startswith("killed") else cause
        _LOG.log(
            logging.WARNING if budget else logging.INFO,
            "worker %d (pid %s) %s%s: steadyload started a replacement worker %d%s; the %d "
            "batch%s it held %s re-run in order.",
            worker_id, died.pid, what,
            f" while loading sample {sample!r}" if sample is not None else "", worker_id,
            f" (restart {self._table.restarts} of {self._opts.max_restarts} this epoch)"
            if budget else "",
            len(rerun), "" if len(rerun) == 1 else "es", "is" if len(rerun) == 1 else "are",
        )
        self._record.restarted(RestartReport(worker_id, died.pid, cause, sample, len(rerun)))
        self._restart_worker(pool, worker_id)

    def _restart_worker(self, pool: WorkerPool, worker_id: int) -> None:
        """A fresh worker for ``worker_id``, given the tasks it held, in order."""
        try:
            pool.respawn(worker_id)
        except ServerGone as gone:  # the fork server died under the respawn
            self.on_server_died(pool, gone.event, also=(worker_id,))
            return
        if worker_id in self._stream_state:
            pool.send_restore(worker_id, self._stream_state[worker_id])
        for tid, task in self._table.held_by(worker_id):
            pool.send_task(worker_id, tid, task.indices, self._table.epoch)

    def on_node_lost(self, pool: WorkerPool, lost: NodeLost) -> None:
        """A Ray node left with remote workers on it: one event, one restart. Each of its
        workers is started again elsewhere and re-runs its tasks in order."""
        table = self._table
        workers = sorted(w for w, _, _ in lost.workers)
        held = {w: table.held_by(w) for w in workers}
        batches = sum(len(h) for h in held.values())
        flat = [] if self._stream else [
            i for h in held.values() for _, t in h for i in flat_indices(t.indices)]
        for w in workers:
            self._hung.pop(w, None)
            self.retiring.pop(w, None)
        table.forget(workers)

        def error(outcome: str) -> BaseException:
            return remote_died(
                worker_id=workers[0], pid=None, cause=lost.cause, sample_indices=flat,
                batches_held=batches, sample=None, stream_batches=[],
                outcome=f"It took remote workers {workers} with it. {outcome}",
            )  # fmt: skip

        if self._stream and not self._resumable:
            raise error("steadyload did not restart them: a stream cannot be replayed.")
        if table.restarts >= self._opts.max_restarts:
            raise error(
                f"steadyload did not restart them: max_restarts={self._opts.max_restarts} "
                "restarts were already used in this epoch."
            )
        table.restarts += 1  # one event, one restart
        _LOG.info("%s", error(""))
        _LOG.warning(
            "%s with remote workers %s: steadyload started %d replacement(s) elsewhere "
            "(restart %d of %d this epoch); the %d batch(es) they held (samples %s) are "
            "re-run in order.", lost.cause.short, workers, len(workers), table.restarts,
            self._opts.max_restarts, batches, diagnosis.format_indices(flat),
        )  # fmt: skip
        self._record.restarted(RestartReport(-1, None, lost.cause.short, None, batches))
        for w in workers:
            self._restart_worker(pool, w)

    def on_server_died(
        self, pool: WorkerPool, died: ServerDied, also: tuple[int, ...] = ()
    ) -> None:
        """The fork server died with its workers: one event, one restart, no sample blamed.

        Every worker it took (and ``also``, a worker whose respawn it broke) is started
        again from a new server, with the same preloads, and re-runs its tasks in order.
        """
        table = self._table
        workers = sorted({w for w, _, _ in died.workers} | set(also))
        held = {w: table.held_by(w) for w in workers}
        batches = sum(len(h) for h in held.values())
        for w in workers:
            self._hung.pop(w, None)
            self.retiring.pop(w, None)
        table.forget(workers)

        def error(outcome: str) -> BaseException:
            return diagnosis.server_died(
                method=died.method, pid=died.pid, exitcode=died.exitcode,
                worker_pids=[pid for _, pid, _ in died.workers], batches_held=batches,
                outcome=outcome,
            )

        if self._stream and not self._resumable:
            raise error(
                "steadyload did not restart them: an IterableDataset's stream cannot be "
                "replayed, so the batches they held would be lost."
            )
        if table.restarts >= self._opts.max_restarts:
            raise error(
                f"steadyload did not restart them: max_restarts={self._opts.max_restarts} "
                "restarts were already used in this epoch."
            )
        if not isinstance(pool, ServerPool):
            raise RuntimeError(
                f"[steadyload internal error] a fork server died under a {pool.kind} pool; "
                "please report with the output of `steadyload doctor`"
            )
        table.restarts += 1  # one event, one restart
        preload = pool.restart_server(died)
        if preload:
            self._record.preload = preload
        name = diagnosis.signal_name(died.exitcode)
        cause = f"the {died.method} died ({name or f'exit status {died.exitcode}'})"
        _LOG.info("%s", error(""))
        _LOG.warning(
            "the %s (pid %s) died (%s) with %d workers: steadyload started a new %s and %d "
            "replacement worker(s) (restart %d of %d this epoch); the %d batch(es) they held "
            "are re-run in order.", died.method, died.pid, name or f"exit status {died.exitcode}",
            len(workers), died.method, len(workers), table.restarts, self._opts.max_restarts,
            batches,
        )
        self._record.restarted(RestartReport(-1, died.pid, cause, None, batches))
        for w in workers:
            self._restart_worker(pool, w)
