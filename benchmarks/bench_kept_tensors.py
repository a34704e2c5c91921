"""What kept tensors cost, and the transport figures that must not regress: steadyload vs torch.

Usage: python benchmarks/bench_kept_tensors.py [--reps N] [--batches N] [--quick]
                                                [--steadyload PATH] [--json out.json]

(1) memory held after keeping only the labels of ``--batches`` (300) batches of 32
    3x224x224 float32 images (19 MB) + int labels, 2 workers, each loader in a fresh
    process: shared memory still allocated to the segments/shm files the main process has
    open, its RssAnon growth, and its extra descriptors, after the epoch (workers gone).
(2) batches/s for 19 MB batches (bench_foundation.py's (d)).
(3) samples/s for tiny samples, 16 floats + an int, batch 64 (bench_foundation.py's (c)).
(4) samples/s for many small tensors: 32 tensors of 8 floats per sample, batch 32.
(2)-(4) run in this process, interleaved torch (fork), steadyload, torch, ..., timed from
the first batch to the last (worker start-up excluded); medians with min-max.
``--steadyload PATH`` imports steadyload from another checkout (a before/after comparison).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _setup_path(steadyload_root: str | None) -> None:
    sys.path[:0] = [str(HERE), steadyload_root or str(HERE.parent)]


if __name__ == "__main__" and "--steadyload" in sys.argv:  # before anything imports it
    _ROOT = sys.argv[sys.argv.index("--steadyload") + 1]
    _setup_path(_ROOT)
    # The fork server finds steadyload through its working directory first: leave the
    # checkout, and tell children where the other one is.
    os.chdir(HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])
else:
    _setup_path(None)

import torch  # noqa: E402
from bench_datasets import Trivial  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402


class LabelledImages(Dataset[Any]):
    """(3x224x224 float32 image, int label): a batch of 32 is 19 MB of images."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.image = torch.rand(3, 224, 224)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.image, i


