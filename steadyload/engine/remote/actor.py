"""A remote worker: a Ray actor that runs the one worker loop (../worker/loop.py).

Ray is only the transport. The pool numbers every message it sends an actor; the actor
feeds them to the loop in that order (Ray does not promise the order of an async actor's
calls), and the call that carried a `Task` returns the task's outcome, with its collated
batch, through Ray's object store. The loop runs on a thread of its own, so the actor
answers `stack` (its Python stacks, for ``hang_timeout``) while a sample is being loaded;
`stack` runs in a concurrency group of its own. The actor's process is its own, so its
start (../worker/serve.py) is a worker process's: seeding and `get_worker_info()` as in
torch's `_worker_loop`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from ...diagnosis.describe import describe_exception, format_traceback
from ..config import WorkerConfig
from ..protocol import Done, Ready, Retire, StartFailed, Stop, Task
from ..worker import torch_hooks
from ..worker.memory_cap import MemoryCap, rss_bytes
from ..worker.serve import serve
from ..worker.status import IDLE, LOADING, POSITION, STAGE, STARTED_NS, TASK

CONTROL = "steadyload-control"
"""The concurrency group of `stack`: answered while the loop is busy."""


class Fields:
    """The worker's status fields (status.py's layout), in this process: a `loop.Status`."""

    def __init__(self) -> None:
        self.fields = np.zeros(8, np.int64)
        self.fields[TASK] = -1

    def begin(self, task_id: int) -> None:
        """A task starts."""
        f = self.fields
        f[TASK], f[POSITION], f[STARTED_NS], f[STAGE] = task_id, -1, time.monotonic_ns(), LOADING

    def end(self) -> None:
        """The task's outcome was handed to its call."""
        self.fields[STAGE] = IDLE


class RemoteLink:
    """The actor's `loop.Link`: messages from the numbered calls, each outcome handed back
    to the call that carried its task (with the batch: Ray pickles it)."""

    keeps_objects = False

    def __init__(self, worker: RemoteWorker, cfg: WorkerConfig) -> None:
        self._worker = worker
        cap = cfg.max_memory_bytes
        self._cap = MemoryCap(cap) if cap is not None else None
        self._retire: Retire | None = None

    def receive(self) -> object:
        """The next message, in the pool's numbering."""
        return self._worker.inbox.get()

    def ready(self) -> None:
        """Set-up done (``worker_init_fn``, the first iterator)."""
        gc.freeze()  # as a process worker: later collections leave the dataset's pages alone
        self._worker.set_up.set()

    def send(self, msg: object) -> None:
        """An outcome: to the call that carried its task."""
        self._worker.answer(msg.task_id, (msg, None, self._notices()))  # type: ignore[attr-defined]

    def release(self, freed: tuple[int, ...]) -> None:
        """Nothing to release: batches leave through Ray's object store."""

    def begin_task(self) -> None:
        """Nothing to prepare."""

    def cancel_task(self) -> None:
        """Nothing to undo."""

    def pack(self, data: Any) -> Any:
        """The batch itself: Ray pickles the call's result."""
        return data

    def send_batch(self, done: Done, packed: Any) -> None:
        """The batch and its `Done` (with this process's memory), to the call that
        carried the task."""
        done = dataclasses.replace(done, rss_bytes=rss_bytes())
        self._worker.answer(done.task_id, (done, packed, self._notices()))

    def _notices(self) -> tuple[object, ...]:
        """A `Retire` goes with the outcome of the task after which memory passed the cap."""
        if self._cap is None:
            return ()
        uss = self._cap.exceeded()
        if uss is None:
            return ()
        self._retire = Retire(uss)
        return (self._retire,)

    def after_task(self) -> bool:
        """Past ``max_worker_memory``: stop (the pool replaces this actor)."""
        return self._retire is not None

    def escaped(self, exc: BaseException) -> None:
        """The worker cannot go on: print why and end the actor's process, which is the
        death the pool sees and the iterator heals."""
        traceback.print_exception(exc)
        sys.stderr.flush()
        os._exit(1)


