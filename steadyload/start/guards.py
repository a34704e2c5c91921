"""Guards against starts that would hang: fork after a GPU context, forking with threads,
and workers started from a script's unguarded top level.

Each check raises (or warns once) with what happened, why, and the fix; none of them
starts anything.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
import sys
import threading
import warnings

from ..errors import MainGuardError, UnsafeForkError
from ..memory.advice import check_copy_on_read, check_dataset_shm, raise_fd_limit
from ..pickling import main_is_importable


def gpu_context_description() -> str | None:
    """Describe the GPU context that exists in this process, or None when there is none."""
    import torch  # not at module level: `steadyload.prestart` must not wait for torch

    try:
        initialized = torch.cuda.is_initialized()
    except Exception:  # a broken CUDA install must not stop CPU loading
        return None
    if not initialized:
        return None
    hip = getattr(torch.version, "hip", None)
    return f"a ROCm/HIP GPU context (HIP {hip})" if hip else "a CUDA context"


def check_fork_safe(method: str) -> None:
    """Refuse fork when a GPU context exists: the workers would hang, not fail.

    Raises:
        UnsafeForkError: ``method`` is "fork" and CUDA or ROCm/HIP is initialised here.
    """
    if method != "fork":
        return
    context = gpu_context_description()
    if context is None:
        return
    raise UnsafeForkError(
        f"refusing to start DataLoader workers with fork: this process already holds "
        f"{context}.\n"
        "Why: fork() copies the GPU driver's state into each worker, where it cannot be "
        "used; the workers deadlock (often with the GPU busy at 100%) instead of failing.\n"
        "Fix: drop multiprocessing_context='fork' / start_method='fork' and let steadyload "
        "use forkserver (the default). If you must fork, fork before the GPU is used: "
        "start persistent workers (persistent_workers=True, then iter(loader)) first."
    )


def check_zygote_safe() -> None:
    """Refuse to fork the zygote while a GPU context exists: it and its workers would hang.

    Raises:
        UnsafeForkError: CUDA or ROCm/HIP is initialised in this process (torch only).
    """
    if "torch" not in sys.modules:
        return  # no torch yet, so no torch GPU context; nothing to import for it
    context = gpu_context_description()
    if context is None:
        return
    raise UnsafeForkError(
        f"refusing to fork the zygote for start_method='zygote': this process already "
        f"holds {context}.\n"
        "Why: the zygote is a fork() of this process and every worker is forked from it; "
        "forked copies of the GPU driver's state deadlock (often with the GPU busy at "
        "100%) instead of failing. Once the zygote exists, using the GPU here is safe.\n"
        "Fix: build the first zygote loader, or call "
        "steadyload.prestart(start_method='zygote'), right after importing torch and "
        "before anything touches the GPU (model.cuda(), torch.cuda.*); or use "
        "start_method='forkserver' (the default), which is safe at any time."
    )


_warned_threads: set[tuple[str, tuple[str, ...]]] = set()


def check_process_start(dataset: object, num_workers: int, method: str) -> None:
    """Everything only starting worker processes can break, refused or advised before any
    starts: fork after a GPU context, an unguarded main, threads before fork, copy-on-read
    and /dev/shm advice, and the fd limit raised."""
    check_fork_safe(method)
    check_main_guard(method)
    warn_if_threads_before_fork(method)
    check_copy_on_read(dataset, num_workers, method)
    check_dataset_shm(dataset, num_workers, method)
    raise_fd_limit()


def warn_if_threads_before_fork(method: str) -> None:
    """Warn (once per set of threads) that fork copies only the calling thread."""
    if method == "fork":
        warn_threads("fork", stacklevel=4)


def warn_threads(method: str, stacklevel: int) -> None:
    """Warn once per (method, set of threads) that forking now would copy held locks."""
    others = tuple(
        sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    )
    if not others or (method, others) in _warned_threads:
        return
    _warned_threads.add((method, others))
    hazard = (
        "fork copies only the calling thread; a lock held by another thread at that moment "
        "(logging, a tokenizer's thread pool, an I/O library) stays locked forever in "
    )
    if method == "fork":
        text = (
            f"steadyload: forking DataLoader workers while {len(others)} other thread(s) "
            f"run in this process: {', '.join(others)}. {hazard}the worker, which then "
            "hangs. Fix: use start_method='forkserver' (the default) or 'spawn'."
        )
    else:
        text = (
            f"steadyload: forking the zygote (start_method='zygote') while {len(others)} "
            f"other thread(s) run in this process: {', '.join(others)}. {hazard}the "
            "zygote and in every worker forked from it, which then hang. Fix: build the "
            "first zygote loader, or call steadyload.prestart(start_method='zygote'), "
            "before starting threads; or use start_method='forkserver' (the default)."
        )
    warnings.warn(text, RuntimeWarning, stacklevel=stacklevel)


@functools.lru_cache(maxsize=32)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...]:
    """Line ranges of ``if __name__ == "__main__":`` bodies in the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return ()
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_main_test(node.test):
            ranges.append((node.lineno, node.end_lineno or node.lineno))
    return tuple(ranges)


def is_main_test(test: ast.expr) -> bool:
    """Whether ``test`` is ``__name__ == "__main__"`` (either side first)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]


def unguarded_main_site() -> tuple[str, int] | None:
    """(file, line) when the main script starts workers outside ``if __name__ == "__main__":``.

    Children started by forkserver or spawn import the main script to find what it
    defines; code at its top level then runs again in every worker, and starts workers
    of its own. Found from the call stack and the script's syntax tree.
    """
    if not main_is_importable():
        return None
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and str(getattr(spec, "name", "")).endswith(".__main__"):
        # `python -m pkg`: multiprocessing never re-runs a package's __main__ in children.
        return None
    # Only the script's own frames count: in a spawn child (torch.multiprocessing.spawn,
    # Lightning's ddp_spawn) the outermost "__main__" frame is CPython's `-c` bootstrap,
    # whose globals are not the script module's.
    main_globals = vars(sys.modules["__main__"])
    frame = sys._getframe(1)
    site = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main_globals:
            site = frame
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    if site is None:
        return None
    path, line = site.f_code.co_filename, site.f_lineno
    if any(lo <= line <= hi for lo, hi in _guarded_lines(path)):
        return None
    return path, line


def check_main_guard(method: str) -> None:
    """Refuse to start forkserver/spawn/zygote workers from unguarded top-level script code.

    Raises:
        MainGuardError: with the file and line, and the fix.
    """
    if method not in ("forkserver", "spawn", "zygote"):
        return
    bootstrapping = getattr(multiprocessing.current_process(), "_inheriting", False)
    site = unguarded_main_site()
    if site is None and not bootstrapping:
        return
    where = f"{site[0]}, line {site[1]}" if site else "the main script"
    raise MainGuardError(
        f"DataLoader workers started from the top level of {where}, outside "
        "`if __name__ == \"__main__\":`.\n"
        f"Why: {method} workers import the main script to find the dataset class; without "
        "the guard, that import runs the training code again in every worker and starts "
        "workers of its own.\n"
        "Fix: move the training code under the guard, keeping the dataset class and "
        "imports at module level:\n\n"
        "    class MyDataset(torch.utils.data.Dataset):\n"
        "        ...\n\n"
        "    if __name__ == \"__main__\":\n"
        "        loader = steadyload.DataLoader(MyDataset(...), num_workers=2)\n"
        "        train(loader)\n"
    )

