"""Start-method choice, fork-server preloading, and the fork-after-GPU guard.

The start method is always local to a loader (a context object), never set globally with
`multiprocessing.set_start_method`. The fork server, though, is a process-wide singleton
(`multiprocessing.forkserver._forkserver`) shared with every forkserver user in this
process: its preload list is merged with what is already there, set once before the server
starts, and what was asked for is recorded for error reports and `doctor`. The opt-in
"zygote" method (a fork server forked from this process, `_zygote.py`) is guarded here:
refused when a GPU context exists at the fork, warned about when threads run.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import logging
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Literal

from . import _zygote
from .errors import MainGuardError, UnsafeForkError
from .pickling import main_is_importable

_LOG = logging.getLogger(__name__)

StartMethod = Literal["auto", "fork", "spawn", "forkserver", "zygote"]
START_METHODS: tuple[str, ...] = ("auto", "fork", "spawn", "forkserver", "zygote")

# Imported by every worker: preloading it in the fork server makes a worker start a fork.
_ALWAYS_PRELOAD = ("torch", "steadyload.engine.worker")
_PROBE = "steadyload._preload_probe"  # last: records what the server really imported
# Just before it: gc.freeze() once the imports are done, so that collections in workers do
# not un-share the server's pages (35 MiB per worker after one full collection, measured).
_FREEZE = "steadyload._preload_freeze"
_PATH = "steadyload._preload_path"  # first: gives the server this process's sys.path
# Imported by the parent, but not to be imported by a fork server (GPU or UI state).
_NEVER_PRELOAD = frozenset(
    {"tensorflow", "jax", "jaxlib", "cupy", "pycuda", "IPython", "ipykernel", "pytest",
     "_pytest", "pdb", "tkinter", "matplotlib", "multiprocess", "steadyload"}
)

_preload_lock = threading.Lock()
_started_by_us: dict[int, tuple[str, ...]] = {}  # fork server pid -> what we asked it to import


@dataclass(frozen=True, slots=True)
class StartInfo:
    """What `resolve_context` decided, kept for reports and error messages."""

    method: str
    """The start method the workers use: "fork", "spawn", "forkserver" or "zygote"."""
    preload: tuple[str, ...]
    """Modules the fork server was asked to import by steadyload (empty: none, or the
    server was started by someone else)."""


def default_method() -> str:
    """forkserver where the platform has it (Linux), else spawn; never fork by default."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods and sys.platform != "darwin" else "spawn"


def _importable(module: str) -> bool:
    if module in ("__main__", "__mp_main__", "builtins"):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _forkserver_running() -> bool:
    # Private CPython state, checked by tests/unit/test_private_apis.py.
    return forkserver._forkserver._forkserver_pid is not None  # type: ignore[attr-defined]


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


def _preload_path_env() -> str:
    from ._preload_path import ENV

    return ENV


def _ensure_forkserver(extra_modules: tuple[str, ...]) -> tuple[str, ...]:
    """Merge our preloads into the fork server's list and start it if it is not running."""
    with _preload_lock:
        server = forkserver._forkserver  # the process-wide singleton
        was_running = _forkserver_running()
        wanted = tuple(
            dict.fromkeys(
                m for m in (_PATH, *_ALWAYS_PRELOAD, *extra_modules, _PROBE) if _importable(m)
            )
        )
        if not was_running:
            current = list(server._preload_modules)  # type: ignore[attr-defined]  # private
            merged = [_PATH] + [m for m in current if m != _PATH]
            # _FREEZE imports nothing new, so it is asked for but not reported.
            order = [m for m in wanted if m != _PROBE] + [_FREEZE, _PROBE]
            merged += [m for m in order if m not in merged]
            server.set_forkserver_preload(merged)
            _LOG.debug("starting the fork server with preload %s", merged)
            # Read by _preload_path in the server (CPython ignores its sys_path argument).
            os.environ[_preload_path_env()] = json.dumps(sys.path)
        try:
            # Starting the server returns at once; it imports the preloads in the
            # background, overlapping with whatever the caller does next.
            server.ensure_running()
        finally:
            os.environ.pop(_preload_path_env(), None)
        pid = server._forkserver_pid  # type: ignore[attr-defined]  # private
        if not was_running:
            _started_by_us[pid] = wanted
        # A server started earlier has the preloads of that time (ours, or unknown).
        return _started_by_us.get(pid, ())


