"""A thread worker's side: its loop (torch's worker loop in a thread of this process), its
record (`WorkerThread`) and the queue its outcomes go to (`Outbox`).

The counterpart of worker.py (a worker process's loop), for `threads.ThreadSupervisor`:
the same fetcher, the same outcomes, queued as objects instead of sent (no pickling, no
shared memory). Seeding touches only the thread's own generators (worker_info.py).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from .._seeding import SampleSeeder
from ..per_worker import enter_thread_worker
from .config import WorkerConfig
from .events import Died, GlobalRngDrawn, Received
from .fetch import ITERABLE, AllSkipped, Fetcher, start_fetching
from .protocol import Done, Empty, Exhausted, Ready, Reset, Restore, Stop, Task
from .status import IDLE, LOADING, POSITION, SENDING, STAGE, STARTED_NS, TASK, Progress
from .worker import failed_outcome
from .worker_info import drawn, global_rngs, make_info, set_thread_info, single_threaded_ops


class WorkerThread:
    """The supervisor's record of one worker thread."""

    def __init__(self, worker_id: int, generation: int, started_at: float) -> None:
        self.worker_id = worker_id
        self.generation = generation
        self.started_at = started_at
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.fields = np.zeros(8, np.int64)  # status.py's layout, written by the thread only
        self.fields[TASK] = -1
        self.abandoned = False
        self.thread: threading.Thread | None = None
        self.measured = (0, 0, 0.0)  # tasks, samples, wall s (one tuple: read whole)
        self.ops_set = threading.Event()  # its torch ops are single-threaded (the spawner waits)

    def progress(self) -> Progress:
        """What the thread is doing now (status.py's fields)."""
        f = self.fields
        return Progress(int(f[TASK]), int(f[POSITION]), int(f[STAGE]), int(f[STARTED_NS]), 0)


class Outbox:
    """The worker threads' events, and a socket that turns readable when one is queued, so
    that a process supervisor's wait can wake for them too (engine/handover.py)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[int, int, object]] = queue.SimpleQueue()
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self.armed = False
        """Whether a wait on the socket may come (a hand-over under way): only then is a
        byte sent per event, a system call saved otherwise. Arm before looking at the
        queue one last time, and an event queued after that look sends its byte."""

    def put(self, item: tuple[int, int, object]) -> None:
        self.queue.put(item)
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

    def close(self) -> None:
        """Close the socket pair (a later `put` still queues; its byte is dropped)."""
        self._r.close()
        self._w.close()


def thread_main(
    cfg: WorkerConfig, dataset: Any, w: WorkerThread,
    events: Outbox,
) -> None:  # fmt: skip
    """One worker thread: torch's worker loop, with outcomes queued as objects. Whatever
    escapes it (never the dataset's errors: they are outcomes) is reported as the thread's
    death, so the iterator replaces it instead of waiting for it."""
    worker_id, generation = w.worker_id, w.generation

    def put(event: object) -> None:
        events.put((worker_id, generation, event))

    try:
        try:
            single_threaded_ops()
        finally:
            w.ops_set.set()
        _thread_loop(cfg, dataset, w, put)
    except BaseException:
        put(Died(exitcode=None, pid=os.getpid(), progress=w.progress(),
                 stacks=traceback.format_exc()))  # fmt: skip
    finally:
        set_thread_info(None)


def _thread_loop(
    cfg: WorkerConfig, dataset: Any, w: WorkerThread, put: Callable[[object], None]
) -> None:
    worker_id = w.worker_id

    seed = cfg.base_seed + worker_id  # torch's per-worker seed; only this thread's generators
    info = make_info(worker_id, cfg.num_workers, seed, dataset, "thread")
    set_thread_info(info)
    enter_thread_worker()
    seeder = (
        SampleSeeder(cfg.base_seed, worker_id, own=info, process_wide=False)
        if cfg.sample_seeds else None
    )

    new_fetcher, fetcher, init_error = start_fetching(cfg, dataset, worker_id, w.fields, seeder)
    put(Ready(pid=os.getpid(), preload_missing=None))
    ended, first = False, True
    while not w.abandoned:
        msg = w.inbox.get()
        if isinstance(msg, Stop):
            break
        if isinstance(msg, (Reset, Restore)):
            ended = False
            if init_error is None:
                try:
                    if isinstance(msg, Restore):
                        dataset.load_state_dict(pickle.loads(msg.state))
                    fetcher = new_fetcher()
                except Exception as exc:
                    init_error = (exc, "in iter(dataset)")
            continue
        assert isinstance(msg, Task)
        if init_error is not None:
            put(failed_outcome(msg.task_id, *init_error))
            continue
        assert fetcher is not None  # start_fetching: a fetcher unless an error
        if ended:
            put(Exhausted(msg.task_id))
            continue
        if seeder is not None:
            seeder.epoch = msg.epoch
        w.fields[TASK], w.fields[POSITION] = msg.task_id, -1
        w.fields[STARTED_NS], w.fields[STAGE] = time.monotonic_ns(), LOADING
        before = global_rngs(type(dataset)) if first else None
        began = time.perf_counter()
        ended = _run_task(msg, fetcher, cfg, dataset, w.fields, put)
        if not first:  # the first pays for lazy set-up (imports, caches): not measured
            tasks, samples, wall = w.measured
            w.measured = (tasks + 1, samples + fetcher.count, wall + time.perf_counter() - began)
        first = False
        if before is not None and drawn(before):
            put(GlobalRngDrawn(type(dataset)))
        w.fields[STAGE] = IDLE  # after the outcome is queued: see on_its_way


def _run_task(
    task: Task, fetcher: Fetcher, cfg: WorkerConfig, dataset: Any, fields: Any,
    put: Callable[[object], None],
) -> bool:  # fmt: skip
    """Run one task and queue its outcome; True when the dataset's stream has ended."""
    began = time.perf_counter()
    try:
        data = fetcher.fetch(task.indices)
    except AllSkipped:
        put(Empty(task.task_id, tuple(fetcher.skipped)))
        return False
    except StopIteration as exc:
        if cfg.dataset_kind == ITERABLE:
            put(Exhausted(task.task_id, tuple(fetcher.skipped)))
            return True
        put(failed_outcome(task.task_id, exc, fetcher.where))
        return False
    except Exception as exc:
        put(failed_outcome(task.task_id, exc, fetcher.where))
        return False
    fields[STAGE] = SENDING
    try:
        state = pickle.dumps(dataset.state_dict()) if cfg.stateful_stream else None
    except Exception as exc:  # user code: reported like the dataset's own errors
        put(failed_outcome(task.task_id, exc, "while saving the stream's position (state_dict())"))
        return False
    done = Done(
        task_id=task.task_id, payload=b"", segments=(), skipped=tuple(fetcher.skipped),
        stream_state=state, samples=fetcher.count, load_s=time.perf_counter() - began,
    )  # fmt: skip
    put(Received(done, data))
    return False
