"""steadyload next to torch's DataLoader: same batches, throughput, and what a dead worker says.

Run: python3 dev.py demo   (or: python examples/demo_throughput.py [--samples N])

1. Loads a synthetic image dataset (uint8 images decoded to normalised float tensors, about
   a millisecond of work each, batches of 32 x 3 x 224 x 224 float32 = 19 MB) with both
   loaders, 2 workers each, checks that the batches are identical, and prints time to
   the first batch and samples/s.
2. Kills one worker of each loader with SIGKILL in mid-epoch and prints what each says.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import steadyload as sl


class SyntheticImages(Dataset[Any]):
    """Images made from the index: "decode" (uint8 HWC -> float CHW), normalise, flip."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        raw = torch.randint(0, 256, (224, 224, 3), dtype=torch.uint8, generator=g)
        image = (raw.permute(2, 0, 1).float() / 255 - self.mean) / self.std
        if torch.rand(()) < 0.5:  # a random augmentation, drawn from the worker's seed
            image = image.flip(-1)
        return image, i % 10


class Pids(Dataset[Any]):
    """Slow samples that carry the worker's pid, to have something to kill."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.02)
        return torch.tensor(os.getpid())


def run(loader: Any) -> tuple[float, float, list[Any]]:
    """(seconds to the first batch, samples/s after it, a checksum per batch)."""
    t0 = time.perf_counter()
    it = iter(loader)
    images, labels = next(it)
    first = time.perf_counter() - t0
    sums = [(images.sum().item(), labels.tolist())]
    t1, n = time.perf_counter(), 0
    for images, labels in it:
        sums.append((images.sum().item(), labels.tolist()))
        n += len(labels)
    return first, n / (time.perf_counter() - t1), sums


def death_message(cls: Any) -> str:
    it = iter(cls(Pids(), batch_size=4, num_workers=2))
    os.kill(int(next(it)[0]), signal.SIGKILL)
    try:
        for _ in it:
            pass
    except RuntimeError as exc:
        return str(exc)
    return "(no error: the loader went on)"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=1024)
    args = ap.parse_args()
    ds = SyntheticImages(args.samples)
    print(f"steadyload {sl.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"{args.samples} samples, batch 32 x 3 x 224 x 224 float32 (19 MB), 2 workers\n")
    rows = {}
    for name, cls, extra in (
        ("torch DataLoader (fork)", torch.utils.data.DataLoader,
         {"multiprocessing_context": "fork"}),
        ("steadyload (forkserver)", sl.DataLoader, {}),
        ("steadyload, 2nd loader", sl.DataLoader, {}),
    ):
        loader = cls(ds, batch_size=32, shuffle=True, num_workers=2,
                     generator=torch.Generator().manual_seed(0), **extra)
        rows[name] = run(loader)
    (t_first, t_rate, t_sums), (s_first, s_rate, s_sums), (w_first, w_rate, w_sums) = rows.values()
    print(f"{'loader':26s} {'first batch':>12s} {'samples/s':>10s}")
    for name, (first, rate, _) in rows.items():
        print(f"{name:26s} {first:10.3f} s {rate:10.0f}")
    print(f"{'steadyload 2nd / torch':26s} {w_first / t_first:10.2f} x {w_rate / t_rate:9.2f} x")
    print("(the first steadyload loader starts the fork server, which imports torch once;\n"
          " later loaders fork their workers from it in milliseconds, and a fork server\n"
          " never inherits a GPU context, so it cannot deadlock the way fork can)")
    same = t_sums == s_sums == w_sums
    print(f"\nidentical batches (values, labels and random flips): {same}\n")
    print("A worker killed with SIGKILL in mid-epoch. torch says:\n")
    print("  " + death_message(torch.utils.data.DataLoader).replace("\n", "\n  "))
    print("\nsteadyload says:\n")
    print("  " + death_message(sl.DataLoader).replace("\n", "\n  "))


if __name__ == "__main__":
    main()
