"""`SharedList` and `SharedDict`: records packed once into shared memory, read without copies.

A dataset that keeps its metadata (file names, captions, boxes) in Python lists and dicts
pays for it once per worker: forkserver and spawn workers each unpickle a full copy, and
forked workers copy the pages as they touch the objects' reference counts (the
copy-on-read effect, pytorch issue 13246). `SharedList` packs the records into one
anonymous shared-memory file (memfd): a header, the layout, an int64 offsets table and the
records' bytes. Workers receive a file descriptor, not the data, and map the same pages;
reading a record touches no Python object of the others. The memory goes when the last
process lets go; nothing is ever created in /dev/shm, so nothing can be left there.

Records are stored by columns' types where they are uniform (docs/design/shm.md#sharedlist,
`layout.py`): str and bytes as such, dicts with the same keys and tuples of the same
length as a struct of their numbers followed by their strings, numbers as typed arrays;
other values with marshal, or pickle where marshal would not give them back unchanged.

Costs, honestly: building encodes every record once. Reading decodes the record each time,
so a read costs several times an index into a list (benchmarks/bench_shared_list.py);
slices build lists. The contents are read-only. `SharedDict` finds keys by a sorted table
of 64-bit hashes: O(log n).
"""

from __future__ import annotations

import abc
import bisect
import hashlib
import mmap
import operator
import os
import pickle
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from multiprocessing import context, reduction
from typing import Any, cast, overload

from . import descriptors
from . import layout as _layout

_HEADER = struct.Struct("<8sQQQQ")  # magic, count, layout length, offsets at (0: none), data at
_MAGIC = b"slshlst3"


def _encode(record: Any) -> bytes:
    """Bytes that identify ``record`` (for `SharedDict`'s key hashes)."""
    if type(record) is str:
        return b"\x00" + record.encode("utf-8", "surrogatepass")
    if type(record) is bytes:
        return b"\x01" + record
    return b"\x02" + pickle.dumps(record, pickle.HIGHEST_PROTOCOL)


class SharedList(Sequence[Any]):
    """An immutable list whose records live once in shared memory, for all workers.

    Write ``self.rows = steadyload.SharedList(rows)`` in a Dataset's ``__init__`` (and drop
    the original list): forkserver/spawn workers get a handle instead of a copy, and forked
    workers read without copying pages. Supports ``len``, indexing (negative too),
    iteration and slicing (a slice is a plain list). Safe to read from many processes and
    threads.

    Reads are fastest for lists of str, of bytes, of numbers, and of dicts with the same
    keys (or tuples of the same length) whose values are numbers, str, bytes or None: those
    are stored by field and rebuilt without pickle. Other values are stored with marshal,
    or pickle where marshal would not give them back unchanged, and cost a ``loads`` per
    read. The object is an instance of a subclass made for its layout (its
    ``__getitem__`` is generated, as `collections.namedtuple` generates its classes);
    ``isinstance(x, steadyload.SharedList)`` holds.

    Args:
        records: any picklable objects, equal to themselves after a pickle round trip.
    """

    __slots__ = ("_fd", "_mm", "_count", "_offsets", "_column", "_view", "__weakref__")
    _fd: int
    _mm: mmap.mmap
    _count: int
    _offsets: memoryview | None
    _column: memoryview | None
    _view: memoryview

    def __new__(cls, records: Iterable[Any]) -> SharedList:
        items = records if isinstance(records, (list, tuple)) else list(records)
        layout, encoded = _layout.plan(items)
        head = layout.to_bytes()
        count = len(items)
        at = -(-(_HEADER.size + len(head)) // 8) * 8
        if encoded is not None:
            offsets_at, data_at = at, at + 8 * (count + 1)
            total = data_at + sum(len(e) for e in encoded)
        else:
            fixed = _layout.fixed_bytes(layout, items)
            offsets_at, data_at = 0, at
            total = data_at + len(fixed)
        del items
        fd = os.memfd_create("steadyload-sharedlist", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total)
        except BaseException:
            os.close(fd)
            raise
        _HEADER.pack_into(mm, 0, _MAGIC, count, len(head), offsets_at, data_at)
        mm[_HEADER.size : _HEADER.size + len(head)] = head
        if encoded is None:
            mm[data_at:total] = fixed
        else:
            # Offsets are absolute (from the start of the segment): one addition less per read.
            offsets = memoryview(mm)[offsets_at:data_at].cast("q")
            position = data_at
            for i, e in enumerate(encoded):
                offsets[i] = position
                mm[position : position + len(e)] = e
                position += len(e)
            offsets[count] = position
            offsets.release()
        return _attach(fd, mm)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        # Replaced in each layout's subclass by a generated method (_layout.getitem).
        return self._other_index(index)

    def _other_index(self, index: Any) -> Any:
        """Everything but an int in range: negative, numpy/torch integers, slices, errors."""
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"SharedList indices must be integers or slices, not {type(index).__name__}"
            ) from None
        j = i + self._count if i < 0 else i
        if 0 <= j < self._count:
            return self[j]
        raise IndexError(f"SharedList index {index} out of range (len {self._count})")

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._count):
            yield self[i]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if context.get_spawning_popen() is not None:
            # Starting a worker: send the file descriptor, not the records; beside the
            # worker's arguments when steadyload starts it (any number: descriptors.py).
            index = descriptors.collect(self._fd)
            if index is not None:
                return (_rebuild_from_table, (index,))
            return (_rebuild_shared, (reduction.DupFd(self._fd),))
        # Any other pickling (torch.save, a queue): the records themselves.
        return (SharedList, (list(self),))

    def __repr__(self) -> str:
        return f"steadyload.SharedList({self._count} records, {self.nbytes} bytes shared)"

    @property
    def nbytes(self) -> int:
        """Size of the shared segment. [Unit: byte]"""
        return len(self._mm)

    def __del__(self) -> None:
        try:
            for view in (self._column, self._offsets, self._view):
                if view is not None:
                    view.release()
            self._mm.close()
        except (AttributeError, BufferError, ValueError):
            pass  # half-built, or a record view is still held: the mapping goes with it
        try:
            os.close(self._fd)
        except (AttributeError, OSError):
            pass


