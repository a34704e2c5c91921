"""The in-process iterator (num_workers=0) and helpers shared with `_worker_iter.py`.

Iterators subclass torch's `_BaseDataLoaderIter`, so the sampler, the base seed drawn from
``generator``, pin-memory handling and torch's warnings are torch's own code.
"""

from __future__ import annotations

import collections
import logging
import pickle
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import state
from ._seeding import KeepCallerRngs, SampleSeeder
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

    def nothing_loaded(self) -> SkipLimitError:
        """The error for an epoch that ended without a single sample loaded."""
        first = self._first
        where = (
            f"; the first was sample {first.index!r}: {first.error_type}: {first.message}"
            if first is not None else ""
        )
        return SkipLimitError(
            f"on_error='skip' left out every sample of the epoch{where}\n"
            "Why: with nothing loaded there is no batch to yield; the cause is a bug or a "
            "wrong path rather than the odd corrupt file.\n"
            "Fix: load one sample in this process (dataset[i]) to see the error.",
            first_index=first.index if first is not None else None,
            first_error=f"{first.error_type}: {first.message}" if first is not None else "",
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


def empty_like(batch: Any) -> Any:
    """``batch``'s structure with no samples: zero-length tensors, empty lists of items.

    Raises:
        TypeError: for a batch type whose empty form steadyload cannot know.
    """
    if isinstance(batch, torch.Tensor):
        return batch.new_empty((0, *batch.shape[1:]))
    if isinstance(batch, np.ndarray):
        return np.empty((0, *batch.shape[1:]), dtype=batch.dtype)
    if isinstance(batch, Mapping):
        items = {k: empty_like(v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(empty_like(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        nested = (torch.Tensor, np.ndarray, Mapping, list, tuple)
        if any(isinstance(v, nested) for v in batch):  # collated fields: one per element
            return type(batch)(empty_like(v) for v in batch)
        return type(batch)()  # a batch of plain items (strings, numbers): no items
    raise TypeError(
        f"steadyload cannot make an empty batch shaped like a {type(batch).__qualname__}"
    )


_UNSET = object()


class EmptyBatches:
    """What a batch whose every sample was skipped is yielded as (the count never changes).

    ``collate_fn([])`` when the collate function accepts an empty list; otherwise the
    structure of a batch that did load (`learn`), with no samples in it.
    """

    def __init__(self, collate_fn: Any) -> None:
        self._collate_fn = collate_fn
        self._collate_ok: bool | None = None
        self._template: Any = _UNSET

    def learn(self, batch: Any) -> None:
        """A batch that loaded: remember its structure (once)."""
        if self._template is _UNSET:
            try:
                self._template = empty_like(batch)
            except TypeError as exc:
                self._template = exc

    @property
    def ready(self) -> bool:
        """Whether `make` can answer now (else a loaded batch must be `learn`ed first)."""
        if self._collate_ok is None:
            try:
                self._collate_fn([])
                self._collate_ok = True
            except Exception:
                self._collate_ok = False
        return self._collate_ok or self._template is not _UNSET

    def make(self) -> Any:
        """An empty batch; call only when `ready`."""
        if self._collate_ok:
            return self._collate_fn([])
        template = self._template
        if isinstance(template, TypeError):
            raise TypeError(
                f"{template}: every sample of a batch was skipped (on_error='skip'), and "
                "steadyload yields such a batch empty so that the number of batches never "
                "changes.\nFix: let your collate_fn accept an empty list and return an "
                "empty batch."
            ) from None
        return empty_like(template)


class TimedNext:
    """Mixin for the iterators: times each ``next()`` for the data-stall share (report.py)."""

    record: RunRecord

    def _next_data_timed(self) -> Any:
        raise NotImplementedError

    def _next_data(self) -> Any:
        called = time.perf_counter()
        try:
            data = self._next_data_timed()
        except StopIteration:
            self.record.waited(called, time.perf_counter(), delivered=False)
            raise
        self.record.waited(called, time.perf_counter())
        return data


class _InProcessIter(TimedNext, _BaseDataLoaderIter):
    """num_workers=0: load in this process, with torch's semantics and steadyload's notes."""

    # Set by state.begin_epoch: batches yielded, epoch over, a stream's saved position.
    _sl_progress: state.Progress
    _sl_finished: bool
    _sl_stream_resume: dict[str, Any] | None

    def __init__(self, loader: DataLoader[Any]) -> None:
        super().__init__(loader)
        if self._timeout != 0:
            raise ValueError(
                f"timeout option needs num_workers > 0, got timeout={self._timeout} with "
                "num_workers=0: in-process loading cannot be interrupted. Set timeout=0 or "
                "use workers."
            )
        self._sl_epoch = state.begin_epoch(loader, self)
        resume = self._sl_stream_resume
        if resume is not None:
            dataset: Any = self._dataset
            dataset.load_state_dict(pickle.loads(resume["workers"][-1]))
        options = loader._options
        self._seeder = SampleSeeder(int(self._base_seed)) if options.sample_seeds else None
        if self._seeder is not None:
            self._seeder.epoch = self._sl_epoch
        self._fetcher = Fetcher(
            self._dataset_kind, self._dataset, self._auto_collation,
            self._collate_fn, self._drop_last, skip_errors=options.on_error == "skip",
            seeder=self._seeder,
        )  # fmt: skip
        self.record = RunRecord("in-process", ())
        self._guard = SkipGuard()
        self._empty = EmptyBatches(self._collate_fn)
        self._ahead: collections.deque[tuple[int, Any]] = collections.deque()

    def _next_data_timed(self) -> Any:
        ordinal, data = self._ahead.popleft() if self._ahead else self._load_next()
        if data is _UNSET:  # every sample of the batch was skipped
            while not self._empty.ready:  # nothing loaded yet to copy the structure of
                try:
                    ahead = self._load_next()
                except StopIteration:
                    raise self._guard.nothing_loaded() from None
                self._ahead.append(ahead)
            data = self._empty.make()
        self._sl_progress.mark(ordinal)
        if self._pin_memory:
            data = _pin_memory(data, self._pin_memory_device)
        return data

    def _load_next(self) -> tuple[int, Any]:
        """The next batch with its ordinal; ``_UNSET`` for a batch whose samples all failed."""
        try:
            index = self._next_index()
        except StopIteration:
            self._sl_finished = True
            raise
        ordinal = self._sampler_iter.ordinal
        try:
            if self._seeder is not None:
                with KeepCallerRngs():
                    data = self._fetcher.fetch(index)
            else:
                data = self._fetcher.fetch(index)  # may raise StopIteration
        except AllSkipped:
            self._record_skips()
            return ordinal, _UNSET
        except StopIteration:
            self._record_skips()
            self._sl_finished = True
            raise
        except Exception as exc:
            add_note(exc, f"steadyload: raised in the main process {self._fetcher.where}")
            raise
        self._record_skips()
        self._guard.delivered()
        self._empty.learn(data)
        return ordinal, data

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


