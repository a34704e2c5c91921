"""Ray resources shared by this process's remote pools: an idle pool gives its actors back.

An actor holds its Ray resources (``num_cpus``, ...) for as long as it lives. An iterator a
training loop left behind (a ``break``, an evaluation loader started mid-epoch, a second
loader built to resume) keeps its actors until it is garbage-collected, which for an
iterator in a reference cycle can be much later. torch's local workers would merely
overcommit the CPUs; on a cluster without spare resources the new iterator's actors would
wait for Ray to place them for ever, a deadlock.

So while an actor of one pool waits for Ray to place it (`unplaced`: Ray has no process for
it yet), every other pool of this process that is *idle* gives its actors back: not polled
for `IDLE_S`, nothing in flight on an actor that started, and nothing in an actor that
must survive (a map-style dataset without state of its own). Results it already fetched
stay queued for its iterator; what an unstarted actor was sent goes to its successor. If
that iterator is used again (it sends, or waits for such tasks), its pool asks Ray for the
same workers (same ids, same seeds), and they start as after a restart.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any, Protocol

from .records import PLACEMENT_WARN_S, Actor, warn_unplaced
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


class GivesBack:
    """`RemotePool`'s side of the sharing: it gives its actors back while idle, and asks
    for them again once its iterator sends or waits."""

    running: bool
    _lock: threading.RLock
    _actors: dict[int, Actor]
    _generations: collections.Counter[int]
    _released: set[int]  # the ids given back (their actors stay, gone, until taken back)
    _shareable: bool  # its actors hold nothing that must survive
    _polled: float  # when the iterator last looked at the pool
    _in_poll: bool  # and whether it is looking now

    def _end(self, a: Actor) -> None: ...

    def _spawn(self, worker_id: int) -> None: ...

    def give_back(self) -> list[int]:
        """Kill every actor if the pool is idle and they hold nothing that must survive
        (see module); they start again when the iterator is in use. Tasks sent to an
        actor Ray never started go to the one that replaces it: else the pool's other
        actors would keep their CPUs for as long as Ray cannot place that one, and a
        loader waiting for those CPUs would wait for ever. Returns the worker ids."""
        with self._lock:
            live = [a for a in self._actors.values() if not a.gone]
            if (
                not self.running
                or not self._shareable
                or self._in_poll
                or not live
                or time.monotonic() - self._polled < IDLE_S
                or any(a.held for a in live if a.set_up)
            ):
                return []
            for a in live:
                a.gone = True  # under the lock: a send now asks for them again
                if a.sent:  # it never started: its messages go to its successor, and a
                    self._generations[a.worker_id] += 1  # late word of it is dropped
            ids = sorted(a.worker_id for a in live)
            self._released.update(ids)
        for a in live:
            self._end(a)
        return ids

    def _in_use(self, sending: bool) -> None:
        """The iterator sends, or waits for what an unstarted actor held: the actors given
        back start again, under the same generation so the results fetched before still
        count, and an unstarted one's messages go to its successor. (Waiting for results
        fetched before, as at the epoch's end, starts nothing.)"""
        with self._lock:  # a give-back sees the poll begin, or is seen here
            self._polled = time.monotonic()
            if not sending:
                self._in_poll = True
                if not any(self._actors[w].sent for w in self._released):
                    return
            for w in take_back(self._released):
                unstarted = self._actors[w].sent or []
                self._spawn(w)
                for sent in unstarted:
                    self._actors[w].call(*sent)


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
