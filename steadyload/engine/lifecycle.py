"""Stopping worker processes: ask, wait, terminate, kill; every step bounded and logged.

Order (docs/design/shutdown.md): send `Stop` to every worker, close the parent's ends of
the pipes (a worker blocked sending a batch gets EPIPE and exits), wait ``grace_s`` on the
process sentinels, then SIGTERM, wait, SIGKILL, wait, and reap. Shared-memory segments need
no step here: they are memfds, freed by the kernel when the last process and mapping let go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

_LOG = logging.getLogger(__name__)


def _wait_exit(procs: Sequence[BaseProcess], timeout_s: float, clock: Callable[[], float]) -> None:
    deadline = clock() + timeout_s
    while True:
        alive = [p for p in procs if p.exitcode is None]
        remaining = deadline - clock()
        if not alive or remaining <= 0:
            return
        wait([p.sentinel for p in alive], timeout=remaining)


def stop_processes(
    procs: Sequence[BaseProcess],
    grace_s: float = 2.0,
    kill_wait_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Make sure every process in ``procs`` has exited and is reaped. Never blocks forever.

    Call after the workers were asked to stop. Waits ``grace_s`` for them, then sends
    SIGTERM and SIGKILL, each followed by a wait of at most ``kill_wait_s``. [Unit: second]
    """
    started = [p for p in procs if getattr(p, "_popen", None) is not None]
    _wait_exit(started, grace_s, clock)
    for step in ("terminate", "kill"):
        alive = [p for p in started if p.exitcode is None]
        if not alive:
            break
        _LOG.debug("%s worker pids %s", step, [p.pid for p in alive])
        for p in alive:
            try:
                getattr(p, step)()
            except (OSError, ValueError):  # already gone, or closed
                pass
        _wait_exit(alive, kill_wait_s, clock)
    for p in started:
        if p.exitcode is not None:
            p.join(0)
            try:
                p.close()  # releases the sentinel's file descriptor now, not at GC
            except ValueError:
                pass
        else:
            _LOG.warning("worker pid %s did not exit after SIGKILL", p.pid)
