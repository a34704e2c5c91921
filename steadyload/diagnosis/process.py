"""A process worker's death: its exit code or signal, with the evidence (memory, OOM kills,
/dev/shm, a native crash's stack, the libraries loaded) -> what happened, why, what to do.

The first line of each message keeps the words torch's DataLoader uses for the same event
("DataLoader worker (pid N) is killed by signal: Killed.") so that log searches and
``pytest.raises(match=...)`` written against torch keep working; steadyload's explanation
follows on the next lines.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import WorkerDiedError
from ..host.system import Space, gib
from .describe import format_indices, signal_name, tail


def _torch_first_line(pid: int | None, exitcode: int | None) -> str:
    # These are torch's own words (torch/csrc/DataLoader.cpp), kept for users who match them.
    if exitcode is not None and exitcode < 0:
        try:
            text = signal.strsignal(-exitcode) or f"signal {-exitcode}"
        except ValueError:
            text = f"signal {-exitcode}"
        return f"DataLoader worker (pid {pid}) is killed by signal: {text}."
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}."


@dataclass(frozen=True, slots=True)
class Evidence:
    """What was known about a worker when it died. Every field may be unknown (None)."""

    rss_bytes: int | None = None
    """The worker's resident memory at the last sample before it died."""
    memory_limit_bytes: int | None = None
    """The cgroup limit, else the machine's memory."""
    oom_kills_before: int | None = None
    oom_kills_after: int | None = None
    shm: Space | None = None
    stacks: str = ""
    libraries: tuple[str, ...] = ()
    stage: str = ""
    """What the worker was doing: "loading", "collating", "sending", "idle"."""

    def as_dict(self) -> dict[str, object]:
        """The evidence as plain data, for reports."""
        return {
            "rss_bytes": self.rss_bytes, "memory_limit_bytes": self.memory_limit_bytes,
            "oom_kills_before": self.oom_kills_before, "oom_kills_after": self.oom_kills_after,
            "shm_free_bytes": self.shm.free_bytes if self.shm else None,
            "libraries": list(self.libraries), "stage": self.stage,
        }


def _memory_figure(ev: Evidence) -> str:
    if ev.rss_bytes is None:
        return "its memory was not measured before it died"
    limit = f" of a {gib(ev.memory_limit_bytes)} limit" if ev.memory_limit_bytes else ""
    return f"its last measured memory was {gib(ev.rss_bytes)}{limit}"


