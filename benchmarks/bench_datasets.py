"""Datasets for the benchmarks, importable by worker processes."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class Trivial(Dataset[Any]):
    """Almost no work: measures start-up and per-batch overhead."""

    def __init__(self, n: int, dim: int = 16) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((self.dim,), float(i)), i


class StatefulStream(IterableDataset[Any]):
    """`Trivial`'s samples as a stream, sharded over the workers (worker w takes samples w,
    w + W, ...), with torchdata's Stateful protocol: ``state_dict()`` is how many samples
    this replica has yielded, ``load_state_dict`` goes on from there."""

    def __init__(self, n: int, dim: int = 16) -> None:
        self.n, self.dim, self.i = n, dim, 0

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while (k := worker + self.i * workers) < self.n:
            self.i += 1
            yield torch.full((self.dim,), float(k)), k

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


def _spin(iterations: int) -> int:
    acc = 0
    for k in range(iterations):
        acc += k * k
    return acc


class CpuBound(Dataset[Any]):
    """About ``work_ms`` of pure-Python work per sample (calibrated once)."""

    def __init__(self, n: int, iterations: int) -> None:
        self.n, self.iterations = n, iterations

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([_spin(self.iterations) % 7, i], dtype=torch.float32)


class Images(Dataset[Any]):
    """3x224x224 float32 images with no compute: collate makes 19 MB batches of 32."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.image = torch.rand(3, 224, 224)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.image


def calibrate(work_ms: float) -> int:
    """Iterations of `_spin` that take about ``work_ms`` here."""
    import time

    n = 10_000
    while True:
        t0 = time.perf_counter()
        _spin(n)
        dt = time.perf_counter() - t0
        if dt > 0.02:
            return max(1, int(n * work_ms / 1000 / dt))
        n *= 2
