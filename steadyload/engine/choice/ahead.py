"""Process workers started or stopped on a helper thread, while the loop goes on.

``worker_type="auto"``'s threads-first path (handover.py) starts its process workers from
the fork server, whose first start imports torch (about a second): a helper thread waits
for that, so the training loop never does. The helper only runs `ProcessPool.start`; the
pool is the helper's until it has finished, then the iterating thread's. The
processes-first path stops its process workers after the hand-over to threads on a helper
too: their exit (and the zygote's, if it goes) takes tens of milliseconds.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

from ..pool import WorkerPool
from ..process.pool import ProcessPool

_LOG = logging.getLogger(__name__)
_HELPERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_helpers(timeout_s: float = 30.0) -> None:
    """At exit, let a process start still under way finish and stop its workers: killed
    half-way (a daemon thread at exit), it would leave the fork server reading a truncated
    request, which prints a traceback after a good run. Bounded. [Unit: second]"""
    deadline = time.monotonic() + timeout_s
    for helper in list(_HELPERS):
        helper.join(max(deadline - time.monotonic(), 0.0))


def start_on_helper(
    supervisor: ProcessPool, finished: Callable[[BaseException | None], None]
) -> threading.Thread:
    """Start ``supervisor``'s workers on a new helper thread, then call ``finished`` there
    with what the start raised (None: it succeeded). The exit waits for the helper."""

    def run() -> None:
        failure: BaseException | None = None
        try:
            supervisor.start()
        except BaseException as exc:  # said by `finished`, where the choice is known
            failure = exc
        finished(failure)

    helper = threading.Thread(target=run, name="steadyload-handover", daemon=True)
    _HELPERS.add(helper)
    helper.start()
    return helper


def stop_on_helper(pool: WorkerPool, then: Callable[[], None]) -> threading.Thread:
    """Stop ``pool`` on a new helper thread, then call ``then`` there. From now on the pool
    is the helper's: it is not polled, routed to or collected from (not ``running``); its
    owner joins the helper before its own shutdown. The exit waits for it."""
    pool.running = False

    def run() -> None:
        try:
            pool.shutdown()
        except BaseException:  # the owner's shutdown calls it again, which finishes the job
            _LOG.debug("stopping the handed-over process workers failed", exc_info=True)
            return
        then()

    helper = threading.Thread(target=run, name="steadyload-handover-stop", daemon=True)
    _HELPERS.add(helper)
    helper.start()
    return helper
