"""Public exception hierarchy.

Every error steadyload raises on its own account derives from `SteadyloadError`, and also
from the builtin that torch raises in the same situation (`RuntimeError` for dead workers
and time-outs), so that `except RuntimeError` written for torch's DataLoader still works.
Messages are composed in `steadyload.diagnosis`; these classes only carry the fields.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MainGuardError",
    "NotPicklableError",
    "SharedMemoryError",
    "SkipLimitError",
    "SteadyloadError",
    "UnsafeForkError",
    "WorkerDiedError",
    "WorkerHangError",
    "WorkerStartError",
]


class SteadyloadError(Exception):
    """Root of every error raised by steadyload itself (not by your dataset).

    Every steadyload error survives `pickle` and `copy` with its message, its fields and
    its notes, so it can cross processes (torchelastic error files, Ray, multiprocessing
    pools): the default exception pickling would call ``cls(*args)`` and miss the
    keyword-only fields. ``cls(message)`` alone works too (every field has a default), as
    torch's `ExceptionWrapper.reraise` and its test harness rebuild errors that way.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class WorkerDiedError(SteadyloadError, RuntimeError):
    """A worker process exited while it still held work.

    Attributes:
        worker_id: the worker's id (0 .. num_workers - 1), as `get_worker_info().id` saw it.
        pid: the worker's process id.
        exitcode: `Process.exitcode`: negative for a signal (-9 is SIGKILL), else the exit status.
        signal_name: e.g. ``"SIGKILL"``, or None when the worker exited with a status.
        sample_indices: the dataset indices of the samples the worker held when it died
            (empty for an IterableDataset, whose items have no indices: the message
            numbers the batches instead).
        evidence: facts the diagnosis used, as ``name -> value``.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int = -1,
        pid: int | None = None,
        exitcode: int | None = None,
        signal_name: str | None = None,
        sample_indices: Sequence[object] = (),
        evidence: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.signal_name = signal_name
        self.sample_indices = list(sample_indices)
        self.evidence = dict(evidence or {})


class WorkerStartError(SteadyloadError, RuntimeError):
    """A worker could not start: its arguments did not unpickle, or its set-up raised.

    Attributes:
        worker_id: the worker's id.
        pid: the worker's process id, if it got that far.
    """

    def __init__(self, message: str, *, worker_id: int = -1, pid: int | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid


class WorkerHangError(SteadyloadError, RuntimeError, TimeoutError):
    """No batch arrived within the loader's ``timeout``.

    Also a `TimeoutError` (so ``except TimeoutError`` works) and a `RuntimeError` (what
    torch raises for "DataLoader timed out after N seconds").

    Attributes:
        timeout_s: the limit that was exceeded. [Unit: second]
        worker_id: the worker that held the overdue batch, if known.
        sample_indices: the indices of the overdue batch.
    """

    def __init__(
        self,
        message: str,
        *,
        timeout_s: float = 0.0,
        worker_id: int | None = None,
        sample_indices: Sequence[object] = (),
    ) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s
        self.worker_id = worker_id
        self.sample_indices = list(sample_indices)


class SharedMemoryError(SteadyloadError, RuntimeError):
    """A batch could not cross between a worker and this process: out of file descriptors,
    memory mappings or shared memory.

    A `RuntimeError`, as torch's "Too many open files" error, whose words it keeps.

    Attributes:
        worker_id: the worker whose batch could not cross.
        errno: the operating system's error number (EMFILE, ENFILE, ENOMEM).
        where: "main process" or "worker": which side ran out.
        evidence: the figures the diagnosis used (open fds, limits, mappings).
    """

    def __init__(
        self, message: str, *, worker_id: int | None = None, errno: int = 0, where: str = "",
        evidence: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.errno = errno
        self.where = where
        self.evidence = dict(evidence or {})


class UnsafeForkError(SteadyloadError, RuntimeError):
    """The fork start method was chosen while a GPU context exists in this process.

    fork() copies the GPU driver's state into the child, where it is unusable: the worker
    hangs (often with the GPU at 100%) instead of failing. steadyload refuses up front.
    """


class NotPicklableError(SteadyloadError, TypeError):
    """The dataset, collate_fn or worker_init_fn cannot be sent to forkserver/spawn workers.

    Also a `TypeError`, which is what pickle raises for most such objects.

    Attributes:
        path: where the offending object sits, e.g. ``"dataset.index.conn"``.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class MainGuardError(SteadyloadError, RuntimeError):
    """Workers were started from a script's top level, outside ``if __name__ == "__main__":``.

    forkserver and spawn workers import the main script; without the guard that import
    would run the training code again in every worker.
    """


class SkipLimitError(SteadyloadError, RuntimeError):
    """``on_error="skip"`` skipped so many samples in a row that it cannot be bad data.

    Skipping is for the odd corrupt file; a dataset where every sample fails (a wrong
    path, a bug in ``__getitem__``) would otherwise be skipped forever, silently.

    Attributes:
        first_index: the first sample of the run of failures.
        first_error: its exception type and message.
    """

    def __init__(
        self, message: str, *, first_index: object = None, first_error: str = ""
    ) -> None:
        super().__init__(message)
        self.first_index = first_index
        self.first_error = first_error


def _rebuild(
    cls: type[SteadyloadError], args: tuple[Any, ...], state: dict[str, Any]
) -> SteadyloadError:
    """Unpickle a steadyload error: its keyword-only fields come from its saved state."""
    params = inspect.signature(cls.__init__).parameters
    fields = {
        name: state[name] for name, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name in state
    }
    exc = cls(*args, **fields)
    exc.__dict__.update(state)  # notes, and anything set after construction
    return exc


# Public names report the package they are imported from (see steadyload/__init__.py).
for _public in (
    SteadyloadError, WorkerDiedError, WorkerStartError, WorkerHangError, UnsafeForkError,
    NotPicklableError, MainGuardError, SkipLimitError, SharedMemoryError,
):
    _public.__module__ = "steadyload"
del _public
