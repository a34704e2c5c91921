"""``remote_workers=(min, max)``: the iterator's side of autoscaling.

`RemoteScaling` feeds the training loop's figures to the stall rule
(engine/remote/scaling.py) once per window and applies its decisions to the remote pool. A
worker id without a running actor is *parked*: dispatch passes it by (torch's round-robin
over the others), so the batches and their order are unchanged; only who loads them changes.
Growing starts an actor for the lowest parked id, which joins dispatch when it says `Ready`,
even while the loop waits for a batch (a pending actor, what Ray's autoscaler sees as demand
for a node, never holds a batch back); shrinking parks the highest live id and stops its
actor once every task it holds was yielded (nothing is lost or loaded twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..engine.remote import scaling as rule
from ..engine.remote.spec import RemoteWorkers
from .record import RunRecord
from .tasks import TaskTable

_LOG = logging.getLogger(__name__)


class RemoteScaling:
    """Parks and starts remote worker ids on the stall rule's decisions (see module)."""

    def __init__(
        self,
        spec: RemoteWorkers,
        first_id: int,
        table: TaskTable,
        record: RunRecord,
        *,
        fixed_workers: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fixed_workers:  # a stream, or a dataset with its own state per worker
            raise ValueError(
                f"remote_workers={spec.count} (a range) needs a map-style dataset without "
                "state_dict() of its own.\n"
                "Why: an IterableDataset is split between workers by their number "
                "(get_worker_info().num_workers), and a dataset's own state is kept per "
                "worker, so workers cannot come and go mid-epoch.\n"
                f"Fix: a fixed count, remote_workers={spec.maximum}."
            )
        if first_id == 0 and spec.minimum == 0:
            raise ValueError(
                f"remote_workers={spec.count} with num_workers=0 would start with no worker.\n"
                "Why: the pool grows on the training loop's waits, and with no worker there is "
                "no batch to wait for.\n"
                f"Fix: remote_workers=(1, {spec.maximum}), or num_workers >= 1."
            )
        self._spec = spec
        self._first = first_id
        self._table = table
        self._record = record
        self._clock = clock  # the rule's windows are on it [Unit: second]; tests inject one
        self.parked: set[int] = set()
        """Worker ids dispatch passes by: no actor, one starting, or one being drained."""
        self.reset()

    def reset(self) -> None:
        """A new pool started its minimum of actors: every other id is parked."""
        spec, first = self._spec, self._first
        self._scaler = rule.StallScaler(spec.minimum, spec.maximum, interval_s=rule.INTERVAL_S)
        self.parked.clear()  # in place: the iterator's dispatch holds this set
        self.parked.update(range(first + spec.minimum, first + spec.maximum))
        self._starting: set[int] = set()
        self._draining: set[int] = set()
        self._next_look = 0.0

    def live(self) -> int:
        """Remote workers taking tasks now."""
        return self._spec.maximum - len(self.parked)

    def on_ready(self, pool: Any) -> int:
        """An actor said `Ready`: a started one joins dispatch now, not when the batch the
        loop waits for comes (a stalled worker may hold it until help arrives). Returns how
        many joined (the caller sends them their share of the window)."""
        return len(self._join(pool.remote))

    def after_batch(self, pool: Any) -> int:
        """A batch was taken: stop drained actors, let started ones join; once per window,
        apply the rule. Returns how many workers joined dispatch (the caller sends them
        their share of the window). A failure of Ray here is logged, never raised: the
        batch in hand is already counted as yielded."""
        try:
            return self._step(pool.remote)
        except Exception as exc:
            _LOG.warning(
                "steadyload: resizing the remote pool failed (%s: %s); it stays at %d workers",
                type(exc).__name__,
                exc,
                self.live(),
            )
            return 0

    def _join(self, remote: Any) -> list[int]:
        joined = [w for w in self._starting if remote.ready(w)]
        for w in joined:
            self._starting.discard(w)
            self.parked.discard(w)
            self._scaler.joined()
        return joined

    def _step(self, remote: Any) -> int:
        for w in [w for w in self._draining if self._table.load(w) == 0]:
            self._draining.discard(w)
            remote.retire(w)
        joined = self._join(remote)
        now = self._clock()
        if now < self._next_look:
            return len(joined)
        self._next_look = now + rule.INTERVAL_S / 4
        record, live = self._record, self.live()
        ready = self._table.settled()
        change, stall, rate, reason = self._scaler.observe(
            now, record.wait_s, record.batches, live, ready, remote.unplaced() + len(self._starting)
        )
        ids = set(range(self._first, self._first + self._spec.maximum))
        if change > 0 and self.parked - self._starting:
            w = min(self.parked - self._starting)
            if w in self._draining:  # still has its actor: it takes tasks again
                self._draining.discard(w)
                self.parked.discard(w)
                joined.append(w)
            else:
                self._starting.add(w)
                remote.respawn(w)
        elif change < 0 and ids - self.parked:
            w = max(ids - self.parked)
            self.parked.add(w)
            self._draining.add(w)
        else:
            return len(joined)
        decision = rule.ScalingDecision(
            at_s=time.perf_counter() - record.epoch_began,
            workers=self.live() + len(self._starting),
            change=change,
            stall_share=stall,
            batches_per_s=rate,
            reason=reason,
            epoch=record.epoch,
        )
        record.scaling.append(decision)
        _LOG.info(
            "remote workers %s to %d (worker %d): %s (%.1f batches/s)",
            "grown" if change > 0 else "shrunk",
            decision.workers,
            w,
            reason,
            rate,
        )
        return len(joined)
