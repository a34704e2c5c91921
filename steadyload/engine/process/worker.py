"""A worker process: its set-up and its `loop.Link`. Module-level functions only (picklable
by name).

A worker reads messages on a small reader thread, so that the parent's sends never block on
a busy worker (and a busy worker still notices the parent's death), and runs the one worker
loop (../worker/loop.py, started by ../worker/serve.py, which seeds it as torch's
`_worker_loop` does) on its main thread: fetch the batch, pack it into shared memory, send
it. It exits on `Stop`, on EOF from the parent, or, from the reader thread, as soon as the
parent process is gone. What the worker is doing (task, sample, since when) is kept in its
status block (../worker/status.py), which the parent reads after a death or a hang.
"""

from __future__ import annotations

import errno
import gc
import logging
import multiprocessing
import os
import queue
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ...diagnosis.describe import describe_exception, format_traceback
from ...memory import descriptors
from ..config import Deferred, WorkerConfig
from ..protocol import Done, NewSegment, Ready, Retire, StartFailed, Stop
from ..transport import channel
from ..transport.segments import HAVE_MEMFD, Arena, announce, announced
from ..worker import torch_hooks
from ..worker.memory_cap import MemoryCap
from ..worker.serve import serve
from ..worker.status import WorkerStatus


class _WorkerTag(logging.Filter):
    """Prefix worker log records with ``[steadyload worker N pid P]``."""

    def __init__(self, worker_id: int) -> None:
        super().__init__()
        self._tag = f"[steadyload worker {worker_id} pid {os.getpid()}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self._tag):
            record.msg = self._tag + str(record.msg)
        return True


_STOP_GRACE_S = 0.25


def _read_loop(conn: Connection, inbox: queue.SimpleQueue[Any], stopped: threading.Event) -> None:
    """Reader thread: move messages to ``inbox``; end the process if the parent dies."""
    parent = multiprocessing.parent_process()
    watch: list[Any] = [conn] + ([parent.sentinel] if parent is not None else [])
    while True:
        ready = channel.ready(watch, None)
        if conn in ready:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = Stop()
            inbox.put(msg)
            if not isinstance(msg, Stop):
                continue
            # The parent wants no more results. If the main thread is inside a long
            # task it cannot see the Stop; finishing the task would only delay shutdown.
            if not stopped.wait(_STOP_GRACE_S):
                _exit_now()
            return
        if ready:
            _exit_now()  # the parent is gone: nobody wants our results


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not keep us alive
            pass
    os._exit(0)


def _preload_missing(requested: tuple[str, ...]) -> tuple[str, ...] | None:
    if not requested:
        return None
    from ...start.server_hooks import probe

    if not probe.IN_FORK_SERVER:
        return None  # the fork server was not started by steadyload: unknown
    return tuple(m for m in requested if m not in probe.IMPORTED)


def _receive_descriptors(sock: socket.socket, count: int) -> bool:
    """The shared lists' descriptors, sent beside the arguments (memory/descriptors.py);
    False when the parent is gone. Raises EMFILE when the kernel dropped some."""
    fds: list[int] = []
    while len(fds) < count:
        _, got, flags, _ = socket.recv_fds(sock, 1, channel.MAX_FDS)
        fds.extend(got)
        if flags & socket.MSG_CTRUNC or not got:
            descriptors.install(fds)
            descriptors.close_unused()
            if not got and not flags & socket.MSG_CTRUNC:
                return False  # EOF: the parent is gone
            raise OSError(
                errno.EMFILE,
                f"the worker received {len(fds)} of the {count} descriptors of the "
                "dataset's SharedLists",
            )
    descriptors.install(fds)
    return True


