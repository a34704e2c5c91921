"""A hang: a worker past ``hang_timeout`` (its stack), or no batch within torch's ``timeout``."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import WorkerHangError
from .describe import format_indices, tail


def timed_out(
    *, timeout_s: float, worker_id: int | None, pid: int | None, sample_indices: Sequence[object]
) -> WorkerHangError:
    """Build the error for torch's ``timeout``: no batch arrived within ``timeout_s``."""
    where = (
        f"worker {worker_id} (pid {pid}) has held the next batch (samples "
        f"{format_indices(sample_indices)}) for that long"
        if worker_id is not None
        else "no worker held the next batch"
    )
    message = (
        f"DataLoader timed out after {timeout_s} seconds\n"
        f"steadyload: {where}.\n"
        "Likely cause: a sample that takes longer than the timeout to load, or a worker "
        "stuck on I/O, a lock or a deadlock.\n"
        "Fix: raise `timeout`, or find the slow sample by loading it with num_workers=0."
    )
    return WorkerHangError(
        message, timeout_s=timeout_s, worker_id=worker_id, sample_indices=sample_indices
    )


def worker_hung(
    *,
    worker_id: int,
    pid: int | None,
    hang_timeout_s: float | None,
    sample: object,
    sample_indices: Sequence[object],
    stack: str,
    times: int,
    thread: bool = False,
    starting: str = "",
) -> WorkerHangError:
    """Build the `WorkerHangError` for a task that outlived ``hang_timeout`` ``times`` times
    (``thread``: in a thread worker, which cannot be killed and was abandoned; ``starting``:
    the worker hung outside any task, "in worker_init_fn" or "in iter(dataset)")."""
    what = (
        f"sample {sample!r}" if sample is not None
        else f"samples {format_indices(sample_indices)}"
    )
    doing = f"starting ({starting})" if starting else f"loading {what}"
    culprit = (
        "a worker_init_fn or __iter__ that never returns" if starting
        else "a sample that never finishes loading"
    )
    again = "twice, on two fresh workers" if times >= 2 else "and no restart was left"
    who = f"thread worker {worker_id}" if thread else f"worker {worker_id} (pid {pid})"
    where = (
        "Where it was stuck (most recent call last):" if thread
        else "Where it was stuck (all threads, most recent call first):"
    )
    abandoned = (
        "A thread cannot be killed: steadyload abandoned it (it runs on until that call "
        "returns, then exits; its batch is dropped).\n" if thread else ""
    )
    message = (
        f"steadyload: {who} hung while {doing}: it ran for "
        f"more than hang_timeout={hang_timeout_s} s {again}.\n"
        f"{where}\n{tail(stack, 40)}\n{abandoned}"
        f"Likely cause: {culprit} (an endless loop, a network or disk read without a "
        "timeout, a lock held forever, a deadlock in a native library).\n"
        "Fix: look at the innermost frames above; add a timeout to the I/O, or raise "
        "hang_timeout if such samples are just slow."
    )
    return WorkerHangError(
        message, timeout_s=hang_timeout_s or 0.0, worker_id=worker_id,
        sample_indices=sample_indices,
    )


