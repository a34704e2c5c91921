"""Turn the evidence about a failed worker into a message: what happened, why, what to do.

The first line of each message keeps the words torch's DataLoader uses for the same event
("DataLoader worker (pid N) is killed by signal: Killed.") so that log searches and
``pytest.raises(match=...)`` written against torch keep working; steadyload's explanation
follows on the next lines.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from .errors import WorkerDiedError, WorkerHangError

_MAX_INDICES_SHOWN = 16


def signal_name(exitcode: int | None) -> str | None:
    """``-9 -> "SIGKILL"``; None for a normal exit status or an unknown signal number."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return None


def format_indices(indices: Sequence[object]) -> str:
    """A short, readable rendering of a list of sample indices."""
    shown = ", ".join(repr(i) for i in indices[:_MAX_INDICES_SHOWN])
    more = len(indices) - _MAX_INDICES_SHOWN
    return f"[{shown}, ... {more} more]" if more > 0 else f"[{shown}]"


def _torch_first_line(pid: int | None, exitcode: int | None) -> str:
    # These are torch's own words (torch/csrc/DataLoader.cpp), kept for users who match them.
    if exitcode is not None and exitcode < 0:
        try:
            text = signal.strsignal(-exitcode) or f"signal {-exitcode}"
        except ValueError:
            text = f"signal {-exitcode}"
        return f"DataLoader worker (pid {pid}) is killed by signal: {text}."
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}."


def _cause_and_fix(exitcode: int | None, start_method: str) -> tuple[str, str]:
    name = signal_name(exitcode)
    if name == "SIGKILL":
        cause = (
            "SIGKILL comes from the out-of-memory killer (the kernel log, `dmesg`, says "
            "'Out of memory: Killed process') or from another process (a job scheduler, "
            "a user's kill -9)."
        )
        fix = (
            "if memory ran out, lower num_workers, batch_size or prefetch_factor, or the "
            "memory each sample needs."
        )
    elif name == "SIGBUS":
        cause = "a bus error in a data loader almost always means shared memory (/dev/shm) ran out."
        fix = (
            "give the container more shared memory (docker run --shm-size=8g) or lower "
            "batch_size, prefetch_factor or num_workers."
        )
    elif name in ("SIGSEGV", "SIGABRT", "SIGFPE", "SIGILL"):
        cause = (
            f"{name} is a crash in native code (a C/C++ extension used by the dataset, "
            "or a library that is not safe to use after fork)."
        )
        fix = (
            "run with num_workers=0 to get the native stack, and prefer the forkserver "
            "start method (steadyload's default) over fork."
        )
    elif name is not None:
        cause, fix = f"the worker received {name}.", "find out which process sent it."
    elif exitcode == 255 and start_method == "forkserver":
        cause = "exit code 255 under forkserver usually means the fork server itself died."
        fix = "check the fork server's stderr above; re-create the loader to start a new one."
    else:
        cause = (
            f"the worker's Python process exited with status {exitcode} without reporting "
            "an error: dataset code called sys.exit() or os._exit(), or the worker failed "
            "while starting (its traceback, if any, is printed above on stderr)."
        )
        fix = (
            "look for sys.exit/os._exit in the dataset, collate_fn and worker_init_fn; run "
            "with num_workers=0 to see the error in this process."
        )
    return cause, fix


def worker_died(
    *,
    worker_id: int,
    pid: int | None,
    exitcode: int | None,
    sample_indices: Sequence[object],
    batches_held: int,
    start_method: str,
) -> WorkerDiedError:
    """Build the `WorkerDiedError` for a worker that exited while it held work."""
    name = signal_name(exitcode)
    how = f"was killed by {name}" if name else f"exited with status {exitcode}"
    if batches_held:
        what = (
            f"while loading {batches_held} batch{'es' if batches_held != 1 else ''} "
            f"(samples {format_indices(sample_indices)})"
        )
    else:
        what = "while it held no batch"
    cause, fix = _cause_and_fix(exitcode, start_method)
    message = (
        f"{_torch_first_line(pid, exitcode)}\n"
        f"steadyload: worker {worker_id} (pid {pid}) {how} {what}.\n"
        f"Likely cause: {cause}\n"
        f"Fix: {fix}"
    )
    return WorkerDiedError(
        message,
        worker_id=worker_id,
        pid=pid,
        exitcode=exitcode,
        signal_name=name,
        sample_indices=sample_indices,
        evidence={"start_method": start_method, "batches_held": batches_held},
    )


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
