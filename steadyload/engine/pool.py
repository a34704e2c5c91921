"""`WorkerPool`: what the iterators ask of their workers, processes or threads.

`supervisor.Supervisor` (processes) and `threads.ThreadSupervisor` (threads) both provide
it; iterators/ is written against this, so dispatch, recovery, the hang watch and
checkpoints are one code for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .status import Progress


class WorkerPool(Protocol):
    """The workers of one iterator: start, message, watch, stop (see `Supervisor`)."""

    running: bool

    @property
    def views(self) -> Sequence[Any]:
        """Each worker id's latest process or thread, as ``iterator._workers`` shows it."""

    @property
    def stopped(self) -> bool:
        """Whether every worker has been stopped."""

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the pool measures with."""

    def start(self) -> None:
        """Start all workers."""

    def respawn(self, worker_id: int) -> None:
        """Start a fresh worker for ``worker_id``."""

    def shutdown(self) -> None:
        """Stop every worker; idempotent."""

    def restart_server(self, dead: Any) -> tuple[str, ...]:
        """Start a new fork server in place of a dead one."""

    def pid(self, worker_id: int) -> int | None:
        """The worker's process id."""

    def pids(self) -> dict[int, int]:
        """worker id -> pid of the live workers whose memory is their own."""

    def started_at(self, worker_id: int) -> float | None:
        """When the worker was asked for, on `clock`. [Unit: second]"""

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Send a task."""

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Tell a replacement worker where its stream resumes."""

    def send_reset(self) -> None:
        """Tell every worker a new epoch begins."""

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """Block until events arrive or ``timeout_s`` passes. [Unit: second]"""

    def progress(self, worker_id: int) -> Progress | None:
        """What the worker is doing now."""

    def on_its_way(self, worker_id: int) -> bool:
        """Whether an outcome is waiting to be read."""

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """The (hung) worker's Python stacks."""

    def kill(self, worker_id: int) -> None:
        """Stop the worker now; its `Died` event follows from `wait`."""
