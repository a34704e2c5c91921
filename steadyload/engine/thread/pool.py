"""`ThreadPool`: the `WorkerPool` over threads of this process.

Why the same interface: dispatch, the task table, recovery, the hang watch, checkpoints and
the report (iterators/) drive a pool through its protocol (../pool.py) and a stream of
events (`Ready`, `Received`, `Failed`, `Empty`, `Exhausted`, `Died`). A `ThreadPool` gives
the same calls and events, so thread workers get torch's order, exactly-once delivery,
skip, resume and the report from the code the process workers use, not from a copy.

What threads change:
- No transport: a thread's batch is the collated object itself, handed over through one
  `queue.SimpleQueue` (no pickling, no shared memory, no copy).
- A map-style dataset is shared by all threads (one copy of every resource: its
  ``__getitem__`` must be thread-safe); an IterableDataset gets a replica per thread
  (`copy.deepcopy`), as each worker process has its own, since ``iter()`` state and
  `worker_init_fn`'s sharding write to it.
- `get_worker_info()` answers per thread (../worker/torch_hooks.py); the process-wide random
  generators are the training loop's: never reseeded for a thread, and put back after the
  threads' set-up (``worker_init_fn``); each thread has its own
  (``get_worker_info().rng``: torch's container for thread workers).
- A thread cannot be killed. `kill` (after ``hang_timeout``) *abandons* it: it is
  dropped from the live set, a `Died` event reports it, and a replacement thread with the
  same id re-runs its tasks. The abandoned thread runs on until its call returns, then
  exits; what it sends is dropped (each thread has a generation number).
- Nothing here assumes a GIL: every structure two threads touch is a `SimpleQueue`
  (thread-safe by itself) or is written by one thread only (a worker's status fields).
"""

from __future__ import annotations

import copy
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch

from ...host.slabs import SLABS
from ...pickling import not_copyable
from ..config import WorkerConfig
from ..events import Died, GlobalRngDrawn
from ..pool import THREAD, Kind
from ..protocol import Reset, Restore, Stop, Task
from ..transport.outbox import Outbox
from ..worker.fetch import ITERABLE, stateful
from ..worker.rngs import drawn, process_rngs
from ..worker.status import IDLE, Progress
from ..worker.torch_hooks import install_per_thread
from .sharing import global_rngs, restore_default, restore_rngs
from .worker import ThreadLink, WorkerThread, thread_main

_JOIN_S = 2.0  # how long shutdown waits for a thread that is inside a dataset call
DRAW_CHECKS = 256
"""Waits around which the process-wide generators are compared (a dataset that draws from
them is found while the training loop waits for data; its own draws are made outside)."""
SET_UP_WAIT_S = 30.0
"""Without ``hang_timeout``, how long a thread's set-up is waited for before the training
loop goes on (the generators are put back then; a set-up slower than that may still draw)."""
EXIT_JOIN_S = 30.0
"""At interpreter exit, how long to wait for worker threads still inside dataset code."""
ABANDONED_EXIT_JOIN_S = 2.0
"""At exit, how long to wait for a thread abandoned after a hang: steadyload gave up on it
during training (its tasks were re-run), so the exit does not wait out that hang again; a
call about to return gets the time a stopping pool gives one (`_JOIN_S`)."""
_LOG = logging.getLogger(__name__)
_live_pools: weakref.WeakSet[ThreadPool] = weakref.WeakSet()
_started: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # every worker thread
_abandoned: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
"""Threads abandoned after a hang, and where (which sample) they hung."""
_exit_hook = threading.Lock()  # held once the hook is registered


