"""Who keeps the zygote: each loader whose workers may come from it holds a claim, and
when the last one is let go (``worker_type="auto"`` chose threads) the zygote is stopped.

The zygote pins this process's heap as it was at the fork: a page written here later (a
garbage collection touches every tracked object) becomes a copy, and the old one is the
zygote's alone, so over a run it grows to the whole heap it was forked from. Worth it while
workers may be wanted; once no loader may start one, it is memory for nothing
(docs/design/zygote.md#how).
"""

from __future__ import annotations

import threading
import weakref

from . import zygote

_lock = threading.Lock()  # a claim, and a release's decision: a loader claiming meanwhile keeps it
_claims: weakref.WeakSet[object] = weakref.WeakSet()  # a loader garbage-collected holds none
_kept = False  # asked for by name: kept for the life of this process


def claim(owner: object) -> None:
    """``owner`` (a loader's worker plans) may start workers from the zygote."""
    with _lock:
        _claims.add(owner)


def keep() -> None:
    """The zygote was asked for by name (``start_method="zygote"``, ``prestart``): it is
    kept, as a loader built after the GPU is in use may need it and could not fork it."""
    global _kept
    _kept = True


def release(owner: object, *, stop_if_unclaimed: bool = True) -> None:
    """``owner`` starts no more workers from the zygote (auto chose threads). With no other
    claim the zygote is stopped: a loader built later forks a new one where that is safe,
    else starts from the fork server (rule.py)."""
    with _lock:
        if owner not in _claims:
            return
        _claims.discard(owner)
        if stop_if_unclaimed and not _claims and not _kept:
            zygote.stop()
