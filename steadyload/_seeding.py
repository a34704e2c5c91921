"""``sample_seeds=True``: seed the RNGs before each sample from (base seed, epoch, index).

With torch's default seeding, each worker seeds its RNGs once (base seed + worker id), so the
random values a sample draws depend on which worker loaded it and what that worker loaded
before: change ``num_workers``, restart a worker or resume a run, and augmentations differ.
Seeding per sample from values that do not depend on the worker layout makes them the same.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import worker as _torch_worker

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    # splitmix64's finaliser: consecutive inputs give unrelated outputs.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def _key(index: Any) -> int:
    if isinstance(index, int) and not isinstance(index, bool):
        return index & _MASK
    digest = hashlib.blake2b(repr(index).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def worker_rng(seed: int) -> Any:
    """Generators of one worker's own, seeded from ``seed`` (torch's container for thread
    workers, ``get_worker_info().rng``); None on a torch without it."""
    container = getattr(_torch_worker, "_RNG", None)
    if container is None:
        return None
    return container(
        random.Random(seed),
        torch.Generator().manual_seed(seed),
        np.random.Generator(np.random.PCG64(seed)),
    )


_in_process: list[Any] = []  # the training process's own, made at the first use


def _in_process_rng() -> Any:
    if not _in_process:
        _in_process.append(worker_rng(torch.initial_seed()))
    return _in_process[0]


def sample_rng() -> Any:
    """The random generators a dataset draws from, the same way in every kind of worker and
    with ``num_workers=0``: ``.torch_generator``, ``.random_generator``,
    ``.numpy_generator``.

    In a worker they are its own (``get_worker_info().rng``); in the training process
    (``num_workers=0``, where ``get_worker_info()`` is None) they are generators of this
    process's own, not the process-wide ones. With ``sample_seeds=True`` the loader reseeds
    them for every sample, so a sample's draws are the same for any number and kind of
    workers. Example: ``torch.rand(2, generator=steadyload.sample_rng().torch_generator)``.
    """
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    rng = getattr(info, "rng", None) if info is not None else None
    return rng if rng is not None else _in_process_rng()


def sample_seed(base_seed: int, epoch: int, index: Any) -> int:
    """A 63-bit seed for one sample; the same in any process and worker layout."""
    h = _mix((base_seed & _MASK) ^ 0x9E3779B97F4A7C15)
    h = _mix(h ^ (epoch & _MASK))
    return _mix(h ^ _key(index)) >> 1


class SampleSeeder:
    """Seeds torch's CPU generator, `random` and (if imported) numpy's global RNG, and the
    worker's own generators (``get_worker_info().rng``: engine/worker_info.py).

    Thread workers pass ``process_wide=False``: the process-wide generators are shared by
    every thread (and the training loop), so seeding them from one thread would reseed the
    others mid-sample; only the thread's own generators are seeded.
    """

    def __init__(
        self,
        base_seed: int,
        stream_tag: int | None = None,
        *,
        own: Any = None,
        process_wide: bool = True,
    ) -> None:
        self.base_seed = base_seed
        self.epoch = 0
        self._tag = stream_tag  # the worker id, for IterableDataset items
        self._own = own  # the worker's WorkerInfo (engine/worker_info.py), or None
        self._process_wide = process_wide

    def __call__(self, index: Any) -> None:
        """Seed the RNGs for sample ``index`` of the current epoch."""
        if isinstance(index, StreamItem):
            index = ("stream", self._tag, index.number)
        seed = sample_seed(self.base_seed, self.epoch, index)
        # A worker's own generators; in the training process (num_workers=0, a replay), the
        # ones `sample_rng` gives there.
        own = getattr(self._own, "rng", None) if self._own is not None else None
        if own is None and self._own is None and self._process_wide:
            own = _in_process_rng()
        if own is not None:
            own.torch_generator.manual_seed(seed)
            own.random_generator.seed(seed)
            if own.numpy_generator is not None:
                bits = own.numpy_generator.bit_generator
                bits.state = type(bits)(seed).state
        if not self._process_wide:
            return
        torch.random.default_generator.manual_seed(seed)
        random.seed(seed)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(seed & 0xFFFFFFFF)


class StreamItem:
    """The n-th item of an IterableDataset replica's stream, as a seeding key."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number


class KeepCallerRngs:
    """Saves the caller's RNG states and puts them back (in-process loading seeds them)."""

    def __enter__(self) -> None:
        self._torch = torch.get_rng_state()
        self._random = random.getstate()
        np = sys.modules.get("numpy")
        self._np = (np, np.random.get_state()) if np is not None else None

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self._torch)
        random.setstate(self._random)
        if self._np is not None:
            np, state = self._np
            np.random.set_state(state)


sample_rng.__module__ = "steadyload"  # the public name (steadyload/__init__.py)
