"""What a worker is sent when it starts: `WorkerConfig`, carried by `Deferred`.

`Deferred` pickles the config while the worker process is being started (so shared tensors
and file descriptors travel as multiprocessing arranges) but unpickles it inside the
worker's own error handling, so that a dataset that does not unpickle is reported to the
parent instead of dying with a traceback on stderr.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ..memory import descriptors
from ..pickling import dumps_for_worker


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker needs, sent once when it starts."""

    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    worker_init_fn: Any
    num_workers: int
    preload: tuple[str, ...] = ()
    """Modules asked of the fork server, checked by the worker (see start/server_hooks/probe.py)."""
    skip_errors: bool = False
    """on_error="skip": leave out samples whose loading raises."""
    max_memory_bytes: int | None = None
    """Retire (exit after the current task) when the worker's USS passes this."""
    sample_seeds: bool = False
    """Seed the RNGs before each sample from (base seed, epoch, index): see _seeding.py."""
    hang_timeout_s: float | None = None
    """``hang_timeout``: how long a task, or a worker's set-up, may take. [Unit: second]"""
    probe_gil: bool = False
    """``worker_type="auto"`` measuring on processes: a GIL probe inside the worker process
    (../worker/gil.py), read by the parent from the worker's status block."""
    lazy_iter: bool = False
    """A resume sends each worker its replica's position (`Restore`): ``iter(dataset)``
    waits for it (or the first task), so that it runs once, as without a resume."""


class Deferred:
    """Carries an object to a child, unpickled inside the child's own error handling.

    multiprocessing unpickles a Process's arguments before the target runs, so a dataset
    that fails to unpickle in the child would only print a traceback there. Pickling the
    object to bytes while the Process is being pickled (the spawning context is set then,
    so shared tensors and file descriptors travel correctly) lets the worker catch the
    failure and report it to the parent. Under fork nothing is pickled at all.
    """

    def __init__(self, obj: Any, parts: dict[str, Any] | None = None) -> None:
        self._obj = obj
        self._parts = parts or {"arguments": obj}  # named for error messages
        self._data: bytes | None = None
        self.descriptors = 0
        """How many descriptors travel beside the pickle (memory/descriptors.py)."""
        self.last_descriptors: list[int] = []
        """The parent's descriptors of the latest pickling, to send after the start."""

    def __reduce__(self) -> tuple[Any, tuple[bytes, int]]:
        with descriptors.collecting() as table:
            data = dumps_for_worker(self._parts, self._obj)
        self.last_descriptors = table  # the pool sends them once the process started
        return (_rebuild_deferred, (data, len(table)))

    def get(self) -> Any:
        """The object (unpickled here in the child, if it was pickled)."""
        if self._data is not None:
            return pickle.loads(self._data)
        return self._obj


def _rebuild_deferred(data: bytes, descriptors: int = 0) -> Deferred:
    d = Deferred(None, {})
    d._data = data
    d.descriptors = descriptors
    return d
