"""A dataset exception raised in a worker, rebuilt in the parent as its own type.

The exception is re-raised with the worker's traceback as its ``__cause__`` and a note
naming the worker and the sample (Grain's rebuilt tracebacks); one that does not survive
pickling is replaced by a `WorkerException` that keeps its type name and text.
"""

from __future__ import annotations

import pickle

from ..engine.protocol import Failed
from ..host import limits
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
    traceback as its cause. A thread worker's is the object itself (its own traceback and
    cause kept); one that did not pickle is rebuilt from its class and text, as torch
    does; a stand-in keeping type name and text is the last resort."""
    exc: BaseException | None = failed.error
    if exc is not None:
        add_note(exc, f"steadyload: raised in thread worker {worker_id} {failed.where}")
        return exc
    if failed.exception is not None:
        try:
            exc = pickle.loads(failed.exception)
        except Exception:
            exc = None
    if exc is None and failed.exception_type is not None:
        try:
            exc = pickle.loads(failed.exception_type)(failed.text)
        except Exception:
            exc = None
    if exc is None:
        exc = WorkerException(
            f"{failed.type_name}: {failed.text} (the original exception could not be "
            "pickled, so it is re-raised under this type)"
        )
    add_note(exc, f"steadyload: raised in worker {worker_id} (pid {pid}) {failed.where}")
    if isinstance(exc, OSError) and exc.errno == 24:
        add_note(exc, limits.too_many_files_note())
    exc.__cause__ = RemoteTraceback(failed.traceback)
    return exc
