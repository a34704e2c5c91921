"""What a worker death costs: steadyload recovers; torch's DataLoader loses the epoch.

Usage: python benchmarks/bench_recovery.py [--reps N] [--json out.json]

An epoch of 400 samples (about 2 ms of work each, batch 4, 2 workers) runs without a fault
and with worker 0 SIGKILLed from outside after the 10th batch, interleaved. Printed:
the time from the kill to the next batch the loop receives, the time from the kill until
every batch the dead worker held has been delivered again (respawn + re-run), the extra
epoch time, and what torch's DataLoader does with the same kill.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
import steadyload as sl  # noqa: E402


class Work(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
        return torch.tensor([i, os.getpid()])


def epoch(make: Any, kill_after: int | None) -> dict[str, float]:
    """Run one epoch; optionally kill the worker that made batch ``kill_after``."""
    t0 = time.perf_counter()
    it = iter(make())
    out: dict[str, float] = {}
    killed_at = None
    pending: set[int] = set()
    n = 0
    for batch in it:
        n += 1
        if killed_at is not None:
            if "next_s" not in out:
                out["next_s"] = time.perf_counter() - killed_at
            pending -= {int(p) for p in batch[:, 0]}
            if not pending and "recovered_s" not in out:
                out["recovered_s"] = time.perf_counter() - killed_at
        if kill_after is not None and n == kill_after:
            victim = int(batch[0, 1])
            # The prefetch window (2 workers x prefetch 2 x batch 4): the dead worker held
            # half of it; recovery is done when all of it has arrived.
            pending = set(range(n * 4, n * 4 + 16))
            os.kill(victim, signal.SIGKILL)
            killed_at = time.perf_counter()
    out["epoch_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    def make() -> Any:
        return sl.DataLoader(Work(), batch_size=4, num_workers=2)

    clean, faulty = [], []
    for _ in range(args.reps):
        clean.append(epoch(make, None))
        faulty.append(epoch(make, 10))
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(f"steadyload, medians of {args.reps} (2 workers, batch 4, ~2 ms/sample, 400 samples)")
    print(f"  epoch without a fault:              {med(clean, 'epoch_s'):.3f} s")
    print(f"  epoch with worker 0 SIGKILLed:      {med(faulty, 'epoch_s'):.3f} s "
          f"(+{med(faulty, 'epoch_s') - med(clean, 'epoch_s'):.3f} s)")
    print(f"  kill -> next batch in the loop:     {med(faulty, 'next_s') * 1e3:.1f} ms")
    print(f"  kill -> dead worker's batches back: {med(faulty, 'recovered_s') * 1e3:.1f} ms")
    torch_outcome = "the epoch completed (unexpected)"
    try:
        epoch(lambda: torch.utils.data.DataLoader(Work(), batch_size=4, num_workers=2), 10)
        print("torch: the epoch completed (unexpected)")
    except RuntimeError as exc:
        torch_outcome = str(exc).splitlines()[0]
        print(f"torch's DataLoader with the same kill: the epoch is lost: {torch_outcome}")
    if args.json:
        from bench_json import write_json

        write_json(args.json, {
            "reps": args.reps,
            "medians": {"clean_epoch_s": med(clean, "epoch_s"),
                        "faulty_epoch_s": med(faulty, "epoch_s"),
                        "next_s": med(faulty, "next_s"),
                        "recovered_s": med(faulty, "recovered_s")},
            "raw": {"clean": clean, "faulty": faulty},
            "torch_error": torch_outcome,
        })


if __name__ == "__main__":
    main()
