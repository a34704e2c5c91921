"""`steadyload.DataLoader`: torch's DataLoader, with steadyload's supervised workers.

The class subclasses `torch.utils.data.DataLoader`, so argument checking, samplers,
``len()``, the persistent-iterator logic and ``isinstance`` checks in training frameworks
are torch's own; only the iterators differ (`_iterators.py`). steadyload's own options are
keyword-only, after torch's, and are collected in `LoaderOptions`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.utils.data

from . import start
from ._iterators import _InProcessIter, _WorkerIter
from .report import LoaderReport, RunRecord

_T_co = TypeVar("_T_co", covariant=True)


@dataclass(frozen=True, slots=True)
class LoaderOptions:
    """steadyload-only settings of one loader (torch's arguments stay on the loader)."""

    start_method: str = "auto"
    """How workers start: "auto" (forkserver on Linux, else spawn), "forkserver", "spawn"
    or "fork". torch's ``multiprocessing_context``, when given, takes precedence."""

    def __post_init__(self) -> None:
        if self.start_method not in start.START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(map(repr, start.START_METHODS))}, "
                f"got {self.start_method!r}"
            )


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in `torch.utils.data.DataLoader` whose workers are supervised and fork-safe.

    Takes torch's arguments with torch's meaning and yields the same batches (for the same
    ``generator`` seed, also the same random values drawn inside workers). With
    ``num_workers > 0`` the workers are steadyload's: started with forkserver by default
    (torch, the steadyload worker and the dataset's module preloaded in the fork server),
    watched through their process sentinels so that a death is reported at once as
    `steadyload.WorkerDiedError` naming the worker, its exit signal and the samples it held,
    and batches cross over in pooled shared memory.

    Args (steadyload-only, keyword-only):
        start_method: "auto" (default: forkserver on Linux, spawn elsewhere), "forkserver",
            "spawn" or "fork". fork is refused while a CUDA/ROCm context exists, because
            forked workers then deadlock. An explicit ``multiprocessing_context`` wins.

    Raises:
        ValueError: for the argument combinations torch rejects, with torch's messages.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: torch.utils.data.Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: torch.utils.data.Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: multiprocessing.context.BaseContext | str | None = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        start_method: str = "auto",
    ) -> None:
        options = LoaderOptions(start_method=start_method)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self._options = options
        self._start: tuple[multiprocessing.context.BaseContext, start.StartInfo] | None = None
        self._last_run: RunRecord | None = None
        if num_workers > 0 and not getattr(multiprocessing.current_process(), "_inheriting", False):
            # Start the fork server now, so that its imports overlap with the caller's
            # set-up (building the model). Not while this process is itself a worker
            # importing the main script: a loader built at top level is harmless there.
            self._start_context()

    def _start_context(self) -> tuple[multiprocessing.context.BaseContext, start.StartInfo]:
        """The workers' context and how it was chosen (decided once per loader)."""
        explicit = self.multiprocessing_context
        if self._start is None or (explicit is not None and self._start[0] is not explicit):
            module = type(self.dataset).__module__
            self._start = start.resolve_context(self._options.start_method, explicit, module)
        return self._start

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return _InProcessIter(self)
        self.check_worker_number_rationality()
        iterator = _WorkerIter(self)
        self._last_run = iterator.record
        return iterator

    def report(self) -> LoaderReport:
        """How the latest run's workers started: start method, fork-server preloads (and
        which of them failed to import), each worker's pid and start time.

        Cheap; safe to call at any time, also while iterating or after the run.
        """
        if self._last_run is not None:
            return self._last_run.to_report()
        info = self._start[1] if self._start is not None else None
        return LoaderReport(
            start_method=info.method if info else "in-process",
            preload_requested=info.preload if info else (),
            preload_missing=None,
            workers=(),
        )
