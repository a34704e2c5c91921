"""``remote_workers=(min, max)``: the iterator's side of autoscaling.

`RemoteScaling` feeds the training loop's figures to the stall rule
(engine/remote/scaling.py) once per window and applies its decisions to the remote pool. A
worker id without an actor is *parked*: dispatch passes it by (torch's round-robin over
the others), so the batches and their order are unchanged; only who loads them changes.
Shrinking parks the highest live id and stops its actor once every task it holds was
yielded (nothing is lost or loaded twice); growing starts an actor for the lowest parked
id (a pending actor is what Ray's autoscaler sees as demand for a node).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..engine.remote import scaling as rule
from ..engine.remote.spec import RemoteWorkers
from .record import RunRecord
from .tasks import TaskTable

_LOG = logging.getLogger(__name__)


class RemoteScaling:
    """Parks and starts remote worker ids on the stall rule's decisions (see module)."""

    def __init__(
        self, spec: RemoteWorkers, first_id: int, table: TaskTable, record: RunRecord,
        *, iterable: bool,
    ) -> None:  # fmt: skip
        if iterable:
            raise ValueError(
                f"remote_workers={spec.count} (a range) needs a map-style dataset.\n"
                "Why: an IterableDataset is split between workers by their number "
                "(get_worker_info().num_workers), so workers cannot come and go mid-epoch.\n"
                f"Fix: a fixed count, remote_workers={spec.maximum}."
            )
        self._first = first_id
        self._table = table
        self._record = record
        self._scaler = rule.StallScaler(spec.minimum, spec.maximum, interval_s=rule.INTERVAL_S)
        self.parked: set[int] = set(range(first_id + spec.minimum, first_id + spec.maximum))
        """Worker ids dispatch passes by: no actor, or one being drained to stop."""
        self._draining: set[int] = set()
        self._next_look = 0.0

    def live(self) -> int:
        """Remote workers taking tasks now."""
        return self._scaler.maximum - len(self.parked)

    def after_batch(self, pool: Any) -> int:
        """A batch was taken: stop drained actors; once per window, apply the rule. Returns
        the change (+1: the caller sends the added worker its share of the window)."""
        remote = pool.remote
        for w in [w for w in self._draining if self._table.load[w] == 0]:
            self._draining.discard(w)
            remote.retire(w)
        now = time.monotonic()
        if now < self._next_look:
            return 0
        self._next_look = now + rule.INTERVAL_S / 4
        record, live = self._record, self.live()
        ready = sum(1 for t in self._table.tasks.values() if t.has_outcome)
        change, stall, rate, reason = self._scaler.observe(
            now, record.wait_s, record.batches, live, ready, remote.unplaced())
        if change == 0:
            return 0
        if change > 0:
            w = min(self.parked)
            self.parked.discard(w)
            if w in self._draining:  # still has its actor: it takes tasks again
                self._draining.discard(w)
            else:
                remote.respawn(w)
        else:
            w = max(set(range(self._first, self._first + self._scaler.maximum)) - self.parked)
            self.parked.add(w)
            self._draining.add(w)
        decision = rule.ScalingDecision(
            at_s=time.perf_counter() - record.epoch_began, workers=self.live(), change=change,
            stall_share=stall, batches_per_s=rate, reason=reason, epoch=record.epoch,
        )  # fmt: skip
        record.scaling.append(decision)
        _LOG.info(
            "remote workers %s to %d (worker %d): %s (%.1f batches/s)",
            "grown" if change > 0 else "shrunk", decision.workers, w, reason, rate,
        )  # fmt: skip
        return change
