"""`WorkerPlans`: which workers each iterator of a `DataLoader` starts.

A mixin of `steadyload.DataLoader` (loader.py): processes (their start context, decided
once per loader), threads, ``worker_type="auto"``'s choice, and remote workers beside the
local ones (engine/factory.py builds the pool from the plan).
"""

from __future__ import annotations

import dataclasses
import multiprocessing.context
from typing import Any

from ...start.context import StartInfo, resolve_context, warms_in_background
from ..factory import THREADS, PoolPlan
from .worker_kind import WorkerChoice, static_choice


class WorkerPlans:
    """The pool plan of a loader's next iterator (mixed into `DataLoader`)."""

    _options: Any
    _last_run: Any
    _worker_choice: WorkerChoice | None
    _start: tuple[multiprocessing.context.BaseContext, StartInfo] | None
    num_workers: int
    multiprocessing_context: Any
    dataset: Any
    _prestarted: Any

    def _pool_plan(self) -> PoolPlan:
        """This iterator's workers: processes (their context), threads, or, with "auto"
        undecided, threads that may hand over to processes (engine/choice/handover.py);
        and remote workers beside them."""
        remote = self._options.remote
        if remote is None:
            return self._local_plan()
        warm = self._prestarted
        if self.num_workers == 0:
            return PoolPlan("remote", remote=remote, prestarted=warm)
        return dataclasses.replace(self._local_plan(), remote=remote, prestarted=warm)

    def _local_plan(self) -> PoolPlan:
        kind = self._options.worker_type
        if kind == "auto":
            last = self._last_run
            if self._worker_choice is None and last is not None and last.auto_kind:  # decided
                self._worker_choice = WorkerChoice(last.auto_kind, last.worker_type_choice or "")
            if self._worker_choice is None:
                self._worker_choice = static_choice(self, self._options.max_worker_memory_bytes)
            if self._worker_choice is None:  # measured on the first batches
                warm = warms_in_background(self._options.start_method, self.multiprocessing_context)
                return PoolPlan("auto", processes=self._start_context, warm=warm)
            kind = self._worker_choice.kind
        if kind == "thread":
            return THREADS
        return PoolPlan("process", *self._start_context())

    def _start_context(self) -> tuple[multiprocessing.context.BaseContext, StartInfo]:
        """The workers' context and how it was chosen (decided once per loader)."""
        explicit = self.multiprocessing_context
        if self._start is None or (explicit is not None and self._start[0] is not explicit):
            module = type(self.dataset).__module__
            self._start = resolve_context(self._options.start_method, explicit, module)
        return self._start
