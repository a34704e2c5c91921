"""A batch's wire format: a pickle whose tensors are rows of a storage table, aliasing kept.

Worker side, `pack` pickles the batch with each tensor replaced by ``("T", k)``: the same k
for the same tensor object, so ``a is b`` holds in the parent. After the dump the tensors
are grouped by the storage they view. A storage already in shared memory (collate wrote it
there) is sent in place, whole, as torch would. Any other storage is cut into clusters of
the byte extents its tensors use (overlapping, or apart by less than the tensor and than
`_GAP`): each cluster is copied once, so views of it stay views of one storage (the same
offsets, writes seen by all) and a view of a huge storage costs only its cluster. A
cluster of at most `INLINE_MAX` bytes travels inline in the payload (up to `INLINE_BUDGET`
per batch): a small tensor then owns its memory in the parent, as under torch, instead of
pinning a segment. docs/design/shm.md has the layout and the reasons.

Payload: ``[batch pickle][inline bytes][table pickle][pinned segment ids][trailer]``.
"""

from __future__ import annotations

import array
import ctypes
import io
import math
import pickle
import struct
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

INLINE_MAX = 4096
"""Clusters up to this size travel in the payload. [Unit: byte]"""
INLINE_BUDGET = 1 << 20
"""Inline bytes per batch; clusters past it go to shared memory. [Unit: byte]"""
INLINE = -1
"""The segment id of a storage whose bytes are inline."""
_GAP = 64 << 10  # extents at most this far apart may share one copy (fewer storages)
_MAGIC = b"SLT\x01"  # a plain pickle ends with b"." (STOP): the two never mix up
_TRAILER = struct.Struct("<QQQ4s")  # ends of the batch pickle, the inline bytes, the table

# A storage row: (segment id or INLINE, offset, nbytes). A tensor row: (storage row, dtype,
# size, stride, storage_offset), or (-1, dtype, size) for a tensor with no elements.
Row = tuple[Any, ...]


