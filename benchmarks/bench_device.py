"""Is the copy to the device hidden? steadyload's device stage against torch's DataLoader.

Usage: python3 benchmarks/bench_device.py [--reps N] [--quick] [--json out.json]

A synthetic training step (matmuls sized to take STEP_MS on the device) fed by batches of
MB_PER_BATCH MB (float32 images), 2 workers, each run a fresh process, repetitions
interleaved (rep 1 of every loader, then rep 2, ...), medians shown. Loaders:
  torch-pin    torch's DataLoader(pin_memory=True), ``.to(device, non_blocking=True)`` in
               the loop (what torch's docs recommend)
  sl-device    steadyload's DataLoader(device="cuda"): pinned pool, copies on a side
               stream ``device_prefetch`` batches ahead
  tnt-prefetch torch's loader under torchtnt's CudaDataPrefetcher (when torchtnt imports)
Per loader: the step time over the steady batches (the second half), against
max(compute, copy) measured in the same run (the step's matmuls alone; one pinned batch's
copy alone: the pinned-copy peak); the host-to-device rate its copies reached (sl-device:
from its report; torch-pin: timed with events around the copy in the loop); and the CPU
time per batch of the training thread and of the loader's helper thread (torch's pin
thread, steadyload's stage thread), from /proc.

Without a GPU it runs the CPU shape (``device="cpu"``, the same stage with nothing to copy,
and a CPU step) and says that GPU figures need a GPU: it never estimates one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOADERS = ["torch-pin", "sl-device", "tnt-prefetch"]
STEP_MS = 40.0
MB_PER_BATCH = (4, 20)  # the two batch sizes measured


class Images(Dataset[torch.Tensor]):
    """Float32 3x224x224 images (0.6 MB each); sample i is full of i % 251."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), float(i % 251))


def _cpu_s(native_id: int | None) -> float:
    """A thread's CPU time so far (utime + stime, /proc). [Unit: second]"""
    if native_id is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _helper_thread() -> int | None:
    for t in threading.enumerate():
        if "pin_memory" in t.name or t.name == "steadyload-feed":
            return t.native_id
    return None


def _step_fn(device: torch.device) -> Any:
    """A training step of about STEP_MS on ``device``: n chained matmuls, n calibrated."""
    a = torch.randn(1024, 1024, device=device)

    def run(n: int) -> torch.Tensor:
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)
        return x

    def timed(n: int) -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        run(n)
        sync()
        began = time.perf_counter()
        for _ in range(3):
            run(n)
        sync()
        return (time.perf_counter() - began) / 3

    n = 1
    while timed(n) < STEP_MS / 1e3 and n < 4096:
        n *= 2
    n = max(1, round(n * STEP_MS / 1e3 / timed(n)))
    return lambda batch: run(n).sum() + batch.float().mean(), timed(n)


