"""Batches across processes: the parent's mappings of a worker's segments, and what crosses.

Worker side (`arena.py`), an `Arena` owns a few segments (memfd: anonymous shared memory
with no name in /dev/shm, so nothing can be left behind there whatever gets killed, and the
/dev/shm size limit of containers does not apply); collate writes big batches straight
into them and `storage_table.pack` writes the payload: a pickle whose tensors are rows of a
storage table, small storages inline.

Parent side, a `SegmentMap` maps each segment once (its file descriptor arrives over the
socket with SCM_RIGHTS) and rebuilds each storage of the table as a view of the mapping:
no copy. Every such storage has a `weakref.finalize`; a segment goes back to the worker
(with its next task) when the last storage in it dies, and only then may the worker reuse
it. A segment that stays partly alive (the user keeps one tensor of a batch) has the pages
of its dead storages returned to the system after `PUNCH_AFTER` tasks, never at once: the
common case, a whole batch dropped, hands the segment back with its pages resident, ready
for the next batch. docs/design/shm.md has the lifecycle.
"""

from __future__ import annotations

import collections
import mmap
import os
import pickle
import socket
import threading
import weakref
from typing import Any

import numpy as np
import torch

from . import storage_table
from .arena import Arena, Segment

__all__ = ["HAVE_MEMFD", "Arena", "SegmentMap", "announce", "announced"]

HAVE_MEMFD = hasattr(os, "memfd_create") and hasattr(socket.socket, "sendmsg")
PUNCH_AFTER = 4
"""Tasks sent to a worker after which the dead storages of a partly alive segment have their
pages returned (a batch whose tensors die a few steps apart is not worth punching)."""
_CAN_PUNCH = hasattr(mmap, "MADV_REMOVE")
_PAGE = mmap.PAGESIZE


def announce(segments: list[Segment]) -> list[int]:
    """The descriptors of new segments, to send with the `Done` that announces them."""
    return [s.fd for s in segments if s.fd is not None]


def announced(segments: list[Segment]) -> None:
    """The parent has the descriptors (the mappings here keep their own): close ours."""
    for s in segments:
        if s.fd is not None:
            os.close(s.fd)
            s.fd = None


class _Held:
    """A segment in which storages of a batch the parent received are still alive."""

    __slots__ = ("mm", "live", "dead", "since", "pinned", "retired")

    def __init__(self, mm: mmap.mmap, pinned: bool) -> None:
        self.mm = mm
        self.live = 0
        self.dead: list[tuple[int, int]] = []  # (offset, nbytes) of storages that died
        self.since = 0  # the drain at which the first of them was seen
        self.pinned = pinned  # the worker still views it: its pages must never be returned
        self.retired = False  # the worker closed it: never hand it back


