"""The child side: one worker process's loop. Module-level functions only (picklable by name).

A worker reads messages on a small reader thread, so that the parent's sends never block on
a busy worker (and a busy worker still notices the parent's death), and runs tasks on its
main thread: fetch the batch, pack it into shared memory, send it. It exits on `Stop`, on
EOF from the parent, or, from the reader thread, as soon as the parent process is gone.
Seeding and `get_worker_info()` follow torch's `_worker_loop` exactly, so datasets that draw
random numbers or shard themselves behave as they do under torch's DataLoader. What the
worker is doing (task, sample, since when) is kept in its status block (status.py), which
the parent reads after a death or a hang.
"""

from __future__ import annotations

import errno
import gc
import logging
import multiprocessing
import os
import pickle
import queue
import random
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data._utils import worker as _torch_worker

from .._seeding import SampleSeeder
from ..describe import describe_exception, format_traceback
from ..memory import descriptors
from . import channel
from .config import Deferred, WorkerConfig
from .fetch import ITERABLE, AllSkipped, Fetcher, start_fetching
from .protocol import (
    Done,
    Empty,
    Exhausted,
    Failed,
    NewSegment,
    Ready,
    Reset,
    Restore,
    Retire,
    StartFailed,
    Stop,
    Task,
)
from .status import SENDING, STAGE, WorkerStatus
from .transport import HAVE_MEMFD, Arena, announce, announced, install_collate_hook
from .worker_info import make_info

_LOG = logging.getLogger(__name__)
_MEMORY_CHECK_INTERVAL_S = 0.25


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


def _seed(base_seed: int, worker_id: int) -> int:
    # Exactly torch's _worker_loop, so that random values drawn in datasets are the same.
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return seed
    np.random.seed(_torch_worker._generate_state(base_seed, worker_id))
    return seed


def failed_outcome(task_id: int, exc: BaseException, where: str) -> Failed:
    """The `Failed` message for ``exc``: pickled if it survives pickling, else its words.
    Shared with thread workers (thread_worker.py), so both report errors alike."""
    type_name, text = describe_exception(exc)
    data: bytes | None
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # exceptions with custom __init__ often fail only here
    except Exception:
        data = None
    return Failed(
        task_id=task_id, exception=data, type_name=type_name, text=text,
        traceback=format_traceback(exc), where=where,
    )


def _preload_missing(requested: tuple[str, ...]) -> tuple[str, ...] | None:
    if not requested:
        return None
    from ..start.server_hooks import probe

    if not probe.IN_FORK_SERVER:
        return None  # the fork server was not started by steadyload: unknown
    return tuple(m for m in requested if m not in probe.IMPORTED)