def _cause_and_fix(exitcode: int | None, start_method: str, ev: Evidence) -> tuple[str, str]:
    name = signal_name(exitcode)
    memory_fix = (
        "lower num_workers, batch_size or prefetch_factor, or the memory each sample needs; "
        "if the workers grow epoch after epoch, keep large Python lists/dicts of metadata "
        "out of the dataset object (copy-on-read), or cap them with max_worker_memory."
    )
    if name == "SIGKILL":
        before, after = ev.oom_kills_before, ev.oom_kills_after
        near_limit = (
            ev.rss_bytes is not None and ev.memory_limit_bytes is not None
            and ev.rss_bytes >= 0.8 * ev.memory_limit_bytes
        )
        if before is not None and after is not None and after > before:
            cause = (
                f"the out-of-memory killer (cgroup memory.events oom_kill went {before} -> "
                f"{after}; {_memory_figure(ev)})."
            )
            return cause, memory_fix
        if near_limit:
            return f"probably the out-of-memory killer: {_memory_figure(ev)}.", memory_fix
        recorded = (
            "no out-of-memory kill was recorded in this cgroup, and " if after is not None else ""
        )
        cause = (
            f"another process sent SIGKILL ({recorded}{_memory_figure(ev)}): a job "
            "scheduler, a watchdog, a user's kill -9, or the out-of-memory killer of a "
            "machine whose kernel log (`dmesg`) says 'Out of memory: Killed process'."
        )
        return cause, "find out who sends the signal; if memory ran out, " + memory_fix
    if name == "SIGBUS":
        space = ""
        if ev.shm:
            space = (
                f" ({gib(ev.shm.free_bytes)} free of {gib(ev.shm.total_bytes)} in "
                f"{ev.shm.path} now)"
            )
        cause = (
            f"a bus error in a data loader almost always means shared memory (/dev/shm) ran "
            f"out{space}. steadyload's own batches do not use /dev/shm, so it is the "
            "dataset's or another library's shared memory."
        )
        fix = (
            "give the container more shared memory (docker run --shm-size=8g) or lower "
            "batch_size, prefetch_factor or num_workers."
        )
        return cause, fix
    if name in ("SIGSEGV", "SIGABRT", "SIGFPE", "SIGILL"):
        libs = ""
        if ev.libraries:
            libs = f" Loaded crash-prone native libraries: {', '.join(ev.libraries)}."
        stack = ""
        if ev.stacks.strip():
            stack = f"\nWorker stack at the crash (faulthandler):\n{tail(ev.stacks)}"
        cause = (
            f"{name} is a crash in native code (a C/C++ extension used by the dataset, or a "
            f"library that is not safe to use after fork).{libs}{stack}"
        )
        fix = (
            "load the sample with num_workers=0 to reproduce it in this process; with "
            "OpenCV call cv2.setNumThreads(0) in worker_init_fn; keep the forkserver start "
            "method (steadyload's default) rather than fork."
        )
        if start_method == "zygote":
            # Zygote workers are forks of a copy of the training process, like fork's.
            fix = fix.replace(
                "rather than fork.",
                "rather than zygote: zygote workers are forked from a copy of this process, "
                "so a library that is not fork-safe can crash them as under fork.",
            )
        return cause, fix
    if name is not None:
        return f"the worker received {name}.", "find out which process sent it."
    if exitcode == 255 and start_method == "forkserver":
        cause = (
            "exit code 255 under forkserver is what CPython reports when the fork server "
            "itself died; steadyload found the server alive, so the worker exited with 255."
        )
        return cause, "look for sys.exit(255)/os._exit(255) in the dataset; run with num_workers=0."
    if exitcode == 255 and start_method == "zygote":
        cause = (
            "exit code 255 under zygote is what is reported when the zygote (the fork "
            "server forked from this process) itself died; steadyload found it alive, so "
            "the worker exited with 255."
        )
        return cause, "look for sys.exit(255)/os._exit(255) in the dataset; run with num_workers=0."
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
    evidence: Evidence | None = None,
    sample: object = None,
    outcome: str = "",
    stream_batches: Sequence[int] = (),
) -> WorkerDiedError:
    """Build the `WorkerDiedError` for a worker that exited while it held work.

    ``sample`` is the index the worker was loading when it died, when known; ``outcome``
    says what steadyload did about it (restart, skip, gave up), as a last line. For an
    IterableDataset, whose items have no indices, ``stream_batches`` numbers the batches
    held (their position in the epoch) and ``sample_indices`` is empty.
    """
    ev = evidence or Evidence()
    name = signal_name(exitcode)
    how = f"was killed by {name}" if name else f"exited with status {exitcode}"
    plural = "es" if batches_held != 1 else ""
    if stream_batches:
        contents = (
            f"batch{plural} {format_indices(stream_batches)} of the epoch; an "
            "IterableDataset's items have no indices"
        )
    else:
        contents = f"samples {format_indices(sample_indices)}"
    held = f"{batches_held} batch{plural}: {contents}" if batches_held else "no batch"
    if sample is not None:
        what = f"while loading sample {sample!r} (it held {held})"
    elif ev.stage in ("collating", "sending"):
        what = f"while {ev.stage} a batch (it held {held})"
    elif batches_held:
        what = f"while it held {batches_held} batch{plural} ({contents})"
    else:
        what = "while it held no batch"
    cause, fix = _cause_and_fix(exitcode, start_method, ev)
    message = (
        f"{_torch_first_line(pid, exitcode)}\n"
        f"steadyload: worker {worker_id} (pid {pid}) {how} {what}.\n"
        f"Likely cause: {cause}\n"
        f"Fix: {fix}"
    )
    if outcome:
        message += f"\n{outcome}"
    return WorkerDiedError(
        message,
        worker_id=worker_id,
        pid=pid,
        exitcode=exitcode,
        signal_name=name,
        sample_indices=sample_indices,
        evidence={"start_method": start_method, "batches_held": batches_held,
                  "sample": sample, **ev.as_dict()},
    )


