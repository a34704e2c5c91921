"""What the ledger costs: epoch time with and without ``ledger=``, and its bytes per sample.

Usage: python3 benchmarks/bench_ledger.py [--batches N] [--rounds R] [--quick] [--json out.json]

The peers benchmark's tiny-batch workload (16 floats and an int per sample, batch 64: the
per-batch overhead is all there is), one epoch per run, steadyload with 2 process workers
and in-process (``num_workers=0``), each without and with a ledger, interleaved (the order
alternating each round). Printed: the median epoch time of each, the ledger's overhead as a
share of it, and the ledger's size on disk per sample and per step. The goal (issue #37):
at most 2% of epoch time, a few bytes per sample.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from bench_datasets import Trivial  # noqa: E402
from bench_json import write_json  # noqa: E402

import steadyload as sl  # noqa: E402

BATCH = 64


def epoch(workers: int, ledger: str | None, batches: int) -> float:
    """Seconds from ``iter()`` to the end of one epoch (workers started in it)."""
    loader = sl.DataLoader(
        Trivial(BATCH * batches), batch_size=BATCH, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(0), ledger=ledger,
    )  # fmt: skip
    start = time.perf_counter()
    n = sum(1 for _ in loader)
    elapsed = time.perf_counter() - start
    assert n == batches
    del loader
    gc.collect()
    return elapsed


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="200 batches, 2 rounds")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    batches, rounds = (200, 2) if args.quick else (args.batches, args.rounds)
    scratch = Path(tempfile.mkdtemp(prefix="steadyload-ledger-bench-"))
    results: dict[str, Any] = {}
    try:
        for workers in (2, 0):
            name = f"{workers} workers" if workers else "in-process"
            times: dict[str, list[float]] = {"off": [], "on": []}
            size = 0
            epoch(workers, None, min(batches, 50))  # warm: imports, the fork server
            for r in range(rounds):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for mode in order:
                    folder = scratch / f"w{workers}-r{r}"
                    times[mode].append(
                        epoch(workers, str(folder) if mode == "on" else None, batches)
                    )
                    if mode == "on":
                        size = folder_bytes(folder)
                        shutil.rmtree(folder)
                print(
                    f"  {name:10s} round {r + 1}: without {times['off'][-1]:.3f} s, "
                    f"with ledger {times['on'][-1]:.3f} s",
                    flush=True,
                )
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            samples = BATCH * batches
            results[name] = {
                "epoch_s_without": off,
                "epoch_s_with": on,
                "overhead": on / off - 1,
                "bytes_per_sample": size / samples,
                "bytes_per_step": size / batches,
                "rounds_without": times["off"],
                "rounds_with": times["on"],
            }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"\nledger cost, tiny batches ({BATCH} samples of 16 floats + an int), "
        f"{batches} batches an epoch, median of {rounds} interleaved rounds"
    )
    print(
        f"  {'loader':12s} {'without s':>10s} {'with s':>10s} {'overhead':>9s} "
        f"{'B/sample':>9s} {'B/step':>8s}"
    )
    for name, r in results.items():
        print(
            f"  {name:12s} {r['epoch_s_without']:10.3f} {r['epoch_s_with']:10.3f} "
            f"{r['overhead']:+8.1%} {r['bytes_per_sample']:9.2f} {r['bytes_per_step']:8.1f}"
        )
    if args.json:
        write_json(
            args.json,
            {"batch_size": BATCH, "batches": batches, "rounds": rounds, "results": results},
        )


if __name__ == "__main__":
    main()
