"""Every hook steadyload sets in torch's private internals, in one place (each has a check in
tests/unit/test_private_apis.py that fails loudly if torch moves it).

- ``get_worker_info()`` per process (`set_process_info`) or per thread (`install_per_thread`;
  threads a thread worker starts answer as their worker, through ``threading.Thread.start``).
- Workers seeded as torch's ``_worker_loop`` seeds them (`seed_process`, `make_info`).
- Shared storage (``UntypedStorage._new_shared``, which default_collate calls in workers)
  routed into a process worker's arena (`route_shared_storage`), or plain in a thread
  worker (`install_per_thread`) and a remote worker's actor (`plain_shared_storage`).
- Whether torch's profiler runs (`profiler_enabled`).

torch keeps one module global (`torch.utils.data._utils.worker._worker_info`), which is
right for processes. Thread workers share a process, so each thread needs its own answer
while the main thread must still get None. `install_per_thread` makes torch's own
`get_worker_info` function consult a thread-local first: its code object is swapped for
one that does, which every reference sees, including ``from torch.utils.data import
get_worker_info`` bound before (replacing the module attribute would miss those).

Each worker's info also carries random generators of its own, seeded from the worker's
seed, in torch's own container for thread workers: ``info.rng.torch_generator``,
``info.rng.random_generator`` (`random.Random`) and ``info.rng.numpy_generator`` (numpy's
`Generator`), with ``info.worker_method`` "thread" or "multiprocessing". Thread workers
share the process-wide generators (``torch.rand``, ``random.random``), whose draws then
depend on thread scheduling; these do not.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import worker as _torch_worker

from ..._seeding import worker_rng
from ...host.slabs import SLAB_FROM, SLABS


class _WorkerOfThread(threading.local):
    """Which thread worker the calling thread is, or works for: a thread started by a
    thread worker (a read-ahead producer, a decode pool) answers as its worker, as every
    thread of a worker process answers as that process (`install_per_thread`)."""

    own: Any = None

    @property
    def info(self) -> Any:
        """The calling thread's worker info, its own or inherited; None outside workers."""
        own = self.own
        return own if own is not None else getattr(threading.current_thread(), _INHERITED, None)


_INHERITED = "_steadyload_worker_info"
_threads = _WorkerOfThread()
_install_lock = threading.Lock()


def make_info(worker_id: int, num_workers: int, seed: int, dataset: Any, method: str) -> Any:
    """torch's `WorkerInfo` for one worker, with generators of its own seeded from ``seed``
    (``info.rng``, torch's container for thread workers) and ``worker_method`` ("thread" or
    "multiprocessing"), where this torch has them."""
    fields: dict[str, Any] = {}
    rng = worker_rng(seed)
    if rng is not None:
        fields["rng"] = rng
        fields["worker_method"] = method
    try:
        return _torch_worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset, **fields
        )
    except TypeError:  # a torch whose WorkerInfo has neither
        return _torch_worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
        )


def set_process_info(info: Any) -> None:
    """What `get_worker_info()` returns in this worker process (torch's module global)."""
    _torch_worker._worker_info = info


def seed_process(base_seed: int, worker_id: int) -> int:
    """Seed this worker process's generators exactly as torch's ``_worker_loop`` does (so
    values drawn in datasets are the same); returns the worker's seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_torch_worker._generate_state(base_seed, worker_id))
    return seed


def _per_thread_get_worker_info() -> Any:
    # The body torch's get_worker_info gets: it runs with *torch's* module globals, where
    # install_per_thread put ``_steadyload_threads`` beside torch's ``_worker_info``.
    info = getattr(_steadyload_threads, "info", None)  # type: ignore[name-defined]  # noqa: F821
    return _worker_info if info is None else info  # type: ignore[name-defined]  # noqa: F821


def install_per_thread() -> None:
    """Make torch's `get_worker_info` answer per thread, and shared storage asked for in a
    thread worker plain (idempotent).

    Raises:
        RuntimeError: torch's function is not the plain global read this relies on.
    """
    with _install_lock:
        function = _torch_worker.get_worker_info
        if function.__code__ is _per_thread_get_worker_info.__code__:
            return
        if function.__code__.co_freevars or "_worker_info" not in function.__code__.co_names:
            raise RuntimeError(
                "steadyload's thread workers cannot give each thread its own "
                "get_worker_info(): torch.utils.data._utils.worker.get_worker_info is not "
                f"the global read it expects in torch {torch.__version__}. Use "
                "worker_type='process', and please report this."
            )
        _torch_worker._steadyload_threads = _threads  # type: ignore[attr-defined]  # ours
        function.__code__ = _per_thread_get_worker_info.__code__
        _install_plain_storage()
        _install_inheritance()


def _install_inheritance() -> None:
    """Threads started from a thread worker answer `get_worker_info()` as that worker:
    ``threading.Thread.start`` notes the starting thread's worker info on the new thread."""
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        info = _threads.info
        if info is not None and getattr(self, _INHERITED, None) is None:
            setattr(self, _INHERITED, info)
        original(self)

    threading.Thread.start = start  # type: ignore[method-assign]  # deliberate, once


def _install_plain_storage() -> None:
    """In a thread worker, storage asked for as shared (default_collate does so whenever
    `get_worker_info()` is not None, to hand the batch to another process) is plain: the
    batch stays in this process, and a /dev/shm segment per batch would only cost."""
    _plain_shared_storage(lambda: getattr(_threads, "info", None) is not None)


def plain_shared_storage() -> None:
    """In a remote worker's actor: storage asked for as shared is plain. Ray pickles the
    batch to send it, so a /dev/shm segment per batch would only cost, and an actor killed
    while torch names one (before it unlinks it) would leave the file behind."""
    _plain_shared_storage(lambda: True)


def _plain_shared_storage(plain: Callable[[], bool]) -> None:
    """Route ``UntypedStorage._new_shared`` to plain CPU memory while ``plain()``.

    From `SLAB_FROM` it is a slab of `SLABS`, given again to a later batch once this one is
    gone (kept only while thread workers run), and numpy's memory, which numpy advises for
    transparent huge pages (docs/design/figures.md#threads). Like the shared storage of
    torch's worker processes, it cannot grow (``resize_`` within its size works)."""
    original = torch.UntypedStorage._new_shared

    def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
        if plain() and torch.device(device).type == "cpu":
            if size >= SLAB_FROM:
                return torch.from_numpy(SLABS.take(size)).untyped_storage()
            return torch.UntypedStorage(size)
        return original(size, device=device)

    torch.UntypedStorage._new_shared = classmethod(_new_shared)  # type: ignore[assignment,method-assign]  # deliberate, once per process


def set_thread_info(info: Any) -> None:
    """What `get_worker_info()` returns in the calling thread (None: the process's own)."""
    _threads.own = info


def thread_worker_id() -> int | None:
    """The id of the thread worker calling, or None outside thread workers."""
    info = getattr(_threads, "info", None)
    return None if info is None else int(info.id)


def route_shared_storage(arena: Any) -> None:
    """In a worker process: torch's shared-storage allocations (default_collate's) come from
    ``arena`` (``arena.storage(nbytes)``) while ``arena.active``."""
    original = torch.UntypedStorage._new_shared

    def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
        if arena.active and torch.device(device).type == "cpu":
            return arena.storage(size)
        return original(size, device=device)

    torch.UntypedStorage._new_shared = classmethod(_new_shared)  # type: ignore[assignment,method-assign]  # deliberate monkeypatch, worker only


def profiler_enabled() -> bool:
    """Whether torch's autograd profiler is running (then torch's ``__next__`` is used, with
    its profiler range)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)