def worker_main(deferred: Deferred, conn: Connection, worker_id: int) -> None:
    """Entry point of a worker process."""
    # Ctrl-C goes to the whole process group; the parent decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    # First on the socket: the status block (stack dumps go there from now on).
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        return  # the parent is gone already
    status = WorkerStatus(fds[0])
    try:
        if not _receive_descriptors(sock, deferred.descriptors):
            return
        cfg: WorkerConfig = deferred.get()
        descriptors.close_unused()
    except BaseException as exc:
        type_name, text = describe_exception(exc)
        channel.send(
            sock,
            StartFailed(
                type_name=type_name,
                text=text,
                traceback=format_traceback(exc),
                errno=exc.errno if isinstance(exc, OSError) else None,
            ),
        )
        return
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stopped = threading.Event()
    threading.Thread(
        target=_read_loop, args=(conn, inbox, stopped), name="steadyload-reader", daemon=True
    ).start()
    logging.getLogger("steadyload").addFilter(_WorkerTag(worker_id))

    arena = Arena(worker_id)
    if HAVE_MEMFD:
        torch_hooks.route_shared_storage(arena)
    link = ProcessLink(sock, inbox, arena, cfg)
    try:
        serve(
            cfg, cfg.dataset, worker_id, link, status, process_wide=True, method="multiprocessing"
        )
    finally:
        stopped.set()
        sock.close()


class ProcessLink:
    """A worker process's `loop.Link`: messages from the reader thread, outcomes over the
    socket, batches packed into the arena's shared memory (one copy at most)."""

    keeps_objects = False

    def __init__(
        self,
        sock: socket.socket,
        inbox: queue.SimpleQueue[Any],
        arena: Arena,
        cfg: WorkerConfig,
    ) -> None:
        self._sock = sock
        self._inbox = inbox
        self._arena = arena
        self._preload = cfg.preload
        cap = cfg.max_memory_bytes
        self._cap = MemoryCap(cap) if cap is not None else None

    def ready(self) -> None:
        """Set-up done: freeze what it made, then say `Ready`."""
        # Keep later collections off the objects made so far (the dataset; under fork, the
        # parent's whole heap): a full collection writes to every object it traverses and
        # un-shares its page. See start/server_hooks/freeze.py.
        gc.freeze()
        self.send(Ready(pid=os.getpid(), preload_missing=_preload_missing(self._preload)))

    def receive(self) -> object:
        """The next message the reader thread took off the socket."""
        return self._inbox.get()

    def send(self, msg: object) -> None:
        """Send ``msg`` to the parent."""
        channel.send(self._sock, msg)

    def release(self, freed: tuple[int, ...]) -> None:
        """The parent is done with these segments."""
        self._arena.release(freed)

    def begin_task(self) -> None:
        """Collate's shared storage goes to this batch's segments from now on."""
        self._arena.begin_task()

    def cancel_task(self) -> None:
        """No batch: its segments are free again once nothing here views them."""
        if self._arena.active:
            self._arena.end_task(sent=False)

    def pack(self, data: Any) -> Any:
        """The batch as a payload whose tensors live in shared segments."""
        return self._arena.pack(data) if HAVE_MEMFD else ForkingPickler.dumps(data)

    def send_batch(self, done: Done, packed: Any) -> None:
        """Send ``done`` with the payload, and the descriptors of segments new to the parent."""
        arena = self._arena
        used, new, retired = arena.end_task(sent=True)
        fds = announce(new)
        channel.send(
            self._sock,
            Done(
                task_id=done.task_id,
                payload=arena.seal(packed) if HAVE_MEMFD else bytes(packed),
                segments=used,
                new_segments=tuple(NewSegment(s.segment_id, s.nbytes) for s in new),
                retired=retired,
                skipped=done.skipped,
                stream_state=done.stream_state,
                samples=done.samples,
                load_s=done.load_s,
                span=done.span,
            ),
            fds,
        )
        announced(new)

    def after_task(self) -> bool:
        """Past ``max_worker_memory``: say so (`Retire`) and stop; the parent replaces us."""
        if self._cap is None:
            return False
        uss = self._cap.exceeded()
        if uss is None:
            return False
        channel.send(self._sock, Retire(uss))
        return True

    def escaped(self, exc: BaseException) -> None:
        """The parent closed our pipe (it is shutting down): end quietly. Anything else is
        raised again, so the process exits non-zero with its traceback on stderr."""
        if not isinstance(exc, (BrokenPipeError, ConnectionResetError, EOFError)):
            raise exc
