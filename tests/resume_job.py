"""A training-shaped run for the resume tests: record batches, save mid-epoch, resume.

Run as ``python -m tests.resume_job OUT --workers N [--save-at EPOCH BATCH] [--resume STATE]``:
it writes the batches it saw (and the loader state, when saving) with torch.save.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

import steadyload

N, BATCH, EPOCHS = 50, 4, 4


class Augmented(Dataset[Any]):
    """A sample is its index plus one random draw from each of torch, random and numpy."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor(
            [float(i), torch.rand(()).item(), random.random(), float(np.random.rand())],
            dtype=torch.float64,
        )


def make_loader(workers: int, persistent: bool = False, in_order: bool = True) -> Any:
    """The loader every run builds: the same arguments apart from ``num_workers``."""
    return steadyload.DataLoader(
        Augmented(), batch_size=BATCH, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(1234), sample_seeds=True,
        persistent_workers=persistent and workers > 0, in_order=in_order,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Iterate EPOCHS epochs (from the saved one when resuming); save batches to OUT."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--save-at", type=int, nargs=2, metavar=("EPOCH", "BATCH"))
    p.add_argument("--resume")
    args = p.parse_args(argv)
    torch.manual_seed(99)  # a different global state in every run must not matter
    loader = make_loader(args.workers, args.persistent)
    first = 0
    if args.resume:
        state = torch.load(args.resume, weights_only=True)
        loader.load_state_dict(state)
        first = state["epoch"] + (1 if state["finished"] else 0)
    seen: list[torch.Tensor] = []
    for epoch in range(first, EPOCHS):
        for k, batch in enumerate(loader):
            seen.append(batch)
            if args.save_at and [epoch, k + 1] == args.save_at:
                torch.save(loader.state_dict(), args.out + ".state")
                torch.save(seen, args.out)
                return
    torch.save(seen, args.out)


if __name__ == "__main__":
    main()
