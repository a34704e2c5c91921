"""Remote workers started when their loader is built (prestarted), as the fork server is
for local ones: by the first iteration Ray has placed the actors and they have imported
torch, so that start overlaps with the training script's own set-up (building the model).

Only when this process is connected to Ray already (``ray.init`` before the loader): a
loader never connects by itself before it is iterated. A prestarted actor holds nothing but
its imports; the loader's first pool takes it and tells it which worker it is
(`RemoteWorker.configure`), so it is as fresh as an actor started then. Actors not taken
die with their loader; an idle set gives them back to a pool Ray cannot place
(sharing.py); pickling the loader (for another process) gives them back, and the copy
has none.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any

from . import sharing
from .actor import CONTROL, RemoteWorker
from .spec import RemoteWorkers, remote_spec

_LOG = logging.getLogger("steadyload.engine.remote.pool")


def actor_class(ray: Any) -> Any:
    """`RemoteWorker` as a Ray actor class (its stack calls answered beside the loop)."""
    return ray.remote(concurrency_groups={CONTROL: 1})(RemoteWorker)


class Prestarted:
    """A loader's actors started before its first iteration (see module)."""

    def __init__(self, spec: RemoteWorkers) -> None:
        self.spec = spec
        self._ray: Any = None
        self._handles: list[Any] = []
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        # The loader goes to another process (a spawned rank), whose copy starts its own:
        # these would hold their Ray resources here, unused, so they go now.
        self.give_back()
        return Prestarted, (self.spec,)

    def start(self, ray: Any, count: int) -> None:
        """Ask Ray for ``count`` actors, placed as the spec says."""
        self._ray, cls = ray, actor_class(ray)
        options = self.spec.actor_options(set())
        self._handles = [cls.options(**options).remote(None, -1) for _ in range(count)]
        sharing.register(self)

    def take(self) -> Any | None:
        """A prestarted actor's handle, or None when none is left."""
        with self._lock:
            return self._handles.pop(0) if self._handles else None

    def give_back(self) -> list[int]:
        """Kill the actors not taken (sharing.py, and when the loader goes)."""
        with self._lock:
            handles, self._handles = self._handles, []
        for handle in handles:
            try:
                self._ray.kill(handle, no_restart=True)
            except Exception:  # already gone, or Ray is shutting down
                pass
        if handles:
            _LOG.info(
                "%d prestarted remote worker(s) of a loader not iterated yet gave back "
                "their Ray resources",
                len(handles),
            )
        return []


def prestart(loader: Any) -> Prestarted | None:
    """Start ``loader``'s remote workers now if it has some, its `RemoteWorkers` allows it
    and this process is connected to Ray; None otherwise."""
    spec = remote_spec(getattr(loader, "remote_workers", None))
    ray = sys.modules.get("ray")
    if spec is None or not spec.prestart or ray is None or not ray.is_initialized():
        return None
    started = Prestarted(spec)
    started.start(ray, spec.minimum)
    weakref.finalize(loader, started.give_back)
    return started
