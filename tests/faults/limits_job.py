"""Run out of descriptors or mappings on purpose, in a process of its own; print the outcome.

``python limits_job.py MODE`` with MODE one of:
- ``torch-test``: PyTorch's test_fd_limit_exceeded body (200 small tensors kept, 100 fds);
- ``parent-fds``: big batches kept while the main process has a few descriptors left;
- ``parent-maps``: big batches kept while the main process has little address space left.
Prints one JSON line: {"outcome": "completed" | "raised", "type", "message", "batches"}.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
from torch.utils.data import Dataset, IterableDataset

import steadyload as sl


class RandomDataset(IterableDataset):  # type: ignore[type-arg]  # as in PyTorch's test
    def __init__(self, length: int, size: tuple[int, ...]) -> None:
        super().__init__()
        self.len, self.size = length, size

    def __iter__(self) -> RandomDataset:
        return self

    def __next__(self) -> torch.Tensor:
        if self.len <= 0:
            raise StopIteration
        self.len -= 1
        return torch.randn(self.size)


class Big(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256, 1024), float(i))  # 1 MiB per sample


def main(mode: str) -> dict[str, object]:
    kept: list[torch.Tensor] = []
    try:
        if mode == "torch-test":
            resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
            loader = sl.DataLoader(RandomDataset(200, (2, 2)), multiprocessing_context="fork",
                                   num_workers=1)
            for t in loader:
                t.max(dim=0)
                kept.append(t)
        else:
            loader = sl.DataLoader(Big(), batch_size=4, num_workers=1)
            it = iter(loader)
            kept.append(next(it))
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if mode == "parent-fds":
                open_now = len(os.listdir("/proc/self/fd"))
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 12, hard))
            else:
                with open("/proc/self/status") as f:
                    vm = next(int(x.split()[1]) for x in f if x.startswith("VmSize:"))
                resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (64 << 20), resource.RLIM_INFINITY))
            for batch in it:
                kept.append(batch)
    except RuntimeError as exc:
        return {"outcome": "raised", "type": type(exc).__name__, "message": str(exc),
                "batches": len(kept)}
    return {"outcome": "completed", "type": None, "message": "", "batches": len(kept)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
    os._exit(0)  # the limits stay low: skip interpreter teardown work that needs descriptors
