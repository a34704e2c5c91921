"""Batches across processes: tensors in pooled shared-memory segments, descriptors on the pipe.

Worker side, an `Arena` owns a few segments (memfd: anonymous shared memory with no name in
/dev/shm, so nothing can be left behind there whatever gets killed, and the /dev/shm size
limit of containers does not apply). While a batch is loaded, torch's collate asks for
shared storage (``UntypedStorage._new_shared``, which default_collate calls inside workers);
the worker's hook carves it from the current segment, so the batch is written once, straight
into memory the parent can map. `pack` pickles the batch with each tensor replaced by a
descriptor ``(segment, offset, nbytes, dtype, size, stride, storage_offset)``; a tensor that
is not in the arena yet is copied in.

Parent side, a `SegmentMap` maps each segment once (its file descriptor arrives over the
socket with SCM_RIGHTS) and rebuilds tensors as views of the mapping: no copy. Each batch's
view of a segment is a numpy array with a `weakref.finalize`; when the last tensor of the
batch dies, the segment id is queued and goes back to the worker with its next task, and
only then may the worker reuse it. A worker also never reuses a segment while its own
tensors still point into it. The pool grows when the user keeps batches, and shrinks to a
few free segments. docs/design/shm.md has the lifecycle.
"""

from __future__ import annotations

import collections
import io
import mmap
import os
import pickle
import socket
import weakref
from typing import Any

import numpy as np
import torch

_ALIGN = 64
_MIN_SEGMENT = 1 << 20
_KEEP_FREE = 4
HAVE_MEMFD = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")

# (segment, offset, nbytes, dtype, size, stride, storage_offset), or ("empty", dtype, size)
Descriptor = tuple[Any, ...]


def _eligible(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_nested
    )


class _Segment:
    __slots__ = ("segment_id", "nbytes", "mm", "addr", "fd", "parent_holds", "local_refs")

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


