"""`Outbox`: events queued in this process (by worker threads, or a remote pool's collector
threads) with a socket that one poll can wait on beside other pools' descriptors."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ..interrupts import interrupts_allowed


class Outbox:
    """The worker threads' events, with two ways to wait for them: `wait` (threads alone:
    an event object, no byte sent per event) and a socket that turns readable when one is queued
    while a poll waits for it (`ThreadPool.waitables`), so one poll can wait for threads,
    processes and a signal together (`HandoverPool`)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[int, int, object]] = queue.SimpleQueue()
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self.armed = False
        """Whether a wait on the socket may come: only then is a byte sent per event (a
        system call saved otherwise). Arm before looking at the queue one last time, and an
        event queued after that look sends its byte."""
        self._waiting = False  # `wait` is under way: an event sets `_queued`
        self._queued = threading.Event()

    def wait(self, timeout_s: float | None) -> None:
        """Block until an event is queued or ``timeout_s`` passes; dequeues nothing, so a
        Ctrl-C landing here loses nothing (engine/interrupts.py). [Unit: second]"""
        self._queued.clear()
        self._waiting = True  # before the last look: an event queued after it sets the flag
        try:
            if self.queue.empty():
                with interrupts_allowed():
                    self._queued.wait(timeout_s)
        finally:
            self._waiting = False

    def put(self, item: tuple[int, int, object]) -> None:
        """Queue an event (any thread)."""
        self.queue.put(item)
        if self._waiting:
            self._queued.set()  # a lock release: cheaper than a byte on the socket
        if not self.armed:
            return
        try:
            self._w.send(b"\0")
        except OSError:  # full (its reader drains it at each wait), or closed at shutdown
            pass

    def fileno(self) -> int:
        """The descriptor to wait on (readable: events may be queued)."""
        return self._r.fileno()

    def drain(self) -> None:
        """Empty the wake-up bytes (the events stay queued)."""
        try:
            while self._r.recv(4096):
                pass
        except OSError:
            pass

    def take(
        self, ready: Collection[Any], generations: Mapping[int, int] | Sequence[int]
    ) -> list[tuple[int, object]]:
        """Every queued event, without blocking: ``(worker_id, event)`` of the workers'
        current generations (a replaced worker's are dropped) and pool-wide ones (worker id
        -1; a `wake`'s empty one dropped). Disarms, and drains the wake-up bytes if the
        poll's ``ready`` saw them."""
        if self.armed:
            self.armed = False
            if self in ready:  # (a byte sent after the poll wakes the next one: harmless)
                self.drain()
        out: list[tuple[int, object]] = []
        while not self.queue.empty():
            worker_id, generation, event = self.queue.get_nowait()
            current = event is not None if worker_id < 0 else generation == generations[worker_id]
            if current:
                out.append((worker_id, event))
        return out

    def wake(self) -> None:
        """End a `wait` under way, without an event (safe from any thread)."""
        self.put((-1, 0, None))

    def close(self) -> None:
        """Close the socket pair (a later `put` still queues; its byte is dropped)."""
        self._r.close()
        self._w.close()
