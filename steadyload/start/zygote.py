"""start_method="zygote": a fork server made by fork() of this process, so workers share its memory.

CPython's fork server is a fresh interpreter: everything it imports (torch's Python objects
and libtorch tables: docs/design/figures.md#fork-server) is a second copy next to this
process's. The zygote
is CPython's fork server loop (`multiprocessing.forkserver.main`) run in a *forked* copy of
this process instead, so it and every worker forked from it share this process's pages
until one of them writes to a page. Workers are still never forked from this process
itself, so a GPU context created here *after* the zygote exists is never inherited; one
created *before* is refused (guards.py). See docs/design/zygote.md for when it is safe and
what it costs.

The parent side is a `ForkServer` instance of its own (not the process-wide
`multiprocessing.forkserver._forkserver` that forkserver loaders use) and a context whose
Popen asks that instance for new processes. Everything a worker receives still travels
pickled, as under forkserver (file descriptors with DupFd, SharedList handles, torch's
shared tensors). Written against CPython 3.10 to 3.13's forkserver.py/popen_forkserver.py.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from multiprocessing import (
    connection,
    context,
    forkserver,
    process,
    resource_tracker,
    spawn,
    util,
)
from typing import NoReturn

from .launch import BoundedPopen

_LOG = logging.getLogger(__name__)

# forkserver.main's parameters in CPython 3.10-3.13; 3.14 adds an authentication key.
_MAIN_PARAMS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")


def unsupported_reason() -> str | None:
    """Why this interpreter cannot run a zygote, or None when it can."""
    if sys.platform != "linux":
        return f"it needs Linux (fork with file-descriptor passing), not {sys.platform}"
    params = tuple(inspect.signature(forkserver.main).parameters)
    if params != _MAIN_PARAMS:
        return (
            f"CPython {sys.version.split()[0]}'s fork server takes {params}; steadyload's "
            f"zygote knows that of CPython 3.10 to 3.13, {_MAIN_PARAMS}"
        )
    return None


class _Zygote(forkserver.ForkServer):
    """The parent's handle on its zygote: CPython's ForkServer, started by fork() not exec."""

    # Private ForkServer state (CPython 3.10-3.13), set here instead of by ensure_running.
    _forkserver_address: str | None
    _forkserver_alive_fd: int | None
    _forkserver_pid: int | None
    _lock: threading.Lock

    def __init__(self, before_fork: Callable[[], None]) -> None:
        super().__init__()
        self._before_fork = before_fork

    def ensure_running(self) -> None:
        """Fork the zygote unless it runs. Called before every worker start, as in CPython."""
        with self._lock:
            resource_tracker.ensure_running()  # before the fork: one tracker for all of us
            pid = self._forkserver_pid
            if pid is not None:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else: gone all the same
                    done, status = pid, 0
                if not done:
                    return
                _LOG.warning(
                    "the zygote (pid %d) exited (%s); forking a new one from this process",
                    pid,
                    _describe(status),
                )
                self._forget()
            self._before_fork()  # raises when forking is unsafe now (a GPU context)
            self._fork()

    def _forget(self) -> None:
        if self._forkserver_alive_fd is not None:
            os.close(self._forkserver_alive_fd)
        address = self._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            try:
                os.unlink(address)
            except OSError:
                pass
        self._forkserver_address = self._forkserver_alive_fd = self._forkserver_pid = None

    def _fork(self) -> None:
        main = _main_to_import()
        util._flush_std_streams()  # type: ignore[attr-defined]  # private; else each worker prints buffered output again at exit
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]  # private CPython helper
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            # Parent and workers hold the write end; EOF on the read end tells the zygote
            # that all of them are gone (CPython's "alive" pipe).
            alive_r, alive_w = os.pipe()
            try:
                with warnings.catch_warnings():
                    # CPython 3.12+ warns about fork() with threads; guards.py has warned
                    # already, in words that name the threads and the fix.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
            except BaseException:
                os.close(alive_r)
                os.close(alive_w)
                if not util.is_abstract_socket_namespace(address):
                    os.unlink(address)
                raise
            if pid == 0:
                _run_zygote(listener, alive_r, alive_w, main)
            os.close(alive_r)
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_w
        self._forkserver_pid = pid
        _LOG.debug("forked the zygote (pid %d), listening on %s", pid, address)


def _describe(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _main_to_import() -> tuple[str, str] | None:
    """How workers will find ``__main__`` (by module name or by path), if they can."""
    from ..pickling import main_is_importable

    if not main_is_importable():
        return None  # sent by value instead (pickling.py); nothing to import
    data = spawn.get_preparation_data("zygote")
    if "init_main_from_name" in data:
        return "name", str(data["init_main_from_name"])
    if "init_main_from_path" in data:
        return "path", str(data["init_main_from_path"])
    return None


# -- in the zygote ---------------------------------------------------------------------------


def _run_zygote(
    listener: socket.socket, alive_r: int, alive_w: int, main: tuple[str, str] | None
) -> NoReturn:
    """The zygote's whole life; never returns into the caller's stack (os._exit)."""
    code = 1
    try:
        # First, before anything allocates: no collection here or in a worker may traverse
        # (and so write to, un-sharing) the parent's objects. O(1): it splices lists.
        # A gc.collect() first, as the fork server does, would touch every page instead.
        gc.freeze()
        listener_fd = listener.detach()  # forkserver.main owns it from now on
        os.close(alive_w)  # else the zygote would keep itself alive
        _become_server()
        _import_main(main)
        _warm_worker_start()
        gc.freeze()  # what importing the main script and the warm-up made
        # Restored in each worker by forkserver._serve_one (it saves the handlers in force).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        forkserver.main(listener_fd, alive_r, [], None, None)
    except SystemExit:
        code = 0  # EOF on the alive pipe: the parent and all workers are gone
    except BaseException:
        try:
            sys.stderr.write("steadyload: the zygote failed:\n" + traceback.format_exc())
            sys.stderr.flush()
        except BaseException:  # a closed stderr must not keep the process alive
            pass
    finally:
        os._exit(code)


def _become_server() -> None:
    """Drop the parent's process state that a fresh fork server would not have."""
    global _server, _lock
    _server, _lock = None, threading.Lock()  # a worker wanting a zygote forks its own
    # Ctrl-C reaches the whole process group; the zygote outlives it like a fork server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        # Python handlers installed by the parent (a trainer's SIGTERM handler) would run
        # the parent's code in the zygote and the workers: back to the default. Ignored
        # signals stay ignored, as they would across exec.
        if callable(handler) and sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_DFL)
    # The process-wide fork server is the parent's child, not ours: a worker starting one
    # of its own must not wait on it.
    setattr(forkserver._forkserver, "_forkserver_pid", None)  # noqa: B010  # private CPython state


