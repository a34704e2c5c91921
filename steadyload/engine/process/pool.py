"""`ProcessPool`: start worker processes, send them tasks, wait for results and deaths at once.

The pool blocks in one place, a poll (`channel.ready`) on every worker's socket and process
sentinel (and the fork server's pidfd), so a death is seen the moment it happens and no
wait can outlive a SIGKILLed worker. Reads never block: each socket is read
by a non-blocking `channel.Reader` that returns only complete messages. Each worker has a
socket of its own rather than one shared result queue: a worker killed while writing to a
shared queue leaves its lock held and a partial message behind, which blocks or corrupts
every other worker; a private socket just closes. The task table (which worker holds which
task) is kept by the caller, `iterators/workers.py`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Collection
from dataclasses import replace
from multiprocessing.context import BaseContext
from typing import Any

from ...host import limits
from ...pickling import unimportable_main_hidden
from ...start import servers
from ...start.launch import StartStalled
from ...start.servers import ServerRef
from ..config import Deferred, WorkerConfig
from ..events import Died, ServerGone
from ..pool import PROCESS, Kind, wait_any
from ..protocol import Reset, Restore, Task
from ..transport import channel
from ..worker.status import Progress, StatusBlock
from .handles import Handle, WorkerView
from .lifecycle import stop_all
from .liveness import ProcessExit, ServerExit
from .server_watch import ServerWatch
from .worker import worker_main

_LOG = logging.getLogger(__name__)
SERVER = -1  # the "worker id" of events about the fork server itself


class ProcessPool:
    """Owns the worker processes of one iterator: start, message, watch, stop.

    Not thread-safe: one thread (the one iterating) drives it. `shutdown` is idempotent,
    resumable if interrupted, and also runs when the pool is garbage-collected or the
    interpreter exits.
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
        self._ctx, self._method = ctx, ctx.get_start_method()
        self._config, self._num_workers = config, num_workers
        self._clock, self._grace_s = clock, grace_s
        self._handles: list[Handle | None] = [None] * num_workers
        self._live: list[Handle] = []  # shared with the finalizer; never reassigned
        server_fds: dict[ServerRef, int] = {}  # shared likewise
        self._servers = ServerWatch(server_fds)
        self._finalizer = weakref.finalize(self, stop_all, self._live, server_fds, grace_s)
        self._deferred: Deferred | None = None
        self.views: list[WorkerView | None] = [None] * num_workers
        """Each worker id's latest process, as ``iterator._workers`` shows it."""
        self.running = False
        self._by_object: dict[Any, tuple[str, Handle | None]] = {}  # of the latest waitables
        self._fired: dict[int, ServerRef] = {}

    @property
    def kind(self) -> Kind:
        """Always "process"."""
        return PROCESS

    @property
    def start_method(self) -> str:
        """The context's start method."""
        return self._method

    @property
    def preload(self) -> tuple[str, ...]:
        """What the fork server was asked to import."""
        return self._config.preload

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start all workers. On failure, those already started are stopped again.

        Raises:
            ServerGone: the fork server died while the workers were starting.
        """
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
        """Start a fresh process for ``worker_id`` (same id, so the same seed).

        Raises:
            ServerGone: the fork server died (its death is reported by the exception).
        """
        old = self._handles[worker_id]
        if old is not None and old in self._live:
            raise RuntimeError(
                f"[steadyload internal error] respawn of live worker {worker_id}; "
                "please report with the output of `steadyload doctor`"
            )
        self._spawn(worker_id)

    def _spawn(self, worker_id: int) -> None:
        try:
            self._start_one(worker_id)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise limits.shared_memory_exhausted(
                worker_id=worker_id,
                error=exc.errno,
                detail=f"{type(exc).__name__}: {exc}",
                where="main process",
                during=f"while starting worker {worker_id}",
            ) from exc

    def _start_one(self, worker_id: int) -> None:
        assert self._deferred is not None
        deferred = self._deferred
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        sock = socket.socket(fileno=os.dup(parent_conn.fileno()))
        parent_conn.close()
        status = StatusBlock.create(worker_id)
        started_at = self._clock()
        process = self._ctx.Process(  # type: ignore[attr-defined]  # BaseContext stubs lack Process
            target=worker_main,
            args=(deferred, child_conn, worker_id),
            name=f"steadyload-worker-{worker_id}",
            daemon=True,
        )
        server = self._servers.watch(self._method)
        try:
            with unimportable_main_hidden():
                process.start()
        except (EOFError, ConnectionError, FileNotFoundError) as exc:
            sock.close()
            status.close()
            # CPython's fork-server client, talking to a server that died in the meantime.
            event = self._server_death(server, wait_s=2.0) if server is not None else None
            if event is not None:
                raise ServerGone(event) from exc
            raise limits.start_refused(worker_id=worker_id, method=self._method, exc=exc) from exc
        except StartStalled as exc:
            sock.close()
            status.close()
            raise limits.start_stalled(worker_id=worker_id, why=str(exc), server_pid=exc.pid,
                                       stopped=exc.stopped) from exc
        except BaseException:
            sock.close()
            status.close()
            raise
        finally:
            child_conn.close()
        try:
            socket.send_fds(sock, [b"S"], [status.fd])
            table = deferred.last_descriptors
            for at in range(0, len(table), channel.MAX_FDS):
                socket.send_fds(sock, [b"F"], table[at : at + channel.MAX_FDS])
        except OSError:
            pass  # died at once; its sentinel will say so
        # CPython restarts a dead fork server at a start: whichever forked it is its server.
        server = self._servers.watch(self._method)
        handle = Handle(worker_id, process, sock, started_at, status, server)
        self._handles[worker_id] = handle
        self.views[worker_id] = handle.view
        self._live.append(handle)
        _LOG.debug("started worker %d (pid %s)", worker_id, process.pid)

    def shutdown(self) -> None:
        """Stop every worker (Stop, then SIGTERM, then SIGKILL). Safe to call more than once;
        if it failed half-way, calling it again finishes the job."""
        self.running = False
        if self._finalizer.alive:
            self._finalizer()  # once: the same call runs at garbage collection or exit
        elif self._live:
            stop_all(self._live, self._servers.fds, self._grace_s)

    @property
    def stopped(self) -> bool:
        """Whether every worker this pool started has exited and been reaped."""
        return not self._live

    # -- the fork server ---------------------------------------------------------------------
    def _server_death(self, server: ServerRef, wait_s: float = 0.0) -> Died | None:
        """If ``server`` has exited (waiting at most ``wait_s``), bury every worker it
        forked and return the one event for it. [Unit: second]"""
        exited, exitcode = self._servers.exited(server, wait_s)
        if not exited:
            return None
        gone = []
        for h in [h for h in self._live if h.server == server]:
            gone.append((h.worker_id, h.pid, h.status.progress()))
            self._live.remove(h)
            h.close_channels()
            h.kill_orphan()  # its parent died, not it: it would run on
            h.finish()
        self._servers.forget(server)
        _LOG.debug("the %s (pid %d) exited with %s", server.method, server.pid, exitcode)
        cause = ServerExit(server.method, server.pid, exitcode, tuple(gone))
        return Died(PROCESS, SERVER, server.pid, None, cause)

    def restart_server(self, method: str, pid: int) -> tuple[str, ...]:
        """A server in place of the dead one (`servers.restart_or_fall_back`); its preloads."""
        module = type(self._config.dataset).__module__
        ctx, preload = servers.restart_or_fall_back(self._ctx, ServerRef(method, pid), module)
        if ctx is not self._ctx:
            self._ctx, self._method = ctx, ctx.get_start_method()
            self._config = replace(self._config, preload=preload)
        return preload

    # -- messaging ---------------------------------------------------------------------------
    def pid(self, worker_id: int) -> int | None:
        """The worker's process id."""
        h = self._handles[worker_id]
        return h.pid if h is not None else None

    def host(self, worker_id: int) -> str | None:
        """None: on this machine."""
        return None

    def pids(self) -> dict[int, int]:
        """worker id -> pid of the live workers (safe to call from another thread)."""
        return {h.worker_id: h.pid for h in list(self._live) if h.pid is not None}

    def started_at(self, worker_id: int) -> float | None:
        """When the worker was asked for, on the pool's clock. [Unit: second]"""
        h = self._handles[worker_id]
        return h.started_at if h is not None else None

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the pool measures with."""
        return self._clock

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Send a task, handing back the segments the parent has finished with."""
        h = self._handles[worker_id]
        assert h is not None
        self._send(h, Task(task_id, indices, h.segments.drain_freed(), epoch))

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Tell a worker where its dataset replica resumes (`WorkerPool.send_restore`)."""
        h = self._handles[worker_id]
        assert h is not None
        self._send(h, Restore(state))

    def send_reset(self) -> None:
        """Tell every worker a new epoch begins (persistent workers)."""
        for h in self._live:
            self._send(h, Reset(h.segments.drain_freed()))

    def _send(self, h: Handle, msg: object) -> None:
        if h in self._live and not h.send(msg):
            # Gone (its sentinel says so next) or not reading for 10 s: replace it; the
            # task table re-sends what it held.
            self.kill(h.worker_id)

    def waitables(self) -> list[Any]:
        """Every live worker's socket and process sentinel, and the fork servers' pidfds."""
        by_object: dict[Any, tuple[str, Handle | None]] = {}
        for h in self._live:
            if not h.reader.closed:
                by_object[h.reader] = ("conn", h)
            by_object[h.process.sentinel] = ("sentinel", h)
        self._fired = {}
        if self._live:
            for fd, server in self._servers.waitables():
                by_object[fd] = ("server", None)
                self._fired[fd] = server
        self._by_object = by_object
        return list(by_object)

    def pending(self) -> bool:
        """Never: every event of a process arrives through a descriptor."""
        return False

    def exit_unreported(self) -> bool:
        """Whether a live worker has exited or is exiting (its sentinel fires later)."""
        return any(h.exiting() for h in self._live)

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """Block until a message or a death arrives, or ``timeout_s`` passes. [Unit: second]"""
        return wait_any((self,), timeout_s)

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """The events behind ``ready``: a protocol message (a `Done` comes back as
        `Received`), `Died`, `ReceiveFailed`, or ``(SERVER, Died)`` once for a fork server
        that died with all its workers (its cause a `ServerExit`). Messages a worker sent
        before it died come first."""
        by_object, fired = self._by_object, self._fired
        ready = [obj for obj in ready if obj in by_object]
        events: list[tuple[int, object]] = []
        for obj in ready:
            kind, owner = by_object[obj]
            if kind == "conn" and owner is not None:
                self._receive(owner, events)
        sentinels = [
            owner for obj in ready for kind, owner in (by_object[obj],)
            if kind == "sentinel" and owner is not None
        ]
        exited = []
        for h in sentinels:
            # Under fork the sentinel can fire a moment before waitpid sees the exit.
            h.process.join(0.05)
            if h.process.exitcode is not None:
                exited.append(h)
        # A fork server reports 255 for each worker when it dies itself; its own exit can
        # lag a moment behind the closing of their sentinels.
        suspects = {fired[obj] for obj in ready if obj in fired}
        suspects |= {h.server for h in exited if h.process.exitcode == 255 and h.server}
        if suspects:
            for live in list(self._live):  # what they sent before the server died counts
                self._receive(live, events)
            for server in suspects:
                died = self._server_death(server, wait_s=1.0)
                if died is not None:
                    events.append((SERVER, died))
        for h in exited:
            if h in self._live:
                self._receive(h, events)  # what it sent before dying comes first
                events.append((h.worker_id, self._bury(h)))
        return events

    @staticmethod
    def _receive(h: Handle, events: list[tuple[int, object]]) -> None:
        events.extend((h.worker_id, event) for event in h.receive())

    def progress(self, worker_id: int) -> Progress | None:
        """What the worker is doing now, from its status block."""
        h = self._handles[worker_id]
        return h.status.progress() if h is not None and h in self._live else None

    def on_its_way(self, worker_id: int) -> bool:
        """Whether a message from the worker is waiting to be read, or half-read."""
        h = self._handles[worker_id]
        if h is None or h not in self._live:
            return False
        return h.reader.partial or bool(channel.ready([h.reader.sock], 0))

    def settle(self) -> None:
        """``worker_type="auto"`` chose: the workers stop measuring (`StatusBlock.settle`)."""
        for h in self._live:
            h.status.settle()

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """A (hung) worker's Python stacks (all threads), waited for at most ``wait_s``;
        faulthandler dumps from a C signal handler, also while C holds the GIL. [Unit: second]"""
        h = self._handles[worker_id]
        if h is None or h not in self._live:
            return ""
        return h.dump_stack(self._clock, wait_s)

    def kill(self, worker_id: int) -> None:
        """SIGKILL the worker; its death arrives as a `Died` event from `wait`."""
        h = self._handles[worker_id]
        if h is not None and h in self._live:
            with contextlib.suppress(OSError, ValueError):
                h.process.kill()

    def _bury(self, h: Handle) -> Died:
        exitcode = h.process.exitcode
        cause = ProcessExit(exitcode, self._method, h.status.stacks(), tuple(h.status.libraries()))
        died = Died(PROCESS, h.worker_id, h.pid, h.status.progress(), cause)
        _LOG.debug("worker %d (pid %s) exited with %s", h.worker_id, h.pid, exitcode)
        self._live.remove(h)
        h.close_channels()
        h.kill_orphan()
        h.finish()
        return died
