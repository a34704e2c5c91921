"""`Mover`: the device stage's thread (feed.py) and what it uses: batches packed into
pinned buffers, copied to the device on the stage's stream, passed through
``device_transform``; and the stage's figures. `Taken`: what the iterator hands the stage."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory

from ..report import DeviceReport
from .backends import Backend, Event
from .pinned import PinnedPool, nbytes, pack, packed_size
from .structure import map_tensors, tensors


@dataclass(slots=True)
class Taken:
    """A batch the iterator took for the feed, not yet handed over."""

    data: Any = None
    hand: Callable[[], Callable[[], None] | None] | None = None
    """Marks it handed over (consumed, in the epoch's progress); returns the undo (a
    Ctrl-C at the last moment keeps the batch for the next call)."""
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
class Stats:
    """The stage's running figures (`Mover.report` turns them into a `DeviceReport`)."""

    batches: int = 0
    wait_s: float = 0.0  # the training loop's waits for the stage
    pack_s: float = 0.0  # the stage thread's packing (or pinning)
    transform_s: float = 0.0
    copy_s: float = 0.0  # the copies' device time (from pinned buffers)
    copied_bytes: int = 0
    skipped_batches: int = 0


@dataclass(slots=True)
class Job:
    """One batch on its way: what the thread made of it, and when it was done."""

    taken: Taken
    done: threading.Event = field(default_factory=threading.Event)
    began: float = 0.0
    out: Any = None
    error: BaseException | None = None
    phase: str = "pinning"  # what the thread was doing (named if it raises)
    ready: Event | None = None


class Mover:
    """The feed's thread and what it uses, and its figures. It holds nothing of the
    iterator or the feed, so that an iterator the loop drops is collected at once, its feed
    with it, which stops the thread (`weakref.finalize`); the run's record keeps `report`."""

    def __init__(
        self,
        backend: Backend,
        pool: PinnedPool,
        transform: Callable[[Any], Any] | None,
        pin_only: bool,
        stats: Stats,
        depth: int,
    ) -> None:
        self.backend, self.pool, self.transform = backend, pool, transform
        self.pin_only, self.stats, self.depth = pin_only, stats, depth
        self.jobs: collections.deque[Job | None] = collections.deque()
        self.wake = threading.Condition()
        # (figure, start, end): device times to add once their events are done
        self.timings: collections.deque[tuple[str, Event, Event]] = collections.deque()
        self.thread = threading.Thread(target=self._run, name="steadyload-feed", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
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
        """Add the device time of the copies and transforms whose events are done."""
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
        failure = ""
        try:
            self.backend.bind()
        except BaseException as exc:  # every job fails with why (kept as words: see below)
            failure = f"{type(exc).__name__}: {exc}"
        while True:
            with self.wake:
                while not self.jobs:
                    self.wake.wait()
                job = self.jobs.popleft()
            if job is None:
                return
            job.began = time.perf_counter()
            try:
                if failure:
                    raise RuntimeError(f"the device stage could not start: {failure}")
                job.out = self._move(job)
            except BaseException as exc:
                job.error = exc
            finally:
                job.done.set()
                # This frame lives as long as the thread: it must not keep a failed job,
                # whose error's traceback reaches the feed once raised there.
                del job

    def _move(self, job: Job) -> Any:
        batch, backend, stats = job.taken.data, self.backend, self.stats
        job.taken.data = None  # the host batch goes once moved (its shared memory too)
        began = time.perf_counter()
        if not backend.copies:  # pin_memory=True alone, or device="cpu"
            out = pin_memory(batch) if self.pin_only else map_tensors(batch, lambda t: t)
            stats.pack_s += time.perf_counter() - began
            return self._transformed(out, job)
        job.phase = f"the copy to {backend.device}"
        host = tensors(batch)
        sizes = [nbytes(t) for t in host]
        buffer = self.pool.take(packed_size(sizes))
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
                stats.copied_bytes += sum(sizes)
        stats.pack_s += time.perf_counter() - began
        return self._transformed(out, job)

    def _transformed(self, out: Any, job: Job) -> Any:
        backend = self.backend
        with backend.side_stream():
            if self.transform is not None:
                job.phase = "device_transform"
                start = backend.record()
                out = self.transform(out)
                self.timings.append(("transform_s", start, backend.record()))
            job.ready = backend.record()
        return out