class SegmentMap:
    """The parent's mappings of one worker process's segments, and what still lives in them.

    One thread (the pool's) calls every method; storages die in any thread, and their
    finalizers only queue the event until `drain_freed` (after `close`, they settle it).
    """

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._held: dict[int, _Held] = {}
        self._partial: dict[int, _Held] = {}  # held segments with dead storages to punch
        # Appended to from weakref callbacks (any thread); deque.append is atomic.
        self._dead: collections.deque[tuple[int, int, int]] = collections.deque()
        self._freed: list[int] = []
        self._lock = threading.Lock()
        self._drains = 0
        self._closed = False
        self.punched = 0
        """Bytes whose pages were returned early (dead storages of partly kept batches)."""

    def receive(self, segments: tuple[Any, ...], fds: list[int]) -> None:
        """Map the segments a `Done` announced, from the descriptors that came with it.

        Closes the descriptors (each mapping keeps its own). Raises `OSError` as mmap does
        (EMFILE: out of descriptors; ENOMEM: out of mappings or address space); segments
        mapped before the failure stay mapped.
        """
        try:
            for new, fd in zip(segments, fds, strict=True):
                self._maps[new.segment_id] = mmap.mmap(fd, new.nbytes)
        finally:
            for fd in fds:
                os.close(fd)

    def retire(self, segment_ids: tuple[int, ...]) -> None:
        """Forget segments the worker closed (live tensors keep their own reference)."""
        for segment_id in segment_ids:
            self._maps.pop(segment_id, None)
            held = self._held.get(segment_id)
            if held is not None:
                held.retired = True

    def unpack(self, payload: bytes, segments: tuple[int, ...]) -> Any:
        """Rebuild a batch; its storages are views of the segments, lent until they die."""
        parsed = storage_table.parse(payload)
        if parsed is None:  # no shared memory: a plain pickle
            return pickle.loads(payload)
        storages: list[torch.UntypedStorage | None] = []
        for segment_id, offset, nbytes in parsed.storages:
            if segment_id == storage_table.INLINE:
                storages.append(None)  # made by the unpickler: it owns its bytes
                continue
            held = self._held.get(segment_id)
            if held is None:
                pinned = segment_id in parsed.pinned
                held = self._held[segment_id] = _Held(self._maps[segment_id], pinned)
            base = np.frombuffer(held.mm, np.uint8, nbytes, offset)
            weakref.finalize(base, self._died, segment_id, offset, nbytes).atexit = False
            held.live += 1
            storages.append(torch.from_numpy(base).untyped_storage())
        for segment_id in segments:
            if segment_id not in self._held:  # nothing of the batch lives there
                self._freed.append(segment_id)
        return storage_table.unpack(payload, parsed, storages)

    def _died(self, segment_id: int, offset: int, nbytes: int) -> None:
        # A weakref callback, in whatever thread dropped the storage: queue it only, unless
        # no `drain_freed` will come any more.
        self._dead.append((segment_id, offset, nbytes))
        if self._closed:
            self._settle()

    def _settle(self) -> None:
        """Count the queued deaths. Never blocks: a finalizer may run while the lock's
        holder (this thread or another) is inside; the holder then takes its event too."""
        dead = self._dead
        while dead and self._lock.acquire(blocking=False):
            try:
                while dead:
                    segment_id, offset, nbytes = dead.popleft()
                    held = self._held.get(segment_id)
                    if held is None:
                        continue
                    held.live -= 1
                    if held.live == 0:
                        del self._held[segment_id]
                        self._partial.pop(segment_id, None)
                        if not (held.retired or self._closed):
                            self._freed.append(segment_id)
                        continue
                    held.dead.append((offset, nbytes))
                    if segment_id not in self._partial:
                        held.since = self._drains
                        self._partial[segment_id] = held
                    if self._closed:  # no worker will reuse it: no reason to wait
                        self._punch(segment_id, held)
            finally:
                self._lock.release()

    def _punch(self, segment_id: int, held: _Held) -> None:
        """Return the pages wholly inside the dead storages of a partly alive segment.

        MADV_REMOVE frees them in every mapping (they read as zeros, which no live storage
        can see: only whole pages inside dead ones go). Caller holds the lock.
        """
        self._partial.pop(segment_id, None)
        dead, held.dead = held.dead, []
        if held.pinned or not _CAN_PUNCH:
            return
        for offset, nbytes in dead:
            start = -(-offset // _PAGE) * _PAGE
            end = (offset + nbytes) // _PAGE * _PAGE
            if end > start:
                try:
                    held.mm.madvise(mmap.MADV_REMOVE, start, end - start)
                except OSError:  # not supported here: the pages go with the segment
                    return
                self.punched += end - start

    def drain_freed(self) -> tuple[int, ...]:
        """Segment ids freed since the last call, to hand back to the worker.

        Called once per task sent; also returns the pages of storages dead for
        `PUNCH_AFTER` calls in segments that something else keeps alive.
        """
        self._drains += 1
        self._settle()
        with self._lock:
            for segment_id, held in list(self._partial.items()):
                if self._drains - held.since >= PUNCH_AFTER:
                    self._punch(segment_id, held)
            out, self._freed = tuple(self._freed), []
        return out

    def close(self) -> None:
        """Drop all mappings; memory still viewed by live tensors stays valid.

        From now on, dead storages of partly alive segments have their pages returned at
        once (no worker will reuse them).
        """
        self._closed = True
        self._maps.clear()
        with self._lock:
            for segment_id, held in list(self._partial.items()):
                self._punch(segment_id, held)
        self._settle()  # after the lock: deaths queued meanwhile are not left behind
