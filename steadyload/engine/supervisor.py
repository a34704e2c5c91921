"""The parent side: start workers, send them tasks, and wait for results and deaths at once.

The supervisor blocks in one place, `multiprocessing.connection.wait` on every worker's pipe
and process sentinel, so a worker's death is seen the moment it happens and no wait can
outlive a SIGKILLed worker. Each worker has a pipe of its own rather than one shared result
queue: a worker killed while writing to a shared queue leaves its lock held and a partial
message behind, which blocks or corrupts every other worker; a private pipe just closes.
The task table (which worker holds which task) is kept by the caller, `iterators/workers.py`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from ..pickling import unimportable_main_hidden
from .config import Deferred, WorkerConfig
from .lifecycle import stop_processes
from .protocol import Done, Reset, Restore, Stop, Task
from .status import Progress, StatusBlock
from .transport import SegmentMap
from .worker import worker_main

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Died:
    """Event: the worker process exited, with what the parent knows about its last moments."""

    exitcode: int | None
    pid: int | None
    progress: Progress | None = None
    stacks: str = ""
    """What faulthandler wrote: a native crash's stack, or a hang dump."""
    libraries: tuple[str, ...] = ()
    """Crash-prone native libraries the worker had loaded."""


def _dup(fd: int) -> int:
    return os.dup(fd)


class _Handle:
    """One worker process and the parent's end of its pipe."""

    __slots__ = (
        "worker_id", "process", "conn", "sock", "segments", "readable", "pid", "started_at",
        "status",
    )

    def __init__(
        self, worker_id: int, process: BaseProcess, conn: Connection, started_at: float,
        status: StatusBlock,
    ) -> None:
        self.worker_id = worker_id
        self.started_at = started_at
        self.status = status
        self.process = process
        self.pid = process.pid
        self.conn = conn
        self.sock = socket.socket(fileno=_dup(conn.fileno()))
        self.segments = SegmentMap()
        self.readable = True

    def close_channels(self) -> None:
        for closer in (self.conn.close, self.sock.close, self.segments.close, self.status.close):
            try:
                closer()
            except OSError:
                pass


def _shutdown(handles: list[_Handle], grace_s: float) -> None:
    """Stop the workers in ``handles``; also run by the finalizer at interpreter exit."""
    if not handles:
        return
    _LOG.debug("stopping %d workers", len(handles))
    for h in handles:
        try:
            h.conn.send(Stop())
        except (OSError, ValueError):
            pass  # dead already, or pipe closed
    for h in handles:
        h.close_channels()
    stop_processes([h.process for h in handles], grace_s=grace_s)
    handles.clear()


