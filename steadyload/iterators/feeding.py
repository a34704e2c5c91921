"""The iterators' side of the device stage (device/feed.py): batches taken without being
handed over, and handed over when the stage yields them.

Without a stage (no ``device=``, no pinning) an iterator takes and hands over in one step,
as it always has; with one, ``next()`` goes through the stage (`common.TimedNext`), which
calls back `_take` (ahead, when a batch is ready) and each batch's `Taken.hand` when it
yields it.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..device.feed import Feed, Taken
from ..device.target import feed_for, pinned_cap
from ..engine.interrupts import held_interrupts
from ..engine.worker.fetch import ITERABLE
from ..options import LoaderOptions
from ..report import SkippedSample
from .common import DatasetError, EmptyBatches, SkipGuard, TimedNext, flat_indices
from .delivery import commit, record_step, take_back
from .record import RunRecord

_EXIT_REPORT_S = 2.0
"""How long the epoch's end waits for the death of a worker that has exited (or is exiting)
but whose `Died` has not come yet (its fork server reports it late). [Unit: second]"""


def later(method: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """``method(*args)`` to call later, without keeping its object (the iterator) alive:
    the feed holds these, and the iterator holds the feed."""
    ref = weakref.WeakMethod(method)

    def call() -> Any:
        bound = ref()
        return bound(*args) if bound is not None else None

    return call


class Feeding(TimedNext):
    """Mixin for both iterators: ``next()`` through the device stage, when there is one."""

    _feed: Feed | None = None
    _guard: SkipGuard
    _empty: EmptyBatches
    _pin_memory: bool
    _persistent_workers: bool

    def _start_feed(self, options: LoaderOptions) -> None:
        """The stage this iterator's batches go through, if any (device/target.py)."""
        self._feed = feed_for(
            options.device,
            self._pin_memory,
            self._take,
            depth=options.device_prefetch,
            transform=options.device_transform,
            cap_bytes=pinned_cap(options.pinned_memory_limit_bytes),
            skip=self._skip_batch if options.on_error == "skip" else None,
            hang_timeout=options.hang_timeout,
            keep_thread=bool(self._persistent_workers),
        )
        if self._feed is not None:
            self.record.device = self._feed.mover_report  # (not the feed: see feed.py)

    def _take(self, block: bool) -> Taken | None:
        """The next batch, taken but not handed over; None: ``block`` is False and none is
        ready. Raises what the batch raises (a dataset error, a fatal one)."""
        raise NotImplementedError

    def _skip_batch(self, samples: list[SkippedSample]) -> Any:
        """A batch whose ``device_transform`` raised, with ``on_error="skip"``: its samples
        are left out (recorded as skipped) and it is yielded empty, as a batch whose every
        sample failed in a worker is."""
        self._guard.record(self.record, samples)
        return self._empty.make()  # (ready: the batch itself loaded, its structure is known)


class WorkerFeeding(Feeding):
    """`Feeding._take` for the multi-worker iterator (iterators/workers.py)."""

    record: RunRecord
    _pool: Any
    _error: BaseException | None
    _stash: Any
    _handing: Any
    _progress: Any
    _ledger: Any
    _scaling: Any
    _dataset_kind: int
    _prefetch_factor: int
    _ended: dict[int, bytes | None]
    _recovery: Any
    _outcomes: Any
    # The iterator's own steps (iterators/workers.py):
    _shutdown_workers: Callable[[], None]
    _hold_back: Callable[[], None]
    _next_data_inner: Callable[[bool], Any]
    _try_put_index: Callable[..., bool]

    def _read_last_events(self) -> None:
        """Before the epoch's workers stop: the events already on their way (a worker that
        died after its last task, an announcement), so that none goes unsaid."""
        pool = self._pool
        if pool is None or not pool.running:
            return
        self._recovery.epoch_over = True
        deadline = time.monotonic() + _EXIT_REPORT_S
        timeout_s = 0.0
        try:
            while True:
                for worker_id, event in pool.wait(timeout_s):
                    self._outcomes.on_event(pool, worker_id, event)
                if not (pool.running and pool.exit_unreported()) or time.monotonic() > deadline:
                    return
                timeout_s = 0.05  # its fork server has not reported it yet: a moment more
        finally:
            self._recovery.epoch_over = False

    def _take(self, block: bool) -> Taken | None:
        if self._pool is not None and not self._pool.running:
            self._shutdown_workers()
        if self._error is not None:
            raise self._error
        failure: BaseException | None = None
        try:
            with held_interrupts(before_delivery=self._hold_back):
                stash, self._stash = self._stash, None
                got = stash if stash is not None else self._next_data_inner(block)
                if got is not None:
                    self._handing = (*got, None)  # taken back by a Ctrl-C: nothing to undo
            self._handing = None
        except StopIteration:
            ended = dict(self._ended)
            return Taken(end=True, hand=later(self._finish_epoch, ended))
        except KeyboardInterrupt:
            raise
        except DatasetError as wrapped:
            failure = wrapped.exc
        except BaseException as exc:
            self._error = exc  # worker death, hang, time-out: stop the workers now
            self._shutdown_workers()
            raise
        if failure is not None:
            try:  # raised outside the handler (see workers.py: no cycle through __context__)
                raise failure
            finally:
                del failure
        if got is None:
            return None
        data, task = got
        stream = self._dataset_kind == ITERABLE
        samples = None if stream else flat_indices(task.indices)
        return Taken(
            data,
            later(self._hand, task),
            samples,
            task.ordinal,
            after=later(self._handed, task, data if stream else None),
        )

    def _finish_epoch(self, ended: dict[int, bytes | None]) -> None:
        """The epoch's end is handed over: its streams' ends (``ended``), and the ledger's."""
        self._progress.ended = ended
        self._progress.finished = True
        if self._ledger is not None:
            self._ledger.end_epoch(self._progress.step_base + self._progress.yielded.count)

    def _hand(self, task: Any) -> Any:
        """``task``'s batch is yielded by the stage: it counts as consumed. Returns the undo
        (a Ctrl-C at the last moment keeps the batch)."""
        before = commit(self._progress, task, self._dataset_kind == ITERABLE)
        return functools.partial(take_back, self._progress, task, before)

    def _handed(self, task: Any, stream: Any) -> None:
        """Once handed over for good: the ledger's line (``stream``: a stream's batch, for
        its samples' keys), and a grown remote pool filled."""
        if self._ledger is not None:
            record_step(self._ledger, self._progress, task, self._pool, self.record, stream)
        if self._scaling is not None and self._pool is not None:
            for _ in range(self._scaling.after_batch(self._pool) * self._prefetch_factor):
                self._try_put_index()
