"""The in-process iterator (num_workers=0) and helpers shared with `_worker_iter.py`.

Iterators subclass torch's `_BaseDataLoaderIter`, so the sampler, the base seed drawn from
``generator``, pin-memory handling and torch's warnings are torch's own code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .engine.fetch import AllSkipped, Fetcher
from .errors import SkipLimitError
from .report import RunRecord, SkippedSample

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


SKIP_LIMIT = 64


class SkipGuard:
    """Stops ``on_error="skip"`` from skipping everything: SKIP_LIMIT failures in a row raise."""

    def __init__(self) -> None:
        self._run = 0
        self._first: SkippedSample | None = None

    def skipped(self, sample: SkippedSample) -> None:
        """A sample was left out; raises `SkipLimitError` at the limit."""
        if self._run == 0:
            self._first = sample
        self._run += 1
        if self._run >= SKIP_LIMIT and self._first is not None:
            first = self._first
            raise SkipLimitError(
                f"on_error='skip' left out {self._run} samples in a row without loading a "
                f"single one; the first was sample {first.index!r}: {first.error_type}: "
                f"{first.message}\n"
                "Why: skipping is for the odd corrupt file; when every sample fails, the "
                "cause is a bug or a wrong path, and skipping would go on forever.\n"
                f"Fix: load that sample in this process (dataset[{first.index!r}]) to see "
                "the error with its traceback.",
                first_index=first.index,
                first_error=f"{first.error_type}: {first.message}",
            )

    def delivered(self) -> None:
        """A batch with at least one sample arrived."""
        self._run = 0

    def record(self, record: RunRecord, samples: Iterable[SkippedSample]) -> None:
        """Log skipped samples, list them in the run's record, and check the limit."""
        for sample in samples:
            _LOG.warning(
                "skipped sample %r: %s: %s", sample.index, sample.error_type, sample.message
            )
            record.skipped.append(sample)
            self.skipped(sample)


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
            self._collate_fn, self._drop_last, skip_errors=loader._options.on_error == "skip",
        )  # fmt: skip
        self.record = RunRecord("in-process", ())
        self._guard = SkipGuard()

    def _next_data(self) -> Any:
        while True:
            index = self._next_index()  # may raise StopIteration
            try:
                data = self._fetcher.fetch(index)  # may raise StopIteration
            except AllSkipped:
                self._record_skips()
                continue
            except StopIteration:
                self._record_skips()
                raise
            except Exception as exc:
                add_note(exc, f"steadyload: raised in the main process {self._fetcher.where}")
                raise
            self._record_skips()
            self._guard.delivered()
            break
        if self._pin_memory:
            data = _pin_memory(data, self._pin_memory_device)
        return data

    def _record_skips(self) -> None:
        self._guard.record(self.record, self._fetcher.skipped)


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


