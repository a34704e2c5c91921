"""The iterators `DataLoader.__iter__` returns: one engine run per epoch (or per loader,
with persistent workers).

Both subclass torch's `_BaseDataLoaderIter`, so the sampler, the base seed drawn from
``generator``, pin-memory handling and torch's warnings are torch's own code: for the same
seed the index batches and worker seeds are the same as torch's. The multi-worker iterator
keeps torch's dispatch policy (round-robin over active workers, ``prefetch_factor`` tasks
per worker, in order), so a worker sees the same samples in the same order as under torch
and random values drawn inside ``__getitem__`` match too.
"""

from __future__ import annotations

import collections
import itertools
import logging
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import diagnosis, start
from .engine.fetch import ITERABLE, Fetcher
from .engine.protocol import Exhausted, Failed, Ready, StartFailed
from .engine.supervisor import Died, Supervisor
from .engine.worker import WorkerConfig
from .errors import WorkerStartError
from .report import RunRecord, WorkerReport

if TYPE_CHECKING:
    from .loader import DataLoader

_LOG = logging.getLogger(__name__)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where notes are stored, not printed)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


class RemoteTraceback(Exception):
    """The worker's traceback, attached as ``__cause__`` of a re-raised dataset exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\n{self.tb}"


class WorkerException(Exception):
    """Stands in for a dataset exception that could not be pickled; keeps its type and text."""


class _InProcessIter(_BaseDataLoaderIter):
    """num_workers=0: load in this process, with torch's semantics and steadyload's notes."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        super().__init__(loader)
        if self._timeout != 0:
            raise ValueError(
                f"timeout option needs num_workers > 0, got timeout={self._timeout} with "
                "num_workers=0: in-process loading cannot be interrupted. Set timeout=0 or "
                "use workers."
            )
        self._fetcher = Fetcher(
            self._dataset_kind, self._dataset, self._auto_collation,
            self._collate_fn, self._drop_last,
        )  # fmt: skip

    def _next_data(self) -> Any:
        index = self._next_index()  # may raise StopIteration
        try:
            data = self._fetcher.fetch(index)  # may raise StopIteration
        except StopIteration:
            raise
        except Exception as exc:
            add_note(exc, f"steadyload: raised in the main process {self._fetcher.where}")
            raise
        if self._pin_memory:
            data = _pin_memory(data, self._pin_memory_device)
        return data


@dataclass(slots=True)
class _Task:
    worker_id: int
    indices: Any
    outcome: Any = None
    has_outcome: bool = False
    failed: bool = False


@dataclass(slots=True)
class _Epoch:
    """The task table of one epoch: task id -> `_Task`, for tasks not yet yielded."""

    first_id: int
    tasks: dict[int, _Task] = field(default_factory=dict)
    rcvd: int = 0
    outstanding: int = 0  # tasks sent whose outcome has not arrived (torch's _tasks_outstanding)


