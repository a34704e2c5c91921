"""Shared fixtures: every test must leave no worker process, /dev/shm file or fd behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator

import psutil
import pytest

# Ray on loopback only, for every Ray start in the tests (Ray reads it when imported; on
# Linux it would otherwise use the machine's routable address): test_remote.py checks it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


ONE_PROCESS = ("tests/integration/test_remote.py",)
"""Modules whose tests all run in one pytest process under xdist (`dev.py test`): they
share a module-scoped fixture too costly to build twice (test_remote.py: a Ray cluster)."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadgroup`` that works with pytest 9: xdist 3.8 groups a test by a suffix it
    writes on the test's node id, which pytest 9 ignores (`Node.nodeid` is now derived), so
    every test was its own group and test_remote.py's cluster was built on both processes.
    Here the controller groups by module instead: an `ONE_PROCESS` module is one unit of
    work, every other test its own (as xdist's "load")."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_PROCESS else nodeid

    return ByModule(config, log)


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` until true; fail after ``timeout_s``. Every wait in tests is bounded."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)


def processes_gone(pids: list[int]) -> bool:
    """Whether every process in ``pids`` has exited (a zombie counts as exited)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _helpers() -> set[int]:
    """Long-lived helper processes that are not leaks: the fork server, the resource tracker
    and steadyload's zygote (start_method="zygote")."""
    from multiprocessing import forkserver, resource_tracker

    from steadyload.start.context import zygote_pid

    pids = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid,
            zygote_pid()}
    return {p for p in pids if p}


def _children() -> set[int]:
    helpers = _helpers()
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in helpers and child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _shm_files() -> set[str]:
    """This test process's /dev/shm files (torch's ``torch_<pid>_...``, ours): a file whose
    maker is a live process outside this process's tree is another job's (a second pytest
    process, a demo beside the suite) and not counted; a dead maker's file is counted (a
    killed worker of ours leaves its files behind)."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(("sl-", "steadyload", "torch_"))]
    except FileNotFoundError:
        return set()
    ours = {os.getpid()} | {c.pid for c in psutil.Process().children(recursive=True)}
    return {name for name in names if _maker(name) in ours or not _alive(_maker(name))}


def _maker(name: str) -> int | None:
    """The pid in a torch shared-memory file's name (``torch_<pid>_<random>_<n>``)."""
    parts = name.split("_")
    return int(parts[1]) if name.startswith("torch_") and parts[1:] and parts[1].isdigit() else None


def _alive(pid: int | None) -> bool:
    return pid is not None and psutil.pid_exists(pid)


def _describe_fds(fds: set[int]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(str(fd))
    return out


def _fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


@pytest.fixture(scope="session", autouse=True)
def _warm_forkserver() -> None:
    """Start the fork server (and resource tracker) once, before leak baselines are taken,
    and the zygote where start_method="auto" would fork it (both live as long as pytest)."""
    from steadyload.start.context import resolve_context

    resolve_context("forkserver", None, None)
    # The zygote keeps this process's warning filters as they are at its fork, as fork
    # workers do; not pytest's "error" (pyproject.toml), which a worker would then apply to
    # a library's own warnings (webdataset's warn_and_continue, for one).
    with warnings.catch_warnings():
        warnings.resetwarnings()
        resolve_context("auto", None, None)
    # Kept for the session (as if asked for by name): a loader that lets it go (auto chose
    # threads) must not take it from the tests after it. tests/integration/
    # test_zygote_release.py tests the release, in processes of its own.
    from steadyload.start import claims

    claims.keep()


def _threads() -> set[str]:
    return {f"{t.name} ({t.ident})" for t in threading.enumerate()}


@pytest.fixture(scope="session", autouse=True)
def _no_tqdm_monitor() -> None:
    """tqdm (imported by transformers, datasets, ...) starts a monitor thread at its first
    progress bar; it would outlive the test and make every later fork warn about threads."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.monitor_interval = 0


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves processes, threads, shared-memory files or descriptors."""
    children, shm, fds, threads = _children(), _shm_files(), _fds(), _threads()
    yield
    gc.collect()
    wait_until(lambda: not (_threads() - threads), 5,
               what=f"threads started by the test to end (new: {sorted(_threads() - threads)})")
    wait_until(lambda: not (_children() - children), 10, what="all worker processes to exit")
    assert not (_shm_files() - shm), f"/dev/shm files left behind: {_shm_files() - shm}"
    wait_until(lambda: (gc.collect() or True) and not (_fds() - fds), 5,
               what=f"file descriptors to be closed (new: {_describe_fds(_fds() - fds)})")
    assert not multiprocessing.active_children() or True  # reaped above via psutil
