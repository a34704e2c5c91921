"""Ray resources shared by this process's remote pools: an idle pool gives its actors back.

An actor holds its Ray resources (``num_cpus``, ...) for as long as it lives. An iterator a
training loop left behind (a ``break``, an evaluation loader started mid-epoch, a second
loader built to resume) keeps its actors until it is garbage-collected, which for an
iterator in a reference cycle can be much later. torch's local workers would merely
overcommit the CPUs; on a cluster without spare resources the new iterator's actors would
wait for Ray to place them for ever, a deadlock.

So while an actor of one pool waits for Ray to place it (`unplaced`: Ray has no process for
it yet), every other pool of this process that is *idle* gives its actors back: not polled
for `IDLE_S`, nothing in flight, and nothing in an actor that must survive (a map-style
dataset without state of its own). Results it already fetched stay queued for its
iterator. If that iterator is used again, its pool asks Ray for the same workers (same
ids, same seeds) at its next send, and they start as after a restart.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Protocol

from .records import PLACEMENT_WARN_S, warn_unplaced
from .spec import RemoteWorkers

_LOG = logging.getLogger("steadyload.engine.remote.pool")

IDLE_S = 1.0
"""A pool not polled this long, nothing in flight, may give its actors back. [Unit: second]"""
LOOK_EVERY_S = 1.0
"""How often an actor waiting for placement asks idle pools for their resources. [Unit: second]"""


class Sharing(Protocol):
    """What a pool offers the others."""

    def give_back(self) -> list[int]:
        """Kill the actors if idle (see module); the worker ids given back."""
        ...


_pools: weakref.WeakSet[Any] = weakref.WeakSet()


def register(pool: Sharing) -> None:
    """Let ``pool`` be asked for its resources (until it is garbage-collected)."""
    _pools.add(pool)


def give_back_idle(asking: object) -> list[int]:
    """Every idle pool but ``asking`` gives its actors back; the worker ids given back."""
    ids: list[int] = []
    for pool in list(_pools):
        if pool is not asking and (given := pool.give_back()):
            _LOG.info(
                "remote workers %s of an idle iterator gave back their Ray resources to "
                "another loader's workers that Ray could not place; they start again if "
                "that iterator is used again",
                given,
            )
            ids += given
    return ids


def take_back(released: set[int]) -> list[int]:
    """The worker ids a pool gave back, now that its iterator is in use again (emptied)."""
    ids = sorted(released)
    released.clear()
    if ids:
        _LOG.info("remote workers %s start again: their iterator is in use again", ids)
    return ids


def unplaced(ray: Any, handle: Any) -> bool:
    """Whether Ray has not placed the actor yet: it waits for resources (no process), as
    opposed to starting on a node (its ``__init__`` importing torch can take seconds)."""
    from ray._private import state

    try:
        info = state.actors(actor_id=handle._actor_id.hex())
    except Exception:  # the GCS is going away: nothing to share
        return False
    return info.get("State") in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") and not info.get("Pid")


def await_placement(ray: Any, spec: RemoteWorkers, actor: Any, ref: Any, pool: object) -> None:
    """Wait for Ray to start ``actor`` (its ``ready`` call is ``ref``); while Ray has no
    place for it, the other idle pools give theirs back; a long wait is said once."""
    asked, warned = time.monotonic(), False
    while not actor.gone and not ray.wait([ref], timeout=LOOK_EVERY_S)[0]:
        if unplaced(ray, actor.handle):
            give_back_idle(pool)
        if not warned and time.monotonic() - asked >= PLACEMENT_WARN_S and not actor.gone:
            warned = True
            warn_unplaced(ray, spec, actor.worker_id)
