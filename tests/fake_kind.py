"""A fourth kind of worker, for tests only: a link and a cause, and nothing else.

Its workers run in this process, like threads, but nothing they send reaches the pool as
the object they made: every outcome and every batch crosses pickled, as over a wire, so
it proves the pool and the iterators need no shared object from a worker. Its liveness is
the thread kind's (an escaped exception, or abandonment after a hang); what is its own:

- `WireLink`: its transport (the loop's `Link`: pickles what it sends),
- `WireCut`: its cause of death (the `Cause` protocol: words, blame, group, explain),

and `pool` builds it: ``ThreadPool(config, n, link=WireLink)``. The pool contract tests
(tests/integration/test_pool_contract.py) run it beside processes and threads.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from steadyload import diagnosis
from steadyload.engine.config import WorkerConfig
from steadyload.engine.events import Cause, Loss
from steadyload.engine.protocol import Done
from steadyload.engine.thread.pool import ThreadPool
from steadyload.engine.thread.worker import ThreadLink
from steadyload.errors import WorkerDiedError

KIND = "wire"


@dataclass(frozen=True, slots=True)
class WireCut:
    """Why a wire worker is gone: ``raised`` escaped it, or (empty) it was cut off."""

    raised: str = ""
    traceback: str = ""
    group: tuple[Any, ...] = ()
    blames_sample: bool = True
    clean: bool = False

    @property
    def name(self) -> str:
        """What escaped, or "cut"."""
        return self.raised or "cut"

    @property
    def short(self) -> str:
        """For the restart list."""
        return f"its wire was cut ({self.name})"

    def heal(self, pool: Any) -> tuple[str, ...]:
        """Nothing to restart but the worker."""
        return ()

    def explain(self, loss: Loss) -> WorkerDiedError:
        """What happened to which samples, why, and what to do."""
        held = diagnosis.format_indices(loss.sample_indices)
        message = (
            f"steadyload: wire worker {loss.worker_id} is gone: {self.short}, holding "
            f"{loss.batches_held} batch(es) (samples {held}).\nWhy: {self.raised or 'a hang'}."
            f"\nFix: none needed, it is a test kind.\n{loss.outcome}"
        )
        return WorkerDiedError(message, worker_id=loss.worker_id, pid=loss.pid,
                               sample_indices=loss.sample_indices)


class WireLink(ThreadLink):
    """The wire kind's transport: outcomes and batches cross pickled."""

    keeps_objects = False  # exceptions cross pickled too (loop.failed_outcome)
    kind = KIND  # type: ignore[assignment]

    @staticmethod
    def cause(raised: str = "", traceback: str = "") -> Cause:
        """Its own cause of death."""
        return WireCut(raised, traceback)

    def send(self, msg: object) -> None:
        """An outcome, through the wire."""
        self.put(pickle.loads(pickle.dumps(msg)))

    def pack(self, data: Any) -> Any:
        """The batch as bytes."""
        return pickle.dumps(data)

    def send_batch(self, done: Done, packed: Any) -> None:
        """The batch, unpacked on the pool's side of the wire."""
        super().send_batch(pickle.loads(pickle.dumps(done)), pickle.loads(packed))


def pool(config: WorkerConfig, num_workers: int) -> ThreadPool:
    """An unstarted pool of wire workers."""
    return ThreadPool(config, num_workers, link=WireLink)
