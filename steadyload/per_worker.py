"""`per_worker`: a resource built lazily, once in each process, and never pickled.

Heavy or process-bound resources (a HuggingFace processor, an LMDB or h5py handle, a
database connection) must not travel inside the pickled dataset: some cannot be pickled at
all, and the others are shipped to every worker for nothing. ``per_worker(factory)``
stands in for the resource: the first access in a process calls ``factory()`` and caches
the result there; a pickled copy carries only the factory; a forked child notices the new
pid and builds its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class per_worker(Generic[T]):  # noqa: N801  (lower case: reads like a function, as property does)
    """A lazily built, per-process resource; use as a class attribute or a plain wrapper.

    As a class attribute (a descriptor), instances see the built value::

        class Captions(Dataset):
            processor = steadyload.per_worker(lambda: AutoProcessor.from_pretrained(PATH))

            def __getitem__(self, i):
                return self.processor(text=...)   # built on first use in this worker

    As an instance attribute, call `get()`::

        self.db = steadyload.per_worker(functools.partial(sqlite3.connect, path))
        row = self.db.get().execute(...)

    ``factory`` runs once per process (thread-safe), on first access: in each worker, and
    in the main process only if it is used there; in thread workers (``worker_type=
    "thread"``) once per thread, and freed with it. Pickling keeps the factory and drops
    the value (the factory is pickled by value with cloudpickle when it is a lambda or
    local function). After `os.fork` the child builds its own value.

    Args:
        factory: a callable with no arguments that builds the resource.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        if not callable(factory):
            raise TypeError(
                f"per_worker needs a callable that builds the resource, got {factory!r}; "
                "write per_worker(lambda: make_it()) rather than per_worker(make_it())"
            )
        self._factory = factory
        self._pid: int | None = None
        self._value: T | None = None
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._name = getattr(factory, "__name__", "resource")

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = f"{owner.__qualname__}.{name}"

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> per_worker[T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> T | per_worker[T]:
        if obj is None:
            return self  # accessed on the class: the descriptor itself
        return self.get()

    def get(self) -> T:
        """The resource of this process (of this thread, in a thread worker), built by
        ``factory()`` on first call."""
        values = getattr(_thread_worker, "values", None)
        if values is not None:  # a thread worker: its own value, freed when the thread ends
            if self not in values:
                values[self] = self._factory()
            return values[self]
        pid = os.getpid()
        if self._pid != pid:
            if self._lock_pid != pid:
                # Forked while another thread held the lock? The child gets a fresh one
                # (it has a single thread right after fork, so this cannot race).
                self._lock, self._lock_pid = threading.Lock(), pid
            with self._lock:
                if self._pid != pid:
                    self._value = self._factory()
                    self._pid = pid
        return self._value  # type: ignore[return-value]  # set above for this pid

    @property
    def built(self) -> bool:
        """True when this process has built its value."""
        return self._pid == os.getpid()

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        import cloudpickle

        # The value never travels; the factory does (by value if it is a lambda).
        return (_rebuild, (cloudpickle.dumps(self._factory),))

    def __repr__(self) -> str:
        state = "built" if self.built else "not built in this process"
        return f"steadyload.per_worker({self._name}, {state})"


_thread_worker = threading.local()  # ``values`` is set in thread workers only


def enter_thread_worker() -> None:
    """The calling thread is a thread worker: per_worker values are built per thread."""
    _thread_worker.values = {}


def _rebuild(factory_bytes: bytes) -> per_worker[Any]:
    import pickle

    return per_worker(pickle.loads(factory_bytes))


# Public names report the package they are imported from (see steadyload/__init__.py).
for _public in (per_worker,):
    _public.__module__ = "steadyload"
del _public