class RemoteWorker:
    """The actor's class (made a Ray actor by the pool: Ray is imported there only)."""

    def __init__(self, config: bytes | None, worker_id: int) -> None:
        """Start the worker, or (``config`` None: prestarted, warm.py) only import, until
        `configure` says which worker it is."""
        self.worker_id = worker_id
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.set_up = threading.Event()
        self.began = threading.Event()  # torch imported: the loop's set-up starts
        self.status = Fields()
        self._config = config
        self._started: StartFailed | None = None
        self._answers: dict[int, asyncio.Future[Any]] = {}
        self._lock = threading.Lock()
        self._queued: dict[int, Any] = {}  # numbered messages not yet fed to the loop
        self._next = 0
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(
            target=self._main, name="steadyload-remote-worker", daemon=True
        )
        if config is not None:
            self._thread.start()

    async def configure(self, config: bytes, worker_id: int) -> None:
        """A prestarted actor becomes worker ``worker_id`` of a pool (its imports are done)."""
        if self._config is None:
            self._config, self.worker_id = config, worker_id
            self._thread.start()

    def _main(self) -> None:
        try:
            assert self._config is not None
            cfg: WorkerConfig = pickle.loads(self._config)
        except BaseException as exc:
            type_name, text = describe_exception(exc)
            self._started = StartFailed(type_name, text, format_traceback(exc))
            self.began.set()
            self.set_up.set()
            return
        link = RemoteLink(self, cfg)
        torch_hooks.plain_shared_storage()  # Ray pickles the batch: no /dev/shm on the way
        try:
            # Process-wide: the actor's process is its own, as a worker process's is.
            serve(
                cfg,
                cfg.dataset,
                self.worker_id,
                link,
                self.status,
                process_wide=True,
                method="multiprocessing",
                began=self.began.set,  # torch is imported: the pool watches set-up for hangs
            )
        finally:
            self.set_up.set()

    def answer(self, task_id: int, outcome: Any) -> None:
        """The loop's outcome for ``task_id``: resolve the waiting call (any thread)."""
        with self._lock:  # made before its task reached the loop (`call`): always there
            future = self._answers.pop(task_id)
        assert self._aio is not None
        self._aio.call_soon_threadsafe(_resolve, future, outcome)

    async def begin(self) -> tuple[int, str, str]:
        """Wait until the loop's set-up starts (torch imported): (pid, node id, address).
        From then on the set-up (``worker_init_fn``, the first iterator) is watched for
        hangs, never the actor's placement or imports."""
        await asyncio.get_running_loop().run_in_executor(None, self.began.wait)
        return _where()

    async def ready(self) -> Any:
        """Wait for the set-up: `Ready` or `StartFailed`."""
        await asyncio.get_running_loop().run_in_executor(None, self.set_up.wait)
        pid, node, address = _where()
        return self._started or Ready(
            pid=pid, preload_missing=None, node=f"{node[:12]} ({address})"
        )

    async def call(self, number: int, msg: Any) -> Any:
        """Message ``number`` of the pool's: fed to the loop in order; for a `Task`, its
        outcome ``(message, batch, notices)``."""
        self._aio = asyncio.get_running_loop()
        future = None
        if isinstance(msg, Task):
            future = self._aio.create_future()
            with self._lock:
                self._answers[msg.task_id] = future
        self._queued[number] = msg
        while self._next in self._queued:  # only this event loop's thread runs here
            self.inbox.put(self._queued.pop(self._next))
            self._next += 1
        if isinstance(msg, Stop) or future is None:
            return None
        return await future

    async def stack(self) -> tuple[str, list[int]]:
        """Every thread's Python stack, most recent call last, and the status fields."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        text = []
        for ident, frame in frames.items():
            text.append(
                f'Thread "{names.get(ident, ident)}" (most recent call last):\n'
                + "".join(traceback.format_stack(frame))
            )
        return "\n".join(text), [int(x) for x in self.status.fields]


def _where() -> tuple[int, str, str]:
    """This actor's pid, Ray node id and node address."""
    import ray

    return os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _resolve(future: asyncio.Future[Any], outcome: Any) -> None:
    if not future.done():
        future.set_result(outcome)
