"""Start-method choice, fork-server preloading, and the fork-after-GPU guard.

The start method is always local to a loader (a context object), never set globally with
`multiprocessing.set_start_method`. The fork server, though, is a process-wide singleton
(`multiprocessing.forkserver._forkserver`) shared with every forkserver user in this
process: its preload list is merged with what is already there, set once before the server
starts, and what was asked for is recorded for error reports and `doctor`.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import multiprocessing.context
import sys
import threading
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Literal

import torch

from .errors import UnsafeForkError

_LOG = logging.getLogger(__name__)

StartMethod = Literal["auto", "fork", "spawn", "forkserver"]
START_METHODS: tuple[str, ...] = ("auto", "fork", "spawn", "forkserver")

# Imported by every worker: preloading it in the fork server makes a worker start a fork.
_ALWAYS_PRELOAD = ("torch", "steadyload.engine.worker")

_preload_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class StartInfo:
    """What `resolve_context` decided, kept for reports and error messages."""

    method: str
    """The start method the workers use: "fork", "spawn" or "forkserver"."""
    preload: tuple[str, ...]
    """Modules steadyload asked the fork server to import (empty unless forkserver)."""
    server_was_running: bool
    """True when the fork server had been started before: then our preloads may be missing."""


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


def _ensure_forkserver(extra_modules: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """Merge our preloads into the fork server's list and start it if it is not running."""
    with _preload_lock:
        server = forkserver._forkserver  # the process-wide singleton
        was_running = _forkserver_running()
        wanted = tuple(m for m in (*_ALWAYS_PRELOAD, *extra_modules) if _importable(m))
        if not was_running:
            current = list(server._preload_modules)  # type: ignore[attr-defined]  # private
            merged = current + [m for m in wanted if m not in current]
            server.set_forkserver_preload(merged)
            _LOG.debug("starting the fork server with preload %s", merged)
        # Starting the server returns at once; it imports the preloads in the background,
        # so this overlaps with whatever the caller does next (building the model).
        server.ensure_running()
        return wanted, was_running


def resolve_context(
    start_method: str,
    multiprocessing_context: multiprocessing.context.BaseContext | None,
    dataset_module: str | None,
) -> tuple[multiprocessing.context.BaseContext, StartInfo]:
    """Pick the context the workers start with, and warm the fork server when it is used.

    An explicit ``multiprocessing_context`` (torch's argument) wins over ``start_method``.
    """
    if multiprocessing_context is not None:
        ctx = multiprocessing_context
    else:
        method = default_method() if start_method == "auto" else start_method
        ctx = multiprocessing.get_context(method)
    method = ctx.get_start_method()
    preload: tuple[str, ...] = ()
    was_running = False
    if method == "forkserver":
        extra = (dataset_module,) if dataset_module else ()
        preload, was_running = _ensure_forkserver(extra)
    return ctx, StartInfo(method=method, preload=preload, server_was_running=was_running)


def gpu_context_description() -> str | None:
    """Describe the GPU context that exists in this process, or None when there is none."""
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
        "use forkserver (the default), or create the loader's iterator before anything "
        "touches the GPU."
    )
