"""The worker's side of batches in shared memory: memfd segments that collate writes into.

While a batch is loaded, torch's collate asks for shared storage
(``UntypedStorage._new_shared``, which default_collate calls inside workers); the worker's
hook carves it from the current segment, so a big batch is written once, straight into
memory the parent can map. Storages of at most `storage_table.INLINE_MAX` bytes are
ordinary memory instead: they travel inline in the payload. `Arena.pack` writes the
payload (`storage_table`), copying into the segments whatever big tensor is not there yet.

A segment is reused only once the parent handed it back and no tensor of this process
views it. One the parent holds for more than `HELD_TASKS` tasks (a user keeps part of its
batch) is retired here: its mapping and descriptor are closed, so this process's
descriptors and mappings stay bounded whatever the user keeps. docs/design/shm.md.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref
from typing import Any

import numpy as np
import torch

from ...host import limits
from ...host.heap import HeapFit
from . import storage_table

_ALIGN = 64
_PAGE_FROM = 64 << 10  # storages this big start on a page: the parent can return their pages
_MIN_SEGMENT = 1 << 20
_KEEP_FREE = 4
HELD_TASKS = 16
"""Tasks after which a segment the parent still holds is closed here (the parent keeps it)."""
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class Segment:
    __slots__ = (
        "segment_id", "nbytes", "mm", "addr", "fd", "parent_holds", "local_refs", "sent_at",
    )

    def __init__(self, segment_id: int, nbytes: int, name: str) -> None:
        self.segment_id = segment_id
        self.nbytes = nbytes
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd  # closed once the parent has it
        self.addr = int(np.frombuffer(self.mm, np.uint8, 1).ctypes.data)
        self.parent_holds = False
        self.local_refs = 0
        self.sent_at = 0


class Arena:
    """The worker's pool of shared-memory segments; one per worker process, one thread."""

    def __init__(self, worker_id: int) -> None:
        self.active = False
        self._worker_id = worker_id
        self._segments: dict[int, Segment] = {}
        self._free: list[Segment] = []
        self._next_id = 0
        self._hint = _MIN_SEGMENT
        self._task: list[Segment] = []
        self._cursor = 0
        self._used = 0
        self._retired: list[int] = []
        self._tasks_sent = 0
        self._ends = (0, 0, 0)
        self._pinned: tuple[int, ...] = ()
        self._heap = HeapFit()

    # -- segment bookkeeping -------------------------------------------------------------
    def release(self, freed: tuple[int, ...]) -> None:
        """The parent no longer uses these segments."""
        for segment_id in freed:
            seg = self._segments.get(segment_id)
            if seg is not None:
                seg.parent_holds = False
                self._maybe_free(seg)

    def _local_release(self, seg: Segment) -> None:
        # Runs from a weakref callback: only bookkeeping here, no allocation or unmapping.
        seg.local_refs -= 1
        if seg not in self._task:
            self._maybe_free(seg)

    def _maybe_free(self, seg: Segment) -> None:
        if seg.parent_holds or seg.local_refs or seg.segment_id not in self._segments:
            return
        if seg in self._free:
            return
        if seg.nbytes < self._hint or len(self._free) >= _KEEP_FREE:
            # Too small for current batches, or enough spares: close it. The mapping goes
            # when the last reference does (never close() a buffer numpy may still export).
            del self._segments[seg.segment_id]
            self._retired.append(seg.segment_id)
            if seg.fd is not None:  # never announced to the parent
                os.close(seg.fd)
                seg.fd = None
            return
        self._free.append(seg)

    def _retire_held(self) -> None:
        """Close segments the parent has held for long: it keeps its own mapping of them."""
        for seg in list(self._segments.values()):
            if (
                seg.parent_holds and not seg.local_refs
                and self._tasks_sent - seg.sent_at >= HELD_TASKS
            ):
                del self._segments[seg.segment_id]
                self._retired.append(seg.segment_id)
                if seg.fd is not None:
                    os.close(seg.fd)
                    seg.fd = None
                try:
                    seg.mm.close()  # the descriptor and mapping go now, not at collection
                except BufferError:
                    pass  # still exported after all: it goes with the last view

    def _acquire(self, nbytes: int) -> Segment:
        fitting = [s for s in self._free if s.nbytes >= nbytes]
        if fitting:
            seg = min(fitting, key=lambda s: s.nbytes)
            self._free.remove(seg)
            return seg
        size = max(_MIN_SEGMENT, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        try:
            seg = Segment(self._next_id, size, f"steadyload-w{self._worker_id}-{self._next_id}")
        except OSError as exc:
            if exc.errno not in _OUT_OF:
                raise
            held = sum(s.parent_holds for s in self._segments.values())
            raise limits.shared_memory_exhausted(
                worker_id=self._worker_id, error=exc.errno, where="worker", segments=1,
                detail=(
                    f"creating a {size >> 20} MiB shared-memory segment: {exc.strerror}; the "
                    f"worker maps {len(self._segments)} segments, {held} of them held by "
                    "the main process"
                ),
            ) from None
        self._next_id += 1
        self._segments[seg.segment_id] = seg
        return seg

    def close(self) -> None:
        """Drop every segment (mappings go when no tensor views them any more)."""
        self._segments.clear()
        self._free.clear()
        self._task = []

    # -- per task ------------------------------------------------------------------------
    def begin_task(self) -> None:
        """Start a batch: allocations until `end_task` go to this batch's segments."""
        self._task = []
        self._cursor = 0
        self._used = 0
        self.active = True

    def alloc(self, nbytes: int) -> tuple[Segment, int]:
        """Reserve ``nbytes`` for the current batch; returns (segment, offset)."""
        align = mmap.PAGESIZE if nbytes >= _PAGE_FROM else _ALIGN
        seg = self._task[-1] if self._task else None
        offset = -(-self._cursor // align) * align
        if seg is None or offset + nbytes > seg.nbytes:
            seg = self._acquire(max(nbytes, self._hint - self._used))
            self._task.append(seg)
            offset = self._cursor = 0
        self._used += offset + nbytes - self._cursor  # with the alignment padding
        self._cursor = offset + nbytes
        return seg, offset

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """Shared storage for collate (the ``_new_shared`` hook), tracked while alive here.

        A small one is ordinary memory: it is sent inline, and a kept label or scalar then
        costs the parent its own bytes instead of a segment.
        """
        if nbytes <= storage_table.INLINE_MAX:
            return torch.UntypedStorage(nbytes)
        seg, offset = self.alloc(nbytes)
        arr = np.frombuffer(seg.mm, np.uint8, nbytes, offset)
        seg.local_refs += 1
        weakref.finalize(arr, self._local_release, seg).atexit = False
        return torch.from_numpy(arr).untyped_storage()

    def find(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """(segment id, offset) when ``[ptr, ptr + nbytes)`` lies in this batch's segments."""
        for seg in self._task:
            if seg.addr <= ptr and ptr + nbytes <= seg.addr + seg.nbytes:
                return seg.segment_id, ptr - seg.addr
        return None

    def place(self, address: int, nbytes: int) -> tuple[int, int]:
        """Copy ``nbytes`` at ``address`` into this batch's segments: (segment id, offset)."""
        seg, offset = self.alloc(nbytes)
        ctypes.memmove(seg.addr + offset, address, nbytes)
        return seg.segment_id, offset

    def pack(self, data: Any) -> bytes:
        """The batch as a payload (`storage_table`), to be finished by `seal`."""
        body, self._ends = storage_table.pack(data, self)
        return body

    def end_task(self, sent: bool) -> tuple[tuple[int, ...], list[Segment], tuple[int, ...]]:
        """Finish a batch: (its segment ids, segments whose fd must follow, retired ids).

        ``sent`` says whether the batch goes to the parent; if not (the task failed), its
        segments are free again as soon as this process no longer uses them.
        """
        self.active = False
        task, self._task = self._task, []
        if self._used:
            # Size the next batch's segment by this one, with room to grow.
            self._hint = max(_MIN_SEGMENT, self._used + self._used // 4)
            self._heap.batch(self._used)  # its samples stay in the heap for the next one
        new = [s for s in task if s.fd is not None] if sent else []
        if sent:
            self._tasks_sent += 1
            # Segments that user code here still views (it kept a collate output): the
            # parent must never return their pages early.
            self._pinned = tuple(s.segment_id for s in task if s.local_refs)
        for seg in task:
            seg.parent_holds = sent
            seg.sent_at = self._tasks_sent
            self._maybe_free(seg)
        self._retire_held()
        retired, self._retired = tuple(self._retired), []
        used = tuple(s.segment_id for s in task) if sent else ()
        return used, new, retired

    def seal(self, payload: bytes | memoryview) -> bytes:
        """The payload `pack` made, finished after `end_task`: what the parent unpacks."""
        return storage_table.seal(payload, self._ends, self._pinned)
