"""One short first epoch of GIL-bound work in a fresh process: auto against its fixed choices.

Usage: python3 benchmarks/bench_short_epoch.py [--reps N] [--samples N] [--json out.json]

The workload of issue #21 item 14: 2,000 samples of about 2 ms of pure-Python work each
(returned as a 4-element int64 tensor), batch 32, 2 workers. Each run is a fresh Python
process (imports done before the clock): the clock starts before the `DataLoader` is built
and stops at the end of the first epoch, so a fork server's start, auto's measurement and
its hand-over all count, as they do for a user's first epoch. Loaders: torch's DataLoader
with fork workers, steadyload with process, thread and auto workers. Runs are interleaved
(rep 1 of every loader, then rep 2, ...); medians are printed with auto's ratio to the
better of steadyload's two fixed choices (the goal: at least 0.9x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOADERS = ["torch-fork", "sl-process", "sl-thread", "sl-auto"]


def _spin(iterations: int, seed: int) -> int:
    acc = seed
    for k in range(iterations):
        acc = (acc * 31 + k) % 1_000_003
    return acc


class TwoMs:
    """About 2 ms of pure Python per sample (holds the GIL); a 4-element int64 tensor."""

    def __init__(self, n: int, iterations: int) -> None:
        self.n, self.iterations = n, iterations

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        acc = _spin(self.iterations, i)
        return torch.tensor([i, acc, acc % 7, 1], dtype=torch.int64)


def _calibrate() -> int:
    """Iterations of `_spin` that take about 2 ms here."""
    began = time.perf_counter()
    _spin(100_000, 0)
    per = (time.perf_counter() - began) / 100_000
    return max(1000, int(0.002 / per))


def _child(loader_name: str, samples: int, iterations: int) -> dict[str, Any]:
    import torch

    import steadyload as sl

    dataset = TwoMs(samples, iterations)
    began = time.perf_counter()
    if loader_name == "torch-fork":
        loader: Any = torch.utils.data.DataLoader(dataset, batch_size=32, num_workers=2,
                                                  multiprocessing_context="fork")
    else:
        loader = sl.DataLoader(dataset, batch_size=32, num_workers=2,
                               worker_type=loader_name.removeprefix("sl-"))
    first = None
    count = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - began
        count += len(batch)
    wall = time.perf_counter() - began
    out = {"samples_per_s": count / wall, "first_batch_s": first, "wall_s": wall}
    if loader_name != "torch-fork":
        report = loader.report()
        out["kind"] = report.worker_kind
        out["choice"] = report.worker_type_choice
    return out


def main() -> None:
    """Run the interleaved repetitions and print the table (and the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, metavar=("LOADER", "SAMPLES", "ITERATIONS"))
    args = parser.parse_args()
    if args.child:
        name, samples, iterations = args.child
        print(json.dumps(_child(name, int(samples), int(iterations))))
        return
    iterations = _calibrate()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LOADERS}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"}
    for rep in range(args.reps):
        for name in LOADERS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, str(args.samples), str(iterations)],
                capture_output=True, text=True, timeout=600, env=env, cwd=HERE,
            )  # fmt: skip
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(result)
            print(f"rep {rep + 1} {name:11s} {result['samples_per_s']:8.0f} samples/s "
                  f"(first batch {result['first_batch_s']:.2f} s) {result.get('kind', '')}",
                  flush=True)  # fmt: skip
    medians = {name: statistics.median(r["samples_per_s"] for r in rs) for name, rs in runs.items()}
    best_fixed = max(medians["sl-process"], medians["sl-thread"])
    print(f"\n{args.samples} samples of ~2 ms pure Python, batch 32, 2 workers, first epoch "
          f"in a fresh process; medians of {args.reps}:")
    for name in LOADERS:
        print(f"  {name:11s} {medians[name]:8.0f} samples/s")
    ratio = medians["sl-auto"] / best_fixed
    print(f"  auto / the better fixed choice: {ratio:.2f}x (goal: at least 0.90x)")
    if args.json:
        sys.path.insert(0, str(HERE))
        from bench_json import write_json

        write_json(args.json, {"samples": args.samples, "iterations": iterations,
                               "runs": runs, "medians": medians, "auto_ratio": ratio})


if __name__ == "__main__":
    main()
