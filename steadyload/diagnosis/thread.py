"""A thread worker's death: a BaseException that escaped the dataset's code."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import WorkerDiedError
from .describe import format_indices, tail


def thread_died(
    *,
    worker_id: int,
    raised: str,
    traceback: str,
    sample: object,
    sample_indices: Sequence[object],
    batches_held: int,
    outcome: str = "",
) -> WorkerDiedError:
    """Build the `WorkerDiedError` for a thread worker ended by an exception that is not a
    dataset error (``SystemExit``, ``KeyboardInterrupt``: `BaseException`, not `Exception`)."""
    plural = "es" if batches_held != 1 else ""
    what = (
        f"while loading sample {sample!r}" if sample is not None
        else f"while it held {batches_held} batch{plural} "
        f"(samples {format_indices(sample_indices)})" if batches_held
        else "while it held no batch"
    )
    message = (
        f"steadyload: thread worker {worker_id} ended: {raised} was raised {what}.\n"
        "Why: it is not an Exception (sys.exit(), KeyboardInterrupt and other BaseExceptions "
        "end the worker; a process worker would exit), so it is not a dataset error that "
        "on_error can skip.\n"
        "Fix: raise an Exception for a bad sample (on_error='skip' then leaves it out).\n"
        f"Its traceback:\n{tail(traceback, 30)}"
    )
    if outcome:
        message += f"\n{outcome}"
    return WorkerDiedError(
        message, worker_id=worker_id, pid=None, exitcode=None, signal_name=None,
        sample_indices=sample_indices,
        evidence={"raised": raised, "batches_held": batches_held, "sample": sample},
    )


