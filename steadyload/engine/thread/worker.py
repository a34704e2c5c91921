"""A thread worker: its record (`WorkerThread`) and its `loop.Link`; its outcomes go to the
pool's `Outbox` (../transport/outbox.py).

A thread runs the one worker loop (../worker/loop.py, through ../worker/serve.py) like a
process does; its link hands the collated batch over as an object (no pickling, no shared
memory). Seeding touches only the thread's own generators (../worker/serve.py).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from typing import Any

import numpy as np

from ...diagnosis.describe import describe_exception
from ...per_worker import enter_thread_worker
from ..config import WorkerConfig
from ..events import Cause, Died, Received
from ..pool import THREAD, Kind
from ..protocol import Done, Ready, Stop, Task
from ..transport.outbox import Outbox
from ..worker.serve import serve
from ..worker.status import IDLE, LOADING, POSITION, STAGE, STARTED_NS, TASK, Progress
from . import sharing
from .liveness import ThreadEnd


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
        self.task: Any = None  # the last task it received
        self.thread: threading.Thread | None = None
        self.measured = (0, 0, 0.0)  # tasks, samples, wall s (one tuple: read whole)
        self.set_up_done = False  # its first task (which pays for lazy set-up) is done
        self.ops_set = threading.Event()  # its torch ops are single-threaded (the spawner waits)
        self.set_up = threading.Event()  # worker_init_fn and iter(dataset) done (or failed)

    def begin(self, task_id: int) -> None:
        """A task starts (position -1: no sample yet)."""
        f = self.fields
        f[TASK], f[POSITION], f[STARTED_NS], f[STAGE] = task_id, -1, time.monotonic_ns(), LOADING

    def end(self) -> None:
        """The task's outcome is queued."""
        self.fields[STAGE] = IDLE  # after the outcome is queued: see ThreadPool.on_its_way

    def where(self) -> str:
        """The sample it is loading now: "sample 7 (task 3)", or its task alone."""
        f, task = self.fields, self.task
        position, where = int(f[POSITION]), f"task {int(f[TASK])}"
        indices = getattr(task, "indices", None)
        if isinstance(indices, list) and 0 <= position < len(indices):
            return f"sample {indices[position]} ({where})"
        if position < 0 and indices is not None and not isinstance(indices, list):
            return f"sample {indices} ({where})"  # batch_size=None: the index itself
        return where

    def progress(self) -> Progress:
        """What the thread is doing now (status.py's fields)."""
        f = self.fields
        return Progress(int(f[TASK]), int(f[POSITION]), int(f[STAGE]), int(f[STARTED_NS]), 0)


class ThreadLink:
    """A worker thread's `loop.Link`: messages from its inbox, outcomes and batches queued
    as objects. It also measures the thread's tasks for ``worker_type="auto"``."""

    keeps_objects = True
    kind: Kind = THREAD
    """The kind its pool reports (a subclass with another transport is another kind)."""

    @staticmethod
    def cause(raised: str = "", traceback: str = "") -> Cause:
        """Why a thread of this kind ended: ``raised`` escaped it, or (empty) it was
        abandoned."""
        return ThreadEnd(raised, traceback)

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
        if isinstance(msg, Task):
            self._w.task = msg
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
            w.measured = (
                tasks + 1,
                samples + self._samples,
                wall + time.perf_counter() - self._began,
            )
        self._first = False
        w.set_up_done = True
        return w.abandoned

    def escaped(self, exc: BaseException) -> None:
        """Queue the thread's death (called in the handler: its traceback is the stacks)."""
        w = self._w
        w.set_up.set()
        text = describe_exception(exc)[1]
        raised = f"{type(exc).__qualname__}: {text}" if text else type(exc).__qualname__
        cause = self.cause(raised, traceback.format_exc())
        self.put(Died(self.kind, w.worker_id, os.getpid(), w.progress(), cause))


def thread_main(
    cfg: WorkerConfig,
    dataset: Any,
    w: WorkerThread,
    events: Outbox,
    link_type: type[ThreadLink] = ThreadLink,
) -> None:
    """One worker thread: the worker loop, with outcomes queued as objects. Whatever
    escapes it (never the dataset's errors: they are outcomes) is reported as the thread's
    death (`ThreadLink.escaped`), so the iterator replaces it instead of waiting for it."""
    link = link_type(w, events)
    try:
        try:
            sharing.single_threaded_ops()
        finally:
            w.ops_set.set()
    except BaseException as exc:
        link.escaped(exc)
        return
    serve(
        cfg,
        dataset,
        w.worker_id,
        link,
        w,
        process_wide=False,
        method="thread",
        began=enter_thread_worker,
    )