class _WorkerIter(_BaseDataLoaderIter):
    """num_workers>0: batches from steadyload's supervised worker processes."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        super().__init__(loader)
        self._prefetch_factor: int = loader.prefetch_factor or 2
        self._in_order = loader.in_order
        self._loader_options = loader._options
        self._ctx, self._start_info = loader._start_context()
        start.check_fork_safe(self._start_info.method)
        start.check_main_guard(self._start_info.method)
        start.warn_if_threads_before_fork(self._start_info.method)
        self.record = RunRecord(self._start_info.method, self._start_info.preload)
        self._config = WorkerConfig(
            dataset_kind=self._dataset_kind,
            dataset=self._dataset,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=int(self._base_seed),
            worker_init_fn=loader.worker_init_fn,
            num_workers=self._num_workers,
            preload=self._start_info.preload,
        )
        self._supervisor: Supervisor | None = None
        self._error: BaseException | None = None
        self._next_task_id = 0
        self._stale: set[int] = set()
        self._arrived: collections.deque[int] = collections.deque()
        self._epoch = _Epoch(first_id=0)
        self._active = [True] * self._num_workers
        self._per_worker = [0] * self._num_workers
        self._cycle = itertools.cycle(range(self._num_workers))
        self._start_workers()
        self._reset(loader, first_iter=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def _start_workers(self) -> None:
        supervisor = Supervisor(self._ctx, self._config, self._num_workers)
        started = time.monotonic()
        supervisor.start()
        self._supervisor = supervisor
        _LOG.debug(
            "started %d workers with %s in %.3f s",
            self._num_workers, self._start_info.method, time.monotonic() - started,
        )  # fmt: skip

    def _shutdown_workers(self) -> None:
        if self._supervisor is not None:
            self._supervisor.shutdown()
            self._supervisor = None

    def __del__(self) -> None:
        if getattr(self, "_supervisor", None) is not None:  # __init__ may have failed
            self._shutdown_workers()

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        if self._supervisor is None:
            # Persistent workers that were stopped by an error: start afresh.
            self._error = None
            self._stale.clear()
            self._epoch.tasks.clear()
            self._start_workers()
        elif not first_iter:
            self._supervisor.send_reset()
        # Tasks still in flight from the last epoch are discarded when they arrive.
        self._stale.update(
            tid for tid, t in self._epoch.tasks.items() if not t.has_outcome
        )
        self._epoch = _Epoch(first_id=self._next_task_id, rcvd=self._next_task_id)
        self._arrived.clear()
        self._active = [True] * self._num_workers
        self._per_worker = [0] * self._num_workers
        self._cycle = itertools.cycle(range(self._num_workers))
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    # -- dispatch ----------------------------------------------------------------------------
    def _try_put_index(self) -> None:
        # torch's policy, kept exactly: see _MultiProcessingDataLoaderIter._try_put_index.
        epoch = self._epoch
        max_tasks = self._prefetch_factor * self._num_workers
        if epoch.outstanding >= max_tasks or self._supervisor is None:
            return
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):
            worker_id = next(self._cycle)
            if self._active[worker_id]:
                if self._in_order:
                    break
                if self._per_worker[worker_id] < max_tasks // sum(self._active):
                    break
        else:
            return
        task_id = self._next_task_id
        self._next_task_id += 1
        epoch.tasks[task_id] = _Task(worker_id, index)
        self._per_worker[worker_id] += 1
        epoch.outstanding += 1
        self._supervisor.send_task(worker_id, task_id, index)

    # -- results -----------------------------------------------------------------------------
    def _next_data(self) -> Any:
        if self._error is not None:
            # Never resume silently after a fatal error: the lost batches would go unnoticed.
            raise self._error
        try:
            return self._next_data_inner()
        except StopIteration:
            raise
        except _DatasetError as wrapped:
            raise wrapped.exc from wrapped.exc.__cause__
        except BaseException as exc:
            # Worker death, time-out, KeyboardInterrupt: stop the workers now, not at GC.
            self._error = exc if not isinstance(exc, KeyboardInterrupt) else None
            self._shutdown_workers()
            raise

    def _next_data_inner(self) -> Any:
        epoch = self._epoch
        while True:
            while epoch.rcvd < self._next_task_id:
                task = epoch.tasks.get(epoch.rcvd)
                if task is not None:
                    if task.has_outcome or self._active[task.worker_id]:
                        break
                    del epoch.tasks[epoch.rcvd]  # its worker's stream ended first
                epoch.rcvd += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            task = epoch.tasks[epoch.rcvd]
            if task.has_outcome:
                del epoch.tasks[epoch.rcvd]
                epoch.rcvd += 1
                return self._process(task)
            while self._arrived:  # in_order=False: whatever came first
                early = epoch.tasks.pop(self._arrived.popleft(), None)
                if early is not None:
                    return self._process(early)
            self._collect(epoch.rcvd)

    def _collect(self, awaited: int) -> None:
        """Wait for worker events and record them in the task table."""
        assert self._supervisor is not None
        timeout = self._timeout if self._timeout > 0 else None
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = self._supervisor.wait(remaining)
            if events:
                break
            if deadline is not None and time.monotonic() >= deadline:
                task = self._epoch.tasks.get(awaited)
                worker_id = task.worker_id if task else None
                raise diagnosis.timed_out(
                    timeout_s=self._timeout,
                    worker_id=worker_id,
                    pid=self._supervisor.pid(worker_id) if worker_id is not None else None,
                    sample_indices=_flat(task.indices) if task else [],
                )
        for worker_id, event in events:
            if isinstance(event, Ready):
                self._on_ready(worker_id, event)
                continue
            if isinstance(event, Died):
                raise self._death(worker_id, event)
            if isinstance(event, StartFailed):
                raise self._start_failure(worker_id, event)
            if isinstance(event, tuple):
                done, batch = event
                task = self._settle(done.task_id)
                if task is not None:
                    task.outcome, task.has_outcome = batch, True
                    self._note_arrival(done.task_id)
            elif isinstance(event, Failed):
                task = self._settle(event.task_id)
                if task is not None:
                    task.outcome = self._rebuild_exception(worker_id, event)
                    task.has_outcome = task.failed = True
                    self._note_arrival(event.task_id)
            elif isinstance(event, Exhausted):
                if self._settle(event.task_id) is not None:
                    self._active[worker_id] = False
                    self._try_put_index()
            else:
                raise RuntimeError(
                    f"[steadyload internal error] unexpected message {event!r} from worker "
                    f"{worker_id}; please report with the output of `steadyload doctor`"
                )

    def _on_ready(self, worker_id: int, ready: Ready) -> None:
        assert self._supervisor is not None
        asked = self._supervisor.started_at(worker_id)
        start_s = self._supervisor.clock() - asked if asked is not None else None
        record = self.record
        record.workers[worker_id] = WorkerReport(worker_id, ready.pid, start_s)
        if ready.preload_missing and record.preload_missing is None:
            _LOG.warning(
                "the fork server could not import %s (CPython skips failed preloads "
                "silently); every worker imports them itself, which is slower",
                ", ".join(ready.preload_missing),
            )
        if ready.preload_missing is not None:
            record.preload_missing = ready.preload_missing

    def _note_arrival(self, task_id: int) -> None:
        if not self._in_order:
            self._arrived.append(task_id)

    def _settle(self, task_id: int) -> _Task | None:
        """An outcome for ``task_id`` arrived: the task, or None if it is stale."""
        if task_id in self._stale:
            self._stale.discard(task_id)
            return None
        self._epoch.outstanding -= 1
        return self._epoch.tasks.get(task_id)

    def _process(self, task: _Task) -> Any:
        self._per_worker[task.worker_id] -= 1
        self._try_put_index()
        if task.failed:
            raise _DatasetError(task.outcome)
        data = task.outcome
        if self._pin_memory:
            data = _pin_memory(data, self._pin_memory_device)
        return data

    # -- errors ------------------------------------------------------------------------------
    def _held_by(self, worker_id: int) -> list[_Task]:
        return [
            t for t in self._epoch.tasks.values() if t.worker_id == worker_id and not t.has_outcome
        ]

    def _death(self, worker_id: int, died: Died) -> BaseException:
        held = self._held_by(worker_id)
        return diagnosis.worker_died(
            worker_id=worker_id,
            pid=died.pid,
            exitcode=died.exitcode,
            sample_indices=[i for t in held for i in _flat(t.indices)],
            batches_held=len(held),
            start_method=self._start_info.method,
        )

    def _start_failure(self, worker_id: int, failed: StartFailed) -> BaseException:
        assert self._supervisor is not None
        return WorkerStartError(
            f"DataLoader worker {worker_id} (pid {self._supervisor.pid(worker_id)}) could "
            f"not start: {failed.type_name}: {failed.text}\n"
            "Likely cause: the dataset, collate_fn or worker_init_fn could not be unpickled "
            f"in a {self._start_info.method} worker, which imports them by module and name.\n"
            "Fix: define them at module level in an importable module (not in a notebook "
            "or inside a function), or use start_method='fork' when no GPU is in use.\n"
            f"Worker traceback:\n{failed.traceback}",
            worker_id=worker_id,
            pid=self._supervisor.pid(worker_id),
        )

    def _rebuild_exception(self, worker_id: int, failed: Failed) -> BaseException:
        exc: BaseException
        if failed.exception is not None:
            try:
                exc = pickle.loads(failed.exception)
            except Exception:
                exc = WorkerException(f"{failed.type_name}: {failed.text}")
        else:
            exc = WorkerException(
                f"{failed.type_name}: {failed.text} (the original exception could not be "
                "pickled, so it is re-raised under this type)"
            )
        pid = self._supervisor.pid(worker_id) if self._supervisor else None
        add_note(exc, f"steadyload: raised in worker {worker_id} (pid {pid}) {failed.where}")
        exc.__cause__ = RemoteTraceback(failed.traceback)
        return exc


class _DatasetError(Exception):
    """Internal wrapper: a dataset exception to re-raise as is (the iterator stays usable)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc


def _flat(indices: Any) -> list[Any]:
    if isinstance(indices, (list, tuple)):
        return list(indices)
    if isinstance(indices, torch.Tensor):
        return list(indices.tolist())
    return [indices]


__all__ = ["_InProcessIter", "_WorkerIter", "ITERABLE"]
