"""`Feed`: the device stage. Batches taken ahead of the training loop, moved to the device
on a thread and a stream of their own, and handed over in order.

The iterator hands the feed each batch *taken* but not yet *handed over* (`Taken`): its
place in the epoch's progress, the ledger's line and the end of the epoch are marked only
when the feed yields it, so ``state_dict()`` never counts a batch that is still on its way
(it is loaded again after a resume). The feed keeps up to ``device_prefetch`` batches
beyond the one it yields: it takes a batch ahead only when the iterator has one ready
(never waiting for one while a batch is there to yield).

On the feed's thread (`mover.Mover`), each batch is packed into one pinned buffer of the
pool (the copy that ``pin_memory`` makes), copied to the device on the feed's stream, and
passed through ``device_transform`` on that stream. The training loop's stream waits on the
event after it (no host wait), and every tensor it gets is marked used on that stream
(``record_stream``), so the caching allocator does not reuse it early; the pinned buffer
goes back to the pool with the event after its copy. With ``pin_memory=True`` alone the
thread pins the batch as torch's ``pin_memory`` does, and with ``device="cpu"`` it only
runs the transform.
"""

from __future__ import annotations

import collections
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from ..engine.interrupts import held_interrupts
from ..errors import WorkerHangError
from ..report import DeviceReport, SkippedSample
from .backends import Backend
from .mover import Job, Mover, Stats, Taken
from .pinned import PinnedPool
from .structure import map_tensors, tensors

__all__ = ["Feed", "Taken"]

STAGE_POLL_S = 0.1  # how often a wait for the feed's thread checks that it still runs


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
        self._stats = Stats()
        self._ahead: collections.deque[Job] = collections.deque()
        self._handing: tuple[Job, Callable[[], None] | None] | None = None
        pool = PinnedPool(backend, cap_bytes)
        self._mover = Mover(backend, pool, transform, pin_only, self._stats, depth)
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

    def _handed(self, job: Job) -> Any:
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
        job = Job(taken)
        self._ahead.append(job)
        if taken.end or taken.error is not None:
            job.done.set()
            return
        self._mover.submit(job)

    def _await(self, job: Job) -> None:
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

    def _failed(self, job: Job) -> Any:
        exc, job.error = job.error, None  # (no cycle through the job: see mover.py)
        assert exc is not None
        where = (
            f"steadyload: raised in {job.phase} on batch {job.taken.ordinal} "
            f"(samples {_samples(job.taken)}), in the training process on "
            f"{self._backend.device}"
        )
        skip = self._skip_ref() if self._skip_ref is not None else None
        if skip is None or job.phase != "device_transform":  # (skip is for the data's errors)
            exc.add_note(where)
            try:
                raise exc
            finally:
                del exc  # this frame is in its traceback
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


def _samples(taken: Taken) -> str:
    if taken.samples is None:
        return "of a stream: see the ledger for their keys"
    shown = ", ".join(repr(i) for i in taken.samples[:8])
    more = f", ... {len(taken.samples) - 8} more" if len(taken.samples) > 8 else ""
    return f"[{shown}{more}]"
