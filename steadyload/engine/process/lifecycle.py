"""Stopping worker processes: ask, wait, terminate, kill; every step bounded, logged, resumable.

Order (docs/design/shutdown.md): send `Stop` to every worker, close the parent's ends of
the sockets (a worker blocked sending a batch gets EPIPE and exits), wait ``grace_s`` on the
process sentinels, then SIGTERM, wait, SIGKILL, wait, and reap; then SIGKILL any worker
whose fork server died under it (it was reported dead but still runs). A handle leaves the
list only once its process is reaped, and each step is done once per handle, so a
teardown that was interrupted finishes on the next call (`teardown` runs again from the
iterator, its ``__del__`` or the interpreter's exit). SIGINT is held meanwhile: a Ctrl-C
skips the grace periods instead of leaving workers behind, and is delivered at the end.
Shared-memory segments need no step: they are memfds, freed by the kernel when the last
process and mapping let go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from ...start.servers import ServerRef
from ..interrupts import held_interrupts, on_interrupt
from .handles import Handle
from .server_watch import ServerWatch

_LOG = logging.getLogger(__name__)
_SLICE_S = 0.1  # waits are cut in slices, so that a held Ctrl-C can cut them short


def _never() -> bool:
    return False


def _wait_exit(
    procs: Sequence[BaseProcess], timeout_s: float, clock: Callable[[], float],
    urgent: Callable[[], bool],
) -> None:
    deadline = clock() + timeout_s
    while True:
        alive = [p for p in procs if p.exitcode is None]
        remaining = deadline - clock()
        if not alive or remaining <= 0 or urgent():
            return
        wait([p.sentinel for p in alive], timeout=min(remaining, _SLICE_S))


def stop_processes(
    procs: Sequence[BaseProcess],
    grace_s: float = 2.0,
    kill_wait_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
    urgent: Callable[[], bool] = _never,
) -> None:
    """Make sure every process in ``procs`` has exited. Never blocks forever.

    Call after the workers were asked to stop. Waits ``grace_s`` for them (not at all once
    ``urgent()`` is true), then sends SIGTERM and SIGKILL, each followed by a wait of at
    most ``kill_wait_s``. Does not close the process objects. [Unit: second]
    """
    started = [p for p in procs if getattr(p, "_popen", None) is not None]
    _wait_exit(started, grace_s, clock, urgent)
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
        _wait_exit(alive, kill_wait_s, clock, _never)
    for p in started:
        if p.exitcode is None:
            _LOG.warning("worker pid %s did not exit after SIGKILL", p.pid)


def teardown(handles: list[Handle], grace_s: float) -> None:
    """Stop the workers in ``handles`` and empty the list; safe to call again if interrupted.

    Also run by the pool's finalizer at garbage collection and interpreter exit.
    """
    if not handles:
        return
    urgent = [False]
    with held_interrupts(), on_interrupt(lambda: urgent.__setitem__(0, True)):
        _LOG.debug("stopping %d workers", len(handles))
        for h in handles:
            h.request_stop()
        stop_processes([h.process for h in handles], grace_s=grace_s,
                       urgent=lambda: urgent[0])
        for h in list(handles):
            h.kill_orphan()
            h.finish()
            handles.remove(h)


def stop_all(live: list[Handle], server_fds: dict[ServerRef, int], grace_s: float) -> None:
    """A pool's teardown, then its fork servers' pidfds closed: also what its finalizer
    runs at garbage collection or exit."""
    try:
        teardown(live, grace_s)  # a held Ctrl-C is raised at its end
    finally:
        ServerWatch(server_fds).close()
