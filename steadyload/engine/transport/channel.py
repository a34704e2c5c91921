"""Framed messages on a worker's socket: reads that never block, descriptors that ride along.

Each worker has one Unix socketpair with the parent. A frame is what
`multiprocessing.connection.Connection` writes (a 4-byte big-endian length, or -1 and an
8-byte length, then the pickled object), so either side may read with a ``Connection``;
the worker's reader thread does. A message that carries file descriptors (a `Done` with new
shared-memory segments) sends them with its first byte, in the same ``sendmsg``.

The parent reads through a `Reader`: non-blocking, it takes whatever bytes and descriptors
have arrived and returns only complete frames, so a worker stopped or killed half-way
through a message can never block the parent (the rest of the frame, or the worker's death,
arrives as a later event). Descriptors the kernel had to drop because this process ran out
of them (``MSG_CTRUNC``) raise `DescriptorsLost` instead of vanishing.
"""

from __future__ import annotations

import array
import collections
import errno
import math
import os
import pickle
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")
MAX_FDS = 253  # Linux SCM_MAX_FD: descriptors in one message
_CHUNK = 1 << 18
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_CTRUNC = int(socket.MSG_CTRUNC)  # an int: ``flags & socket.MSG_CTRUNC`` makes an enum per read


class ChannelClosed(Exception):
    """The worker's end of the socket is closed (it exited, or is exiting)."""


class DescriptorsLost(OSError):
    """The kernel dropped descriptors sent to this process: it had no free descriptor slot."""


class ChannelStuck(OSError):
    """A send did not complete in time: the worker stopped reading its socket."""


def frame(obj: Any) -> list[bytes]:
    """``obj`` as a frame: [length header, pickle].

    Plain pickle, not multiprocessing's ForkingPickler: messages hold plain values (a
    batch's tensors travel in shared memory, `transport.py`), and ForkingPickler builds a
    pickler and a dispatch table per call, a few microseconds on every task and batch.
    """
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(body)
    head = _LENGTH.pack(n) if n <= 0x7FFFFFFF else _LENGTH.pack(-1) + _LONG_LENGTH.pack(n)
    return [head, body]


def send(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    """Send ``obj`` (and ``fds`` with its first byte) on a blocking socket: the worker side."""
    parts = frame(obj)
    total = sum(len(p) for p in parts)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg(parts, ancillary)
    if sent < total:  # a stream socket may take part of a large frame; the fds went first
        sock.sendall(b"".join(parts)[sent:])


def send_bounded(sock: socket.socket, obj: Any, timeout_s: float) -> None:
    """Send ``obj`` on a non-blocking socket, waiting at most ``timeout_s`` for room.

    The parent side: a worker's reader thread drains its socket at once, so waiting means
    the worker is frozen (SIGSTOP, a native call holding the GIL for long).

    Raises:
        ChannelClosed: the worker's end is gone.
        ChannelStuck: no room within ``timeout_s``. [Unit: second]
    """
    data = memoryview(b"".join(frame(obj)))
    deadline = time.monotonic() + timeout_s
    while data:
        try:
            data = data[sock.send(data):]
            continue
        except (BlockingIOError, InterruptedError):
            pass
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChannelClosed(str(exc)) from None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChannelStuck(errno.ETIMEDOUT, f"the worker read nothing for {timeout_s} s")
        select.select([], [sock], [], remaining)


def ready(objects: Sequence[Any], timeout_s: float | None) -> list[Any]:
    """Those of ``objects`` (descriptors, or objects with ``fileno()``) readable, hung up or
    in error within ``timeout_s`` (None: no limit), as `multiprocessing.connection.wait`
    answers, without the selector that builds per call (tens of microseconds a batch).
    Interrupted by a signal whose handler raises (``KeyboardInterrupt``). [Unit: second]
    """
    poller = select.poll()
    by_fd: dict[int, Any] = {}
    for obj in objects:
        fd = obj if isinstance(obj, int) else obj.fileno()
        by_fd[fd] = obj
        poller.register(fd, select.POLLIN)
    ms = None if timeout_s is None else max(0, math.ceil(timeout_s * 1e3))
    return [by_fd[fd] for fd, _ in poller.poll(ms)]


class Reader:
    """The parent's end of one worker's socket: complete frames as they arrive, never blocking.

    Not thread-safe (the iterating thread owns it). Descriptors are kept in arrival order;
    the message that announced them takes them with `take_fds`.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._buffer = bytearray()
        self._fds: collections.deque[int] = collections.deque()
        self.closed = False
        """EOF was read: the worker's end is gone (frames already complete still count)."""

    def fileno(self) -> int:
        """The socket's descriptor (for `ready`)."""
        return self.sock.fileno()

    def read(self) -> list[Any]:
        """Read what has arrived and return the complete frames, unpickled, in order.

        Raises:
            DescriptorsLost: descriptors sent to this process were dropped (out of them).
        """
        while not self.closed:
            try:
                data, ancillary, flags, _ = self.sock.recvmsg(_CHUNK, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                self.closed = True
                break
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    self._fds.extend(fds)
            if flags & _CTRUNC:
                self.close_fds()
                raise DescriptorsLost(
                    errno.EMFILE, "descriptors sent by a worker were dropped by the kernel"
                )
            if not data:
                self.closed = True
                break
            self._buffer += data
        return self._frames()

    def _frames(self) -> list[Any]:
        out = []
        buffer = self._buffer
        at = 0
        while True:
            if len(buffer) - at < _LENGTH.size:
                break
            (n,) = _LENGTH.unpack_from(buffer, at)
            head = _LENGTH.size
            if n == -1:
                if len(buffer) - at < head + _LONG_LENGTH.size:
                    break
                (n,) = _LONG_LENGTH.unpack_from(buffer, at + head)
                head += _LONG_LENGTH.size
            if len(buffer) - at < head + n:
                break
            with memoryview(buffer) as view, view[at + head : at + head + n] as body:
                out.append(pickle.loads(body))
            at += head + n
        if at:
            del buffer[:at]
        return out

    @property
    def partial(self) -> bool:
        """Bytes of an incomplete frame are waiting for the rest."""
        return bool(self._buffer)

    def take_fds(self, count: int) -> list[int]:
        """The next ``count`` descriptors received, in order (the caller owns them).

        Raises:
            DescriptorsLost: fewer arrived (the sender closed before they came).
        """
        if len(self._fds) < count:
            raise DescriptorsLost(
                errno.EBADMSG, f"a message announced {count} descriptors, {len(self._fds)} came"
            )
        return [self._fds.popleft() for _ in range(count)]

    def close_fds(self) -> None:
        """Close descriptors received and not taken."""
        while self._fds:
            try:
                os.close(self._fds.popleft())
            except OSError:
                pass

    def close(self) -> None:
        """Close the socket and any descriptors not taken. Safe to call more than once."""
        self.closed = True  # `read` then returns only the frames already complete
        self.close_fds()
        self.sock.close()
