"""Recovery helpers for the multi-worker iterator: blame, evidence, rebuilt errors.

Pure functions over what the supervisor reported; the policy (restart, skip, raise) stays
in `_worker_iter.py`. See docs/design/recovery.md.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

from . import _system, diagnosis
from ._iterators import RemoteTraceback, WorkerException, add_note
from .engine.protocol import Failed, StartFailed
from .engine.status import IDLE, LOADING, STAGES, Progress
from .engine.supervisor import Died
from .errors import WorkerStartError


def blame(
    progress: Progress | None, tasks: Mapping[int, Any], held: set[int]
) -> tuple[Any, int | None]:
    """(the sample a dead worker was loading, the task it was running), when known.

    ``tasks`` maps task ids to objects with ``indices``; ``held`` are the ids the worker
    held. A worker that was collating or sending is blamed on the task, not a sample.
    """
    if progress is None or progress.stage == IDLE or progress.task_id not in held:
        return None, None
    task = tasks.get(progress.task_id)
    if task is None:
        return None, None
    indices = task.indices
    if progress.stage == LOADING and progress.position >= 0:
        if isinstance(indices, list) and progress.position < len(indices):
            return indices[progress.position], progress.task_id
        if not isinstance(indices, list):
            return indices, progress.task_id
    return None, progress.task_id


def gather_evidence(
    died: Died, oom_kills_before: int | None, rss_bytes: int | None
) -> diagnosis.Evidence:
    """What the machine, the memory sampler and the worker's status block say about a death."""
    memory = _system.cgroup_memory()
    progress = died.progress
    return diagnosis.Evidence(
        rss_bytes=rss_bytes,
        memory_limit_bytes=memory.limit_bytes or _system.total_memory_bytes(),
        oom_kills_before=oom_kills_before,
        oom_kills_after=memory.oom_kills,
        shm=_system.shm_space(),
        stacks=died.stacks,
        libraries=died.libraries,
        stage=STAGES.get(progress.stage, "") if progress else "",
    )


def start_failure(
    worker_id: int, pid: int | None, method: str, failed: StartFailed
) -> WorkerStartError:
    """The error for a worker whose arguments did not unpickle."""
    return WorkerStartError(
        f"DataLoader worker {worker_id} (pid {pid}) could not start: "
        f"{failed.type_name}: {failed.text}\n"
        "Likely cause: the dataset, collate_fn or worker_init_fn could not be unpickled "
        f"in a {method} worker, which imports them by module and name.\n"
        "Fix: define them at module level in an importable module (not in a notebook "
        "or inside a function), or use start_method='fork' when no GPU is in use.\n"
        f"Worker traceback:\n{failed.traceback}",
        worker_id=worker_id,
        pid=pid,
    )


def rebuild_exception(worker_id: int, pid: int | None, failed: Failed) -> BaseException:
    """The dataset's exception as its own type, with the sample noted and the worker's
    traceback as its cause; a stand-in keeping type name and text if it does not unpickle."""
    exc: BaseException
    if failed.exception is not None:
        try:
            exc = pickle.loads(failed.exception)
        except Exception:
            exc = WorkerException(f"{failed.type_name}: {failed.text}")
    else:
        exc = WorkerException(
            f"{failed.type_name}: {failed.text} (the original exception could not be "
            "pickled, so it is re-raised under this type)"
        )
    add_note(exc, f"steadyload: raised in worker {worker_id} (pid {pid}) {failed.where}")
    if isinstance(exc, OSError) and exc.errno == 24:
        add_note(exc, too_many_files_note())
    exc.__cause__ = RemoteTraceback(failed.traceback)
    return exc


def stateful(dataset: Any) -> bool:
    """Whether an IterableDataset can be resumed (state_dict/load_state_dict)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def too_many_files_note() -> str:
    """What to say about "Too many open files" (EMFILE) raised in a worker."""
    import torch.multiprocessing as tmp

    soft, hard = _system.fd_limits()
    return (
        f"steadyload: 'Too many open files': this process may have {soft} open files "
        f"(ulimit -n; the hard limit is {hard}); torch's sharing strategy is "
        f"{tmp.get_sharing_strategy()!r}. Fix: raise the limit (ulimit -n {hard}), close "
        "files in __getitem__ (use `with open(...)`), or keep fewer batches alive; torch's "
        "'file_system' sharing strategy uses no descriptor per shared tensor."
    )
