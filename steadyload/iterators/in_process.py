"""The in-process iterator (``num_workers=0``): torch's semantics, steadyload's notes.

Loads each batch in this process with the same fetch code as a worker (`engine/worker/fetch.py`),
so ``on_error="skip"``, ``sample_seeds`` (the caller's RNGs restored after each batch),
exception notes and checkpointing behave as with workers.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .._seeding import KeepCallerRngs, SampleSeeder
from ..device.feed import Taken
from ..engine.worker.fetch import ITERABLE, AllSkipped, Fetcher
from ..options import LoaderOptions
from ..resume.checkpoint import Checkpoints
from ..resume.progress import position_blobs
from .common import UNSET, EmptyBatches, SkipGuard, add_note, flat_indices, record_cut
from .feeding import Feeding, later
from .record import History, RunRecord


class InProcessIterator(Feeding, _BaseDataLoaderIter):
    """num_workers=0: load in this process, with torch's semantics and steadyload's notes."""

    def __init__(
        self,
        loader: DataLoader[Any],
        options: LoaderOptions,
        checkpoints: Checkpoints,
        history: History,
    ) -> None:
        super().__init__(loader)
        if self._timeout != 0:
            raise ValueError(
                f"timeout option needs num_workers > 0, got timeout={self._timeout} with "
                "num_workers=0: in-process loading cannot be interrupted. Set timeout=0 or "
                "use workers."
            )
        self._progress = checkpoints.begin_epoch(loader, self)
        self._seeder = SampleSeeder(int(self._base_seed)) if options.sample_seeds else None
        if self._seeder is not None:
            self._seeder.epoch = self._progress.epoch
        resume, self._progress.resume_streams = self._progress.resume_streams, None
        self._fetcher = Fetcher(
            self._dataset_kind,
            self._dataset,
            self._auto_collation,
            self._collate_fn,
            self._drop_last,
            skip_errors=options.on_error == "skip",
            seeder=self._seeder,
            position=position_blobs(resume).get(0) if resume is not None else None,
        )
        self._progress.in_process = self._fetcher.position
        self.record = RunRecord("in-process", None, (), history)
        self.record.ledger = self._ledger = checkpoints.ledger
        self.record.epoch = self._progress.epoch
        self._guard = SkipGuard()
        self._empty = EmptyBatches(self._collate_fn)
        self._ahead: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self._start_feed(options)

    def _next_data_timed(self) -> Any:
        ordinal, index, span, data = self._next_batch()
        self._hand(ordinal)
        self._handed(ordinal, index, span, data)
        return data

    def _take(self, block: bool) -> Taken | None:
        """For the device stage: the next batch, loaded now (never ahead: loading is this
        thread's own work, so nothing is ready before it is asked for)."""
        if not block:
            return None
        ordinal, index, span, data = self._next_batch()
        return Taken(
            data,
            later(self._hand, ordinal),
            None if span is not None else flat_indices(index),
            ordinal,
            after=later(self._handed, ordinal, index, span, data if span is not None else None),
        )

    def _next_batch(self) -> tuple[int, Any, Any, Any]:
        """The next batch, not yet counted as yielded: its ordinal, indices (None for a
        stream), its place in a stream (None for a map-style dataset) and the batch."""
        ordinal, index, data = self._ahead.popleft() if self._ahead else self._load_next()
        span = None
        if self._dataset_kind == ITERABLE:  # (its indices are torch's Nones)
            span, index = index, None
        if data is UNSET:  # every sample of the batch was skipped
            while not self._empty.ready:  # nothing loaded yet to copy the structure of
                try:
                    ahead = self._load_next()
                except StopIteration:
                    raise self._guard.nothing_loaded() from None
                self._ahead.append(ahead)
            data = self._empty.make()
        return ordinal, index, span, data

    def _hand(self, ordinal: int) -> Any:
        """The batch is yielded: it counts as consumed. Returns the undo."""
        self._progress.yielded.mark(ordinal)
        return functools.partial(self._progress.yielded.unmark, ordinal)

    def _handed(self, ordinal: int, index: Any, span: Any, data: Any) -> None:
        """Once yielded for good: the ledger's line."""
        if self._ledger is not None:
            batch = data if span is not None else None  # a stream's, for its keys
            step = self._progress.step_base + ordinal
            pid = os.getpid()
            self._ledger.step(step, index, -1, pid, "in-process", None, batch, None, span)

    def _load_next(self) -> tuple[int, Any, Any]:
        """The next batch with its ordinal and indices; ``UNSET`` for a batch whose samples
        all failed."""
        try:
            index = self._next_index()
        except StopIteration:
            self._end_epoch()
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
            return ordinal, index, UNSET
        except StopIteration:
            self._record_skips()
            if self._fetcher.cut is not None:
                record_cut(self.record, self._fetcher.cut)
            self._end_epoch()
            raise
        except Exception as exc:
            add_note(exc, f"steadyload: raised in the main process {self._fetcher.where}")
            raise
        self._record_skips()
        self.record.loaded(-1, self._fetcher.count, 0.0)  # (no worker: for rows_lost only)
        self._guard.delivered()
        self._empty.learn(data)
        if self._dataset_kind == ITERABLE:
            return ordinal, self._fetcher.span, data  # where it is in the stream, not indices
        return ordinal, index, data

    def _end_epoch(self) -> None:
        """The epoch ended: its position is kept as it is now (a state saved between epochs
        holds it), without keeping the fetcher, and with it the stream, alive."""
        self._progress.finished = True
        if self._ledger is not None:  # (and every step of it on disk)
            self._ledger.end_epoch(self._progress.step_base + self._progress.yielded.count)
        try:
            blob = self._fetcher.position()
        except Exception:  # said when a state is asked for: keep asking the fetcher
            return
        self._progress.in_process = lambda: blob

    def _record_skips(self) -> None:
        self._guard.record(self.record, self._fetcher.skipped)