class Placement(Protocol):
    """Where a batch's bytes go: the worker's `Arena`."""

    def find(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """(segment id, offset) when ``[ptr, ptr + nbytes)`` is in this batch's segments."""

    def place(self, address: int, nbytes: int) -> tuple[int, int]:
        """Copy ``nbytes`` at ``address`` into this batch's segments: (segment id, offset)."""


def eligible(t: torch.Tensor) -> bool:
    """Whether ``t`` crosses as a table row (anything else pickles by value, as torch's)."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_nested
    )


class _Collector(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []  # also keeps each id() unique while we dump
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> tuple[str, int] | None:  # noqa: D102
        if not isinstance(obj, torch.Tensor) or not eligible(obj):
            return None
        k = self._index.get(id(obj))
        if k is None:
            k = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return ("T", k)


def pack(data: Any, placement: Placement) -> tuple[bytes, tuple[int, int, int]]:
    """Pickle ``data`` for `unpack`: (payload without its trailer, the section ends).

    The worker adds the trailer with `seal` once it knows which segments it still views.
    """
    buf = io.BytesIO()
    collector = _Collector(buf)
    collector.dump(data)
    data_end = buf.tell()
    table = _Layout(collector.tensors, placement, buf, data_end).rows()
    blob_end = buf.tell()
    pickle.dump(table, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue(), (data_end, blob_end, buf.tell())


def seal(body: bytes | memoryview, ends: tuple[int, int, int], pinned: tuple[int, ...]) -> bytes:
    """The payload: ``body`` with the segments the worker still views, and the trailer."""
    return b"".join((body, array.array("q", pinned).tobytes(), _TRAILER.pack(*ends, _MAGIC)))


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t`` (with elements) can reach: [lo, hi)."""
    size = t.element_size()
    lo = int(t.storage_offset()) * size
    span = 1 + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return lo, lo + span * size


class _Layout:
    """Builds the storage and tensor rows of one batch (the worker's half of the format)."""

    def __init__(
        self, tensors: list[torch.Tensor], placement: Placement, buf: io.BytesIO, blob: int
    ) -> None:
        self._tensors = tensors
        self._placement = placement
        self._buf = buf
        self._blob = blob
        self._inline_left = INLINE_BUDGET
        self.storages: list[Row] = []
        self.tensor_rows: list[Row] = [()] * len(tensors)

    def rows(self) -> tuple[list[Row], list[Row]]:
        groups: dict[tuple[int, int], list[int]] = {}
        for k, t in enumerate(self._tensors):
            if t.is_conj() or t.is_neg():  # the storage holds other values than t shows
                t = self._tensors[k] = t.resolve_conj().resolve_neg()
            if t.numel() == 0:
                self.tensor_rows[k] = (-1, t.dtype, tuple(t.shape))
                continue
            s = t.untyped_storage()
            groups.setdefault((s.data_ptr(), s.nbytes()), []).append(k)
        for (ptr, nbytes), members in groups.items():
            where = self._placement.find(ptr, nbytes)
            if where is not None:  # written by collate into shared memory: send in place
                self._storage(where[0], where[1], nbytes, members, 0)
            else:
                self._clusters(ptr, members)
        return self.storages, self.tensor_rows

    def _storage(self, segment: int, offset: int, nbytes: int, members: list[int], lo: int) -> None:
        sid = len(self.storages)
        self.storages.append((segment, offset, nbytes))
        for k in members:
            t = self._tensors[k]
            first = int(t.storage_offset()) - lo // t.element_size()
            self.tensor_rows[k] = (sid, t.dtype, tuple(t.shape), t.stride(), first)

    def _clusters(self, ptr: int, members: list[int]) -> None:
        spans = []
        for k in members:
            t = self._tensors[k]
            lo, hi = _extent(t)
            own = t.numel() * t.element_size()
            if hi - lo > 2 * own + _GAP:
                # A sparse view (a column of a big matrix): copy it compactly rather than
                # the storage it strides over (it no longer aliases views it overlaps).
                self._tensors[k] = c = t.contiguous()
                self._copy(c.untyped_storage().data_ptr(), *_extent(c), [k])
            else:
                spans.append((lo, hi, own, k))
        if len(spans) == 1:  # the common case: a tensor alone on its storage
            self._copy(ptr, spans[0][0], spans[0][1], [spans[0][3]])
            return
        spans.sort()
        clusters: list[list[Any]] = []  # [lo, hi, members]
        for lo, hi, own, k in spans:
            # Join the previous cluster when the gap between them costs less to copy than
            # the tensor itself (and is under _GAP): aliases always join (no gap).
            if clusters and lo <= clusters[-1][1] + min(own, _GAP):
                clusters[-1][1] = max(clusters[-1][1], hi)
                clusters[-1][2].append(k)
            else:
                clusters.append([lo, hi, [k]])
        for lo, hi, ks in clusters:
            self._copy(ptr, lo, hi, ks)

    def _copy(self, ptr: int, lo: int, hi: int, members: list[int]) -> None:
        """Copy bytes [lo, hi) of the storage at ``ptr`` (kept alive by `_tensors`) once."""
        align = max(self._tensors[k].element_size() for k in members)
        lo -= lo % align  # every member's offset stays a whole number of its elements
        n = hi - lo
        if n <= INLINE_MAX and n <= self._inline_left:
            self._inline_left -= n
            offset = self._buf.tell() - self._blob
            self._buf.write(ctypes.string_at(ptr + lo, n))
            self._storage(INLINE, offset, n, members, lo)
        else:
            segment, offset = self._placement.place(ptr + lo, n)
            self._storage(segment, offset, n, members, lo)


class Parsed(NamedTuple):
    """A payload taken apart by `parse`."""

    storages: list[Row]
    tensors: list[Row]
    inline: int
    """Where the inline bytes start in the payload."""
    pinned: tuple[int, ...]


def parse(payload: bytes) -> Parsed | None:
    """The tables of a `pack`ed payload; None for a plain pickle (no shared memory)."""
    if len(payload) < _TRAILER.size or payload[-4:] != _MAGIC:
        return None
    data_end, blob_end, table_end, _ = _TRAILER.unpack_from(payload, len(payload) - _TRAILER.size)
    view = memoryview(payload)
    storages, tensors = pickle.loads(view[blob_end:table_end])
    pinned = array.array("q")
    pinned.frombytes(view[table_end : len(payload) - _TRAILER.size])
    return Parsed(storages, tensors, data_end, tuple(pinned))


def unpack(payload: bytes, parsed: Parsed, storages: list[torch.UntypedStorage | None]) -> Any:
    """Rebuild the batch of ``payload``; ``storages`` holds the caller's storage for each
    segment row of the table (None for inline rows: they are made here)."""
    return _Unpacker(payload, parsed, storages).load()


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, step in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and step != expected:
            return False
        expected *= n
    return True


class _Unpacker(pickle.Unpickler):
    def __init__(
        self, payload: bytes, parsed: Parsed, storages: list[torch.UntypedStorage | None]
    ) -> None:
        super().__init__(io.BytesIO(payload))  # reads the batch pickle only: up to its STOP
        self._payload = payload
        self._inline = 0  # the inline bytes' address, found on first use
        self._parsed = parsed
        self._storages = storages
        self._made: dict[int, torch.Tensor] = {}
        self._users = [0] * len(storages)
        for row in parsed.tensors:
            if row[0] >= 0:
                self._users[row[0]] += 1

    def persistent_load(self, pid: Any) -> torch.Tensor:  # noqa: D102
        k = pid[1]
        t = self._made.get(k)
        if t is None:
            t = self._made[k] = self._tensor(self._parsed.tensors[k])
        return t

    def _tensor(self, row: Row) -> torch.Tensor:
        if row[0] < 0:
            return torch.empty(row[2], dtype=row[1])
        sid, dtype, size, stride, offset = row
        storage = self._storages[sid]
        if storage is None:  # inline bytes
            _, at, nbytes = self._parsed.storages[sid]
            if not self._inline:  # the payload outlives this call: its buffer stays put
                self._inline = int(np.frombuffer(self._payload, np.uint8).ctypes.data)
            address = self._inline + self._parsed.inline + at
            if (
                self._users[sid] == 1 and offset == 0 and _contiguous(size, stride)
                and math.prod(size) * dtype.itemsize == nbytes
            ):
                # A tensor alone on its bytes (a label): made as torch.empty makes it, so a
                # kept one costs what a plain tensor does (set_ adds ~70 B each).
                t = torch.empty(size, dtype=dtype)
                ctypes.memmove(t.data_ptr(), address, nbytes)
                return t
            storage = self._storages[sid] = torch.UntypedStorage(nbytes)
            ctypes.memmove(storage.data_ptr(), address, nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
