"""Why a thread worker is gone: an exception that is not a dataset error escaped its loop
(`SystemExit`, `KeyboardInterrupt`: a `BaseException`), or the pool abandoned it after a
hang (a thread cannot be killed). Both arrive as the pool's `Died` event (worker.py,
pool.py), with a `ThreadEnd` as its cause."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import diagnosis
from ...errors import WorkerDiedError
from ..events import Loss, Lost


@dataclass(frozen=True, slots=True)
class ThreadEnd:
    """A thread worker ended: ``raised`` escaped it ("SystemExit: 3", with its traceback),
    or (``raised`` empty) it was abandoned."""

    raised: str = ""
    traceback: str = ""
    group: Lost = ()
    blames_sample: bool = True
    clean: bool = False

    @property
    def name(self) -> str:
        """What escaped, or "abandoned"."""
        return self.raised or "abandoned"

    @property
    def short(self) -> str:
        """ "ended by SystemExit: 3", or "abandoned"."""
        return f"ended by {self.raised}" if self.raised else "abandoned"

    def heal(self, pool: Any) -> tuple[str, ...]:
        """Nothing to restart but the thread."""
        return ()

    def explain(self, loss: Loss) -> WorkerDiedError:
        """What escaped, why on_error cannot skip it, the fix, and its traceback."""
        if not self.raised:  # abandoned: worded as a process death without a status
            return loss.worker_died(None, "thread")
        return diagnosis.thread_died(
            worker_id=loss.worker_id,
            raised=self.raised,
            traceback=self.traceback,
            sample=loss.sample,
            sample_indices=loss.sample_indices,
            batches_held=loss.batches_held,
            outcome=loss.outcome,
        )