def _stop_at_exit() -> None:
    """Stop every thread pool and wait for its threads to leave the dataset's code, before
    the interpreter finalizes: a thread still inside torch's C++ ops then would abort the
    process ("terminate called without an active exception", exit status 134) after a
    training script that ended well. Runs from `threading._shutdown`, before daemon threads
    are frozen. What it waits for is said at once; a thread abandoned after a hang is waited
    for `ABANDONED_EXIT_JOIN_S`, any other `EXIT_JOIN_S`, then named, not waited for."""
    for pool in list(_live_pools):
        pool.shutdown()
    threads = [thread for thread in list(_started) if thread.is_alive()]
    for thread in threads:
        thread.join(0.05)  # one about to leave its last call is not announced
    for thread in (thread for thread in threads if thread.is_alive()):
        hung = _abandoned.get(thread)
        wait_s = EXIT_JOIN_S if hung is None else ABANDONED_EXIT_JOIN_S
        what = "inside a dataset call" if hung is None else f"abandoned after a hang at {hung}"
        _LOG.warning(
            "steadyload: at exit, waiting up to %.0f s for %s (%s) to return: a thread "
            "cannot be killed, and one ended inside native code could abort the interpreter.",
            wait_s,
            thread.name,
            what,
        )
        thread.join(wait_s)
        if thread.is_alive():
            advice = (
                ""
                if hung is not None
                else " A call that never returns is a hang: pass hang_timeout= to have it "
                "found during training."
            )
            _LOG.warning(
                "steadyload: %s (%s) has not returned after %.0f s; exiting without it "
                "(the interpreter may abort if that call is in native code).%s",
                thread.name,
                what,
                wait_s,
                advice,
            )


def _replica(dataset: Any) -> Any:
    try:
        return copy.deepcopy(dataset)
    except Exception as exc:  # a lock, a connection, an open file: name it
        raise not_copyable(dataset, exc) from exc


def _register_exit_hook() -> None:
    if _exit_hook.acquire(blocking=False):
        try:
            threading._register_atexit(_stop_at_exit)  # type: ignore[attr-defined]  # private, tested
        except RuntimeError:  # the interpreter is already shutting down
            pass