class Arena:
    """The worker's pool of shared-memory segments; one per worker process, one thread."""

    def __init__(self, worker_id: int) -> None:
        self.active = False
        self._worker_id = worker_id
        self._segments: dict[int, _Segment] = {}
        self._free: list[_Segment] = []
        self._next_id = 0
        self._hint = _MIN_SEGMENT
        self._task: list[_Segment] = []
        self._cursor = 0
        self._used = 0
        self._retired: list[int] = []

    # -- segment bookkeeping -------------------------------------------------------------
    def release(self, freed: tuple[int, ...]) -> None:
        """The parent no longer uses these segments."""
        for segment_id in freed:
            seg = self._segments.get(segment_id)
            if seg is not None:
                seg.parent_holds = False
                self._maybe_free(seg)

    def _local_release(self, seg: _Segment) -> None:
        # Runs from a weakref callback: only bookkeeping here, no allocation or unmapping.
        seg.local_refs -= 1
        if seg not in self._task:
            self._maybe_free(seg)

    def _maybe_free(self, seg: _Segment) -> None:
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

    def _acquire(self, nbytes: int) -> _Segment:
        fitting = [s for s in self._free if s.nbytes >= nbytes]
        if fitting:
            seg = min(fitting, key=lambda s: s.nbytes)
            self._free.remove(seg)
            return seg
        size = max(_MIN_SEGMENT, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        seg = _Segment(self._next_id, size, f"steadyload-w{self._worker_id}-{self._next_id}")
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

    def alloc(self, nbytes: int) -> tuple[_Segment, int]:
        """Reserve ``nbytes`` for the current batch; returns (segment, offset)."""
        seg = self._task[-1] if self._task else None
        if seg is None or self._cursor + nbytes > seg.nbytes:
            seg = self._acquire(max(nbytes, self._hint - self._used))
            self._task.append(seg)
            self._cursor = 0
        offset = self._cursor
        self._cursor = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        self._used += nbytes
        return seg, offset

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """Shared storage for collate (the ``_new_shared`` hook), tracked while alive here."""
        if nbytes == 0:
            return torch.UntypedStorage(0)
        seg, offset = self.alloc(nbytes)
        arr = np.frombuffer(seg.mm, np.uint8, nbytes, offset)
        seg.local_refs += 1
        weakref.finalize(arr, self._local_release, seg).atexit = False
        return torch.from_numpy(arr).untyped_storage()

    def describe(self, t: torch.Tensor) -> Descriptor | None:
        """The descriptor for ``t``, copying it into the arena unless it is there already."""
        if not _eligible(t):
            return None
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if t.numel() == 0:
            return ("empty", t.dtype, tuple(t.shape))
        ptr = storage.data_ptr()
        for seg in self._task:
            if seg.addr <= ptr and ptr + nbytes <= seg.addr + seg.nbytes and not (
                t.is_conj() or t.is_neg()
            ):
                return (
                    seg.segment_id, ptr - seg.addr, nbytes, t.dtype,
                    tuple(t.shape), t.stride(), t.storage_offset(),
                )  # fmt: skip
        n = t.numel() * t.element_size()
        seg, offset = self.alloc(n)
        dst = torch.from_numpy(np.frombuffer(seg.mm, np.uint8, n, offset))
        dst = dst.view(t.dtype).view(t.shape)
        dst.copy_(t)
        return (seg.segment_id, offset, n, t.dtype, tuple(t.shape), dst.stride(), 0)

    def end_task(self, sent: bool) -> tuple[tuple[int, ...], list[_Segment], tuple[int, ...]]:
        """Finish a batch: (its segment ids, segments whose fd must follow, retired ids).

        ``sent`` says whether the batch goes to the parent; if not (the task failed), its
        segments are free again as soon as this process no longer uses them.
        """
        self.active = False
        task, self._task = self._task, []
        if self._used:
            # Size the next batch's segment by this one, with room to grow.
            self._hint = max(_MIN_SEGMENT, self._used + self._used // 4)
        new = [s for s in task if s.fd is not None] if sent else []
        for seg in task:
            seg.parent_holds = sent
            self._maybe_free(seg)
        retired, self._retired = tuple(self._retired), []
        used = tuple(s.segment_id for s in task) if sent else ()
        return used, new, retired

    def pack(self, data: Any) -> bytes:
        """Pickle a batch with its tensors replaced by arena descriptors."""
        buf = io.BytesIO()
        _Packer(buf, self).dump(data)
        return buf.getvalue()


class _Packer(pickle.Pickler):
    def __init__(self, file: io.BytesIO, arena: Arena) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arena = arena

    def persistent_id(self, obj: Any) -> Descriptor | None:  # noqa: D102
        if isinstance(obj, torch.Tensor):
            return self._arena.describe(obj)
        return None


def send_segments(sock: socket.socket, segments: list[_Segment]) -> None:
    """Send new segments' file descriptors after the `Done` that announced them."""
    fds = [s.fd for s in segments if s.fd is not None]
    socket.send_fds(sock, [b"S"], fds)
    for s in segments:
        if s.fd is not None:
            os.close(s.fd)
            s.fd = None


class SegmentMap:
    """The parent's mappings of one worker process's segments."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        # Appended to from weakref callbacks (any thread); deque.append is atomic.
        self._freed: collections.deque[int] = collections.deque()

    def receive(self, sock: socket.socket, announced: tuple[Any, ...]) -> None:
        """Map the segments a `Done` announced; their fds are next on the socket."""
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1, len(announced))
        try:
            if msg != b"S" or len(fds) != len(announced):
                raise EOFError("the worker's connection closed while it sent shared memory")
            for new, fd in zip(announced, fds, strict=True):
                self._maps[new.segment_id] = mmap.mmap(fd, new.nbytes)
        finally:
            for fd in fds:
                os.close(fd)

    def retire(self, segment_ids: tuple[int, ...]) -> None:
        """Forget segments the worker closed (live tensors keep their own reference)."""
        for segment_id in segment_ids:
            self._maps.pop(segment_id, None)

    def unpack(self, payload: bytes, segments: tuple[int, ...]) -> Any:
        """Rebuild a batch; its tensors are views of the segments, which stay lent until freed."""
        bases = {}
        for segment_id in segments:
            base = np.frombuffer(self._maps[segment_id], np.uint8)
            weakref.finalize(base, self._freed.append, segment_id).atexit = False
            bases[segment_id] = base
        return _Unpacker(io.BytesIO(payload), bases).load()

    def drain_freed(self) -> tuple[int, ...]:
        """Segment ids freed since the last call, to hand back to the worker."""
        out = []
        freed = self._freed
        while freed:
            out.append(freed.popleft())
        return tuple(out)

    def close(self) -> None:
        """Drop all mappings; memory still viewed by live tensors stays valid."""
        self._maps.clear()


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, bases: dict[int, np.ndarray[Any, Any]]) -> None:
        super().__init__(file)
        self._bases = bases

    def persistent_load(self, pid: Any) -> torch.Tensor:  # noqa: D102
        if pid[0] == "empty":
            return torch.empty(pid[2], dtype=pid[1])
        segment_id, offset, nbytes, dtype, size, stride, storage_offset = pid
        storage = torch.from_numpy(self._bases[segment_id][offset : offset + nbytes])
        return torch.empty(0, dtype=dtype).set_(
            storage.untyped_storage(), storage_offset, size, stride
        )


def install_collate_hook(arena: Arena) -> None:
    """Route torch's shared-storage allocations (default_collate's) into ``arena``."""
    original = torch.UntypedStorage._new_shared

    def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
        if arena.active and torch.device(device).type == "cpu":
            return arena.storage(size)
        return original(size, device=device)

    torch.UntypedStorage._new_shared = classmethod(_new_shared)  # type: ignore[assignment,method-assign]  # deliberate monkeypatch, worker only