class ManySmall(Dataset[Any]):
    """A dict of 32 tensors of 8 floats: a batch of 32 is 32 tensors of 1 KiB."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {f"f{k}": torch.full((8,), float(i)) for k in range(32)}


def _held_shared() -> int:
    """Bytes allocated to the shared-memory files this process has open (memfd, /dev/shm)."""
    seen, total = set(), 0
    for name in os.listdir("/proc/self/fd"):
        path = f"/proc/self/fd/{name}"
        try:
            link = os.readlink(path)
            if not link.startswith(("/memfd:", "/dev/shm/")):
                continue
            st = os.stat(path)
        except OSError:
            continue
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _make(kind: str, ds: Dataset[Any], batch_size: int) -> Any:
    if kind == "torch":
        return torch.utils.data.DataLoader(
            ds, batch_size=batch_size, num_workers=2, multiprocessing_context="fork"
        )
    import steadyload as sl

    return sl.DataLoader(ds, batch_size=batch_size, num_workers=2)


def memory_child(kind: str, batches: int) -> dict[str, float]:
    """Keep the labels of ``batches`` image batches; what the main process holds after."""
    dataset = LabelledImages(32 * batches)
    warm = iter(_make(kind, dataset, 32))
    next(warm)  # workers started once: the dataset's image now lives in shared memory
    del warm
    loader = _make(kind, dataset, 32)
    gc.collect()
    time.sleep(0.5)
    shm0, anon0, fds0 = _held_shared(), _status("RssAnon"), len(os.listdir("/proc/self/fd"))
    labels = []
    t0 = time.perf_counter()
    for images, y in loader:
        images.sum()
        labels.append(y)
    elapsed = time.perf_counter() - t0
    del images, y
    gc.collect()
    time.sleep(0.5)  # torch's workers and pin threads wind down
    return {
        "shared_mib": (_held_shared() - shm0) / 2**20,
        "anon_mib": (_status("RssAnon") - anon0) / 2**20,
        "fds": len(os.listdir("/proc/self/fd")) - fds0,
        "batches_per_s": batches / elapsed,
        "labels_ok": float(torch.equal(torch.cat(labels), torch.arange(32 * batches))),
    }


def throughput(make: Any) -> tuple[float, float]:
    """(samples/s, batches/s) from the first batch to the end of one epoch."""
    it = iter(make())
    first = next(it)
    del first
    t0 = time.perf_counter()
    samples = batches = 0
    for batch in it:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch["f0"]
        samples += int(x.shape[0])
        batches += 1
    dt = time.perf_counter() - t0
    del it
    return samples / dt, batches / dt


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, default=300, help="(1): image batches kept")
    ap.add_argument("--quick", action="store_true", help="fewer samples in (2)-(4)")
    ap.add_argument("--steadyload", help="import steadyload from this checkout")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    ap.add_argument("--skip-memory", action="store_true", help="run (2)-(4) only")
    args = ap.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.batches)), flush=True)
        return

    import steadyload as sl

    print(f"steadyload {sl.__version__} from {Path(sl.__file__).parent}, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs, {args.reps} repetitions", flush=True)
    results: dict[str, dict[str, list[float]]] = {}

    def record(section: str, name: str, value: float) -> None:
        results.setdefault(section, {}).setdefault(name, []).append(value)

    if not args.skip_memory:
        child_args = ["--batches", str(args.batches)]
        if args.steadyload:
            child_args += ["--steadyload", args.steadyload]
        for kind in ("torch", "steadyload"):  # once each: a fresh process, 300 batches
            out = subprocess.run(
                [sys.executable, __file__, "--memory-child", kind, *child_args],
                capture_output=True, text=True, timeout=900,
            )
            if out.returncode:
                raise RuntimeError(f"{kind} memory run failed:\n{out.stderr[-3000:]}")
            for key, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
                record(f"mem_{key}", kind, value)
            print(f"  (1) {kind} done", flush=True)

    scale = 0.25 if args.quick else 1.0
    cases = {
        "images": (lambda: LabelledImages(int(3200 * scale)), 32),
        "tiny": (lambda: Trivial(int(40_000 * scale)), 64),
        "many_small": (lambda: ManySmall(int(8_000 * scale)), 32),
    }
    for rep in range(args.reps):
        for section, (make_ds, batch_size) in cases.items():
            ds = make_ds()
            for kind in ("torch", "steadyload"):
                sps, bps = throughput(lambda kind=kind, ds=ds, b=batch_size: _make(kind, ds, b))
                record(section, kind, bps if section == "images" else sps)
        print(f"  (2-4) repetition {rep + 1} done", flush=True)

    print()
    if not args.skip_memory:
        print(f"(1) labels of {args.batches} batches of 19 MB kept, after the epoch:")
        for kind in ("torch", "steadyload"):
            r = {k[4:]: v[kind][0] for k, v in results.items() if k.startswith("mem_")}
            print(f"  {kind:10s} shared memory held {r['shared_mib']:8.1f} MiB   RssAnon "
                  f"{r['anon_mib']:+7.1f} MiB   fds {int(r['fds']):+5d}   "
                  f"({r['batches_per_s']:.0f} batches/s, labels ok: {bool(r['labels_ok'])})")
    labels = {"images": "(2) 19 MB batches [batches/s]",
              "tiny": "(3) tiny samples, batch 64 [samples/s]",
              "many_small": "(4) 32 small tensors/sample, batch 32 [samples/s]"}
    for section, label in labels.items():
        t, s = results[section]["torch"], results[section]["steadyload"]
        mt, ms = statistics.median(t), statistics.median(s)
        print(f"{label:50s} torch {mt:9.1f} ({min(t):.0f}-{max(t):.0f})   steadyload "
              f"{ms:9.1f} ({min(s):.0f}-{max(s):.0f})   ratio {ms / mt:5.2f}x")
    if args.json:
        from bench_json import write_json

        write_json(args.json, {"batches_kept": args.batches, "results": results})


if __name__ == "__main__":
    main()
