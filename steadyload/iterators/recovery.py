"""Recovery policy of the multi-worker iterator: dead, hung and retired workers.

When a worker dies, the supervisor reports it at once with what its status block says it
was doing; `blame` turns that into the sample it was loading and `gather_evidence` adds what
the machine says (memory, OOM kills, /dev/shm). If the restart budget allows, a fresh worker
with the same id (and seed) takes over and re-runs every task the dead one held, in the same
order, so the caller sees the same batches as without the fault. A sample that kills a
worker twice is not tried a third time: it raises, or with ``on_error="skip"`` it is left
out of its batch and recorded. A task that outlives ``hang_timeout`` has the worker's stack
dumped, the worker killed and the task retried once; a second hang raises
`WorkerHangError` with the stack (docs/design/recovery.md). `Recovery` is a mixin of
`WorkerIterator` (workers.py), which owns the task table.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import _system, diagnosis
from ..engine.events import Died, ServerDied, ServerGone
from ..engine.fetch import ITERABLE
from ..engine.pool import WorkerPool
from ..engine.status import IDLE, LOADING, STAGES, Progress
from ..report import RestartReport, RunRecord, SkippedSample
from .common import flat_indices
from .tasks import EMPTY, EpochTable, TaskEntry

if TYPE_CHECKING:
    from ..checkpoint import EpochProgress
    from ..engine.config import WorkerConfig
    from ..memory.sampler import MemorySampler
    from ..options import LoaderOptions
    from ..start.context import StartInfo

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
    memory = _system.cgroup_memory()
    progress = died.progress
    return diagnosis.Evidence(
        rss_bytes=rss_bytes,
        memory_limit_bytes=memory.limit_bytes or _system.total_memory_bytes(),
        oom_kills_before=oom_kills_before,
        oom_kills_after=memory.oom_kills,
        shm=_system.shm_space(),
        stacks=died.stacks,
        libraries=died.libraries,
        stage=STAGES.get(progress.stage, "") if progress else "",
    )


class Recovery:
    """Replaces dead, hung and over-memory workers without losing or repeating a batch."""

    # Owned by WorkerIterator.
    _epoch: EpochTable
    _opts: LoaderOptions
    _supervisor: WorkerPool | None
    _threads: bool
    _num_workers: int
    _dataset_kind: int
    _config: WorkerConfig
    _start_info: StartInfo
    _memory: MemorySampler
    _oom_kills: int | None
    _stale: dict[int, int]
    _kills: collections.Counter[Any]
    _hangs: collections.Counter[int]
    _hung: dict[int, tuple[int, str]]
    _retiring: dict[int, int]
    _stream_state: dict[int, bytes]
    _progress: EpochProgress
    record: RunRecord

    if TYPE_CHECKING:  # Outcomes' method: declared, never a stub that could shadow it
        def _note_arrival(self, task_id: int) -> None: ...

    def _held_by(self, worker_id: int) -> list[tuple[int, TaskEntry]]:
        return sorted(
            (tid, t) for tid, t in self._epoch.tasks.items()
            if t.worker_id == worker_id and not t.has_outcome
        )

    def _on_died(self, worker_id: int, died: Died) -> None:
        assert self._supervisor is not None
        held = self._held_by(worker_id)
        for tid in [tid for tid, owner in self._stale.items() if owner == worker_id]:
            del self._stale[tid]  # never answered now; no need to re-run a finished epoch
        held_ids = {tid for tid, _ in held}
        sample, blamed_task = blame(died.progress, self._epoch.tasks, held_ids)
        evidence = gather_evidence(died, self._oom_kills, self._memory.last_rss(worker_id))
        self._oom_kills = evidence.oom_kills_after
        hung = self._hung.pop(worker_id, None)
        retired_uss = self._retiring.pop(worker_id, None)
        stream = self._dataset_kind == ITERABLE
        flat = [] if stream else [i for _, t in held for i in flat_indices(t.indices)]

        def error(outcome: str) -> BaseException:
            return diagnosis.worker_died(
                worker_id=worker_id, pid=died.pid, exitcode=died.exitcode,
                sample_indices=flat, batches_held=len(held),
                start_method=self._start_info.method, evidence=evidence, sample=sample,
                outcome=outcome, stream_batches=[t.ordinal for _, t in held] if stream else (),
            )

        if retired_uss is not None and died.exitcode == 0:
            cause = (
                f"used {_system.gib(retired_uss)} (above max_worker_memory="
                f"{_system.gib(self._opts.max_worker_memory_bytes)})"
            )
            self._replace(worker_id, died, held, cause, None, budget=False)
            return
        if stream and not self._config.stateful_stream:
            raise error(
                "steadyload did not restart it: an IterableDataset's stream cannot be "
                "replayed, so the batches it held would be lost. A dataset with "
                "state_dict()/load_state_dict() is resumed where its last batch ended."
            )
        if hung is not None:
            task_id, stack = hung
            self._hangs[task_id] += 1
            if self._hangs[task_id] >= 2 or self._epoch.restarts >= self._opts.max_restarts:
                task = self._epoch.tasks.get(task_id)
                raise diagnosis.worker_hung(
                    worker_id=worker_id, pid=died.pid, hang_timeout_s=self._opts.hang_timeout,
                    sample=sample, sample_indices=flat_indices(task.indices) if task else [],
                    stack=stack, times=self._hangs[task_id], thread=self._threads,
                )
            cause = f"hung for more than hang_timeout={self._opts.hang_timeout} s"
            self._replace(worker_id, died, held, cause, sample, budget=True)
            return
        if self._epoch.restarts >= self._opts.max_restarts:
            raise error(
                f"steadyload did not restart it: max_restarts={self._opts.max_restarts} "
                "restarts were already used in this epoch."
            )
        key = sample if sample is not None else ("batch", blamed_task)
        if sample is not None or blamed_task is not None:
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
        self._replace(worker_id, died, held, cause, sample, budget=True, log=error(""))

    def _skip_killer(self, task_id: int | None, sample: Any, died: Died) -> None:
        task = self._epoch.tasks.get(task_id) if task_id is not None else None
        if task is None:
            return
        name = diagnosis.signal_name(died.exitcode) or f"exit status {died.exitcode}"
        reason = f"killed the worker twice ({name})"
        if sample is not None and isinstance(task.indices, list) and len(task.indices) > 1:
            task.indices = [i for i in task.indices if i != sample]
            skipped = [sample]
        else:
            skipped = flat_indices(task.indices)
            task.outcome, task.has_outcome = EMPTY, True
            self._epoch.outstanding -= 1
            self._note_arrival(task_id)  # type: ignore[arg-type]  # not None here
        for index in skipped:
            _LOG.warning("skipped sample %r: it %s", index, reason)
            self.record.skipped.append(SkippedSample(index, "WorkerDied", reason))

    def _replace(
        self, worker_id: int, died: Died, held: list[tuple[int, TaskEntry]], cause: str,
        sample: Any, *, budget: bool, log: BaseException | None = None,
    ) -> None:
        assert self._supervisor is not None
        if budget:
            self._epoch.restarts += 1
        rerun = [(tid, t) for tid, t in held if not t.has_outcome]
        _LOG.info(
            "%s\nsteadyload started a replacement worker %d%s; the %d batch%s it held %s "
            "re-run in order.",
            log if log is not None else f"worker {worker_id} (pid {died.pid}) {cause}.",
            worker_id,
            f" (restart {self._epoch.restarts} of {self._opts.max_restarts} this epoch)"
            if budget else "",
            len(rerun), "" if len(rerun) == 1 else "es", "is" if len(rerun) == 1 else "are",
        )
        self.record.restarts.append(RestartReport(worker_id, died.pid, cause, sample, len(rerun)))
        self._restart_worker(worker_id)

    def _restart_worker(self, worker_id: int) -> None:
        """A fresh process for ``worker_id``, given the tasks it held, in order."""
        assert self._supervisor is not None
        try:
            self._supervisor.respawn(worker_id)
        except ServerGone as gone:  # the fork server died under the respawn
            self._on_server_died(gone.event, also=(worker_id,))
            return
        if worker_id in self._stream_state:
            self._supervisor.send_restore(worker_id, self._stream_state[worker_id])
        for tid, task in self._held_by(worker_id):
            self._supervisor.send_task(worker_id, tid, task.indices, self._progress.epoch)

    def _on_server_died(self, died: ServerDied, also: tuple[int, ...] = ()) -> None:
        """The fork server died with its workers: one event, one restart, no sample blamed.

        Every worker it took (and ``also``, a worker whose respawn it broke) is started
        again from a new server, with the same preloads, and re-runs its tasks in order.
        """
        assert self._supervisor is not None
        workers = sorted({w for w, _, _ in died.workers} | set(also))
        held = {w: self._held_by(w) for w in workers}
        batches = sum(len(h) for h in held.values())
        for w in workers:
            self._hung.pop(w, None)
            self._retiring.pop(w, None)
        self._stale = {t: w for t, w in self._stale.items() if w not in workers}

        def error(outcome: str) -> BaseException:
            return diagnosis.server_died(
                method=died.method, pid=died.pid, exitcode=died.exitcode,
                worker_pids=[pid for _, pid, _ in died.workers], batches_held=batches,
                outcome=outcome,
            )

        if self._dataset_kind == ITERABLE and not self._config.stateful_stream:
            raise error(
                "steadyload did not restart them: an IterableDataset's stream cannot be "
                "replayed, so the batches they held would be lost."
            )
        if self._epoch.restarts >= self._opts.max_restarts:
            raise error(
                f"steadyload did not restart them: max_restarts={self._opts.max_restarts} "
                "restarts were already used in this epoch."
            )
        self._epoch.restarts += 1  # one event, one restart
        preload = self._supervisor.restart_server(died)
        if preload:
            self.record.preload = preload
        name = diagnosis.signal_name(died.exitcode)
        cause = f"the {died.method} died ({name or f'exit status {died.exitcode}'})"
        _LOG.info(
            "%s\nsteadyload started a new %s and %d replacement worker(s) (restart %d of %d "
            "this epoch); the %d batch(es) they held are re-run in order.",
            error(""), died.method, len(workers), self._epoch.restarts,
            self._opts.max_restarts, batches,
        )
        self.record.restarts.append(RestartReport(-1, died.pid, cause, None, batches))
        for w in workers:
            self._restart_worker(w)
