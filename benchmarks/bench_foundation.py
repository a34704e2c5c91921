"""steadyload vs torch's DataLoader, side by side in one run: start-up and throughput.

Usage: python benchmarks/bench_foundation.py [--reps N] [--quick] [--json out.json]

(a) time to the first batch, 2 workers: each loader in a fresh process (includes starting
    the fork server and importing torch there), then a second loader in the same process
    ("warm"). torch runs with fork, spawn, plain forkserver, and forkserver with torch
    preloaded; steadyload with its default (forkserver, torch preloaded).
(b) samples/s, CPU-bound dataset (~5 ms of Python per sample), 2 workers.
(c) samples/s, tiny samples (16 floats + an int), batch_size 64: the per-batch overhead.
(d) batches/s for 19 MB float32 batches (32x3x224x224) from a dataset with no compute,
    with the memcpy bandwidth of the same bytes as the physical limit.
Throughput runs (b)-(d) are interleaved (torch, steadyload, torch, ...) in this process and
timed from the first batch to the last, so worker start-up is excluded. Medians are shown
with the ratio steadyload/torch (>1 is better for rates, <1 for times).
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
sys.path[:0] = [str(HERE), str(HERE.parent)]

FIRST_BATCH_CHILD = r"""
import json, sys, time
sys.path[:0] = {paths!r}
kind = {kind!r}
import multiprocessing as mp
if kind == "torch-forkserver-preload":
    mp.set_forkserver_preload(["torch"])
import torch
import steadyload as sl
from bench_datasets import Trivial

def make():
    ds = Trivial(64)
    if kind == "steadyload":
        return sl.DataLoader(ds, batch_size=8, num_workers=2)
    method = kind.replace("torch-", "").replace("-preload", "")
    return torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2,
                                       multiprocessing_context=method)

if __name__ == "__main__":
    out = []
    for _ in range(2):
        t0 = time.perf_counter()
        it = iter(make())
        next(it)
        out.append(time.perf_counter() - t0)
        del it
    print(json.dumps(out))
"""

FIRST_BATCH_KINDS = [
    "torch-fork", "torch-spawn", "torch-forkserver", "torch-forkserver-preload", "steadyload",
]


def first_batch(kind: str) -> tuple[float, float]:
    """(fresh, warm) seconds to the first batch for one loader kind, in a new process."""
    code = FIRST_BATCH_CHILD.format(paths=[str(HERE), str(HERE.parent)], kind=kind)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    if out.returncode:
        raise RuntimeError(f"{kind} failed:\n{out.stderr}")
    fresh, warm = json.loads(out.stdout.strip().splitlines()[-1])
    return fresh, warm


def throughput(make: Any, samples: int) -> tuple[float, float]:
    """(samples/s, batches/s) from the first batch to the end of one epoch."""
    it = iter(make())
    next(it)
    batches = 1
    t0 = time.perf_counter()
    n = 0
    for batch in it:
        n += _size(batch)
        batches += 1
    dt = time.perf_counter() - t0
    del it
    return n / dt, (batches - 1) / dt


def _size(batch: Any) -> int:
    x = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(x.shape[0])


def memcpy_gbps(nbytes: int, reps: int = 20) -> float:
    """Bandwidth of torch's copy_ for ``nbytes`` (fresh destination reused: warm pages)."""
    import torch

    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer samples, for a smoke run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    from bench_datasets import CpuBound, Images, Trivial, calibrate

    import steadyload as sl

    scale = 0.25 if args.quick else 1.0
    results: dict[str, dict[str, list[float]]] = {}

    def record(section: str, name: str, value: float) -> None:
        results.setdefault(section, {}).setdefault(name, []).append(value)

    print(
        f"steadyload {sl.__version__}, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.reps} repetitions",
        flush=True,
    )

    # (a) first batch, fresh and warm, each in its own process
    for rep in range(args.reps):
        for kind in FIRST_BATCH_KINDS:
            fresh, warm = first_batch(kind)
            record("a_fresh", kind, fresh)
            record("a_warm", kind, warm)
        print(f"  (a) repetition {rep + 1} done", flush=True)

    iterations = calibrate(5.0)
    cpu_n, tiny_n, img_n = int(400 * scale), int(40_000 * scale), int(3200 * scale)
    cases = {
        "b_cpu": (lambda: CpuBound(cpu_n, iterations), dict(batch_size=8)),
        "c_tiny": (lambda: Trivial(tiny_n), dict(batch_size=64)),
        "d_images": (lambda: Images(img_n), dict(batch_size=32)),
    }
    for rep in range(args.reps):
        for section, (make_ds, kwargs) in cases.items():
            ds = make_ds()
            makers = {
                "torch-fork": lambda ds=ds, kw=kwargs: torch.utils.data.DataLoader(
                    ds, num_workers=2, multiprocessing_context="fork", **kw),
                "steadyload": lambda ds=ds, kw=kwargs: sl.DataLoader(ds, num_workers=2, **kw),
            }
            for name, make in makers.items():
                sps, bps = throughput(make, len(ds))
                record(section, name, sps if section != "d_images" else bps)
        print(f"  (b-d) repetition {rep + 1} done", flush=True)
    batch_bytes = 32 * 3 * 224 * 224 * 4
    results["d_memcpy_gbps"] = {"memcpy": [memcpy_gbps(batch_bytes) for _ in range(args.reps)]}

    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in results.items()}
    print()
    print("(a) time to first batch, 2 workers [s]   fresh process          warm (2nd loader)")
    sl_f, sl_w = med["a_fresh"]["steadyload"], med["a_warm"]["steadyload"]
    for kind in FIRST_BATCH_KINDS:
        f, w = med["a_fresh"][kind], med["a_warm"][kind]
        if kind == "steadyload":
            print(f"  {kind:26s} {f:8.3f}                    {w:8.3f}")
        else:
            print(f"  {kind:26s} {f:8.3f}  sl/this {sl_f / f:5.2f}x     "
                  f"{w:8.3f}  sl/this {sl_w / w:5.2f}x")
    labels = {"b_cpu": "(b) CPU-bound ~5 ms/sample [samples/s]",
              "c_tiny": "(c) tiny samples, batch 64 [samples/s]",
              "d_images": "(d) 19 MB batches [batches/s]"}
    for section, label in labels.items():
        t, s = med[section]["torch-fork"], med[section]["steadyload"]
        print(f"{label:44s} torch-fork {t:10.1f}   steadyload {s:10.1f}   "
              f"ratio {s / t:5.2f}x")
    gbps = med["d_memcpy_gbps"]["memcpy"]
    for name in ("torch-fork", "steadyload"):
        rate = med["d_images"][name] * batch_bytes / 1e9
        print(f"    {name:12s} {rate:6.2f} GB/s of batches; "
              f"memcpy of the same bytes: {gbps:6.2f} GB/s")
    if args.json:
        from bench_json import write_json

        write_json(args.json, {"medians": med, "raw": results})


if __name__ == "__main__":
    main()
