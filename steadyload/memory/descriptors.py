"""Descriptors that travel to a starting worker beside its pickled arguments, not in them.

CPython's fork server takes at most ~250 descriptors with a process start (its
``MAXFDS_TO_SEND``, and the kernel's 253 per message), and each `SharedList` is one. So
while a worker's arguments are pickled (`collecting`), shared lists put their descriptor in
a table and pickle only its index; the pool sends the table on the worker's own
socket, in as many messages as it takes, and the worker installs it (`install`) before it
unpickles its arguments. Any number of shared lists then works, whatever the start method.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

_collecting: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "steadyload_descriptors", default=None
)
_received: list[int] = []  # in a worker: the table the parent sent


@contextlib.contextmanager
def collecting() -> Iterator[list[int]]:
    """Within the block, `collect` adds descriptors to the list this yields."""
    table: list[int] = []
    token = _collecting.set(table)
    try:
        yield table
    finally:
        _collecting.reset(token)


def collect(fd: int) -> int | None:
    """Put ``fd`` in the table being collected; its index, or None outside `collecting`."""
    table = _collecting.get()
    if table is None:
        return None
    table.append(fd)
    return len(table) - 1


def install(fds: list[int]) -> None:
    """In a worker: the descriptors received for its arguments, in table order."""
    _received[:] = fds


def take(index: int) -> int:
    """In a worker: the descriptor at ``index`` of the table (the caller owns it).

    Raises:
        RuntimeError: the table has no such descriptor (an internal error).
    """
    if not 0 <= index < len(_received) or _received[index] < 0:
        raise RuntimeError(
            f"[steadyload internal error] descriptor {index} of {len(_received)} sent with "
            "the worker's arguments is missing; please report with the output of "
            "`steadyload doctor`"
        )
    fd, _received[index] = _received[index], -1
    return fd


def close_unused() -> None:
    """In a worker: close descriptors of the table that nothing took."""
    for i, fd in enumerate(_received):
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            _received[i] = -1
