"""How worker arguments are pickled, and what to say when they cannot be.

forkserver and spawn workers receive the dataset, collate_fn and worker_init_fn pickled.
steadyload pickles them like torch (by reference, with torch's shared-memory reductions),
and falls back to cloudpickle, which sends functions and classes *by value*, where that is
what makes it work: a lambda or local function, and anything defined in a ``__main__`` that
workers cannot import (a notebook, a REPL, ``python -c``, a script piped to ``python -``).
When nothing works, `NotPicklableError` names the attribute path of the culprit
(``dataset.index.conn``) and the fix. The happy path pickles once per worker, as before;
the diagnosis (which pickles sub-objects one by one) runs only after a failure.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import sys
from collections import ChainMap
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .errors import NotPicklableError

_MAX_DEPTH = 12


def main_is_importable() -> bool:
    """Whether a forkserver/spawn child can import this process's ``__main__`` module.

    multiprocessing re-imports the main script (by path) or module (by name) in children;
    a REPL, a notebook kernel, ``python -c`` or a script read from stdin have neither.
    """
    main = sys.modules.get("__main__")
    if main is None:
        return False
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None) not in (None, "__main__"):
        return True  # python -m package.module
    path = getattr(main, "__file__", None)
    return bool(path) and not str(path).startswith("<")


@contextlib.contextmanager
def unimportable_main_hidden() -> Iterator[None]:
    """While starting a child, hide a ``__main__.__file__`` that the child cannot import.

    multiprocessing tells forkserver/spawn children to run the parent's main file again;
    for ``python -`` that "file" is ``<stdin>``, which does not exist, and the child dies
    before it can report anything. Such a ``__main__`` is sent by value instead (see
    `dumps_for_worker`), so the child must not look for it. Not thread-safe against code
    that reads ``__main__.__file__`` during the few milliseconds of a process start.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or main_is_importable():
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _cloud_dumps(obj: Any) -> bytes:
    import cloudpickle

    buf = io.BytesIO()
    pickler = cloudpickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    # torch registers its tensor/storage reductions (shared memory) on ForkingPickler only.
    pickler.dispatch_table = ChainMap(ForkingPickler._extra_reducers, pickler.dispatch_table)  # type: ignore[attr-defined]  # ForkingPickler keeps its reducers in this private dict
    pickler.dump(obj)
    return buf.getvalue()


def _plain_dumps(obj: Any) -> bytes:
    return bytes(ForkingPickler.dumps(obj, pickle.HIGHEST_PROTOCOL))


def dumps_for_worker(parts: dict[str, Any], whole: Any) -> bytes:
    """Pickle ``whole`` (built from the user objects in ``parts``) for a forkserver/spawn child.

    Raises:
        NotPicklableError: neither way of pickling works; the message names the path.
    """
    attempts: tuple[Callable[[Any], bytes], ...]
    if not main_is_importable():
        attempts = (_cloud_dumps,)
    else:
        attempts = (_plain_dumps, _cloud_dumps)  # torch's way first: by reference
    first_error: BaseException | None = None
    for dumps in attempts:
        try:
            return dumps(whole)
        except Exception as exc:  # pickling raises TypeError, AttributeError, PicklingError...
            first_error = first_error or exc
    assert first_error is not None
    raise diagnose(parts, attempts[-1], first_error) from first_error


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
        return
    func = getattr(obj, "func", None)
    if func is not None and hasattr(obj, "args") and hasattr(obj, "keywords"):  # partial
        yield ".func", func
        yield from ((f".args[{i}]", a) for i, a in enumerate(obj.args))
        yield from ((f".keywords[{k!r}]", v) for k, v in obj.keywords.items())
        return
    closure = getattr(obj, "__closure__", None)
    if closure:
        names = obj.__code__.co_freevars
        for name, cell in zip(names, closure, strict=False):
            try:
                yield f".<closure {name}>", cell.cell_contents
            except ValueError:  # empty cell
                pass
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        for key, value in state.items():
            yield f".{key}", value
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__"):
                try:
                    yield f".{slot}", getattr(obj, slot)
                except AttributeError:
                    pass


def _find(obj: Any, path: str, dumps: Any, seen: set[int], depth: int) -> tuple[str, str] | None:
    """The deepest path under ``obj`` that does not pickle, with the error text."""
    try:
        dumps(obj)
        return None
    except Exception as exc:
        error = f"{exc}"
        error_type = type(exc).__name__
    if id(obj) in seen or depth >= _MAX_DEPTH:
        return path, f"{error_type}: {error}"
    seen.add(id(obj))
    for suffix, child in _children(obj):
        found = _find(child, path + suffix, dumps, seen, depth + 1)
        if found is not None:
            return found
    return path, f"{error_type}: {error}"


def not_copyable(dataset: Any, error: BaseException) -> NotPicklableError:
    """The `NotPicklableError` for an IterableDataset that thread workers cannot copy (each
    thread iterates a replica of its own, made with ``copy.deepcopy``)."""
    found = _find(dataset, "dataset", copy.deepcopy, set(), 0)
    path, reason = found or ("dataset", f"{type(error).__name__}: {error}")
    return NotPicklableError(
        f"{path}: {reason.split(': ', 1)[-1]}\n"
        "Why: thread workers give each thread its own copy of an IterableDataset "
        "(copy.deepcopy: each thread iterates its own stream, as each worker process does), "
        f"and copying raised {reason.split(':')[0]} for {path}.\n"
        "Fix: create it in __iter__ (once per copy), or make it a per-worker resource, built "
        "lazily in each worker: a class attribute `x = steadyload.per_worker(lambda: "
        "make_x())`; or use worker_type='process'.",
        path=path,
    )


def diagnose(parts: dict[str, Any], dumps: Any, error: BaseException) -> NotPicklableError:
    """Build the `NotPicklableError` for the first of ``parts`` that does not pickle."""
    found: tuple[str, str] | None = None
    for name, obj in parts.items():
        found = _find(obj, name, dumps, set(), 0)
        if found is not None:
            break
    path, reason = found or ("the worker arguments", f"{type(error).__name__}: {error}")
    local = "local object" in reason or "lambda" in reason
    fix = (
        "define it at module level in an importable module (steadyload already sends "
        "lambdas and local functions by value; this one still failed)"
        if local
        else "make it a per-worker resource, built lazily in each worker and never "
        "pickled: a class attribute `x = steadyload.per_worker(lambda: make_x())`, or "
        "create it in worker_init_fn; or, without a GPU, use start_method='fork'"
    )
    return NotPicklableError(
        f"{path}: {reason.split(': ', 1)[-1]}\n"
        "Why: DataLoader workers started with forkserver or spawn receive the dataset, "
        f"collate_fn and worker_init_fn by pickling, and pickle raised {reason.split(':')[0]} "
        f"for {path}.\n"
        f"Fix: {fix}.",
        path=path,
    )
