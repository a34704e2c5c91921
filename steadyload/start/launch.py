"""Asking a fork server for a worker, with every wait bounded.

CPython's `popen_forkserver.Popen._launch` writes the worker's start data to a pipe and
then blocks reading the new pid back from the server, without a timeout: a fork server
that is stopped (SIGSTOP, a debugger, a cgroup freezer) or stuck never answers, and the
loader hangs in `iter()` with nothing said. Here the same exchange waits in slices: a
stopped server is named at once; a server that is slow (the first start waits for its
preloads: torch, your dataset's module and what it imports, from a cold network disk) is
waited for as long as it makes progress (its CPU time or the bytes it reads grow), and one
that has made none for `STALL_S` (the environment variable `STALL_ENV` sets another) fails
the start with what was seen. A server that died
answers EOF, as in CPython.

Used through `BoundedPopen` by the forkserver context (`FORKSERVER`, a `ForkServerContext`
whose processes launch this way) and the zygote's (zygote.py). Written against CPython 3.10
to 3.13.
"""

from __future__ import annotations

import io
import os
import select
import time
from collections.abc import Callable
from multiprocessing import context, forkserver, popen_forkserver, process, reduction, spawn, util
from typing import Any

from ..host.system import proc_stat, process_state

STALL_S = 120.0
"""How long a fork server may make no progress at all (neither CPU time nor reads) before
a worker start it has not answered fails, unless `STALL_ENV` says. [Unit: second]"""
STALL_ENV = "STEADYLOAD_START_STALL_S"


def stall_s() -> float:
    """`STALL_S`, or the seconds `STALL_ENV` sets. [Unit: second]"""
    raw = os.environ.get(STALL_ENV)
    if raw is None:
        return STALL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:  # also NaN
        raise ValueError(
            f"{STALL_ENV}={raw!r} is not a number of seconds above 0: it is how long a "
            "worker start waits for a fork server that makes no progress. Set it to a "
            f"number such as 300, or unset it for the default ({STALL_S:g} s)."
        )
    return value
_SLICE_S = 0.25  # how often the server's state is looked at while waiting


class StartStalled(Exception):
    """The fork server did not answer a worker start (stopped, or past the timeout)."""

    def __init__(self, why: str, pid: int | None, stopped: bool) -> None:
        super().__init__(why)
        self.pid, self.stopped = pid, stopped


def server_progress(pid: int) -> tuple[int, int]:
    """(CPU ticks, bytes read) of process ``pid`` so far; what cannot be read counts 0."""
    ticks = read = 0
    try:
        fields = proc_stat(pid) or []
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
    except (IndexError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            read = int(next(line for line in f if line.startswith(b"rchar:")).split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    return ticks, read


class _Watch:
    """The server a start waits on: stopped, or without progress for `STALL_S`."""

    def __init__(self, pid: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self._clock = clock  # [Unit: second]; tests inject one
        self._seen = server_progress(pid) if pid is not None else (0, 0)
        self._since = clock()
        self._stall_s = stall_s()

    def check(self) -> None:
        """Raise `StartStalled` if the server is stopped or has made no progress lately."""
        pid = self.pid
        if pid is None:
            return
        state = process_state(pid)
        server = f"the fork server (pid {pid})"
        if state in ("T", "t"):
            raise StartStalled(
                f"{server} is stopped (process state {state!r}: SIGSTOP, a "
                "debugger or a frozen cgroup)",
                pid,
                True,
            )
        now, seen = self._clock(), server_progress(pid)
        if seen != self._seen:
            self._seen, self._since = seen, now
        elif now - self._since >= self._stall_s:
            raise StartStalled(
                f"{server} did not fork the worker and made no progress (no "
                f"CPU time, no reads) for {self._stall_s:g} s (process state "
                f"{state!r}; a start waits that long for a server that makes no progress: "
                f"{STALL_ENV}, in seconds, {STALL_S:g} by default)",
                pid,
                False,
            )


def _wait(fd: int, for_write: bool, watch: _Watch) -> None:
    """Until ``fd`` is ready, checking on the server between slices."""
    while True:
        ready = (
            select.select([], [fd], [], _SLICE_S)[1]
            if for_write
            else (select.select([fd], [], [], _SLICE_S)[0])
        )
        if ready:
            return
        watch.check()


class BoundedPopen(popen_forkserver.Popen):
    """`popen_forkserver.Popen` whose launch waits while the server makes progress
    (`_server` names the fork server to ask)."""

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
        watch = _Watch(server_pid)
        data = memoryview(buf.getbuffer())
        try:
            os.set_blocking(w, False)  # a stopped server leaves a full pipe full
            while data:
                _wait(w, True, watch)
                data = data[os.write(w, data) :]
        finally:
            os.close(w)
        _wait(self.sentinel, False, watch)
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
    """CPython's forkserver context, whose worker starts never wait on a stuck server."""

    Process = _ForkserverProcess  # a BaseProcess, as CPython's


FORKSERVER = ForkserverContext()