def prestart(preload: Iterable[str] = ("torch",), *, start_method: str = "forkserver") -> None:
    """Start the fork server now, importing ``preload`` in it, in the background.

    Call it first thing in a training script (before its heavy imports and the model), so
    that the fork server imports torch, transformers, ... while this process does the same:
    the first batch then arrives without waiting for those imports. Later loaders use this
    server. Does nothing inside a worker, under a platform without forkserver, or if the
    fork server already runs. Returns at once.

    With ``start_method="zygote"`` (for loaders built with that option), ``preload`` is
    imported *here* first, then the zygote is forked from this process: it and its workers
    share those modules' memory with this process. Call it after the imports and before
    the GPU is used or large data is loaded (docs/design/zygote.md). Blocks for the imports.

    Args:
        preload: modules to import in the fork server, e.g. ``["torch", "transformers"]``;
            local modules are imported too when listed here (they run in the server).
        start_method: "forkserver" (default) or "zygote".

    Raises:
        ValueError: another ``start_method``, or "zygote" on a platform without it.
        UnsafeForkError: "zygote" while this process holds a CUDA/ROCm context.
    """
    if start_method not in ("forkserver", "zygote"):
        raise ValueError(
            f"prestart's start_method must be 'forkserver' or 'zygote', got {start_method!r}"
        )
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return  # a worker importing the main script: never start servers from there
    if multiprocessing.parent_process() is not None:
        return
    if start_method == "zygote":
        for name in preload:
            importlib.import_module(name)
        _ensure_zygote(stacklevel=4)
        return
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    _ensure_forkserver(tuple(preload))


def _ensure_zygote(stacklevel: int) -> None:
    """Fork the zygote unless it runs: refused with a GPU context, warned about with threads.

    ``stacklevel``: the warning's, as seen from `_warn_threads` (the user's frame).
    """
    reason = _zygote.unsupported_reason()
    if reason is not None:
        raise ValueError(
            f"start_method='zygote' is not available here: {reason}. Fix: use "
            "start_method='forkserver' (the default)."
        )
    if _zygote.pid() is None:
        check_zygote_safe()
        _warn_threads("zygote", stacklevel)
    _zygote.ensure(check_zygote_safe)


def _zygote_pid() -> int | None:
    """The zygote's pid, if one was forked (tests treat it as a helper, like the fork server)."""
    return _zygote.pid()


def resolve_context(
    start_method: str,
    multiprocessing_context: multiprocessing.context.BaseContext | None,
    dataset_module: str | None,
) -> tuple[multiprocessing.context.BaseContext, StartInfo]:
    """Pick the context the workers start with, and warm the fork server when it is used.

    An explicit ``multiprocessing_context`` (torch's argument) wins over ``start_method``.

    Raises:
        UnsafeForkError: "zygote" must fork it now, and a CUDA/ROCm context exists here.
    """
    if multiprocessing_context is not None:
        ctx = multiprocessing_context
    elif start_method == "zygote":
        # Forked once per process, at the first loader's construction (GPU-free or refused).
        _ensure_zygote(stacklevel=6)
        ctx = _zygote.CONTEXT
    else:
        method = default_method() if start_method == "auto" else start_method
        ctx = multiprocessing.get_context(method)
    method = ctx.get_start_method()
    preload: tuple[str, ...] = ()
    if method == "forkserver":
        extra = (*parent_imports(), *((dataset_module,) if dataset_module else ()))
        preload = _ensure_forkserver(extra)
    return ctx, StartInfo(method=method, preload=preload)


def gpu_context_description() -> str | None:
    """Describe the GPU context that exists in this process, or None when there is none."""
    import torch  # not at module level: `steadyload.prestart` must not wait for torch

    try:
        initialized = torch.cuda.is_initialized()
    except Exception:  # a broken CUDA install must not stop CPU loading
        return None
    if not initialized:
        return None
    hip = getattr(torch.version, "hip", None)
    return f"a ROCm/HIP GPU context (HIP {hip})" if hip else "a CUDA context"


def check_fork_safe(method: str) -> None:
    """Refuse fork when a GPU context exists: the workers would hang, not fail.

    Raises:
        UnsafeForkError: ``method`` is "fork" and CUDA or ROCm/HIP is initialised here.
    """
    if method != "fork":
        return
    context = gpu_context_description()
    if context is None:
        return
    raise UnsafeForkError(
        f"refusing to start DataLoader workers with fork: this process already holds "
        f"{context}.\n"
        "Why: fork() copies the GPU driver's state into each worker, where it cannot be "
        "used; the workers deadlock (often with the GPU busy at 100%) instead of failing.\n"
        "Fix: drop multiprocessing_context='fork' / start_method='fork' and let steadyload "
        "use forkserver (the default). If you must fork, fork before the GPU is used: "
        "start persistent workers (persistent_workers=True, then iter(loader)) first."
    )


