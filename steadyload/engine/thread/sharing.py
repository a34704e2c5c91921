"""What thread workers share with the training thread: torch's intra-op threads and the
process-wide random generators.

Process workers each have their own; threads share this process's, so a thread worker runs
torch's ops on itself alone (`single_threaded_ops`), and a dataset that draws from the
process-wide generators is found and named (`global_rngs`, then ../worker/rngs.py's
`drawn`, `warn_global_draws`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from ..worker.rngs import process_rngs
from ..worker.rngs import restore_rngs as _restore_rngs


def single_threaded_ops() -> None:
    """Run torch's ops in the calling thread worker on that thread alone, as torch's process
    workers do (`torch.set_num_threads(1)` in each; torchdata's thread workers too).

    Each thread worker's parallel op (a fill, a copy, ``torch.stack(out=)`` in
    default_collate) otherwise brings its own team of intra-op threads, more busy threads
    than cores (docs/design/figures.md#threads). Under OpenMP the count is per thread (the
    training thread keeps its own); the caller restores the process-wide default for threads
    made later (`restore_default`). Under torch's native pool the count is process-wide:
    left alone there.
    """
    if _openmp():
        # First torch's lazy per-thread set-up, which would later copy the process-wide
        # count (restored by then) over this thread's.
        torch.get_num_threads()
        torch.set_num_threads(1)


def restore_default(threads: int) -> None:
    """Undo what `single_threaded_ops` did to threads started later (call it in the thread
    that read ``threads = torch.get_num_threads()``: its own count stays as it was)."""
    if _openmp():
        torch.set_num_threads(threads)


@functools.cache
def _openmp() -> bool:
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


_warned: set[type] = set()  # dataset classes already warned about (main thread only)


def global_rngs(dataset_type: type) -> tuple[Any, ...] | None:
    """The process-wide generators' states; None once `warn_global_draws` named the class.

    Taken by the training thread when it starts waiting for thread workers' events and
    compared when it stops (`ThreadPool`): a change then is a worker's draw, never the
    training loop's own (dropout, noise), which it makes outside the wait."""
    if dataset_type in _warned:
        return None
    return process_rngs()


def restore_rngs(states: tuple[Any, ...]) -> None:
    """Put back what `process_rngs` took: a thread worker's set-up (``worker_init_fn``: the
    Trainer's ``seed_worker``, torch's reproducibility recipe) seeds the process-wide
    generators, which in a thread worker are the training loop's; in a process worker they
    are its own. So the training loop's draws go on as under process workers."""
    _restore_rngs(states)


def warn_global_draws(dataset_type: type) -> None:
    """Warn (once per dataset class) that thread workers drew from shared generators.

    Called by the iterating thread: a warning raised in a worker thread (``-W error``)
    would end the thread, and the caller's warning filters are meant for the caller.
    """
    if dataset_type in _warned:
        return
    _warned.add(dataset_type)
    warnings.warn(
        f"steadyload: {dataset_type.__qualname__} drew random numbers from a process-wide "
        "generator (torch.rand, random.random or np.random without a generator) in a "
        "thread worker. Thread workers share those generators with each other and with "
        "the training loop, so the values depend on thread timing and do not repeat from "
        "run to run. Draw from the worker's own generators instead: "
        "get_worker_info().rng.torch_generator (e.g. torch.rand(3, generator=...)), "
        ".random_generator, .numpy_generator; with sample_seeds=True they give the same "
        "values for any number of workers. Or use worker_type='process'.",
        RuntimeWarning, stacklevel=5,
    )
