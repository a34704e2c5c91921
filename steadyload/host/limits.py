"""When something gives out besides the dataset: descriptors, memory mappings, a worker's
start. Each builder says what happened, why and what to do, like `diagnosis/` does for
dead and hung workers (and dead fork servers).
"""

from __future__ import annotations

import errno as errnos
import resource

from ..errors import SharedMemoryError, WorkerStartError
from .system import fd_limits, gib, max_map_count, memory_mappings, open_fds


def start_refused(*, worker_id: int, method: str, exc: BaseException) -> WorkerStartError:
    """The error for a worker the fork server (or zygote) did not start, though it runs."""
    return WorkerStartError(
        f"DataLoader worker {worker_id} could not start: {type(exc).__name__}: {exc}\n"
        f"Likely cause: the {method} process that starts workers stopped answering.\n"
        "Fix: run `steadyload doctor`; if it persists, use start_method='spawn'.",
        worker_id=worker_id,
        pid=None,
    )


def start_stalled(
    *, worker_id: int, server_pid: int | None, why: str, stopped: bool
) -> WorkerStartError:
    """The error for a worker start the fork server (or zygote) did not answer."""
    pid = server_pid if server_pid is not None else "PID"
    fix = (
        f"resume it (`kill -CONT {pid}`) or end it (`kill {pid}`: the next loader starts a new one)"
        if stopped
        else f"see what it is doing (`py-spy dump --pid {pid}`); slow preloads (your dataset's "
        "module and its imports) can be moved before the loader with steadyload.prestart()"
    )
    return WorkerStartError(
        f"DataLoader worker {worker_id} could not start: {why}.\n"
        "Why: workers are forked by that server; while it does not answer, no worker can "
        "start, and the loader would wait forever.\n"
        f"Fix: {fix}; if it happens again, use start_method='spawn'.",
        worker_id=worker_id,
        pid=None,
    )


def fd_limit_fix() -> str:
    """The one advice for running out of file descriptors, with this process's limits."""
    soft, hard = fd_limits()
    return (
        f"raise the limit (`ulimit -n {hard}`; it is {soft} now), or keep fewer batches "
        "alive (`.clone()` or `.tolist()` what you keep)"
    )


def start_failed(
    *,
    worker_id: int,
    pid: int | None,
    method: str,
    type_name: str,
    text: str,
    traceback: str,
    error: int | None = None,
) -> WorkerStartError:
    """The error for a worker that could not set itself up: its arguments did not unpickle,
    or (``error`` EMFILE/ENFILE) it ran out of file descriptors receiving them."""
    if error in (errnos.EMFILE, errnos.ENFILE):
        cause = "the worker ran out of file descriptors while it received its arguments."
        fix = fd_limit_fix() + "; or use fewer SharedLists (one of records, not one per column)."
    else:
        cause = (
            "the dataset, collate_fn or worker_init_fn could not be unpickled in a "
            f"{method} worker, which imports them by module and name."
        )
        fix = (
            "define them at module level in an importable module (not in a notebook or "
            "inside a function), or use start_method='fork' when no GPU is in use."
        )
    return WorkerStartError(
        f"DataLoader worker {worker_id} (pid {pid}) could not start: {type_name}: {text}\n"
        f"Likely cause: {cause}\nFix: {fix}\nWorker traceback:\n{traceback}",
        worker_id=worker_id,
        pid=pid,
    )


def too_many_files_note() -> str:
    """What to say about "Too many open files" (EMFILE) raised by dataset code in a worker."""
    import torch.multiprocessing as tmp

    return (
        "steadyload: 'Too many open files' (ulimit -n); torch's sharing strategy is "
        f"{tmp.get_sharing_strategy()!r}. Fix: {fd_limit_fix()}, or close files in "
        "__getitem__ (use `with open(...)`); torch's 'file_system' sharing strategy uses no "
        "descriptor per shared tensor."
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
    *,
    worker_id: int | None,
    error: int,
    detail: str,
    where: str,
    segments: int = 0,
    during: str | None = None,
) -> SharedMemoryError:
    """The error for a batch that could not cross: out of descriptors (EMFILE/ENFILE) or of
    mappings (ENOMEM), in the main process or the worker (``where``)."""
    soft, hard = fd_limits()
    maps = memory_mappings()
    limit = max_map_count()
    held = maps[1] if maps else None
    evidence: dict[str, object] = {
        "open_fds": open_fds() if where == "main process" else None,
        "fd_soft_limit": soft,
        "fd_hard_limit": hard,
        "mappings": maps[0] if maps else None,
        "batch_segments_mapped": held,
        "max_map_count": limit,
        "detail": detail,
    }
    kept = (
        f"; the batches still referenced here hold {held} shared-memory mapping(s)" if held else ""
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
            "the limit: "
            + ("`ulimit -v unlimited`" if capped else "`sysctl -w vm.max_map_count=262144`")
        )
    else:
        opened = f"{evidence['open_fds']} open, " if evidence["open_fds"] is not None else ""
        first = TORCH_FD_MESSAGE
        needed = f"; the batch needed {segments or 'its'} descriptor(s)" if during is None else ""
        what = (
            f"steadyload: the {where} ran out of file descriptors "
            f"{during or f'while a batch of worker {worker_id} crossed'} ({detail}; "
            f"{opened}soft limit {soft}, hard limit {hard}){kept}{needed}."
        )
        cause = (
            "the training loop keeps many batches (or tensors from them) alive, each holding "
            "its shared memory open; or `ulimit -n` is low"
        )
        fix = (
            f"{fd_limit_fix()}. set_sharing_strategy('file_system') changes how torch shares "
            "the tensors it sends itself (the dataset's), not steadyload's batches"
        )
    message = f"{first}\n{what}\nLikely cause: {cause}.\nFix: {fix}."
    return SharedMemoryError(
        message, worker_id=worker_id, errno=error, where=where, evidence=evidence
    )
