"""When something gives out besides the dataset: descriptors, memory mappings, the fork
server, a worker's start. Each builder says what happened, why and what to do, like
`diagnosis.py` does for dead and hung workers.
"""

from __future__ import annotations

import errno as errnos
import resource
from collections.abc import Sequence

from ._system import fd_limits, gib, max_map_count, memory_mappings, open_fds
from .describe import signal_name
from .errors import SharedMemoryError, WorkerDiedError, WorkerStartError


def start_failed(
    *, worker_id: int, pid: int | None, method: str, type_name: str, text: str, traceback: str
) -> WorkerStartError:
    """The error for a worker whose arguments did not unpickle."""
    return WorkerStartError(
        f"DataLoader worker {worker_id} (pid {pid}) could not start: "
        f"{type_name}: {text}\n"
        "Likely cause: the dataset, collate_fn or worker_init_fn could not be unpickled "
        f"in a {method} worker, which imports them by module and name.\n"
        "Fix: define them at module level in an importable module (not in a notebook "
        "or inside a function), or use start_method='fork' when no GPU is in use.\n"
        f"Worker traceback:\n{traceback}",
        worker_id=worker_id,
        pid=pid,
    )


def too_many_files_note() -> str:
    """What to say about "Too many open files" (EMFILE) raised in a worker."""
    import torch.multiprocessing as tmp

    soft, hard = fd_limits()
    return (
        f"steadyload: 'Too many open files': this process may have {soft} open files "
        f"(ulimit -n; the hard limit is {hard}); torch's sharing strategy is "
        f"{tmp.get_sharing_strategy()!r}. Fix: raise the limit (ulimit -n {hard}), close "
        "files in __getitem__ (use `with open(...)`), or keep fewer batches alive; torch's "
        "'file_system' sharing strategy uses no descriptor per shared tensor."
    )


# torch's words for the same event (torch/utils/data/dataloader.py), kept for users and
# tests that match them; they must contain "ulimit -n" and "set_sharing_strategy".
TORCH_FD_MESSAGE = (
    "Too many open files. Communication with the workers is no longer possible. Please "
    "increase the limit using `ulimit -n` in the shell or change the sharing strategy by "
    "calling `torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning "
    "of your code"
)


def shared_memory_exhausted(
    *, worker_id: int | None, error: int, detail: str, where: str, segments: int = 0,
) -> SharedMemoryError:
    """The error for a batch that could not cross: out of descriptors (EMFILE/ENFILE) or of
    mappings (ENOMEM), in the main process or the worker (``where``)."""
    soft, hard = fd_limits()
    maps = memory_mappings()
    limit = max_map_count()
    held = maps[1] if maps else None
    evidence: dict[str, object] = {
        "open_fds": open_fds() if where == "main process" else None, "fd_soft_limit": soft,
        "fd_hard_limit": hard, "mappings": maps[0] if maps else None,
        "batch_segments_mapped": held, "max_map_count": limit, "detail": detail,
    }
    kept = (
        f"; the batches still referenced here hold {held} shared-memory mapping(s)"
        if held else ""
    )
    if error == errnos.ENOMEM:
        count = f"{maps[0]} memory mappings of vm.max_map_count={limit}" if maps else "?"
        space, _ = resource.getrlimit(resource.RLIMIT_AS)
        capped = space != resource.RLIM_INFINITY
        evidence["address_space_limit"] = space if capped else None
        if capped:
            count += f", and an address-space limit (ulimit -v) of {gib(space)}"
        first = (
            "DataLoader: a batch's shared memory could not be mapped (ENOMEM: out of memory "
            "mappings or address space)."
        )
        what = (
            f"steadyload: the {where} could not map a batch of worker {worker_id} "
            f"({detail}): this process has {count}{kept}."
        )
        cause = (
            "the training loop keeps many batches (or tensors from them) alive, each mapping "
            "its shared memory" + ("; and the address space is limited" if capped else "")
        )
        fix = (
            "keep fewer batches alive (`.clone()` or `.tolist()` what you keep), or raise "
            "the limit: " + ("`ulimit -v unlimited`" if capped
                             else "`sysctl -w vm.max_map_count=262144`")
        )
    else:
        opened = f"{evidence['open_fds']} open, " if evidence["open_fds"] is not None else ""
        first = TORCH_FD_MESSAGE
        what = (
            f"steadyload: the {where} ran out of file descriptors while a batch of worker "
            f"{worker_id} crossed ({detail}; {opened}soft limit {soft}, hard limit {hard})"
            f"{kept}; the batch needed {segments or 'its'} descriptor(s)."
        )
        cause = (
            "the training loop keeps many batches (or tensors from them) alive, each holding "
            "its shared memory open; or `ulimit -n` is low"
        )
        fix = (
            f"keep fewer batches alive (`.clone()` or `.tolist()` what you keep), or raise "
            f"the limit (`ulimit -n {hard}`). set_sharing_strategy('file_system') changes "
            "how torch shares the tensors it sends itself (the dataset's), not "
            "steadyload's batches"
        )
    message = f"{first}\n{what}\nLikely cause: {cause}.\nFix: {fix}."
    return SharedMemoryError(
        message, worker_id=worker_id, errno=error, where=where, evidence=evidence
    )


def server_died(
    *, method: str, pid: int, exitcode: int | None, worker_pids: Sequence[int | None],
    batches_held: int, outcome: str,
) -> WorkerDiedError:
    """The error (or log text) for a fork server that died, taking its workers with it."""
    name = signal_name(exitcode)
    how = (
        f"was killed by {name}" if name
        else f"exited with status {exitcode}" if exitcode is not None else "exited"
    )
    server = (
        "fork server" if method == "forkserver"
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
        message, worker_id=-1, pid=pid, exitcode=exitcode, signal_name=name,
        sample_indices=[], evidence={"start_method": method, "server_pid": pid,
                                     "worker_pids": list(worker_pids)},
    )
