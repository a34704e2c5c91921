"""`SharedList` and `SharedDict`: records packed once into shared memory, read without copies.

A dataset that keeps its metadata (file names, captions, boxes) in Python lists and dicts
pays for it once per worker: forkserver and spawn workers each unpickle a full copy, and
forked workers copy the pages as they touch the objects' reference counts (the
copy-on-read effect, pytorch issue 13246). `SharedList` packs the records into one
anonymous shared-memory file (memfd): a header, an int64 offsets table and the records'
bytes (str and bytes stored as such, anything else pickled). Workers receive a file
descriptor, not the data, and map the same pages; reading a record touches no Python
object of the others. The memory goes when the last process lets go; nothing is ever
created in /dev/shm, so nothing can be left there.

Costs, honestly: building packs every record once (pickle for non-str/bytes). Reading
decodes the record each time (a str is decoded from UTF-8, other objects unpickled), so a
read is a few times slower than indexing a list; slices build lists. The contents are
read-only. `SharedDict` finds keys by a sorted table of 64-bit hashes: O(log n).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import pickle
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from multiprocessing import context, reduction
from typing import Any, overload

_STR, _BYTES, _PICKLE = 0, 1, 2
_HEADER = struct.Struct("<8sQQQ")  # magic, count, data offset, flags
_MAGIC = b"slshlst2"
_ALL_STR = 1  # flag: every record is a str, stored without a tag byte (the fast path)


def _encode(record: Any) -> bytes:
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

    Args:
        records: any picklable objects; str and bytes are stored without pickling.
    """

    __slots__ = ("_fd", "_mm", "_count", "_offsets", "_data", "_all_str", "__weakref__")

    def __init__(self, records: Iterable[Any]) -> None:
        items = list(records)
        all_str = all(type(r) is str for r in items)
        if all_str:
            encoded = [r.encode("utf-8", "surrogatepass") for r in items]
        else:
            encoded = [_encode(r) for r in items]
        del items
        count = len(encoded)
        offsets_at = _HEADER.size
        data_at = offsets_at + 8 * (count + 1)
        total = data_at + sum(len(e) for e in encoded)
        fd = os.memfd_create("steadyload-sharedlist", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(total, 1))
            mm = mmap.mmap(fd, max(total, 1))
        except BaseException:
            os.close(fd)
            raise
        _HEADER.pack_into(mm, 0, _MAGIC, count, data_at, _ALL_STR if all_str else 0)
        # Offsets are absolute (from the start of the segment): one addition less per read.
        offsets = memoryview(mm)[offsets_at:data_at].cast("q")
        position = data_at
        for i, e in enumerate(encoded):
            offsets[i] = position
            mm[position : position + len(e)] = e
            position += len(e)
        offsets[count] = position
        offsets.release()
        self._attach(fd, mm)

    def _attach(self, fd: int, mm: mmap.mmap) -> None:
        magic, count, data_at, flags = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise ValueError("not a steadyload.SharedList segment")
        self._fd = fd
        self._mm = mm
        self._count = count
        view = memoryview(mm)
        self._offsets = view[_HEADER.size : data_at].cast("q")
        self._data = view
        self._all_str = bool(flags & _ALL_STR)

    @classmethod
    def _from_fd(cls, fd: int) -> SharedList:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        obj = cls.__new__(cls)
        obj._attach(fd, mm)
        return obj

    def __len__(self) -> int:
        return self._count

    def _get(self, i: int) -> Any:
        offsets = self._offsets
        raw = self._mm[offsets[i] : offsets[i + 1]]
        if self._all_str:
            return raw.decode("utf-8", "surrogatepass")
        tag = raw[0]
        if tag == _STR:
            return raw[1:].decode("utf-8", "surrogatepass")
        if tag == _BYTES:
            return raw[1:]
        return pickle.loads(raw[1:])

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        # The hot path (a str by int index) is inlined: this runs once per sample.
        if isinstance(index, int):
            i: int = index + self._count if index < 0 else index
            if 0 <= i < self._count:
                if self._all_str:
                    offsets = self._offsets
                    return self._mm[offsets[i] : offsets[i + 1]].decode("utf-8", "surrogatepass")
                return self._get(i)
            raise IndexError(f"SharedList index {index} out of range (len {self._count})")
        if isinstance(index, slice):
            return [self._get(i) for i in range(*index.indices(self._count))]
        return self[index.__index__()]  # numpy and torch integers

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._count):
            yield self._get(i)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if context.get_spawning_popen() is not None:
            # Starting a worker: send the file descriptor, not the records.
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
            self._offsets.release()
            self._data.release()
            self._mm.close()
            os.close(self._fd)
        except (AttributeError, BufferError, OSError, ValueError):
            pass  # half-built, or a record view is still held: the mapping goes with it


def _rebuild_shared(dupfd: Any) -> SharedList:
    return SharedList._from_fd(dupfd.detach())


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
        self._hashes = SharedList([struct.pack(f"<{len(hashed)}q", *(h for h, _ in hashed))])
        self._order = SharedList([struct.pack(f"<{len(hashed)}q", *(i for _, i in hashed))])

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: Any) -> Any:
        import bisect

        hashes = memoryview(self._hashes[0]).cast("q")
        order = memoryview(self._order[0]).cast("q")
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
