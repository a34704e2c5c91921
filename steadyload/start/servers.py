"""The fork server a loader's workers come from: watched for its death, restarted once.

Under forkserver and zygote every worker is a child of one server process, itself a child
of this process. When the server dies (a SIGKILL, a scheduler's SIGTERM to the process
group) CPython reports every worker it forked as exited with status 255, living or not;
steadyload treats that as one event (iterators/recovery.py). The server is peeked at with
``waitid(..., WNOWAIT)``, which never reaps it: CPython's `ForkServer.ensure_running`
reaps it itself when it restarts it, and would fail on a server reaped by someone else.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext

from ..errors import UnsafeForkError
from . import zygote
from .guards import check_zygote_safe
from .preload import ensure_forkserver, forkserver_pid, parent_imports

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerRef:
    """A running fork server: which kind, and its pid."""

    method: str
    """"forkserver" or "zygote"."""
    pid: int


def current(method: str) -> ServerRef | None:
    """The server that forks workers for ``method`` now, if it has one and it was started."""
    if method == "forkserver":
        pid = forkserver_pid()
    elif method == "zygote":
        pid = zygote.pid()
    else:
        return None
    return ServerRef(method, pid) if pid is not None else None


def exit_status(server: ServerRef) -> tuple[bool, int | None]:
    """(exited, its exit code or -signal) without reaping it; (True, None) if it is gone
    and its status unknown (reaped by CPython's restart, or not our child)."""
    try:
        info = os.waitid(os.P_PID, server.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True, None
    if info is None:
        return False, None
    killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    return True, -info.si_status if killed else info.si_status


def wait_exited(server: ServerRef, timeout_s: float) -> bool:
    """Whether the server exits within ``timeout_s`` (a bounded poll). [Unit: second]"""
    deadline = time.monotonic() + timeout_s
    while True:
        exited, _ = exit_status(server)
        if exited or time.monotonic() >= deadline:
            return exited
        time.sleep(0.01)  # no event to wait on for a process that is dying


def restart(server: ServerRef) -> tuple[ServerRef, tuple[str, ...]]:
    """Start a new server in place of the dead one: (it, the preloads it was asked for).

    A forkserver restarts with the same preload list (CPython keeps it; the new pid inherits
    steadyload's record of it, so ``report()`` shows the preloads); a zygote is forked
    again from this process (refused with `UnsafeForkError` if a GPU context exists now).
    Call only once the old server has exited (`exit_status`).
    """
    if server.method == "forkserver":
        preload = ensure_forkserver(())
    else:
        zygote.ensure(check_zygote_safe)
        preload = ()
    new = current(server.method)
    if new is None:
        raise RuntimeError(
            f"[steadyload internal error] the {server.method} did not restart; please report "
            "with the output of `steadyload doctor`"
        )
    _LOG.info("restarted the %s (pid %d, was %d)", server.method, new.pid, server.pid)
    return new, preload


def restart_or_fall_back(
    ctx: BaseContext, server: ServerRef, dataset_module: str
) -> tuple[BaseContext, tuple[str, ...]]:
    """`restart`, or, for a zygote that ``start_method="auto"`` took and that cannot be
    forked again now (a GPU context exists since), CPython's fork server in its place:
    (the context the workers start with from now on, its preloads)."""
    try:
        return ctx, restart(server)[1]
    except UnsafeForkError as exc:
        fallback = getattr(ctx, "fallback", None)
        if fallback is None:
            raise
        _LOG.warning(
            "the zygote (pid %d) died and cannot be forked again (%s); its workers start "
            "from the fork server from now on", server.pid, str(exc).splitlines()[0],
        )
        return fallback, ensure_forkserver((*parent_imports(), dataset_module))
