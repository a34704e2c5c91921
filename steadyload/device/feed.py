"""`Feed`: the device stage. Batches taken ahead of the training loop, moved to the device
on a thread and a stream of their own, and handed over in order.

The iterator hands the feed each batch *taken* but not yet *handed over* (`Taken`): its
place in the epoch's progress, the ledger's line and the end of the epoch are marked only
when the feed yields it, so ``state_dict()`` never counts a batch that is still on its way
(it is loaded again after a resume). The feed keeps up to ``device_prefetch`` batches
beyond the one it yields: it takes a batch ahead only when the iterator has one ready
(never waiting for one while a batch is there to yield).

On the feed's thread, each batch is packed into one pinned buffer of the pool (the copy
that ``pin_memory`` makes), copied to the device on the feed's stream, and passed through
``device_transform`` on that stream. The training loop's stream waits on the event after it
(no host wait), and every tensor it gets is marked used on that stream (``record_stream``),
so the caching allocator does not reuse it early; the pinned buffer goes back to the pool
with the event after its copy. With ``pin_memory=True`` alone the thread pins the batch as
torch's ``pin_memory`` does, and with ``device="cpu"`` it only runs the transform.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory

from ..engine.interrupts import held_interrupts
from ..errors import WorkerHangError
from ..report import DeviceReport, SkippedSample
from .backends import Backend, Event
from .pinned import PinnedPool, nbytes, pack, packed_size
from .structure import map_tensors, tensors

STAGE_POLL_S = 0.1  # how often a wait for the feed's thread checks that it still runs


@dataclass(slots=True)
class Taken:
    """A batch the iterator took for the feed, not yet handed over."""

    data: Any = None
    hand: Callable[[], Callable[[], None] | None] | None = None
    """Marks it handed over (progress, ledger); returns the undo (a Ctrl-C at the last
    moment keeps the batch for the next call)."""
    samples: list[Any] | None = None
    """Its dataset indices (None for a stream's batch)."""
    ordinal: int = -1
    """Its place in the epoch (the sampler's count, from 0)."""
    error: BaseException | None = None
    """Raised at its turn instead of a batch (a dataset error in a worker)."""
    end: bool = False
    """The end of the epoch: `hand` finishes it, then StopIteration."""
    after: Callable[[], None] | None = None
    """Runs once the batch is handed over for good (the ledger's line)."""


@dataclass(slots=True)
class _Stats:
    batches: int = 0
    wait_s: float = 0.0  # the training loop's waits for the stage
    pack_s: float = 0.0  # the stage thread's packing (or pinning)
    transform_s: float = 0.0
    copy_s: float = 0.0  # the copies' device time (from pinned buffers)
    copied_bytes: int = 0
    skipped_batches: int = 0


@dataclass(slots=True)
class _Job:
    taken: Taken
    done: threading.Event = field(default_factory=threading.Event)
    began: float = 0.0
    out: Any = None
    error: BaseException | None = None
    ready: Event | None = None


class Feed:
    """The device stage of one iterator (see the module's docstring)."""

    def __init__(
        self,
        take: Callable[[bool], Taken | None],
        backend: Backend,
        *,
        depth: int,
        transform: Callable[[Any], Any] | None,
        pin_only: bool,
        cap_bytes: int,
        skip: Callable[[list[SkippedSample]], Any] | None,
        hang_timeout: float | None,
        keep_thread: bool = False,
    ) -> None:
        """``take(block)``: the iterator's next batch (None: none ready and ``block`` is
        False); ``skip``: with ``on_error="skip"``, records a failed transform's samples
        and returns the empty batch to yield instead (None: errors are raised);
        ``keep_thread``: the thread outlives the epoch's end (persistent workers)."""
        # Weak: the iterator holds the feed, and a cycle would keep its workers alive until
        # the garbage collector ran.
        self._take_ref = weakref.WeakMethod(take)
        self._skip_ref = weakref.WeakMethod(skip) if skip is not None else None
        self._backend = backend
        self._depth = depth
        self._keep_thread = keep_thread
        self._hang_timeout = hang_timeout
        self._pool = PinnedPool(backend, cap_bytes)
        self._stats = _Stats()
        self._ahead: collections.deque[_Job] = collections.deque()
        self._handing: tuple[_Job, Callable[[], None] | None] | None = None
        self._mover = _Mover(backend, self._pool, transform, pin_only, self._stats, depth)
        weakref.finalize(self, self._mover.stop)

    # -- the training loop's side ----------------------------------------------------------
    def next(self) -> Any:
        """The next batch, on the device; StopIteration at the epoch's end."""
        ahead = self._ahead
        if not ahead:
            self._submit(self._take_now(block=True))
        self._top_up()
        job = ahead[0]
        began = time.perf_counter()
        self._await(job)  # a Ctrl-C here leaves the batch at the head
        self._stats.wait_s += time.perf_counter() - began
        # From here a Ctrl-C is held; one that came puts the batch back (`_keep`).
        with held_interrupts(before_delivery=self._keep):
            ahead.popleft()
            out = self._handed(job)
        self._handing = None
        if job.taken.after is not None:
            job.taken.after()
        self._mover.settle_timings()
        return out

    def _handed(self, job: _Job) -> Any:
        taken = job.taken
        if taken.end:
            if taken.hand is not None:
                taken.hand()
            if not self._keep_thread:  # the iterator is done (no persistent workers)
                self._mover.stop()
            raise StopIteration
        if taken.error is not None:
            raise taken.error
        out = job.out
        if job.error is not None:
            out = self._failed(job)  # raises, or the empty batch (skip)
        elif job.ready is not None:
            stream = self._backend.wait(job.ready)
            for t in tensors(out):
                self._backend.keep_for(t, stream)
        self._handing = (job, taken.hand() if taken.hand is not None else None)
        self._stats.batches += 1
        return out

    def _keep(self) -> None:
        """A Ctrl-C came while a batch was handed over: undo, and yield it next time."""
        if self._handing is None:
            return
        job, undo = self._handing
        self._handing = None
        if undo is not None:
            undo()
        self._stats.batches -= 1
        self._ahead.appendleft(job)

    def _take_now(self, block: bool) -> Taken | None:
        take = self._take_ref()
        if take is None:  # the iterator is gone
            raise StopIteration
        try:
            return take(block)
        except (StopIteration, KeyboardInterrupt):
            raise
        except BaseException as exc:
            if block and not self._ahead:
                raise
            return Taken(error=exc)  # raised at its turn, after the batches before it

    def _top_up(self) -> None:
        ahead = self._ahead
        while len(ahead) <= self._depth and not (ahead[-1].taken.end or ahead[-1].taken.error):
            taken = self._take_now(block=False)
            if taken is None:
                return
            self._submit(taken)

    def _submit(self, taken: Taken | None) -> None:
        assert taken is not None
        job = _Job(taken)
        self._ahead.append(job)
        if taken.end or taken.error is not None:
            job.done.set()
            return
        self._mover.submit(job)

    def _await(self, job: _Job) -> None:
        """Until the feed's thread has done ``job``: bounded by ``hang_timeout``, and by
        the thread running at all."""
        while not job.done.wait(STAGE_POLL_S):
            if not self._mover.thread.is_alive():
                raise RuntimeError(
                    "steadyload's device stage thread ended unexpectedly; the batch it held "
                    "was not delivered (this is a bug in steadyload: please report it)"
                )
            limit = self._hang_timeout
            if limit is not None and job.began and time.perf_counter() - job.began > limit:
                frame = sys._current_frames().get(self._mover.thread.ident or -1)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
                raise WorkerHangError(
                    f"the device stage spent over {limit:g} s (hang_timeout) on batch "
                    f"{job.taken.ordinal} (samples {_samples(job.taken)}) in the training "
                    f"process; its thread's stack:\n{stack}"
                    "Fix: look at device_transform (the stack above), or raise hang_timeout.",
                    timeout_s=limit,
                    sample_indices=job.taken.samples or (),
                )

    def _failed(self, job: _Job) -> Any:
        exc = job.error
        assert exc is not None
        where = (
            f"steadyload: raised in device_transform on batch {job.taken.ordinal} "
            f"(samples {_samples(job.taken)}), in the training process on "
            f"{self._backend.device}"
        )
        skip = self._skip_ref() if self._skip_ref is not None else None
        if skip is None:
            exc.add_note(where)
            raise exc
        text = str(exc).splitlines()[0] if str(exc) else ""
        skipped = [
            SkippedSample(i, type(exc).__name__, f"{text} (in device_transform)")
            for i in (job.taken.samples if job.taken.samples is not None else [job.taken.ordinal])
        ]
        self._stats.skipped_batches += 1
        empty = skip(skipped)
        device = self._backend.device
        return map_tensors(empty, lambda t: t.to(device)) if self._backend.copies else empty

    def reset(self) -> None:
        """A new epoch: what was taken ahead for the last one is dropped, never handed."""
        self._ahead.clear()

    @property
    def mover_report(self) -> Callable[[], DeviceReport]:
        """The stage's figures so far (with its pinned pool's), as a function that does not
        keep this feed alive (for the run's record, which outlives the iterator)."""
        return self._mover.report

    def close(self) -> None:
        """Stop the thread (bounded) and release the pool once its copies are done."""
        self._ahead.clear()
        self._mover.stop()


class _Mover:
    """The feed's thread and what it uses, and its figures. It holds nothing of the
    iterator or the feed, so that an iterator the loop drops is collected at once, its feed
    with it, which stops the thread (`weakref.finalize`); the run's record keeps `report`."""

    def __init__(
        self,
        backend: Backend,
        pool: PinnedPool,
        transform: Callable[[Any], Any] | None,
        pin_only: bool,
        stats: _Stats,
        depth: int,
    ) -> None:
        self.backend, self.pool, self.transform = backend, pool, transform
        self.pin_only, self.stats, self.depth = pin_only, stats, depth
        self.jobs: collections.deque[_Job | None] = collections.deque()
        self.wake = threading.Condition()
        # (figure, start, end): device times to add once their events are done
        self.timings: collections.deque[tuple[str, Event, Event]] = collections.deque()
        self.thread = threading.Thread(target=self._run, name="steadyload-feed", daemon=True)
        self.thread.start()

    def submit(self, job: _Job) -> None:
        """Queue ``job`` for the thread."""
        with self.wake:
            self.jobs.append(job)
            self.wake.notify()

    def stop(self) -> None:
        """Drop the queued jobs, end the thread (waits up to 5 s for the batch it is on),
        then release the pool (waiting for the copies still running)."""
        with self.wake:
            self.jobs.clear()
            self.jobs.append(None)
            self.wake.notify()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)
        if not self.thread.is_alive():
            self.pool.close()

    def settle_timings(self) -> None:
        """Add the transform's device time of the batches whose events are done."""
        timings = self.timings
        stats = self.stats
        while timings and timings[0][2].query():
            figure, start, end = timings.popleft()
            setattr(stats, figure, getattr(stats, figure) + self.backend.elapsed_s(start, end))

    def report(self) -> DeviceReport:
        """The stage's figures so far (with its pinned pool's)."""
        self.settle_timings()
        pool = self.pool.snapshot()
        s = self.stats
        return DeviceReport(
            device=str(self.backend.device) + (" (pinned host memory)" if self.pin_only else ""),
            prefetch=self.depth,
            batches=s.batches,
            wait_s=s.wait_s,
            pack_s=s.pack_s,
            transform_s=s.transform_s,
            copy_s=s.copy_s,
            copied_bytes=s.copied_bytes,
            skipped_batches=s.skipped_batches,
            pinned_bytes=pool.held_bytes,
            pinned_peak_bytes=pool.peak_bytes,
            pinned_cap_bytes=pool.cap_bytes,
            pinned_buffers=pool.buffers,
            pinned_allocations=pool.allocations,
            pinned_reuses=pool.reuses,
            unpinned_batches=pool.unpinned,
            pool_waits=pool.waits,
        )

    def _run(self) -> None:
        failure: BaseException | None = None
        try:
            self.backend.bind()
        except BaseException as exc:  # every job fails with why
            failure = exc
        while True:
            with self.wake:
                while not self.jobs:
                    self.wake.wait()
                job = self.jobs.popleft()
            if job is None:
                return
            job.began = time.perf_counter()
            try:
                if failure is not None:
                    raise failure
                job.out = self._move(job)
            except BaseException as exc:
                job.error = exc
            finally:
                job.done.set()

    def _move(self, job: _Job) -> Any:
        batch, backend, stats = job.taken.data, self.backend, self.stats
        job.taken.data = None  # the host batch goes once moved (its shared memory too)
        began = time.perf_counter()
        if not backend.copies:  # pin_memory=True alone, or device="cpu"
            out = pin_memory(batch) if self.pin_only else map_tensors(batch, lambda t: t)
            stats.pack_s += time.perf_counter() - began
            return self._transformed(out, job)
        host = tensors(batch)
        buffer = self.pool.take(packed_size([nbytes(t) for t in host]))
        with backend.side_stream():
            if buffer is None:  # bigger than the cap: from unpinned memory (waits for it)
                out = map_tensors(batch, lambda t: t.to(backend.device))
            else:
                views = iter(pack(host, buffer))
                start = backend.record()
                out = map_tensors(batch, lambda t: backend.to_device(next(views)))
                copied = backend.record()
                self.pool.give_back(buffer, copied)  # reused once this event is done
                self.timings.append(("copy_s", start, copied))
                stats.copied_bytes += sum(nbytes(t) for t in host)
        stats.pack_s += time.perf_counter() - began
        return self._transformed(out, job)

    def _transformed(self, out: Any, job: _Job) -> Any:
        backend = self.backend
        with backend.side_stream():
            if self.transform is not None:
                start = backend.record()
                out = self.transform(out)
                self.timings.append(("transform_s", start, backend.record()))
            job.ready = backend.record()
        return out


def _samples(taken: Taken) -> str:
    if taken.samples is None:
        return "of a stream: see the ledger for their keys"
    shown = ", ".join(repr(i) for i in taken.samples[:8])
    more = f", ... {len(taken.samples) - 8} more" if len(taken.samples) > 8 else ""
    return f"[{shown}{more}]"
