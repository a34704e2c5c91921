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

import torch

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
        self, base_seed: int, stream_tag: int | None = None, *, own: Any = None,
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
        own = getattr(self._own, "rng", None)
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
