"""A fork server's (or zygote's) death, which takes every worker it forked with it."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import WorkerDiedError
from .describe import signal_name


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