class Supervisor:
    """Owns the worker processes of one iterator: start, message, watch, stop.

    Not thread-safe: one thread (the one iterating) drives it. `shutdown` is idempotent and
    also runs when the supervisor is garbage-collected or the interpreter exits.
    """

    def __init__(
        self,
        ctx: BaseContext,
        config: WorkerConfig,
        num_workers: int,
        *,
        grace_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ctx = ctx
        self._config = config
        self._num_workers = num_workers
        self._clock = clock
        self._handles: list[_Handle | None] = [None] * num_workers
        self._live: list[_Handle] = []  # shared with the finalizer; never reassigned
        self._finalizer = weakref.finalize(self, _shutdown, self._live, grace_s)
        self._deferred: Deferred | None = None
        self.running = False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start all workers. On failure, those already started are stopped again."""
        cfg = self._config
        self._deferred = Deferred(
            cfg,
            {"dataset": cfg.dataset, "collate_fn": cfg.collate_fn,
             "worker_init_fn": cfg.worker_init_fn},
        )
        try:
            for worker_id in range(self._num_workers):
                self._spawn(worker_id)
        except BaseException:
            self.shutdown()
            raise
        self.running = True

    def respawn(self, worker_id: int) -> None:
        """Start a fresh process for ``worker_id`` (same id, so the same seed)."""
        old = self._handles[worker_id]
        if old is not None and old in self._live:
            raise RuntimeError(
                f"[steadyload internal error] respawn of live worker {worker_id}; "
                "please report with the output of `steadyload doctor`"
            )
        self._spawn(worker_id)

    def _spawn(self, worker_id: int) -> None:
        assert self._deferred is not None
        deferred = self._deferred
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        status = StatusBlock.create(worker_id)
        started_at = self._clock()
        process = self._ctx.Process(  # type: ignore[attr-defined]  # BaseContext stubs lack Process
            target=worker_main,
            args=(deferred, child_conn, worker_id),
            name=f"steadyload-worker-{worker_id}",
            daemon=True,
        )
        try:
            with unimportable_main_hidden():
                process.start()
        except BaseException:
            parent_conn.close()
            status.close()
            raise
        finally:
            child_conn.close()
        handle = _Handle(worker_id, process, parent_conn, started_at, status)
        try:
            socket.send_fds(handle.sock, [b"S"], [status.fd])
        except OSError:
            pass  # died at once; its sentinel will say so
        self._handles[worker_id] = handle
        self._live.append(handle)
        _LOG.debug("started worker %d (pid %s)", worker_id, process.pid)

    def shutdown(self) -> None:
        """Stop every worker (Stop, then SIGTERM, then SIGKILL). Safe to call more than once."""
        self.running = False
        self._finalizer()

    # -- messaging ---------------------------------------------------------------------------
    def pid(self, worker_id: int) -> int | None:
        """The worker's process id."""
        h = self._handles[worker_id]
        return h.pid if h is not None else None

    def pids(self) -> dict[int, int]:
        """worker id -> pid of the live workers (safe to call from another thread)."""
        return {h.worker_id: h.pid for h in list(self._live) if h.pid is not None}

    def started_at(self, worker_id: int) -> float | None:
        """When the worker was asked for, on the supervisor's clock. [Unit: second]"""
        h = self._handles[worker_id]
        return h.started_at if h is not None else None

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the supervisor measures with."""
        return self._clock

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Send a task, handing back the segments the parent has finished with."""
        h = self._handles[worker_id]
        assert h is not None
        self._send(h, Task(task_id, indices, h.segments.drain_freed(), epoch))

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Tell a replacement worker where its IterableDataset stream resumes."""
        h = self._handles[worker_id]
        assert h is not None
        self._send(h, Restore(state))

    def send_reset(self) -> None:
        """Tell every worker a new epoch begins (persistent workers)."""
        for h in self._live:
            self._send(h, Reset(h.segments.drain_freed()))

    def _send(self, h: _Handle, msg: object) -> None:
        try:
            h.conn.send(msg)
        except OSError:
            # The worker died; its sentinel reports that on the next wait.
            h.readable = False

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """Block until a message or a death arrives, or ``timeout_s`` passes. [Unit: second]

        Returns ``(worker_id, event)`` pairs: a protocol message (a `Done` comes back as
        ``(done, batch)``) or `Died`. Messages a worker sent before it died come first.
        """
        by_object: dict[Any, tuple[str, _Handle]] = {}
        for h in self._live:
            if h.readable:
                by_object[h.conn] = ("conn", h)
            by_object[h.process.sentinel] = ("sentinel", h)
        if not by_object:
            return []
        events: list[tuple[int, object]] = []
        ready = wait(list(by_object), timeout=timeout_s)
        for obj in ready:
            kind, h = by_object[obj]
            if kind == "conn":
                self._receive(h, events)
        for obj in ready:
            kind, h = by_object[obj]
            if kind == "sentinel" and h in self._live:
                # Under fork the sentinel can fire a moment before waitpid sees the exit.
                h.process.join(0.05)
                if h.process.exitcode is not None:
                    self._receive_all(h, events)  # what it sent before dying comes first
                    events.append((h.worker_id, self._bury(h)))
        return events

    def _receive_all(self, h: _Handle, events: list[tuple[int, object]]) -> None:
        while h.readable:
            try:
                if not h.conn.poll(0):
                    return
            except (OSError, EOFError):
                h.readable = False
                return
            self._receive(h, events)

    def _receive(self, h: _Handle, events: list[tuple[int, object]]) -> None:
        try:
            msg = h.conn.recv()
            if isinstance(msg, Done):
                if msg.new_segments:
                    h.segments.receive(h.sock, msg.new_segments)
                h.segments.retire(msg.retired)
                batch = h.segments.unpack(msg.payload, msg.segments)
                events.append((h.worker_id, (msg, batch)))
                return
        except (EOFError, OSError):
            h.readable = False  # the process is exiting; its sentinel will say how
            return
        events.append((h.worker_id, msg))

    def progress(self, worker_id: int) -> Progress | None:
        """What the worker is doing now, from its status block."""
        h = self._handles[worker_id]
        return h.status.progress() if h is not None and h in self._live else None

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """Ask a (hung) worker for the Python stacks of all its threads, and return them.

        faulthandler dumps from a C signal handler, so this works even while the worker is
        stuck in C code holding the GIL. Waits at most ``wait_s`` for the text. [Unit: second]
        """
        h = self._handles[worker_id]
        if h is None or h not in self._live or h.pid is None:
            return ""
        before = len(h.status.stacks())
        try:
            os.kill(h.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        deadline = self._clock() + wait_s
        text = h.status.stacks()
        # Bounded wait for an asynchronous signal handler; no event exists to wait on.
        while len(text) <= before and self._clock() < deadline:
            time.sleep(0.01)
            text = h.status.stacks()
        return text[before:]

    def kill(self, worker_id: int) -> None:
        """SIGKILL the worker; its death arrives as a `Died` event from `wait`."""
        h = self._handles[worker_id]
        if h is not None and h in self._live:
            try:
                h.process.kill()
            except (OSError, ValueError):
                pass

    def _bury(self, h: _Handle) -> Died:
        died = Died(
            exitcode=h.process.exitcode,
            pid=h.pid,
            progress=h.status.progress(),
            stacks=h.status.stacks(),
            libraries=tuple(h.status.libraries()),
        )
        _LOG.debug("worker %d (pid %s) exited with %s", h.worker_id, h.pid, died.exitcode)
        self._live.remove(h)
        h.close_channels()
        stop_processes([h.process], grace_s=0)
        return died
