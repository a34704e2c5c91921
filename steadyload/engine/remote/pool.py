"""`RemotePool`: the `WorkerPool` over Ray actors (remote workers).

A remote worker runs the one worker loop (actor.py); this pool is its transport and its
liveness signal, nothing more. Dispatch, the task table, recovery, the hang watch,
checkpoints and the report are the iterator's, as for processes and threads:

- Transport: each message is an actor call, numbered per actor (the actor feeds them to
  its loop in that order); a task's call returns the outcome and the batch through Ray's
  object store. The dataset is put in the object store once per pool and every actor
  reads it from there (`ray.put`), never once per task.
- Liveness: a collector thread per actor waits on its calls in order (``ray.get``) and
  queues what comes back as the pool's events, on the same `Outbox` thread workers use
  (one poll can wait on local and remote workers). A call that raises because the actor,
  its node or its result object is gone becomes a `Died` (for a lost node, one for every
  worker on it) with Ray's cause (liveness.py); the iterator re-runs
  what the worker held. Ray never retries anything itself (``max_restarts=0``,
  ``max_task_retries=0``): a task is re-run only by the iterator, under the same task id,
  so a late duplicate is dropped by the task table.
- Each actor has a generation; events of an actor that was replaced are dropped. An idle
  pool gives its actors back to another pool that Ray cannot place (sharing.py).
- Progress (for ``hang_timeout``) is inferred here: the oldest task an actor holds
  started when the outcome before it arrived (or when it was sent to an idle actor);
  the sample being loaded is known after a stack dump (`dump_stack` asks the actor).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from ..config import WorkerConfig
from ..events import Died, Received
from ..pool import REMOTE, Kind
from ..protocol import Done, Reset, Restore, Retire, StartFailed, Task
from ..transport.outbox import Outbox
from ..worker.fetch import MAP, stateful
from ..worker.status import Progress
from . import liveness, sharing
from .records import Actor, RemoteView, dumps_config
from .spec import RemoteWorkers, connect, import_ray
from .warm import Prestarted, actor_class

_BEGIN, _READY = -2, -1  # the collector's markers for the actor's `begin` and `ready` calls


class RemotePool(sharing.GivesBack):
    """Remote workers ``first_id`` .. ``first_id + count - 1`` of one iterator; a
    `WorkerPool` (see module)."""

    kind: Kind = REMOTE
    start_method: str | None = None  # nothing starts here: Ray places actors (pool.py)
    preload: tuple[str, ...] = ()

    def __init__(
        self,
        config: WorkerConfig,
        spec: RemoteWorkers,
        first_id: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        prestarted: Prestarted | None = None,
    ) -> None:
        self._config = config
        self._prestarted = prestarted  # the loader's actors started at its build (warm.py)
        self._spec = spec
        self._first = first_id
        self._count = spec.maximum
        self._clock = clock
        self._ray: Any = None
        self._class: Any = None
        self._config_ref: Any = None
        self._actors: dict[int, Actor] = {}
        self._generations = collections.Counter[int]()
        self._events = Outbox()
        self._lost_nodes: set[str] = set()  # never placed on again by this pool
        self._lock = threading.RLock()  # collectors, other pools and the iterating thread
        self.views: list[RemoteView | None] = [None] * self._count
        self.running = False
        # sharing.py: whether the actors hold nothing that must survive, the ids given back,
        # and when the iterator last looked at this pool (and whether it is looking now)
        self._shareable = config.dataset_kind == MAP and not stateful(config.dataset)
        self._released: set[int] = set()
        self._polled, self._in_poll = time.monotonic(), False
        sharing.register(self)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, count: int | None = None) -> None:
        """Connect to Ray, put the dataset in its object store once, start the actors
        (``count`` of them; default: the spec's minimum, all of a fixed count)."""
        ray = self._ray = import_ray()
        connect(ray, self._spec)
        self._config_ref = ray.put(dumps_config(self._config))
        self._class = actor_class(ray)
        self.running = True
        for i in range(self._spec.minimum if count is None else count):
            self.respawn(self._first + i)  # a range starts at its minimum

    def respawn(self, worker_id: int) -> None:
        """Start a fresh actor for ``worker_id`` (same id, same seed)."""
        old = self._actors.get(worker_id)
        if old is not None and not old.gone:  # never two actors for one id
            self._end(old)
        with self._lock:
            self._generations[worker_id] += 1
            self._released.discard(worker_id)
        self._spawn(worker_id)

    def _spawn(self, worker_id: int) -> None:
        a = Actor(worker_id, self._generations[worker_id], self._clock())
        handle = self._prestarted.take() if self._prestarted and not self._lost_nodes else None
        if handle is not None:  # placed and imported already: it learns which worker it is
            handle.configure.remote(self._config_ref, worker_id)
        else:
            options = self._spec.actor_options(self._lost_nodes)
            handle = self._class.options(**options).remote(self._config_ref, worker_id)
        a.handle = handle
        with self._lock:
            self._actors[worker_id] = a
        self.views[worker_id - self._first] = RemoteView(worker_id, a)
        a.calls.put((a.handle.begin.remote(), _BEGIN))
        a.calls.put((a.handle.ready.remote(), _READY))
        threading.Thread(
            target=self._collect_calls,
            args=(a,),
            daemon=True,
            name=f"steadyload-remote-{worker_id}",
        ).start()

    def retire(self, worker_id: int) -> None:
        """Stop ``worker_id``'s actor for good (the pool shrinks): no event follows."""
        with self._lock:
            a = self._actors.pop(worker_id, None)
            self._released.discard(worker_id)
        if a is not None:
            self._generations[worker_id] += 1
            self._end(a)

    def _end(self, a: Actor) -> None:
        a.gone = True
        a.calls.put(None)
        try:
            self._ray.kill(a.handle, no_restart=True)
        except Exception:  # already gone, or Ray is shutting down
            pass

    def shutdown(self) -> None:
        """Kill every actor (their objects go with them); idempotent."""
        self.running = False
        with self._lock:
            actors, self._actors = list(self._actors.values()), {}
            self._released.clear()
        for a in actors:
            self._generations[a.worker_id] += 1
            self._end(a)
        self._events.close()
        self._config_ref = None

    @property
    def stopped(self) -> bool:
        """Whether `shutdown` ran."""
        return not self._actors and not self.running

    @property
    def remote(self) -> RemotePool:
        """Itself (a `RoutedPool` has one too)."""
        return self

    def ready(self, worker_id: int) -> bool:
        """Whether the worker's actor said `Ready` and is alive."""
        a = self._actors.get(worker_id)
        return a is not None and a.set_up and not a.gone

    def unplaced(self) -> int:
        """Actors Ray has not started yet (no `Ready`)."""
        return sum(1 for a in self._actors.values() if not a.set_up and not a.gone)

    # -- the collectors (one thread per actor) -------------------------------------------------
    def _put(self, a: Actor, event: object) -> None:
        self._events.put((a.worker_id, a.generation, event))

    def _collect_calls(self, a: Actor) -> None:
        ray = self._ray
        while True:
            item = a.calls.get()
            if item is None:
                return
            ref, task_id = item
            del item
            if task_id == _BEGIN:
                sharing.await_placement(self._ray, self._spec, a, ref, self)
            try:
                result = ray.get(ref)
            except BaseException as exc:  # the actor is gone, or (alive) the call raised
                failed = liveness.task_failed(ray, exc, task_id) if task_id >= 0 else None
                if failed is None:
                    if not a.gone:
                        self._on_failure(a, task_id, exc)
                    return
                result = (failed, None, ())
            finally:
                del ref
            if task_id == _BEGIN:  # its set-up starts: hang_timeout counts from here
                with self._lock:
                    (a.pid, a.node_id, a.address), a.setup_ns = result, time.monotonic_ns()
                continue
            if task_id == _READY:
                with self._lock:  # its first task starts now (hang_timeout counts from here)
                    answer, a.head_ns, a.set_up, a.sent = result, time.monotonic_ns(), True, None
                self._put(a, answer)
                if isinstance(answer, StartFailed):
                    return
                continue
            msg, batch, notices = result
            del result
            with self._lock:
                if a.held and a.held[0] == task_id:
                    a.held.popleft()
                a.head_ns, a.fields = time.monotonic_ns(), None
            if isinstance(msg, Done):
                a.busy_s += msg.load_s
                a.samples += msg.samples
            self._put(a, Received(msg, batch) if isinstance(msg, Done) else msg)
            del batch
            for notice in notices:
                self._put(a, notice)
                if isinstance(notice, Retire):  # it stopped after this task: replace it
                    self._end(a)  # (its generation stays: the respawn moves it on)
                    self._put(a, Died(REMOTE, a.worker_id, a.pid, None, liveness.RETIRED))
                    return

    def _on_failure(self, a: Actor, task_id: int, exc: BaseException) -> None:
        """A call raised: the actor, its node or a result is gone. One `Died`, for one actor
        or (worker id -1, the cause's group) every actor of a lost node."""
        cause = liveness.classify(self._ray, exc, a.handle, a.node_id, a.address, a.pid)
        with self._lock:  # the first collector to see it claims every actor it took
            if a.gone or self._actors.get(a.worker_id) is not a:
                return
            group = [a]
            if cause.node_lost and a.node_id:
                self._lost_nodes.add(a.node_id)
                group += [
                    b
                    for b in self._actors.values()
                    if b is not a and b.node_id == a.node_id and not b.gone
                ]
            for b in group:
                b.gone = True
                self._generations[b.worker_id] += 1
        if len(group) > 1:  # one event for every worker the node took
            lost = tuple((b.worker_id, b.pid, b.progress()) for b in group)
            died = Died(REMOTE, -1, None, None, dataclasses.replace(cause, group=lost))
            self._events.put((-1, 0, died))
        else:
            died = Died(REMOTE, a.worker_id, a.pid, a.progress(), cause)
            self._events.put((a.worker_id, self._generations[a.worker_id], died))
        for b in group:
            self._end(b)

    # -- messaging ---------------------------------------------------------------------------
    def _send(self, worker_id: int, msg: object, task_id: int | None = None) -> None:
        with self._lock:  # give_back cannot take the actor between the check and the call
            self._in_use(sending=True)
            a = self._actors.get(worker_id)
            if a is not None and not a.gone:
                a.call(msg, task_id)

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Send a task: one actor call, whose result is its outcome."""
        self._send(worker_id, Task(task_id, indices, (), epoch), task_id)

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Tell an actor where its dataset replica resumes."""
        self._send(worker_id, Restore(state))

    def send_reset(self) -> None:
        """Tell every actor a new epoch begins (persistent workers)."""
        for worker_id in list(self._actors):
            self._send(worker_id, Reset())

    def waitables(self) -> list[Any]:
        """The outbox's socket, armed (as a `ThreadPool`'s)."""
        self._in_use(sending=False)
        self._events.armed = True
        return [self._events]

    def pending(self) -> bool:
        """Whether events are queued."""
        return not self._events.queue.empty()

    def exit_unreported(self) -> bool:
        """Never known here: an actor's death is known when Ray says it (then queued)."""
        return False

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """Every queued event of a current actor (or pool-wide), without blocking."""
        self._polled, self._in_poll = time.monotonic(), False
        return self._events.take(ready, self._generations)

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """Block until an event arrives or ``timeout_s`` passes. [Unit: second]"""
        self._in_use(sending=False)
        self._events.wait(timeout_s)
        return self.collect(())

    # -- the worker's state ------------------------------------------------------------------
    def pid(self, worker_id: int) -> int | None:
        """The actor's process id (on its node)."""
        a = self._actors.get(worker_id)
        return a.pid if a is not None else None

    def host(self, worker_id: int) -> str | None:
        """The address of the actor's node (once its set-up began)."""
        a = self._actors.get(worker_id)
        return a.address or None if a is not None else None

    def pids(self) -> dict[int, int]:
        """Empty: remote memory is not sampled from here (the actors report theirs)."""
        return {}

    def started_at(self, worker_id: int) -> float | None:
        """When the actor was asked for, on the pool's clock. [Unit: second]"""
        a = self._actors.get(worker_id)
        return a.asked_at if a is not None else None

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the pool measures with."""
        return self._clock

    def progress(self, worker_id: int) -> Progress | None:
        """What the actor is doing (inferred, see module)."""
        a = self._actors.get(worker_id)
        if a is None:
            return None
        with self._lock:
            return a.progress()

    def on_its_way(self, worker_id: int) -> bool:
        """Whether an event is waiting to be read."""
        return not self._events.queue.empty()

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """The actor's Python stacks (its control group answers while the loop is busy)."""
        a = self._actors.get(worker_id)
        if a is None:
            return ""
        return liveness.stack(self._ray, a, wait_s)

    def kill(self, worker_id: int) -> None:
        """Kill the actor now (a hang); its `Died` event follows."""
        a = self._actors.get(worker_id)
        if a is None or a.gone:
            return
        progress = a.progress()
        self._generations[worker_id] += 1
        self._end(a)
        cause = liveness.RemoteCause(
            "killed by steadyload (hang_timeout)", "a hang", "see the stack", a.node_id, a.address
        )
        died = Died(REMOTE, worker_id, a.pid, progress, cause)
        self._events.put((worker_id, self._generations[worker_id], died))

    def measured(self) -> dict[int, tuple[str, str, float, int]]:
        """worker id -> (node id, address, seconds loading, samples) of each live actor."""
        return {w: (a.node_id, a.address, a.busy_s, a.samples) for w, a in self._actors.items()}
