"""A thread worker: its record (`WorkerThread`), its `loop.Link` and the queue its outcomes go
to (`Outbox`).

A thread runs the one worker loop (../loop.py) like a process does; its link hands the
collated batch over as an object (no pickling, no shared memory). Seeding touches only the
thread's own generators (torch_hooks.py).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import traceback
from typing import Any

import numpy as np

from ..._seeding import SampleSeeder
from ...describe import describe_exception
from ...per_worker import enter_thread_worker
from .. import loop, torch_hooks
from ..config import WorkerConfig
from ..events import Died, Received
from ..interrupts import interrupts_allowed
from ..protocol import Done, Ready, Stop
from ..status import IDLE, LOADING, POSITION, STAGE, STARTED_NS, TASK, Progress
from . import sharing


class WorkerThread:
    """The pool's record of one worker thread; also its status fields (`loop.Status`)."""

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
        self.set_up = threading.Event()  # worker_init_fn and iter(dataset) done (or failed)

    def begin(self, task_id: int) -> None:
        """A task starts (position -1: no sample yet)."""
        f = self.fields
        f[TASK], f[POSITION], f[STARTED_NS], f[STAGE] = task_id, -1, time.monotonic_ns(), LOADING

    def end(self) -> None:
        """The task's outcome is queued."""
        self.fields[STAGE] = IDLE  # after the outcome is queued: see ThreadPool.on_its_way

    def progress(self) -> Progress:
        """What the thread is doing now (status.py's fields)."""
        f = self.fields
        return Progress(int(f[TASK]), int(f[POSITION]), int(f[STAGE]), int(f[STARTED_NS]), 0)


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

    def close(self) -> None:
        """Close the socket pair (a later `put` still queues; its byte is dropped)."""
        self._r.close()
        self._w.close()


class ThreadLink:
    """A worker thread's `loop.Link`: messages from its inbox, outcomes and batches queued
    as objects. It also measures the thread's tasks for ``worker_type="auto"``."""

    keeps_objects = True

    def __init__(self, w: WorkerThread, events: Outbox) -> None:
        self._w = w
        self._events = events
        self._first = True
        self._began = 0.0
        self._samples = 0  # in the task's batch (0: none sent)

    def put(self, event: object) -> None:
        """Queue ``event`` as this thread's (its generation tells a replaced thread's)."""
        self._events.put((self._w.worker_id, self._w.generation, event))

    def ready(self) -> None:
        """Set-up done: the spawner may restore the process-wide generators."""
        self._w.set_up.set()
        self.put(Ready(pid=os.getpid(), preload_missing=None))

    def receive(self) -> object:
        """The next message; `Stop` once the thread was abandoned (after a hang)."""
        msg = self._w.inbox.get()
        return Stop() if self._w.abandoned else msg

    send = put

    def release(self, freed: tuple[int, ...]) -> None:
        """Nothing to release: batches are plain objects."""

    def begin_task(self) -> None:
        """Note when the task began."""
        self._began, self._samples = time.perf_counter(), 0

    def cancel_task(self) -> None:
        """Nothing to undo."""

    def pack(self, data: Any) -> Any:
        """The batch itself: it stays in this process."""
        return data

    def send_batch(self, done: Done, packed: Any) -> None:
        """Queue the batch with its `Done`."""
        self._samples = done.samples
        self.put(Received(done, packed))

    def after_task(self) -> bool:
        """Count the task (the first pays for lazy set-up: not counted); True once the
        thread was abandoned."""
        w = self._w
        if not self._first:
            tasks, samples, wall = w.measured
            w.measured = (tasks + 1, samples + self._samples,
                          wall + time.perf_counter() - self._began)  # fmt: skip
        self._first = False
        return w.abandoned


def thread_main(cfg: WorkerConfig, dataset: Any, w: WorkerThread, events: Outbox) -> None:
    """One worker thread: the worker loop, with outcomes queued as objects. Whatever
    escapes it (never the dataset's errors: they are outcomes) is reported as the thread's
    death, so the iterator replaces it instead of waiting for it."""
    link = ThreadLink(w, events)
    try:
        try:
            sharing.single_threaded_ops()
        finally:
            w.ops_set.set()
        seed = cfg.base_seed + w.worker_id  # torch's per-worker seed; this thread's generators
        info = torch_hooks.make_info(w.worker_id, cfg.num_workers, seed, dataset, "thread")
        torch_hooks.set_thread_info(info)
        enter_thread_worker()
        seeder = (
            SampleSeeder(cfg.base_seed, w.worker_id, own=info, process_wide=False)
            if cfg.sample_seeds else None
        )
        loop.run(cfg, dataset, w.worker_id, link, w, seeder)
    except BaseException as exc:
        w.set_up.set()
        text = describe_exception(exc)[1]
        raised = f"{type(exc).__qualname__}: {text}" if text else type(exc).__qualname__
        link.put(Died(exitcode=None, pid=os.getpid(), progress=w.progress(),
                      stacks=traceback.format_exc(), kind="thread", raised=raised))  # fmt: skip
    finally:
        torch_hooks.set_thread_info(None)
