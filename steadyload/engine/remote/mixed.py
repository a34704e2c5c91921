"""`MixedPool`: local workers and remote workers serving one loader together.

Worker ids 0 .. n-1 are the local pool's (processes, threads or "auto"), n .. n+m-1 the
remote pool's; every call goes to the pool that owns the id, and one poll waits on both
(`wait_any`). The iterator sees one pool of n+m workers: torch's round-robin dispatch
over all of them, one task table, one recovery.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..pool import Kind, ServerPool, WorkerPool, wait_any
from ..worker.status import Progress
from .pool import RemotePool


class _Views(Sequence[Any]):
    def __init__(self, pool: MixedPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return len(self._pool._local.views) + len(self._pool._remote.views)

    def __getitem__(self, i: Any) -> Any:
        local = self._pool._local.views
        return local[i] if i < len(local) else self._pool._remote.views[i - len(local)]


class MixedPool:
    """Local workers first (ids below ``split``), remote workers after them."""

    def __init__(self, local: WorkerPool, remote: RemotePool, split: int) -> None:
        self._local = local
        self._remote = remote
        self._split = split
        self.views = _Views(self)
        self.running = False

    def _of(self, worker_id: int) -> Any:
        return self._local if worker_id < self._split else self._remote

    @property
    def remote(self) -> RemotePool:
        """The remote part."""
        return self._remote

    @property
    def kind(self) -> Kind:
        """The local workers' kind (the remote ones are "remote")."""
        return self._local.kind

    @property
    def start_method(self) -> str | None:
        """The local processes' start method."""
        return self._local.start_method

    @property
    def preload(self) -> tuple[str, ...]:
        """The local fork server's preloads."""
        return self._local.preload

    @property
    def stopped(self) -> bool:
        """Whether both pools stopped."""
        return self._local.stopped and self._remote.stopped

    @property
    def clock(self) -> Callable[[], float]:
        """The local pool's clock."""
        return self._local.clock

    def start(self) -> None:
        """Start the remote actors (placement takes Ray a while), then the local workers."""
        self._remote.start()
        self._local.start()
        self.running = True

    def shutdown(self) -> None:
        """Stop both pools."""
        self.running = False
        try:
            self._local.shutdown()
        finally:
            self._remote.shutdown()

    def respawn(self, worker_id: int) -> None:
        """A fresh worker of the same kind and id."""
        self._of(worker_id).respawn(worker_id)

    def restart_server(self, method: str, pid: int) -> tuple[str, ...]:
        """The local fork server died: the local pool starts a new one."""
        assert isinstance(self._local, ServerPool)
        return self._local.restart_server(method, pid)

    def pid(self, worker_id: int) -> int | None:
        """The worker's process id."""
        return self._of(worker_id).pid(worker_id)

    def pids(self) -> dict[int, int]:
        """The local workers' pids (memory is sampled here for them only)."""
        return self._local.pids()

    def started_at(self, worker_id: int) -> float | None:
        """When the worker was asked for."""
        return self._of(worker_id).started_at(worker_id)

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Send a task to the pool that owns the worker."""
        self._of(worker_id).send_task(worker_id, task_id, indices, epoch)

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Where the worker's replica resumes."""
        self._of(worker_id).send_restore(worker_id, state)

    def send_reset(self) -> None:
        """A new epoch, for both pools."""
        self._local.send_reset()
        self._remote.send_reset()

    def waitables(self) -> list[Any]:
        """Both pools' waitables."""
        return [*self._local.waitables(), *self._remote.waitables()]

    def pending(self) -> bool:
        """Whether either pool has events queued."""
        return self._local.pending() or self._remote.pending()

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """Both pools' events."""
        return [*self._local.collect(ready), *self._remote.collect(ready)]

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """One poll over both pools. [Unit: second]"""
        return wait_any([self._local, self._remote], timeout_s)

    def progress(self, worker_id: int) -> Progress | None:
        """What the worker is doing."""
        return self._of(worker_id).progress(worker_id)

    def on_its_way(self, worker_id: int) -> bool:
        """Whether the worker's outcome waits to be read."""
        return self._of(worker_id).on_its_way(worker_id)

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """The worker's stacks."""
        return self._of(worker_id).dump_stack(worker_id, wait_s)

    def kill(self, worker_id: int) -> None:
        """Kill the worker; its `Died` follows."""
        self._of(worker_id).kill(worker_id)
