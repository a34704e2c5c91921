"""The remote pool's records: each actor (`Actor`), its view (`RemoteView`), the
configuration actors are sent (`dumps_config`) and the warning for an actor Ray cannot
place (`warn_unplaced`)."""

from __future__ import annotations

import collections
import logging
import queue
import time
from typing import Any

from ...pickling import diagnose
from ..config import WorkerConfig
from ..worker.status import FLAGS, IDLE, INIT, LOADING, POSITION, STAGE, TASK, Progress
from .spec import RemoteWorkers

_LOG = logging.getLogger("steadyload.engine.remote.pool")
PLACEMENT_WARN_S = 15.0
"""How long an actor may wait for Ray to place it before a warning says so. [Unit: second]"""


def dumps_config(config: WorkerConfig) -> bytes:
    """The workers' configuration for Ray (cloudpickle: by reference where importable, by
    value for ``__main__`` and local functions; tensors by value, not as shared memory)."""
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps(config))
    except Exception as exc:
        parts = {
            "dataset": config.dataset,
            "collate_fn": config.collate_fn,
            "worker_init_fn": config.worker_init_fn,
        }
        raise diagnose(parts, cloudpickle.dumps, exc) from exc


class RemoteView:
    """One remote worker as ``iterator._workers`` shows it."""

    def __init__(self, worker_id: int, actor: Actor) -> None:
        self.worker_id = worker_id
        self._actor = actor

    @property
    def pid(self) -> int | None:
        """The actor's process id, on its node."""
        return self._actor.pid

    @property
    def node(self) -> str:
        """The Ray node id the actor runs on ("" before it started)."""
        return self._actor.node_id

    @property
    def exitcode(self) -> int | None:
        """None while the actor runs; 0 once it is gone."""
        return 0 if self._actor.gone else None

    def is_alive(self) -> bool:
        """Whether the actor is still this worker's."""
        return not self._actor.gone

    def __repr__(self) -> str:
        return f"<steadyload remote worker {self.worker_id} pid {self.pid} node {self.node[:12]}>"


class Actor:
    """The pool's record of one actor."""

    def __init__(self, worker_id: int, generation: int, asked_at: float) -> None:
        self.worker_id = worker_id
        self.generation = generation
        self.asked_at = asked_at
        self.handle: Any = None
        self.number = 0  # the next message's number
        self.calls: queue.SimpleQueue[tuple[Any, int] | None] = queue.SimpleQueue()
        self.held: collections.deque[int] = collections.deque()  # task ids, in order
        self.head_ns = 0  # when the oldest held task started (inferred)
        self.fields: list[int] | None = None  # from the latest stack dump
        self.pid: int | None = None  # once its set-up began (`begin`)
        self.setup_ns = 0  # when its set-up began, on this process's clock
        self.set_up = False  # `Ready` came
        self.sent: list[tuple[object, int | None]] | None = []  # its messages, until `Ready`
        self.node_id = ""
        self.address = ""
        self.gone = False
        self.busy_s = 0.0
        self.samples = 0
        self.rss: int | None = None

    def call(self, msg: object, task_id: int | None) -> None:
        """One numbered call (the pool holds its lock); a task's result is collected."""
        ref = self.handle.call.remote(self.number, msg)
        self.number += 1
        if self.sent is not None:  # until it is set up (a give-back may send these again)
            self.sent.append((msg, task_id))
        if task_id is not None:
            if not self.held:
                self.head_ns = time.monotonic_ns()
            self.held.append(task_id)
            self.calls.put((ref, task_id))

    def progress(self) -> Progress:
        """What the actor is doing, inferred (pool.py's module docstring). Times are this
        process's (an actor's clock is its node's); the stage and sample are the actor's
        own once a stack dump brought its fields."""
        since = self.head_ns if self.set_up else self.setup_ns
        if self.fields is not None:
            f = self.fields
            return Progress(f[TASK], f[POSITION], f[STAGE], since, f[FLAGS])
        if not self.set_up:  # in its set-up (worker_init_fn, the first iterator), or not begun
            return Progress(-1, -1, INIT if since else IDLE, since, 0)
        if not self.held:
            return Progress(-1, -1, IDLE, 0, 0)
        return Progress(self.held[0], -1, LOADING, since, 0)


def warn_unplaced(ray: Any, spec: RemoteWorkers, worker_id: int) -> None:
    """Say that Ray has not started a worker's actor after `PLACEMENT_WARN_S`: its tasks
    wait for it, so the training loop would otherwise wait in silence."""
    try:
        free = ray.available_resources()
    except Exception:
        free = {}
    _LOG.warning(
        "remote worker %d has waited %.0f s for Ray to place its actor (it needs "
        "num_cpus=%s%s%s); the cluster has %s CPU(s) free. Its batches wait for it. "
        "Add nodes (an autoscaling cluster adds them for a pending actor), ask for fewer "
        "remote_workers, or lower RemoteWorkers(num_cpus=...).",
        worker_id,
        PLACEMENT_WARN_S,
        spec.num_cpus,
        f", resources={spec.resources}" if spec.resources else "",
        f", labels={spec.label_selector}" if spec.label_selector else "",
        free.get("CPU", 0),
    )