def child(kind: str, batch_mb: int, batches: int) -> dict[str, Any]:
    """One run: ``batches`` steps fed by ``kind``; its figures as JSON."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    size = max(1, round(batch_mb * 1e6 / (3 * 224 * 224 * 4)))
    ds = Images()
    step, compute_s = _step_fn(device)
    sample = torch.stack([ds[i] for i in range(size)])
    peak_bps = None
    if gpu:  # one pinned batch's copy alone: the pinned-copy peak
        pinned = sample.pin_memory()
        pinned.to(device, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            pinned.to(device, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        peak_bps = 5 * pinned.nbytes / (start.elapsed_time(end) / 1e3)
    sampler = list(range(size * batches))
    copy_events: list[tuple[Any, Any]] = []
    if kind == "sl-device":
        import steadyload as sl

        loader = sl.DataLoader(ds, batch_size=size, sampler=sampler, num_workers=2, device=device)
        source: Any = iter(loader)
    else:
        loader = torch.utils.data.DataLoader(
            ds, batch_size=size, sampler=sampler, num_workers=2, pin_memory=gpu
        )
        source = iter(loader)
        if kind == "tnt-prefetch":
            from torchtnt.utils.data import CudaDataPrefetcher

            source = iter(CudaDataPrefetcher(loader, device, num_prefetch_batches=2))
    stamps, loop_cpu = [], []
    helper_cpu: list[float] = []
    for batch in source:
        if kind == "torch-pin" and gpu:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            batch = batch.to(device, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            copy_events.append((start, end))
        step(batch).item()  # the loss, read back as a training loop logs it
        stamps.append(time.perf_counter())
        loop_cpu.append(time.thread_time())
        helper_cpu.append(_cpu_s(_helper_thread()))
    half = len(stamps) // 2
    steady = [b - a for a, b in zip(stamps[half:], stamps[half + 1 :], strict=False)]
    out: dict[str, Any] = {
        "step_s": statistics.median(steady),
        "compute_s": compute_s,
        "batch_bytes": sample.nbytes,
        "loop_cpu_s": (loop_cpu[-1] - loop_cpu[half]) / (len(loop_cpu) - 1 - half),
        "helper_cpu_s": (helper_cpu[-1] - helper_cpu[half]) / (len(helper_cpu) - 1 - half),
        "gpu": torch.cuda.get_device_name(0) if gpu else None,
    }
    if peak_bps:
        out["peak_bps"] = peak_bps
        out["copy_alone_s"] = sample.nbytes / peak_bps
    if kind == "sl-device":
        stage = loader.report().device
        if stage is not None and stage.copy_s > 0:
            out["h2d_bps"] = stage.copied_bytes / stage.copy_s
    elif copy_events:
        torch.cuda.synchronize()
        took = sum(s.elapsed_time(e) for s, e in copy_events[half:]) / 1e3
        out["h2d_bps"] = sample.nbytes * len(copy_events[half:]) / took
    return out


def _run(kind: str, batch_mb: int, batches: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(batch_mb), str(batches)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1][:160]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer batches (a smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, batch_mb, batches = args.child
        print(json.dumps(child(kind, int(batch_mb), int(batches))))
        return
    gpu = torch.cuda.is_available()
    loaders = LOADERS if gpu else ["torch-pin", "sl-device"]
    if not gpu:
        print(
            "No GPU here (torch.cuda.is_available() is False): the CPU shape runs, "
            "device='cpu' against torch's loader with a CPU step. GPU figures need a GPU "
            "(benchmarks/gpu_check.sh runs this there); none is estimated."
        )
    batches = 16 if args.quick else 120
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for mb in MB_PER_BATCH:
            for kind in loaders:
                r = _run(kind, mb, batches)
                runs.setdefault(f"{mb}MB/{kind}", []).append(r)
                print(f"  rep {rep + 1} {mb:2d} MB {kind:13s} " + _line(r), flush=True)
    summary = {key: _summary(rs) for key, rs in runs.items()}
    print("\nmedians (step time vs max(compute, copy); H2D vs the pinned-copy peak; CPU/batch)")
    for key, s in summary.items():
        print(f"  {key:20s} {s.get('text', s.get('error', ''))}")
    if args.json:
        sys.path.insert(0, str(HERE))
        from bench_json import write_json

        write_json(args.json, {"reps": args.reps, "gpu": gpu, "runs": runs, "summary": summary})


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return r["error"]
    bound = max(r["compute_s"], r.get("copy_alone_s", 0.0))
    h2d = f" H2D {r['h2d_bps'] / 1e9:5.1f} GB/s" if "h2d_bps" in r else ""
    return (
        f"step {r['step_s'] * 1e3:6.1f} ms ({r['step_s'] / bound:4.2f}x bound){h2d} "
        f"loop CPU {r['loop_cpu_s'] * 1e3:5.2f} ms helper {r['helper_cpu_s'] * 1e3:5.2f} ms"
    )


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0].get("error", "no run")}
    med = {k: statistics.median(r[k] for r in ok) for k in ok[0] if isinstance(ok[0][k], float)}
    bound = max(med["compute_s"], med.get("copy_alone_s", 0.0))
    out = {**med, "step_over_bound": med["step_s"] / bound}
    if "h2d_bps" in med and "peak_bps" in med:
        out["h2d_of_peak"] = med["h2d_bps"] / med["peak_bps"]
    out["text"] = (
        f"step {med['step_s'] * 1e3:.1f} ms = {out['step_over_bound']:.2f}x max(compute, copy)"
        + (f"; H2D {out['h2d_of_peak']:.0%} of peak" if "h2d_of_peak" in out else "")
        + f"; loop CPU {med['loop_cpu_s'] * 1e3:.2f} ms/batch, helper "
        f"{med['helper_cpu_s'] * 1e3:.2f} ms/batch"
    )
    return out


if __name__ == "__main__":
    main()