class ThreadView:
    """One thread worker as ``iterator._workers`` shows it (pid is this process's)."""

    def __init__(self, worker_id: int, thread: threading.Thread) -> None:
        self.worker_id = worker_id
        self.name = thread.name
        self.pid = os.getpid()
        self._thread = thread

    @property
    def exitcode(self) -> int | None:
        """0 once the thread has ended; None while it runs."""
        return None if self._thread.is_alive() else 0

    def is_alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait at most ``timeout`` seconds for the thread to end. [Unit: second]"""
        self._thread.join(timeout)

    def __repr__(self) -> str:
        return f"<steadyload thread worker {self.worker_id} alive {self.is_alive()}>"


class ThreadPool:
    """Owns the worker threads of one iterator; a `WorkerPool` (see module)."""

    def __init__(
        self,
        config: WorkerConfig,
        num_workers: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        link: type[ThreadLink] = ThreadLink,
    ) -> None:
        self._config = config
        self._link = link  # its transport and its causes: threads', or another kind's
        self.kind: Kind = link.kind
        self._num_workers = num_workers
        self._clock = clock
        self._workers: list[WorkerThread | None] = [None] * num_workers
        self._generations = [0] * num_workers
        self._events = Outbox()
        self._draw_checks = DRAW_CHECKS
        self._rngs_before: tuple[Any, ...] | None = None
        self.views: list[ThreadView | None] = [None] * num_workers
        """Each worker id's latest thread, as ``iterator._workers`` shows it."""
        self.running = False

    kind: Kind = THREAD
    start_method = None
    preload: tuple[str, ...] = ()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker thread."""
        install_per_thread()
        _register_exit_hook()
        if not faulthandler.is_enabled():
            # A crash in native code (a corrupt file in a C decoder) ends this process with
            # thread workers: at least its stacks, the dataset's frames among them, are told.
            faulthandler.enable(all_threads=True)
        _live_pools.add(self)
        SLABS.open(self)  # big batches' memory is given again while these threads run
        self._spawn_set_up(range(self._num_workers))
        self.running = True

    def respawn(self, worker_id: int) -> None:
        """Start a fresh thread for ``worker_id`` (the old one was abandoned)."""
        self._spawn_set_up((worker_id,))

    def _spawn_set_up(self, worker_ids: Iterable[int]) -> None:
        """Start threads and wait for their set-up (``worker_init_fn``, ``iter(dataset)``),
        at most ``hang_timeout`` (a set-up past it is then found by the hang watch) or
        `SET_UP_WAIT_S`, with the process-wide generators put back after it: the caller
        (the training loop) draws nothing meanwhile, so its random stream is the one it has
        under processes."""
        states = process_rngs()
        try:
            spawned = [self._spawn(worker_id) for worker_id in worker_ids]
            # Never unbounded: the caller may hold Ctrl-C (a restart inside the iterator's
            # bookkeeping); a set-up past hang_timeout is the hang watch's to find.
            deadline = time.monotonic() + (self._config.hang_timeout_s or SET_UP_WAIT_S)
            for w in spawned:
                w.set_up.wait(max(0.0, deadline - time.monotonic()))
        finally:
            restore_rngs(states)

    def _spawn(self, worker_id: int) -> WorkerThread:
        self._generations[worker_id] += 1
        w = WorkerThread(worker_id, self._generations[worker_id], self._clock())
        cfg = self._config
        # A stream's iterator and worker_init_fn's sharding write to the dataset, and a
        # dataset with its own state_dict() keeps each worker's state: one replica per
        # thread, as per process. Any other map-style dataset is shared.
        own = cfg.dataset_kind == ITERABLE or stateful(cfg.dataset)
        dataset = _replica(cfg.dataset) if own else cfg.dataset
        w.thread = threading.Thread(
            target=thread_main,
            args=(cfg, dataset, w, self._events, self._link),
            name=f"steadyload-thread-{worker_id}",
            daemon=True,
        )
        self._workers[worker_id] = w
        self.views[worker_id] = ThreadView(worker_id, w.thread)
        threads_here = torch.get_num_threads()
        _started.add(w.thread)
        w.thread.start()
        w.ops_set.wait(timeout=_JOIN_S)  # microseconds: the thread's first statement
        restore_default(threads_here)
        return w

    def shutdown(self) -> None:
        """Ask every thread to stop, and wait a little for the idle ones (they exit at
        once); one inside a dataset call is left to finish on its own (a daemon thread; at
        exit `_stop_at_exit` waits for it), so an error is raised without waiting for it."""
        self.running = False
        _live_pools.discard(self)
        SLABS.close(self)
        live = [w for w in self._workers if w is not None]
        self._workers = [None] * self._num_workers
        for w in live:
            w.abandoned = True
            w.inbox.put(Stop())
        deadline = time.monotonic() + _JOIN_S
        for w in live:
            assert w.thread is not None
            if w.progress().stage == IDLE:
                w.thread.join(max(0.0, deadline - time.monotonic()))
        self._events.close()  # what is still queued is dropped with this pool

    def past_set_up(self) -> bool:
        """Whether every live thread has finished its first task (its lazy set-up)."""
        live = [w for w in self._workers if w is not None]
        return bool(live) and all(w.set_up_done for w in live)

    def measured(self) -> tuple[int, int, float]:
        """Tasks run (each thread's first left out), their samples and their wall seconds,
        summed over the live threads."""
        live = [w.measured for w in self._workers if w is not None]
        return sum(m[0] for m in live), sum(m[1] for m in live), sum(m[2] for m in live)

    @property
    def stopped(self) -> bool:
        """Whether `shutdown` ran (threads still inside a dataset call end by themselves)."""
        return all(w is None for w in self._workers)

    # -- messaging ---------------------------------------------------------------------------
    def pid(self, worker_id: int) -> int | None:
        """This process's id (threads have none of their own)."""
        return os.getpid()

    def host(self, worker_id: int) -> str | None:
        """None: in this process."""
        return None

    def pids(self) -> dict[int, int]:
        """Empty: thread workers share this process's memory, so none is sampled per worker."""
        return {}

    def started_at(self, worker_id: int) -> float | None:
        """When the thread was asked for, on the pool's clock. [Unit: second]"""
        w = self._workers[worker_id]
        return w.started_at if w is not None else None

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the pool measures with."""
        return self._clock

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Hand a task to the thread."""
        w = self._workers[worker_id]
        if w is not None:
            w.inbox.put(Task(task_id, indices, (), epoch))

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Tell a thread where its dataset replica resumes (`WorkerPool.send_restore`)."""
        w = self._workers[worker_id]
        if w is not None:
            w.inbox.put(Restore(state))

    def send_reset(self) -> None:
        """Tell every thread a new epoch begins (persistent workers)."""
        for w in self._workers:
            if w is not None:
                w.inbox.put(Reset())

    def waitables(self) -> list[Any]:
        """The outbox's socket, armed: an event queued from now on makes it readable."""
        self._events.armed = True
        if self._draw_checks > 0:
            self._rngs_before = global_rngs(type(self._config.dataset))
        return [self._events]

    def pending(self) -> bool:
        """Whether events are queued (looked at after arming: none can slip between)."""
        return not self._events.queue.empty()

    def exit_unreported(self) -> bool:
        """Never: a thread's end is queued as it ends."""
        return False

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """Every queued event, without blocking; those of abandoned threads are dropped.
        Runs where Ctrl-C is held, so no dequeued event can be lost to it."""
        out: list[tuple[int, object]] = []
        before, self._rngs_before = self._rngs_before, None
        if before is not None:
            self._draw_checks -= 1
            if drawn(before):  # while the training loop waited: a worker drew
                self._draw_checks = 0
                out.append((-1, GlobalRngDrawn(type(self._config.dataset))))
        return out + self._events.take(ready, self._generations)

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """Block until an event arrives or ``timeout_s`` passes: on the outbox's event, not
        a poll (`wait_any` is for waiting on other pools too). [Unit: second]"""
        if self._draw_checks > 0:
            self._rngs_before = global_rngs(type(self._config.dataset))
        self._events.wait(timeout_s)
        return self.collect(())

    def wake(self) -> None:
        """End a `wait` under way, without an event (safe from any thread)."""
        self._events.wake()

    def progress(self, worker_id: int) -> Progress | None:
        """What the thread is doing now."""
        w = self._workers[worker_id]
        return w.progress() if w is not None else None

    def on_its_way(self, worker_id: int) -> bool:
        """Whether an event is waiting (a thread queues its outcome before going idle)."""
        return not self._events.queue.empty()

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """The (hung) thread's Python stack, most recent call last."""
        w = self._workers[worker_id]
        if w is None or w.thread is None or w.thread.ident is None:
            return ""
        frame = sys._current_frames().get(w.thread.ident)
        if frame is None:
            return ""
        return f'Thread "{w.thread.name}" (most recent call last):\n' + "".join(
            traceback.format_stack(frame)
        )

    def kill(self, worker_id: int) -> None:
        """Abandon the thread (it cannot be killed); its `Died` event follows in `wait`."""
        w = self._workers[worker_id]
        if w is None or w.abandoned:
            return
        w.abandoned = True
        w.inbox.put(Stop())  # it exits once its current call returns
        if w.thread is not None:  # said at exit if it is still in that call (`_stop_at_exit`)
            _abandoned[w.thread] = w.where()
        # Kept as the worker of its id until `respawn`, as a killed process is until it is
        # reaped: its progress still shows the hung task, and tasks sent meanwhile are
        # re-sent to the replacement (they are still held).
        self._generations[worker_id] += 1  # what it sends from now on is dropped
        died = Died(self.kind, worker_id, os.getpid(), w.progress(), self._link.cause())
        self._events.put((worker_id, self._generations[worker_id], died))
