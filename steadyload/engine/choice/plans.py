"""`WorkerPlans`: which workers each iterator of a `DataLoader` starts.

A loader owns one (loader.py): it remembers what is decided once per loader, the
processes' start context and ``worker_type="auto"``'s choice, and makes each iterator's
`PoolPlan` from the loader's arguments: processes, threads, auto's threads-then-processes,
and remote workers beside the local ones (engine/factory.py builds the pool from it).
"""

from __future__ import annotations

import dataclasses
import multiprocessing.context
from typing import Any

from ...start import claims, zygote
from ...start.context import StartInfo, resolve_context, zygote_is_auto_choice
from ..factory import THREADS, PoolPlan
from .worker_kind import WorkerChoice, static_choice


class WorkerPlans:
    """The pool plans of one loader's iterators, and what they decide once per loader."""

    def __init__(self) -> None:
        self.start: tuple[multiprocessing.context.BaseContext, StartInfo] | None = None
        """The processes' context and how it was chosen, once resolved."""
        self.choice: WorkerChoice | None = None
        """``worker_type="auto"``'s choice, once made (statically or measured)."""

    @property
    def start_info(self) -> StartInfo | None:
        """How the processes start, once resolved."""
        return self.start[1] if self.start is not None else None

    def plan(self, loader: Any, options: Any, last_run: Any, prestarted: Any) -> PoolPlan:
        """The next iterator's workers: processes (their context), threads, or, with "auto"
        undecided, threads that may hand over to processes (engine/choice/handover.py);
        and remote workers beside them (``prestarted``: the loader's, warm.py)."""
        remote = options.remote
        if remote is None:
            return self._local(loader, options, last_run)
        if loader.num_workers == 0:
            return PoolPlan("remote", remote=remote, prestarted=prestarted)
        local = self._local(loader, options, last_run)
        return dataclasses.replace(local, remote=remote, prestarted=prestarted)

    def _local(self, loader: Any, options: Any, last_run: Any) -> PoolPlan:
        kind = options.worker_type
        if kind == "auto":
            if self.choice is None and last_run is not None and last_run.auto_kind:  # decided
                self.choice = WorkerChoice(last_run.auto_kind, last_run.worker_type_choice or "")
            if self.choice is None:
                self.choice = static_choice(loader, options.max_worker_memory_bytes)
            if self.choice is None:  # measured on the first batches
                return PoolPlan(
                    "auto",
                    processes=lambda: self.start_context(loader),
                    release=self.release_processes,
                )
            kind = self.choice.kind
        if kind == "thread":
            self.release_processes()
            return THREADS
        return PoolPlan("process", *self.start_context(loader))

    def starts_early(self, loader: Any) -> bool:
        """Whether the loader's construction should resolve its start context: always for
        process workers; for ``worker_type="auto"`` when that forks the zygote, which must
        happen before the thread workers run (their hand-over then starts processes in
        milliseconds), while a fork server is only started once the work leans to them.
        (The remote workers' own warm start is warm.py's.)"""
        kind = loader._options.worker_type
        if kind == "process":
            return True
        if kind != "auto" or loader.multiprocessing_context is not None:
            return False
        method = loader._options.start_method
        return method == "zygote" or (method == "auto" and zygote_is_auto_choice())

    def start_context(self, loader: Any) -> tuple[multiprocessing.context.BaseContext, StartInfo]:
        """The workers' context and how it was chosen (decided once per loader, again if
        the loader's ``multiprocessing_context`` was changed since)."""
        explicit = loader.multiprocessing_context
        if self.start is None or (explicit is not None and self.start[0] is not explicit):
            module = type(loader.dataset).__module__
            claims.claim(self)  # first: a zygote found running is not let go meanwhile
            self.start = resolve_context(loader._options.start_method, explicit, module)
            if not isinstance(self.start[0], zygote.ZygoteContext):
                claims.release(self, stop_if_unclaimed=False)
        return self.start

    def release_processes(self) -> None:
        """This loader starts no more process workers (``worker_type="auto"`` chose
        threads): the zygote may go if no other loader needs it (start/claims.py)."""
        claims.release(self)