def check_zygote_safe() -> None:
    """Refuse to fork the zygote while a GPU context exists: it and its workers would hang.

    Raises:
        UnsafeForkError: CUDA or ROCm/HIP is initialised in this process (torch only).
    """
    if "torch" not in sys.modules:
        return  # no torch yet, so no torch GPU context; nothing to import for it
    context = gpu_context_description()
    if context is None:
        return
    raise UnsafeForkError(
        f"refusing to fork the zygote for start_method='zygote': this process already "
        f"holds {context}.\n"
        "Why: the zygote is a fork() of this process and every worker is forked from it; "
        "forked copies of the GPU driver's state deadlock (often with the GPU busy at "
        "100%) instead of failing. Once the zygote exists, using the GPU here is safe.\n"
        "Fix: build the first zygote loader, or call "
        "steadyload.prestart(start_method='zygote'), right after importing torch and "
        "before anything touches the GPU (model.cuda(), torch.cuda.*); or use "
        "start_method='forkserver' (the default), which is safe at any time."
    )


_warned_threads: set[tuple[str, tuple[str, ...]]] = set()


def warn_if_threads_before_fork(method: str) -> None:
    """Warn (once per set of threads) that fork copies only the calling thread."""
    if method == "fork":
        _warn_threads("fork", stacklevel=4)


def _warn_threads(method: str, stacklevel: int) -> None:
    others = tuple(
        sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    )
    if not others or (method, others) in _warned_threads:
        return
    _warned_threads.add((method, others))
    hazard = (
        "fork copies only the calling thread; a lock held by another thread at that moment "
        "(logging, a tokenizer's thread pool, an I/O library) stays locked forever in "
    )
    if method == "fork":
        text = (
            f"steadyload: forking DataLoader workers while {len(others)} other thread(s) "
            f"run in this process: {', '.join(others)}. {hazard}the worker, which then "
            "hangs. Fix: use start_method='forkserver' (the default) or 'spawn'."
        )
    else:
        text = (
            f"steadyload: forking the zygote (start_method='zygote') while {len(others)} "
            f"other thread(s) run in this process: {', '.join(others)}. {hazard}the "
            "zygote and in every worker forked from it, which then hang. Fix: build the "
            "first zygote loader, or call steadyload.prestart(start_method='zygote'), "
            "before starting threads; or use start_method='forkserver' (the default)."
        )
    warnings.warn(text, RuntimeWarning, stacklevel=stacklevel)


@functools.lru_cache(maxsize=32)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...]:
    """Line ranges of ``if __name__ == "__main__":`` bodies in the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return ()
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            ranges.append((node.lineno, node.end_lineno or node.lineno))
    return tuple(ranges)


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


def unguarded_main_site() -> tuple[str, int] | None:
    """(file, line) when the main script starts workers outside ``if __name__ == "__main__":``.

    Children started by forkserver or spawn import the main script to find what it
    defines; code at its top level then runs again in every worker, and starts workers
    of its own. Found from the call stack and the script's syntax tree.
    """
    if not main_is_importable():
        return None
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and str(getattr(spec, "name", "")).endswith(".__main__"):
        # `python -m pkg`: multiprocessing never re-runs a package's __main__ in children.
        return None
    frame = sys._getframe(1)
    site = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            site = frame
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    if site is None:
        return None
    path, line = site.f_code.co_filename, site.f_lineno
    if any(lo <= line <= hi for lo, hi in _guarded_lines(path)):
        return None
    return path, line


def check_main_guard(method: str) -> None:
    """Refuse to start forkserver/spawn/zygote workers from unguarded top-level script code.

    Raises:
        MainGuardError: with the file and line, and the fix.
    """
    if method not in ("forkserver", "spawn", "zygote"):
        return
    bootstrapping = getattr(multiprocessing.current_process(), "_inheriting", False)
    site = unguarded_main_site()
    if site is None and not bootstrapping:
        return
    where = f"{site[0]}, line {site[1]}" if site else "the main script"
    raise MainGuardError(
        f"DataLoader workers started from the top level of {where}, outside "
        "`if __name__ == \"__main__\":`.\n"
        f"Why: {method} workers import the main script to find the dataset class; without "
        "the guard, that import runs the training code again in every worker and starts "
        "workers of its own.\n"
        "Fix: move the training code under the guard, keeping the dataset class and "
        "imports at module level:\n\n"
        "    class MyDataset(torch.utils.data.Dataset):\n"
        "        ...\n\n"
        "    if __name__ == \"__main__\":\n"
        "        loader = steadyload.DataLoader(MyDataset(...), num_workers=2)\n"
        "        train(loader)\n"
    )


prestart.__module__ = "steadyload"  # public name (see steadyload/__init__.py)