def _uss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_full_info().uss)  # reads smaps: milliseconds


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:  # microseconds
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MemoryCap:
    """Decides after each task whether the worker's USS passed the cap, cheaply.

    RSS >= USS, so while RSS (cheap to read) is under the cap nothing more is needed. Above
    it, USS (costly: it reads smaps) is measured when RSS grew by 5% of the cap since the
    last measurement, or after _MEMORY_CHECK_INTERVAL_S.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._measured_at = 0.0
        self._rss_then = 0

    def exceeded(self) -> int | None:
        """The USS when it is above the cap, else None."""
        rss = _rss_bytes()
        if rss <= self.cap:
            return None
        now = time.monotonic()
        grown = rss - self._rss_then >= 0.05 * self.cap
        if not grown and now - self._measured_at < _MEMORY_CHECK_INTERVAL_S:
            return None
        self._measured_at, self._rss_then = now, rss
        uss = _uss_bytes()
        return uss if uss > self.cap else None


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

    torch.set_num_threads(1)
    seed = _seed(cfg.base_seed, worker_id)
    info = _torch_worker._worker_info = make_info(
        worker_id, cfg.num_workers, seed, cfg.dataset, "multiprocessing"
    )
    arena = Arena(worker_id)
    if HAVE_MEMFD:
        install_collate_hook(arena)

    seeder = SampleSeeder(cfg.base_seed, worker_id, own=info) if cfg.sample_seeds else None

    new_fetcher, fetcher, init_error = start_fetching(
        cfg, cfg.dataset, worker_id, status.fields, seeder
    )
    _LOG.debug("worker %d started (seed %d)", worker_id, seed)
    # Keep later collections off the objects made so far (the dataset; under fork, the
    # parent's whole heap): a full collection writes to every object it traverses and
    # un-shares its page (35 MiB per worker, measured). See start/server_hooks/freeze.py.
    gc.freeze()

    iteration_end = False
    cap = _MemoryCap(cfg.max_memory_bytes) if cfg.max_memory_bytes is not None else None
    try:
        channel.send(sock, Ready(pid=os.getpid(), preload_missing=_preload_missing(cfg.preload)))
        while True:
            msg = inbox.get()
            if isinstance(msg, Stop):
                break
            if isinstance(msg, (Reset, Restore)):
                if isinstance(msg, Reset):
                    arena.release(msg.freed)
                iteration_end = False
                if init_error is None:
                    try:
                        if isinstance(msg, Restore):
                            # Resume the stream where the dead worker's last batch ended.
                            cfg.dataset.load_state_dict(pickle.loads(msg.state))
                        fetcher = new_fetcher()
                    except Exception as exc:
                        init_error = (exc, "in iter(dataset)")
                continue
            assert isinstance(msg, Task)
            arena.release(msg.freed)
            if init_error is not None:
                channel.send(sock, failed_outcome(msg.task_id, *init_error))
                continue
            assert fetcher is not None  # start_fetching: a fetcher unless an error
            if iteration_end:
                channel.send(sock, Exhausted(msg.task_id))
                continue
            status.begin(msg.task_id)
            if seeder is not None:
                seeder.epoch = msg.epoch
            iteration_end = _run_task(
                msg, fetcher, arena, sock, cfg.dataset_kind, status,
                cfg.dataset if cfg.stateful_stream else None,
            )
            status.end()
            if cap is not None:
                uss = cap.exceeded()
                if uss is not None:
                    channel.send(sock, Retire(uss))
                    break
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the parent closed our pipe: it is shutting down
    finally:
        stopped.set()
        sock.close()


def _run_task(
    task: Task, fetcher: Fetcher, arena: Arena, sock: socket.socket, kind: int,
    status: WorkerStatus, stateful: Any,
) -> bool:
    """Run one task and send its outcome; True when the dataset's stream has ended."""
    began = time.perf_counter()
    arena.begin_task()
    try:
        data = fetcher.fetch(task.indices)
    except AllSkipped:
        arena.end_task(sent=False)
        channel.send(sock, Empty(task.task_id, tuple(fetcher.skipped)))
        return False
    except StopIteration as exc:
        arena.end_task(sent=False)
        if kind == ITERABLE:
            channel.send(sock, Exhausted(task.task_id, tuple(fetcher.skipped)))
            return True
        channel.send(sock, failed_outcome(task.task_id, exc, fetcher.where))
        return False
    except Exception as exc:
        arena.end_task(sent=False)
        channel.send(sock, failed_outcome(task.task_id, exc, fetcher.where))
        return False
    status.fields[STAGE] = SENDING
    try:
        payload = arena.pack(data) if HAVE_MEMFD else ForkingPickler.dumps(data)
    except Exception as exc:
        arena.end_task(sent=False)
        where = "while sending the batch to the main process"
        channel.send(sock, failed_outcome(task.task_id, exc, where))
        return False
    del data
    try:
        state = pickle.dumps(stateful.state_dict()) if stateful is not None else None
    except Exception as exc:  # user code: reported like the dataset's own errors
        arena.end_task(sent=False)
        where = "while saving the stream's position (state_dict())"
        channel.send(sock, failed_outcome(task.task_id, exc, where))
        return False
    used, new, retired = arena.end_task(sent=True)
    fds = announce(new)
    channel.send(
        sock,
        Done(
            task_id=task.task_id,
            payload=arena.seal(payload) if HAVE_MEMFD else bytes(payload),
            segments=used,
            new_segments=tuple(NewSegment(s.segment_id, s.nbytes) for s in new),
            retired=retired,
            skipped=tuple(fetcher.skipped),
            stream_state=state,
            samples=fetcher.count,
            load_s=time.perf_counter() - began,
        ),
        fds,
    )
    announced(new)
    return False
