"""A batch's wire format: a pickle whose tensors are rows of a storage table, aliasing kept.

Worker side, `pack` pickles the batch with each tensor replaced by ``("T", k)``: the same k
for the same tensor object, so ``a is b`` holds in the parent. After the dump the tensors
are grouped by the storage they view. A storage already in shared memory (collate wrote it
there) is sent in place, whole, as torch would. Any other storage is cut into clusters of
the byte extents its tensors use (overlapping or within `_GAP` of each other): each cluster
is copied once, so views of it stay views of one storage (the same offsets, writes seen by
all) and a view of a huge storage costs only its cluster. A cluster of at most
`INLINE_MAX` bytes travels inline in the payload (up to `INLINE_BUDGET` per batch): a
small tensor then owns its memory in the parent, as under torch, instead of pinning a
segment. docs/design/shm.md has the layout and the reasons.

Payload: ``[batch pickle][inline bytes][table pickle][pinned segment ids][trailer]``.
"""

from __future__ import annotations

import array
import io
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
_GAP = 64 << 10  # extents closer than this share one copy: fewer storages, little waste
_MAGIC = b"SLT\x01"  # a plain pickle ends with b"." (STOP): the two never mix up
_TRAILER = struct.Struct("<QQQ4s")  # ends of the batch pickle, the inline bytes, the table

# A storage row: (segment id or INLINE, offset, nbytes). A tensor row: (storage row, dtype,
# size, stride, storage_offset), or (-1, dtype, size) for a tensor with no elements.
Row = tuple[Any, ...]


class Placement(Protocol):
    """Where a batch's bytes go: the worker's `Arena`."""

    def find(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """(segment id, offset) when ``[ptr, ptr + nbytes)`` is in this batch's segments."""

    def place(self, data: torch.Tensor) -> tuple[int, int]:
        """Copy the 1-D uint8 ``data`` into this batch's segments: (segment id, offset)."""


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


def seal(body: bytes, ends: tuple[int, int, int], pinned: tuple[int, ...]) -> bytes:
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
                self._clusters(members)
        return self.storages, self.tensor_rows

    def _storage(self, segment: int, offset: int, nbytes: int, members: list[int], lo: int) -> None:
        sid = len(self.storages)
        self.storages.append((segment, offset, nbytes))
        for k in members:
            t = self._tensors[k]
            size = t.element_size()
            self.tensor_rows[k] = (
                sid, t.dtype, tuple(t.shape), t.stride(), t.storage_offset() - lo // size,
            )

    def _clusters(self, members: list[int]) -> None:
        spans = sorted((*_extent(self._tensors[k]), k) for k in members)
        clusters: list[list[Any]] = []  # [lo, hi, own bytes, members]
        for lo, hi, k in spans:
            own = self._tensors[k].numel() * self._tensors[k].element_size()
            if clusters and lo <= clusters[-1][1] + _GAP:
                last = clusters[-1]
                last[1], last[2] = max(last[1], hi), last[2] + own
                last[3].append(k)
            else:
                clusters.append([lo, hi, own, [k]])
        for lo, hi, own, ks in clusters:
            if hi - lo > 2 * own + _GAP:
                # A sparse view (a column of a big matrix): copy each tensor compactly rather
                # than the storage it strides over. Overlapping ones then no longer alias.
                for k in ks:
                    self._tensors[k] = c = self._tensors[k].contiguous()
                    self._copy(*_extent(c), [k])
            else:
                self._copy(lo, hi, ks)

    def _copy(self, lo: int, hi: int, members: list[int]) -> None:
        align = max(self._tensors[k].element_size() for k in members)
        lo -= lo % align  # every member's offset stays a whole number of its elements
        n = hi - lo
        src = torch.empty(0, dtype=torch.uint8).set_(
            self._tensors[members[0]].untyped_storage(), lo, (n,), (1,)
        )
        if n <= INLINE_MAX and n <= self._inline_left:
            self._inline_left -= n
            offset = self._buf.tell() - self._blob
            self._buf.write(src.numpy().tobytes())
            self._storage(INLINE, offset, n, members, lo)
        else:
            segment, offset = self._placement.place(src)
            self._storage(segment, offset, n, members, lo)


class Parsed(NamedTuple):
    """A payload taken apart by `parse`."""

    storages: list[Row]
    tensors: list[Row]
    inline: memoryview
    pinned: tuple[int, ...]


def parse(payload: bytes) -> Parsed | None:
    """The tables of a `pack`ed payload; None for a plain pickle (no shared memory)."""
    if len(payload) < _TRAILER.size or payload[-4:] != _MAGIC:
        return None
    data_end, blob_end, table_end, _ = _TRAILER.unpack_from(payload, len(payload) - _TRAILER.size)
    view = memoryview(payload)
    storages, tensors = pickle.loads(view[blob_end:table_end])
    pinned = array.array("q", view[table_end : len(payload) - _TRAILER.size])
    return Parsed(storages, tensors, view[data_end:blob_end], tuple(pinned))


def inline_storage(inline: memoryview, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage of its own (torch.empty + one copy: no buffer kept alive beside it)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    out.numpy()[:] = np.frombuffer(inline, np.uint8, nbytes, offset)
    return out.untyped_storage()


def unpack(payload: bytes, storages: list[torch.UntypedStorage], tensors: list[Row]) -> Any:
    """Rebuild the batch of ``payload`` with the table's ``storages`` made by the caller."""
    return _Unpacker(io.BytesIO(payload), storages, tensors).load()


class _Unpacker(pickle.Unpickler):
    def __init__(
        self, file: io.BytesIO, storages: list[torch.UntypedStorage], rows: list[Row]
    ) -> None:
        super().__init__(file)  # reads the batch pickle only: it stops at its STOP
        self._storages = storages
        self._rows = rows
        self._made: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> torch.Tensor:  # noqa: D102
        k = pid[1]
        t = self._made.get(k)
        if t is None:
            row = self._rows[k]
            if row[0] < 0:
                t = torch.empty(row[2], dtype=row[1])
            else:
                sid, dtype, size, stride, offset = row
                t = torch.empty(0, dtype=dtype).set_(self._storages[sid], offset, size, stride)
            self._made[k] = t
        return t

