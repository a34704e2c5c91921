"""Fork-server preloading: what the process-wide fork server imports, and starting it.

CPython's fork server is a process-wide singleton (`multiprocessing.forkserver._forkserver`)
shared with every forkserver user in this process: steadyload merges its preloads into the
list already there, sets it once before the server starts, and records what it asked for
(`StartInfo.preload`, shown by ``report()`` and ``doctor``). The server imports
`server_hooks.path` first and `server_hooks.freeze`/`server_hooks.probe` last.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from multiprocessing import forkserver

_LOG = logging.getLogger(__name__)

# Imported by every worker: preloading it in the fork server makes a worker start a fork.
ALWAYS_PRELOAD = ("torch", "steadyload.engine.process.worker")
PROBE = "steadyload.start.server_hooks.probe"  # last: records what the server imported
# Just before it: gc.freeze() once the imports are done, so that collections in workers do
# not un-share the server's pages (docs/design/figures.md#fork-server).
FREEZE = "steadyload.start.server_hooks.freeze"
PATH = "steadyload.start.server_hooks.path"  # first: gives the server this process's sys.path
# Imported by the parent, but not to be imported by a fork server (GPU or UI state, or a
# runtime's own machinery, such as Ray's in a Ray Train actor: slower first batches, a
# bigger server, and no dataset needs them; docs/design/figures.md#fork-server).
_NEVER_PRELOAD = frozenset(
    {"tensorflow", "jax", "jaxlib", "cupy", "pycuda", "IPython", "ipykernel", "pytest",
     "_pytest", "pdb", "tkinter", "matplotlib", "multiprocess", "steadyload", "ray"}
)

_preload_lock = threading.Lock()
_started_by_us: dict[int, tuple[str, ...]] = {}  # fork server pid -> what we asked it to import


def _importable(module: str) -> bool:
    if module in ("__main__", "__mp_main__", "builtins"):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def forkserver_pid() -> int | None:
    """The process-wide fork server's pid, if it was started (it may have died since)."""
    # Private CPython state, checked by tests/unit/test_private_apis.py.
    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return int(pid) if pid is not None else None


def forkserver_running() -> bool:
    """Whether the process-wide fork server has been started (and not found dead)."""
    return forkserver_pid() is not None


def parent_imports() -> tuple[str, ...]:
    """Installed modules this process has imported, in import order: the fork server
    imports them once, so that workers do not each import transformers, peft, ... again.

    Only modules from site-packages count: they are imported for their definitions. Local
    modules could run anything on import, so they are left out (the dataset's own module
    is added separately).
    """
    names = []
    for name, module in list(sys.modules.items()):
        if name in ("__main__", "__mp_main__") or name.partition(".")[0] in _NEVER_PRELOAD:
            continue
        path = getattr(module, "__file__", None) or ""
        if "site-packages" in path or "dist-packages" in path:
            names.append(name)
    return tuple(names)


def ensure_forkserver(extra_modules: tuple[str, ...]) -> tuple[str, ...]:
    """Merge our preloads into the fork server's list and start it if it is not running."""
    with _preload_lock:
        server = forkserver._forkserver  # the process-wide singleton
        was_running = forkserver_running()
        previous = server._forkserver_pid  # type: ignore[attr-defined]  # private
        wanted = tuple(
            dict.fromkeys(
                m for m in (PATH, *ALWAYS_PRELOAD, *extra_modules, PROBE) if _importable(m)
            )
        )
        if not was_running:
            current = list(server._preload_modules)  # type: ignore[attr-defined]  # private
            merged = [PATH] + [m for m in current if m != PATH]
            # FREEZE imports nothing new, so it is asked for but not reported.
            order = [m for m in wanted if m != PROBE] + [FREEZE, PROBE]
            merged += [m for m in order if m not in merged]
            server.set_forkserver_preload(merged)
            _LOG.debug("starting the fork server with preload %s", merged)
        # Starting the server returns at once; it imports the preloads in the background,
        # overlapping with whatever the caller does next. CPython hands it our sys.path,
        # which server_hooks.path applies (CPython 3.11-3.13.7 would ignore it).
        server.ensure_running()
        pid = server._forkserver_pid  # type: ignore[attr-defined]  # private
        if not was_running:
            _started_by_us[pid] = wanted
        elif pid != previous and previous in _started_by_us:
            # CPython restarted a dead server with the preload list steadyload had set.
            _started_by_us[pid] = _started_by_us.pop(previous)
        # A server started earlier has the preloads of that time (ours, or unknown).
        return _started_by_us.get(pid, ())

