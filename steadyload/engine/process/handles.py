"""The parent's handle on one worker process: its channel, mappings, status block and pidfd;
and `WorkerView`, what ``iterator._workers`` shows of it (as torch's iterators do).

A handle is torn down in steps that can each be repeated (`request_stop`, `finish`), so an
interrupted teardown resumes where it stopped (docs/design/shutdown.md).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from ...host.system import close_fds, pidfd_open, process_state
from ...start.servers import ServerRef
from ..events import Received, ReceiveFailed
from ..protocol import Done, Stop
from ..transport import channel
from ..transport.segments import SegmentMap
from ..worker.status import StatusBlock


class WorkerView:
    """One worker process as torch's ``iterator._workers`` shows it: pid, exit code, liveness.

    Stays valid after the workers were stopped (the exit code is kept). Libraries and
    torch's tests read it; steadyload itself does not.
    """

    def __init__(self, worker_id: int, process: BaseProcess) -> None:
        self.worker_id = worker_id
        self.name = process.name
        self.pid = process.pid
        self._process: BaseProcess | None = process
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: killed by that signal); None while it runs."""
        if self._process is not None:
            return self._process.exitcode
        return self._exitcode

    def is_alive(self) -> bool:
        """Whether the process is still running."""
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        """Wait at most ``timeout`` seconds for the process to exit. [Unit: second]"""
        if self._process is not None:
            self._process.join(timeout)

    def terminate(self) -> None:
        """Send SIGTERM (a replacement is started, as for any death)."""
        if self._process is not None and self.exitcode is None:
            self._process.terminate()

    def kill(self) -> None:
        """Send SIGKILL (a replacement is started, as for any death)."""
        if self._process is not None and self.exitcode is None:
            self._process.kill()

    def reaped(self, exitcode: int | None) -> None:
        """The pool closed the process object; keep what it said."""
        self._exitcode = exitcode
        self._process = None

    def __repr__(self) -> str:
        return f"<steadyload worker {self.worker_id} pid {self.pid} exitcode {self.exitcode}>"


class Handle:
    """One worker process and the parent's end of its socket."""

    __slots__ = (
        "worker_id", "process", "reader", "segments", "pid", "started_at", "status", "pidfd",
        "view", "stop_sent", "closed", "server",
    )

    def __init__(
        self, worker_id: int, process: BaseProcess, sock: socket.socket, started_at: float,
        status: StatusBlock, server: ServerRef | None,
    ) -> None:
        self.server = server
        """The fork server (or zygote) that forked it; None under fork and spawn."""
        self.worker_id = worker_id
        self.started_at = started_at
        self.status = status
        self.process = process
        self.pid = process.pid
        self.reader = channel.Reader(sock)
        self.segments = SegmentMap()
        self.pidfd = pidfd_open(process.pid)
        self.view = WorkerView(worker_id, process)
        self.stop_sent = False
        self.closed = False

    def send(self, msg: object, timeout_s: float = 10.0) -> bool:
        """Send ``msg``; False when the worker is gone or stopped reading (its death, or the
        kill that follows, is reported by the sentinel). [Unit: second]"""
        if self.closed:
            return False
        try:
            channel.send_bounded(self.reader.sock, msg, timeout_s)
            return True
        except (channel.ChannelClosed, channel.ChannelStuck, OSError):
            return False

    def receive(self) -> list[object]:
        """The worker's complete messages read so far, each `Done` as a `Received` (its batch
        mapped here) or a `ReceiveFailed`; never blocks."""
        try:
            messages = self.reader.read()
        except channel.DescriptorsLost as exc:
            return [ReceiveFailed(None, exc.errno or 0, str(exc), 0)]
        events: list[object] = []
        for msg in messages:
            if not isinstance(msg, Done):
                events.append(msg)
                continue
            try:
                fds = self.reader.take_fds(len(msg.new_segments))
                self.segments.receive(msg.new_segments, fds)
                self.segments.retire(msg.retired)
                batch = self.segments.unpack(msg.payload, msg.segments)
            except OSError as exc:
                detail = f"{type(exc).__name__}: {exc}"
                events.append(
                    ReceiveFailed(msg.task_id, exc.errno or 0, detail, len(msg.new_segments))
                )
                continue
            events.append(Received(msg, batch))
        return events

    def request_stop(self) -> None:
        """Ask the worker to stop and close the parent's end (each done once)."""
        if not self.stop_sent:
            self.stop_sent = True
            self.send(Stop(), timeout_s=0.5)
        self.close_channels()

    def close_channels(self) -> None:
        """Close the socket, the mappings and the status block (once)."""
        if self.closed:
            return
        self.closed = True
        for closer in (self.reader.close, self.segments.close, self.status.close):
            with contextlib.suppress(OSError):
                closer()

    def really_exited(self) -> bool:
        """Whether the process is gone. Under forkserver the exit code comes from the fork
        server, which reports 255 for all its workers when it dies itself, live or not."""
        if self.pidfd is None:
            return self.process.exitcode is not None
        readable, _, _ = select.select([self.pidfd], [], [], 0)
        return bool(readable)

    def exiting(self) -> bool:
        """Whether the process has exited or is exiting: killed, its main thread is a zombie
        while its other threads end, and only then does its pidfd fire."""
        if self.really_exited():
            return True
        return self.pid is not None and process_state(self.pid) in (None, "Z", "X")

    def kill_orphan(self, wait_s: float = 2.0) -> None:
        """SIGKILL the process if it still runs though its exit was reported (its fork
        server died), and wait at most ``wait_s`` for it. [Unit: second]"""
        if self.pidfd is None or self.really_exited():
            return
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        select.select([self.pidfd], [], [], wait_s)

    def finish(self) -> None:
        """Release the process object and the pidfd, keeping the exit code for `view`."""
        exitcode = self.process.exitcode
        with contextlib.suppress(ValueError):
            self.process.join(0)
            self.process.close()  # releases the sentinel's descriptor now, not at GC
        self.view.reaped(exitcode)
        if self.pidfd is not None:
            close_fds([self.pidfd])
            self.pidfd = None

    def dump_stack(self, clock: Callable[[], float], wait_s: float) -> str:
        """SIGUSR1 the worker (faulthandler dumps every thread's stack from a C signal
        handler, even while C code holds the GIL) and return the new text, waiting at most
        ``wait_s`` on ``clock`` for it. [Unit: second]"""
        if self.pid is None:
            return ""
        before = len(self.status.stacks())
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        deadline = clock() + wait_s
        text = self.status.stacks()
        # Bounded wait for an asynchronous signal handler; no event exists to wait on.
        while len(text) <= before and clock() < deadline:
            time.sleep(0.01)
            text = self.status.stacks()
        return text[before:]
