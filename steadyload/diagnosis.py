"""Turn the evidence about a failed worker into a message: what happened, why, what to do.

The first line of each message keeps the words torch's DataLoader uses for the same event
("DataLoader worker (pid N) is killed by signal: Killed.") so that log searches and
``pytest.raises(match=...)`` written against torch keep working; steadyload's explanation
follows on the next lines.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

from ._system import Space, gib
from .describe import format_indices, signal_name
from .errors import WorkerDiedError, WorkerHangError


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


def _tail(text: str, lines: int = 25) -> str:
    # faulthandler ends with the list of loaded extension modules: not worth the space.
    body = [line for line in text.strip().splitlines() if not line.startswith("Extension modules")]
    kept = body[-lines:]
    return "\n".join("    " + line for line in kept)


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
            stack = f"\nWorker stack at the crash (faulthandler):\n{_tail(ev.stacks)}"
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
        f"Its traceback:\n{_tail(traceback, 30)}"
    )
    if outcome:
        message += f"\n{outcome}"
    return WorkerDiedError(
        message, worker_id=worker_id, pid=None, exitcode=None, signal_name=None,
        sample_indices=sample_indices,
        evidence={"raised": raised, "batches_held": batches_held, "sample": sample},
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
        f"{where}\n{_tail(stack, 40)}\n{abandoned}"
        f"Likely cause: {culprit} (an endless loop, a network or disk read without a "
        "timeout, a lock held forever, a deadlock in a native library).\n"
        "Fix: look at the innermost frames above; add a timeout to the I/O, or raise "
        "hang_timeout if such samples are just slow."
    )
    return WorkerHangError(
        message, timeout_s=hang_timeout_s or 0.0, worker_id=worker_id,
        sample_indices=sample_indices,
    )


def server_died(
    *,
    method: str,
    pid: int,
    exitcode: int | None,
    worker_pids: Sequence[int | None],
    batches_held: int,
    outcome: str,
) -> WorkerDiedError:
    """The error (or log text) for a fork server that died, taking its workers with it."""
    name = signal_name(exitcode)
    how = (
        f"was killed by {name}"
        if name
        else f"exited with status {exitcode}"
        if exitcode is not None
        else "exited"
    )
    server = (
        "fork server"
        if method == "forkserver"
        else "zygote (the fork server forked from this process)"
    )
    if name == "SIGTERM":
        cause = (
            "a job scheduler or supervisor terminated the process group (preemption, a time "
            "limit); this process got the signal too unless it handles SIGTERM."
        )
        fix = (
            "if the job is being preempted, handle SIGTERM in the training script: save a "
            "checkpoint (with loader.state_dict()) and exit; otherwise find who sends it."
        )
    elif name == "SIGKILL":
        cause = (
            "another process sent SIGKILL: the out-of-memory killer (`dmesg` says 'Out of "
            "memory: Killed process'), a job scheduler or a user's kill -9."
        )
        fix = (
            "find out who sends it; if memory ran out, lower num_workers or what the fork "
            "server preloads (steadyload.prestart([...]))."
        )
    else:
        cause = "the server process crashed or exited; its stderr, if any, is above."
        fix = "run `steadyload doctor`; compare with start_method='spawn'."
    pids = ", ".join(str(p) for p in worker_pids)
    plural = "es" if batches_held != 1 else ""
    message = (
        f"DataLoader worker (pid(s) {pids}) exited unexpectedly\n"
        f"steadyload: the {server} (pid {pid}) that starts the workers {how}; its "
        f"{len(worker_pids)} worker(s) went with it, holding {batches_held} batch{plural}. "
        "No sample was at fault.\n"
        f"Likely cause: {cause}\nFix: {fix}"
    )
    if outcome:
        message += f"\n{outcome}"
    return WorkerDiedError(
        message,
        worker_id=-1,
        pid=pid,
        exitcode=exitcode,
        signal_name=name,
        sample_indices=[],
        evidence={"start_method": method, "server_pid": pid, "worker_pids": list(worker_pids)},
    )
