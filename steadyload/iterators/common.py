"""What both iterators share: the skip guard, empty batches, timing of next(), small helpers.

`SkipGuard` stops ``on_error="skip"`` from skipping forever; `EmptyBatches` makes the batch
yielded when every sample of one was skipped (the number of batches never changes: see
docs/design/resume.md); `TimedNext` measures the data-stall share for ``report()``.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterDataPipe, MapDataPipe

from ..engine.worker.torch_hooks import profiler_enabled
from ..errors import SkipLimitError
from ..report import SkippedSample, StreamCut, describe_cut
from .record import RunRecord

_LOG = logging.getLogger(__name__)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where notes are stored, not printed)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


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
            if first is not None
            else ""
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
            record.skip(sample)
            self.skipped(sample)


def record_cut(record: RunRecord, cut: StreamCut) -> None:
    """A worker's stream ended at a bad item: say so at WARNING and keep it in the report."""
    _LOG.warning("%s", describe_cut(cut))
    record.cut(cut)


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


UNSET = object()


class EmptyBatches:
    """What a batch whose every sample was skipped is yielded as (the count never changes).

    ``collate_fn([])`` when the collate function accepts an empty list; otherwise the
    structure of a batch that did load (`learn`), with no samples in it.
    """

    def __init__(self, collate_fn: Any) -> None:
        self._collate_fn = collate_fn
        self._collate_ok: bool | None = None
        self._template: Any = UNSET
        self._unmakeable = ""  # why no empty batch can be shaped like the loaded ones

    def learn(self, batch: Any) -> None:
        """A batch that loaded: remember its structure (once)."""
        if self._template is UNSET:
            try:
                self._template = empty_like(batch)
            except Exception as exc:  # e.g. nested tensors raise RuntimeError
                # Keep the words, not the exception: its traceback would hold this frame,
                # the iterator and its workers alive after the loop drops them.
                self._template = None
                self._unmakeable = f"{type(exc).__name__}: {exc}"

    @property
    def ready(self) -> bool:
        """Whether `make` can answer now (else a loaded batch must be `learn`ed first)."""
        if self._collate_ok is None:
            try:
                self._collate_fn([])
                self._collate_ok = True
            except Exception:
                self._collate_ok = False
        return self._collate_ok or self._template is not UNSET

    def make(self) -> Any:
        """An empty batch; call only when `ready`."""
        if self._collate_ok:
            return self._collate_fn([])
        if self._unmakeable:
            raise TypeError(
                f"{self._unmakeable}: every sample of a batch was skipped (on_error='skip'), and "
                "steadyload yields such a batch empty so that the number of batches never "
                "changes.\nFix: let your collate_fn accept an empty list and return an "
                "empty batch."
            ) from None
        return empty_like(self._template)


class TimedNext:
    """Mixin for the iterators: times each ``next()`` for the data-stall share (report.py),
    and opens torch's profiler range only while a profiler runs."""

    record: RunRecord
    _sampler_iter: Any
    _num_yielded: int
    _dataset_kind: int
    _IterableDataset_len_called: Any
    _dataset: Any
    _num_workers: int
    _drop_last: bool
    _feed: Any = None  # the device stage (device/feed.py; iterators/feeding.py), if any

    def __next__(self) -> Any:
        if profiler_enabled():
            return super().__next__()  # type: ignore[misc]  # torch's, with record_function
        # torch's __next__ without its record_function, which costs even with no profiler
        # (docs/design/figures.md#threads). Kept line for line.
        if self._sampler_iter is None:
            self._reset()  # type: ignore[attr-defined]  # torch's
        data = self._next_data()
        self._num_yielded += 1
        if (
            self._dataset_kind == 1  # _DatasetKind.Iterable
            and self._IterableDataset_len_called is not None
            and self._num_yielded > self._IterableDataset_len_called
        ):
            warn_msg = (
                f"Length of IterableDataset {self._dataset} was reported to be "
                f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                f"{self._num_yielded} samples have been fetched. "
            )
            if self._num_workers > 0:
                warn_msg += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples."
                )
            warnings.warn(warn_msg, stacklevel=2)
        return data

    def _next_data_timed(self) -> Any:
        raise NotImplementedError

    def _next_data(self) -> Any:
        called = time.perf_counter()
        feed = self._feed
        try:
            data = feed.next() if feed is not None else self._next_data_timed()
        except StopIteration:
            self.record.waited(called, time.perf_counter(), delivered=False)
            if self.record.streams_cut and not self.record.finished:
                self._count_rows_lost()
            raise
        self.record.waited(called, time.perf_counter())
        return data

    def _count_rows_lost(self) -> None:
        """At the end of an epoch whose streams were cut: how many rows they lost, when
        ``len(dataset)`` tells (and no partial batch was dropped)."""
        rows = None
        if not self._drop_last:
            try:
                rows = len(self._dataset)
            except TypeError:  # a stream without __len__
                pass
        self.record.ended(rows)
        lost = self.record.rows_lost
        _LOG.warning(
            "the epoch ended with %d worker stream(s) cut at a bad item: %s",
            len(self.record.streams_cut),
            f"{lost} of the dataset's {rows} rows were lost (report().streams_cut says where)"
            if lost is not None
            else "how many rows were lost is unknown (the dataset has no len()); "
            "report().streams_cut says where",
        )


class DatasetError(Exception):
    """Internal wrapper: a dataset exception to re-raise as is (the iterator stays usable)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc


def flat_indices(indices: Any) -> list[Any]:
    """A task's indices as a list (a batch's list, a tensor's values, or one index)."""
    if isinstance(indices, (list, tuple)):
        return list(indices)
    if isinstance(indices, torch.Tensor):
        return list(indices.tolist())
    return [indices]


def refuse_datapipes(dataset: object) -> None:
    """Refuse a DataPipe: its workers need sharding and a shared shuffle seed, which
    steadyload's workers do not apply, so every worker would yield the whole pipe."""
    if isinstance(dataset, (IterDataPipe, MapDataPipe)):
        pipe = getattr(dataset, "_datapipe", dataset)  # torch's serialization wrapper
        raise TypeError(
            f"steadyload does not run a {type(pipe).__qualname__} (a torch DataPipe) in "
            "worker processes: DataPipes shard themselves across workers through torch's "
            "own worker loop, which steadyload's workers do not run, so every worker "
            "would yield every sample.\nFix: use num_workers=0, or an IterableDataset that "
            "splits its stream with get_worker_info() (DataPipes are deprecated in torch)."
        )
