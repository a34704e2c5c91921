"""A dataset exception raised in a worker, rebuilt in the parent as its own type.

The exception is re-raised with the worker's traceback as its ``__cause__`` and a note
naming the worker and the sample (Grain's rebuilt tracebacks); one that does not survive
pickling is replaced by a `WorkerException` that keeps its type name and text.
"""

from __future__ import annotations

import pickle

from .. import limits
from ..engine.protocol import Failed
from .common import add_note


class RemoteTraceback(Exception):
    """The worker's traceback, attached as ``__cause__`` of a re-raised dataset exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\n{self.tb}"


class WorkerException(Exception):
    """Stands in for a dataset exception that could not be pickled; keeps its type and text."""


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
        add_note(exc, limits.too_many_files_note())
    exc.__cause__ = RemoteTraceback(failed.traceback)
    return exc