def _warm_worker_start() -> None:
    """Do once here what every worker's start would do again: import numpy's random module
    (torch's worker seeding needs it) and read the source lines of this stack (torch's
    lazy CUDA/XPU seeding formats the caller's stack, and the zygote's stack is the
    worker's, as deep as the script's at the fork)."""
    try:
        import numpy.random  # noqa: F401
    except ImportError:
        pass
    traceback.format_stack()  # fills linecache, which the workers inherit


def _import_main(main: tuple[str, str] | None) -> None:
    """Give the zygote a ``__main__`` like a fork server's: the script, imported afresh.

    The copy of ``__main__`` forked from the parent is half-executed (the names defined
    below the line that built the loader do not exist yet), and `spawn.prepare` in a
    worker keeps a ``__main__`` whose ``__file__`` is the script's, so it must go. Importing
    the script here as ``__mp_main__`` (guarded code does not run) does what CPython's fork
    server does with its '__main__' preload: workers need not import it each.
    """
    fresh = types.ModuleType("__main__")
    sys.modules["__main__"] = fresh
    if main is None:
        return
    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]  # what multiprocessing sets while importing main in a child
    try:
        kind, where = main
        if kind == "name":
            spawn._fixup_main_from_name(where)  # type: ignore[attr-defined]  # private CPython helper
        else:
            spawn._fixup_main_from_path(where)  # type: ignore[attr-defined]  # private CPython helper
    except BaseException:  # SystemExit from a script too
        # Each worker imports it again and reports the error with its own traceback.
        sys.modules["__main__"] = fresh
        sys.modules.pop("__mp_main__", None)
    finally:
        del current._inheriting  # type: ignore[attr-defined]  # set above


