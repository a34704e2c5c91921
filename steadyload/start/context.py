"""Start-method choice: the multiprocessing context a loader's workers start with.

The start method is always local to a loader (a context object), never set globally with
`multiprocessing.set_start_method`. "auto" (the default) picks the zygote (a fork server
forked from this process, `zygote.py`) where forking now is safe and cheap, by the rule
in `rule.py`, and forkserver otherwise (and spawn where the platform has no forkserver).
forkserver warms the process-wide fork server with steadyload's preloads (`preload.py`);
an explicit "zygote" is refused when a GPU context exists at the fork and warned about
when threads run (`guards.py`). `prestart` starts either ahead of time.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.context
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from . import claims, launch, rule, zygote
from .guards import check_zygote_safe, warn_threads
from .preload import ensure_forkserver, parent_imports

_LOG = logging.getLogger(__name__)
zygote.AutoZygoteContext.fallback = launch.FORKSERVER

StartMethod = Literal["auto", "fork", "spawn", "forkserver", "zygote"]
START_METHODS: tuple[str, ...] = ("auto", "fork", "spawn", "forkserver", "zygote")


@dataclass(frozen=True, slots=True)
class StartInfo:
    """What `resolve_context` decided, kept for reports and error messages."""

    method: str
    """The start method the workers use: "fork", "spawn", "forkserver" or "zygote"."""
    preload: tuple[str, ...]
    """Modules the fork server was asked to import by steadyload (empty: none, or the
    server was started by someone else)."""
    why: str = ""
    """Why ``start_method="auto"`` chose it (empty: it was asked for)."""


def default_method() -> str:
    """forkserver where the platform has it (Linux), else spawn; never fork by default
    (``start_method="auto"`` may take the zygote instead: `auto_method`)."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods and sys.platform != "darwin" else "spawn"


def auto_method(found: rule.StartFacts | None = None) -> tuple[str, str]:
    """What ``start_method="auto"`` picks here now, and why: the zygote or forkserver by
    the rule (rule.py) where forkserver exists, else spawn. ``found``: injected facts."""
    if default_method() != "forkserver":
        return "spawn", "this platform has no forkserver"
    return rule.choose(found if found is not None else rule.facts())


def zygote_is_auto_choice() -> bool:
    """Whether ``start_method="auto"`` would take the zygote now (it runs, or may be forked)."""
    return auto_method()[0] == "zygote"


def prestart(preload: Iterable[str] = ("torch",), *, start_method: str = "forkserver") -> None:
    """Start the fork server now, importing ``preload`` in it, in the background; loaders
    with the default ``start_method="auto"`` then use it (not the zygote).

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
    rule.PRESTARTED.set()  # start_method="auto" uses this server from now on
    ensure_forkserver(tuple(preload))


def _ensure_zygote(stacklevel: int) -> None:
    """Fork the zygote unless it runs: refused with a GPU context, warned about with threads.

    ``stacklevel``: the warning's, as seen from `guards.warn_threads` (the user's frame).
    """
    reason = zygote.unsupported_reason()
    if reason is not None:
        raise ValueError(
            f"start_method='zygote' is not available here: {reason}. Fix: use "
            "start_method='forkserver' (the default)."
        )
    if zygote.pid() is None:
        check_zygote_safe()
        warn_threads("zygote", stacklevel)
    zygote.ensure(check_zygote_safe)
    claims.keep()  # asked for by name: never stopped early


def zygote_pid() -> int | None:
    """The zygote's pid, if one was forked (tests treat it as a helper, like the fork server)."""
    return zygote.pid()


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
    why = ""
    if multiprocessing_context is not None:
        ctx = multiprocessing_context
    elif start_method == "zygote":
        # Forked once per process, at the first loader's construction (GPU-free or refused).
        _ensure_zygote(stacklevel=6)
        ctx = zygote.CONTEXT
    else:
        method = start_method
        if start_method == "auto":
            method, why = auto_method()
            _LOG.info("start_method='auto' chose %s: %s", method, why)
        if method == "zygote":  # the rule found the fork safe (and no thread to warn of)
            zygote.ensure(check_zygote_safe)
            ctx = zygote.AUTO_CONTEXT
        else:
            # CPython's forkserver, but a worker start never waits forever (launch.py).
            ctx = (
                launch.FORKSERVER if method == "forkserver" else multiprocessing.get_context(method)
            )
    method = ctx.get_start_method()
    preload: tuple[str, ...] = ()
    if method == "forkserver":
        extra = (*parent_imports(), *((dataset_module,) if dataset_module else ()))
        preload = ensure_forkserver(extra)
    return ctx, StartInfo(method=method, preload=preload, why=why)


prestart.__module__ = "steadyload"  # public name (see steadyload/__init__.py)