_MAX_CLASSES = 256  # layouts with their own subclass; past that, the generic (slower) read
_classes: dict[tuple[bytes, int], tuple[type[SharedList], _layout.Layout]] = {}


def _class_for(head: bytes, data_at: int) -> tuple[type[SharedList], _layout.Layout]:
    key = (head, data_at)  # the header's bytes tell 0.0 from -0.0 and 1 from True in keys
    found = _classes.get(key)
    if found is not None:
        return found
    layout = _layout.Layout.from_bytes(head)
    namespace = {
        "__slots__": (),
        "__getitem__": _layout.getitem(layout, data_at),
        "__module__": "steadyload",
        "__qualname__": "SharedList",
        "__doc__": SharedList.__doc__,
    }
    cls = cast("type[SharedList]", abc.ABCMeta("SharedList", (SharedList,), namespace))
    if len(_classes) < _MAX_CLASSES:
        _classes[key] = (cls, layout)
    return cls, layout


def _attach(fd: int, mm: mmap.mmap) -> SharedList:
    magic, count, head_len, offsets_at, data_at = _HEADER.unpack_from(mm, 0)
    if magic != _MAGIC:
        raise ValueError("not a steadyload.SharedList segment")
    head = mm[_HEADER.size : _HEADER.size + head_len]
    # Variable-width records are found through the offsets: data_at does not matter.
    cls, layout = _class_for(head, 0 if offsets_at else data_at)
    obj: SharedList = object.__new__(cls)
    obj._fd, obj._mm, obj._count = fd, mm, count
    obj._view = memoryview(mm)
    obj._offsets = obj._view[offsets_at:data_at].cast("q") if offsets_at else None
    obj._column = None
    if layout.shape == "value" and len(layout.codes) == 1 and layout.codes in "bhiqd?":
        width = layout.fixed.size
        obj._column = obj._view[data_at : data_at + width * count].cast(layout.codes)  # type: ignore[call-overload]  # one of "bhiqd?"
    return obj


def _rebuild_shared(dupfd: Any) -> SharedList:
    return _map(dupfd.detach())


def _rebuild_from_table(index: int) -> SharedList:
    return _map(descriptors.take(index))


def _map(fd: int) -> SharedList:
    mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    return _attach(fd, mm)


def _key_hash(key: Any) -> int:
    digest = hashlib.blake2b(_encode(key), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class SharedDict(Mapping[Any, Any]):
    """An immutable dict in shared memory: keys and values in `SharedList` s.

    Lookup: binary search in a sorted table of 64-bit key hashes, then a comparison with
    the stored key; O(log n), no scan. Keys must be picklable and compare equal after a
    pickle round trip (str, bytes, int, tuples of those...).
    """

    __slots__ = ("_keys", "_values", "_hashes", "_order")

    def __init__(self, mapping: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> None:
        items = list(mapping.items() if isinstance(mapping, Mapping) else mapping)
        hashed = sorted((_key_hash(k), i) for i, (k, _) in enumerate(items))
        self._keys = SharedList(k for k, _ in items)
        self._values = SharedList(v for _, v in items)
        # Lists of ints: stored as typed arrays, indexed without a copy by bisect.
        self._hashes = SharedList([h for h, _ in hashed])
        self._order = SharedList([i for _, i in hashed])

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: Any) -> Any:
        hashes, order = self._hashes, self._order
        h = _key_hash(key)
        i = bisect.bisect_left(hashes, h)
        while i < len(hashes) and hashes[i] == h:
            position = order[i]
            if self._keys[position] == key:
                return self._values[position]
            i += 1
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __repr__(self) -> str:
        return f"steadyload.SharedDict({len(self)} items)"


for _public in (SharedList, SharedDict):
    _public.__module__ = "steadyload"
del _public