# -- the parent side -------------------------------------------------------------------------

_lock = threading.Lock()
_server: _Zygote | None = None


def ensure(before_fork: Callable[[], None]) -> int:
    """Fork the zygote now unless it runs; return its pid.

    ``before_fork`` runs right before each fork (also when a dead zygote is replaced later)
    and raises to refuse it. Blocks for the fork only (milliseconds).
    """
    global _server
    with _lock:
        server = _server if _server is not None else _Zygote(before_fork)
        server.ensure_running()
        _server = server
        pid = server._forkserver_pid
        assert pid is not None
        return pid


def pid() -> int | None:
    """The zygote's pid, or None when none was forked (or it was forked and then lost)."""
    server = _server
    return server._forkserver_pid if server is not None else None


def stop(wait_s: float = 1.0) -> None:
    """Let the zygote go: it exits at EOF on its alive pipe, once every worker forked from
    it is gone too; reaped within ``wait_s`` if it has exited by then. [Unit: second]"""
    with _lock:
        gone = _forget()
    _reap(gone, wait_s)


def _forget() -> int | None:
    """Close this process's end of the zygote's alive pipe and forget it (holding `_lock`)."""
    server = _server
    if server is None or server._forkserver_pid is None:
        return None
    zygote_pid = server._forkserver_pid
    with server._lock:
        server._forget()
    _LOG.debug("stopping the zygote (pid %d)", zygote_pid)
    return zygote_pid


def _reap(zygote_pid: int | None, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while zygote_pid is not None and time.monotonic() < deadline:  # past it, workers run
        try:
            if os.waitpid(zygote_pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:  # reaped by someone else
            return
        time.sleep(0.005)


# At exit the zygote goes before this interpreter's teardown, which writes to every object:
# each page the zygote shares with this process would become a copy, a peak for nothing.
# (Registered at import: the exit hooks registered later, which stop workers, run first.)
atexit.register(stop, 0.2)


def _current() -> _Zygote:
    server = _server
    if server is None:
        raise RuntimeError(
            "[steadyload internal error] a zygote worker was started before the zygote; "
            "please report with the output of `steadyload doctor`"
        )
    return server


class _Popen(BoundedPopen):
    method = "zygote"

    def _server(self) -> _Zygote:
        # The zygote instead of the process-wide fork server (a module global in
        # popen_forkserver), with every wait bounded (launch.py).
        return _current()


class _ZygoteProcess(process.BaseProcess):
    # BaseProcess._bootstrap forces this start method in the worker; "zygote" is unknown
    # to multiprocessing, and a zygote worker's multiprocessing state is a forkserver one.
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: process.BaseProcess) -> _Popen:
        return _Popen(process_obj)


class ZygoteContext(context.BaseContext):
    """A multiprocessing context whose processes are forked by the zygote."""

    _name = "zygote"
    Process = _ZygoteProcess


CONTEXT = ZygoteContext()


class AutoZygoteContext(ZygoteContext):
    """The zygote as ``start_method="auto"`` took it: where it must be forked again (it
    died) and that is no longer safe (a GPU context since), the workers' pool falls back
    to ``fallback``, CPython's fork server, instead of failing."""

    fallback: context.BaseContext | None = None  # set by start/context.py (no cycle here)


AUTO_CONTEXT = AutoZygoteContext()
