"""Asking a fork server for a worker, with every wait bounded.

CPython's `popen_forkserver.Popen._launch` writes the worker's start data to a pipe and
then blocks reading the new pid back from the server, without a timeout: a fork server
that is stopped (SIGSTOP, a debugger, a cgroup freezer) or stuck never answers, and the
loader hangs in `iter()` with nothing said. Here the same exchange waits in slices: a
stopped server is named at once, a server that is merely slow (the first start waits for
its preloads, torch alone about a second) is given `START_TIMEOUT_S`, and then the start
fails with what was seen. A server that died answers EOF, as in CPython.

Used through `BoundedPopen` by the forkserver context (`FORKSERVER`, a `ForkServerContext`
whose processes launch this way) and the zygote's (zygote.py). Written against CPython 3.10
to 3.13.
"""

from __future__ import annotations

import io
import os
import select
import time
from multiprocessing import context, forkserver, popen_forkserver, process, reduction, spawn, util
from typing import Any

START_TIMEOUT_S = 120.0
"""How long a running fork server may take to fork a worker: its first fork waits for its
preloads (your dataset's module and what it imports: transformers can take tens of seconds
on a cold disk)."""
_SLICE_S = 0.25  # how often the server's state is looked at while waiting


class StartStalled(Exception):
    """The fork server did not answer a worker start (stopped, or past the timeout)."""

    def __init__(self, why: str, pid: int | None, stopped: bool) -> None:
        super().__init__(why)
        self.pid, self.stopped = pid, stopped


def server_state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, D, T stopped, t traced, Z...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :][:1].decode() or None  # the name may hold spaces


def _wait(fd: int, for_write: bool, server_pid: int | None, deadline: float) -> None:
    """Until ``fd`` is ready, checking on the server between slices."""
    while True:
        ready = select.select([], [fd], [], _SLICE_S)[1] if for_write else (
            select.select([fd], [], [], _SLICE_S)[0])  # fmt: skip
        if ready:
            return
        state = server_state(server_pid) if server_pid is not None else None
        server = f"the fork server (pid {server_pid})"
        if state in ("T", "t"):
            raise StartStalled(f"{server} is stopped (process state {state!r}: SIGSTOP, a "
                               "debugger or a frozen cgroup)", server_pid, True)  # fmt: skip
        if time.monotonic() >= deadline:
            raise StartStalled(f"{server} did not fork the worker within {START_TIMEOUT_S:g} "
                               f"s (process state {state!r})", server_pid, False)  # fmt: skip


class BoundedPopen(popen_forkserver.Popen):
    """`popen_forkserver.Popen` whose launch waits at most `START_TIMEOUT_S` (`_server`
    names the fork server to ask)."""

    def _server(self) -> Any:
        """The running fork server (``connect_to_new_process``, ``_forkserver_pid``)."""
        raise NotImplementedError

    def _launch(self, process_obj: process.BaseProcess) -> None:
        """CPython's `popen_forkserver.Popen._launch`, with every wait bounded.

        Raises:
            StartStalled: the server is stopped or did not answer in time.
            EOFError: the server died (as CPython's own launch raises).
        """
        server = self._server()
        server_pid: int | None = server._forkserver_pid
        prep_data = spawn.get_preparation_data(process_obj._name)  # type: ignore[attr-defined]  # private
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]  # set by Popen.__init__
        # Kept open until the Popen is collected: the worker's parent sentinel reads EOF
        # when this process dies.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]  # close_fds is private
        deadline = time.monotonic() + START_TIMEOUT_S
        data = memoryview(buf.getbuffer())
        try:
            os.set_blocking(w, False)  # a stopped server leaves a full pipe full
            while data:
                _wait(w, True, server_pid, deadline)
                data = data[os.write(w, data) :]
        finally:
            os.close(w)
        _wait(self.sentinel, False, server_pid, deadline)
        self.pid = forkserver.read_signed(self.sentinel)


class _ForkserverPopen(BoundedPopen):
    def _server(self) -> Any:
        server: Any = forkserver._forkserver
        server.ensure_running()  # connect_to_new_process does it too; then the pid is known
        return server


class _ForkserverProcess(process.BaseProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: process.BaseProcess) -> _ForkserverPopen:
        return _ForkserverPopen(process_obj)


# CPython defines ForkServerContext on POSIX only; elsewhere this context is never chosen.
_ForkServerContext: Any = getattr(context, "ForkServerContext", context.BaseContext)


class ForkserverContext(_ForkServerContext):  # CPython's or its base
    """CPython's forkserver context, whose worker starts wait at most `START_TIMEOUT_S`."""

    Process = _ForkserverProcess  # a BaseProcess, as CPython's


FORKSERVER = ForkserverContext()
