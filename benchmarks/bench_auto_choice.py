"""What ``worker_type="auto"`` chooses, run after run, and whether it is the faster kind.

Usage: python3 benchmarks/bench_auto_choice.py [--reps N] [--hog] [--workloads a,b] [--json out]

For each workload, ``--reps`` fresh processes run auto and record its choice and the GIL
probe's figures; in the same interleaved rounds, fixed thread and process workers are
timed (2 workers, batch 16, persistent workers: the first epoch warms up and lets auto
decide, the second is timed). A choice is right when it is the kind that loaded faster,
or when the two are within 10% of each other (then either is fine). ``--hog`` runs a
CPU-bound process beside every run, as a busy machine would.

Workloads: GIL-free (JPEG decode, 19 MB batches), pure Python that hands the GIL over at
a torch call after each sample's Python (0.2, 0.45 and 1 ms: issue #21 item 7, where the
choice used to flip), and pure Python of 2 ms.
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
WORKLOADS = ["jpeg", "big", "py-op-0.2", "py-op-0.45", "py-op-1", "python-2"]
KINDS = ["auto", "thread", "process"]
BATCH, BATCHES = 16, 64
CLOSE = 1.1  # within 10%: either kind is right


def _spin(iterations: int, seed: int) -> int:
    total = 0
    for k in range(iterations):
        total += k * seed
    return total


class PythonThenOp:
    """``ms`` of pure Python per sample, then a torch op (which lets go of the GIL)."""

    def __init__(self, n: int, iterations: int, op: bool) -> None:
        self.n, self.iterations, self.op = n, iterations, op

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        total = _spin(self.iterations, i)
        if self.op:
            return (torch.ones(32, 32) @ torch.ones(32, 32))[0, :4] + i
        return torch.tensor([i, total % 7, 1, 0], dtype=torch.int64)


def _iterations_per_ms() -> float:
    began = time.perf_counter()
    _spin(200_000, 3)
    return 200_000 / ((time.perf_counter() - began) * 1e3)


def _dataset(workload: str, per_ms: float) -> Any:
    n = BATCH * BATCHES
    if workload in ("jpeg", "big"):
        import bench_peers

        if workload == "big":
            return bench_peers.Big(n)
        folder = bench_peers.OUT / "peers-jpegs"
        bench_peers.make_jpegs(folder)
        return bench_peers.Jpegs(str(folder), n)
    ms = float(workload.rsplit("-", 1)[1])
    return PythonThenOp(n, int(ms * per_ms), op=workload.startswith("py-op"))


def _child(workload: str, kind: str, per_ms: float) -> dict[str, Any]:
    import steadyload as sl

    loader = sl.DataLoader(_dataset(workload, per_ms), batch_size=BATCH, num_workers=2,
                           worker_type=kind, persistent_workers=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while True:  # warm-up: auto decides, and its processes (if chosen) start meanwhile
        for _ in loader:
            pass
        report = loader.report()
        chosen = "process" if "chose process" in (report.worker_type_choice or "") else "thread"
        if kind != "auto" or report.worker_kind == chosen or time.monotonic() > deadline:
            break
    began = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    out: dict[str, Any] = {"samples_per_s": count / (time.perf_counter() - began)}
    report = loader.report()
    out["kind"] = report.worker_kind
    out["choice"] = report.worker_type_choice
    del loader
    return out


def main() -> None:
    """Run the interleaved rounds and print, per workload, auto's choices against the rates."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hog", action="store_true")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "KIND", "PER_MS"))
    args = parser.parse_args()
    if args.child:
        workload, kind, per_ms = args.child
        print(json.dumps(_child(workload, kind, float(per_ms))))
        return
    workloads = args.workloads.split(",")
    per_ms = _iterations_per_ms()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"}
    hog = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {k: [] for k in KINDS} for w in workloads}
    try:
        for rep in range(args.reps):
            for workload in workloads:
                for kind in KINDS:
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", workload, kind, str(per_ms)],
                        capture_output=True, text=True, timeout=600, env=env, cwd=HERE,
                    )  # fmt: skip
                    if out.returncode != 0:
                        raise SystemExit(f"{workload} {kind} failed:\n{out.stderr[-3000:]}")
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    runs[workload][kind].append(result)
                    print(f"rep {rep + 1} {workload:11s} {kind:7s} "
                          f"{result['samples_per_s']:8.0f} samples/s -> {result['kind']}",
                          flush=True)  # fmt: skip
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    summary = _summary(runs)
    print(f"\n2 workers, batch {BATCH}, {BATCHES} batches an epoch, second epoch timed"
          f"{', a CPU-bound process beside' if args.hog else ''}:")
    print(f"  {'workload':11s} {'threads/s':>10s} {'processes/s':>12s} {'faster':>8s}  "
          "auto chose (threads/processes), right")
    for w, s in summary.items():
        print(f"  {w:11s} {s['thread']:10.0f} {s['process']:12.0f} {s['faster']:>8s}  "
              f"{s['chose_thread']}/{s['chose_process']}, {s['right']} of {s['runs']}")
    if args.json:
        from bench_json import write_json

        write_json(args.json, {"hog": args.hog, "batch": BATCH, "batches": BATCHES,
                               "runs": runs, "summary": summary})


def _summary(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for workload, by_kind in runs.items():
        rate = {k: statistics.median(r["samples_per_s"] for r in by_kind[k])
                for k in ("thread", "process")}  # fmt: skip
        ratio = max(rate.values()) / min(rate.values())
        faster = "either" if ratio < CLOSE else max(rate, key=lambda k: rate[k])
        chosen = [r["kind"] for r in by_kind["auto"]]
        right = sum(1 for c in chosen if faster in ("either", c))
        out[workload] = {**rate, "faster": faster, "chose_thread": chosen.count("thread"),
                         "chose_process": chosen.count("process"), "right": right,
                         "runs": len(chosen)}
    return out


if __name__ == "__main__":
    main()
