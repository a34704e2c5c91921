"""steadyload against torch's DataLoader and the peer loaders, four workloads, two shapes.

Usage: python3 benchmarks/bench_peers.py [--shape short|steady|both] [--reps N]
       [--close-reps M] [--quick] [--workloads jpeg,python,tiny,big]
       [--loaders torch-fork,...] [--json out.json]

The peers (torchdata 0.11 nodes, SPDL 0.8, Grain 0.2.18) live in a bench-only virtual
environment, ``.venv-peers`` (created on first use, torch==2.13.0 CPU build pinned), never
in steadyload's dependencies; run with any python3 and the script re-runs itself there.

Workloads (2 workers everywhere; batch sizes per shape below):
  jpeg    decode + resize of JPEG files from disk (PIL: releases the GIL)
  python  ~2 ms of pure-Python work per sample (holds the GIL)
  tiny    16 floats + an int per sample: the per-batch overhead
  big     3x224x224 float32 per sample, batch 32: 19 MB batches, no compute (transport)
Loaders: torch (fork, forkserver), steadyload (process, thread, auto), torchdata.nodes
(thread, process ParallelMapper), SPDL (thread pipeline), Grain (DataLoader processes,
IterDataset threads). Each holds at most 4 batches in flight (loading, or loaded and not yet
taken) where it has such a setting: torch's default for 2 workers (prefetch_factor 2),
torchdata.nodes' mapper alone (2 x num_workers; a Prefetcher on top would double it: what
that depth was worth is in docs/benchmarks.md's notes), SPDL's 2 threads and a buffer of 2,
Grain's threads a prefetch buffer of 4.

Every run is a fresh process, in either shape: time to the first batch ("first": loader
built to batch in hand; the imports and one garbage collection are done before), peak PSS
of the process tree (sampled every 100 ms), and a checksum of every batch, compared with
torch's in-process batches ("same" column). Repetitions are interleaved: rep 1 of every
loader, then rep 2, ... in the reverse order, then forward again (so no loader always runs
right after the same one: a slow patch of the machine, or what a run leaves the kernel to
tidy, falls on different loaders); medians are shown. A single run moves by up to a
quarter on a noisy machine, so ``--close-reps M`` (default: ``--reps``) runs on to M
repetitions, after every loader's ``--reps`` on a workload, the loaders near a line the
tables judge: steadyload's three, torch with fork in the short shape (the first-batch
reference) and every peer with the same batches within a fifth of steadyload's better
fixed kind's median rate (a peer further behind cannot become the best peer). Those
repetitions are interleaved among themselves the same way.

Shapes (``--shape``, default both; ``--json`` keeps the steady shape's keys ``runs``,
``summary`` and ``reps`` and adds the short shape's ``short_runs``, ``short_summary`` and
``short_workloads``):
  steady  long epochs (WORKLOADS: jpeg batch 32 x 120, python 16 x 800, tiny 64 x 10,000,
          big 32 x 300). samples/s is the steady state: over the second half of the
          batches (start-up, warm-up and steadyload's hand-over from threads to processes
          fall in the first half; the first-batch column shows the start).
  short   a short first epoch of about 60 batches (SHORT_WORKLOADS: jpeg 32, python 32,
          big 32; tiny 782 batches of 256, the issue's 200,000 samples: 60 of them last
          50 ms, less than the run-to-run spread), what a validation pass or a small
          dataset looks like: samples/s
          from the first batch's arrival to the last batch (batches 2..N), the epoch's wall
          time from just before building the loader to the last batch ("epoch"), and all
          its samples over that time ("epoch rate": start-up included).
After each workload's table, auto against the better of steadyload's fixed choices
(sl-process, sl-thread); for the short shape also sl-process's and sl-auto's first batch
against torch with fork, and the best peer (of those whose batches are the same).
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

from peers_env import ROOT, child_pythonpath, in_peers_env, reexec_in_peers_env

OUT = ROOT / "bench-out"

LOADERS = [
    "torch-fork",
    "torch-forkserver",
    "sl-process",
    "sl-thread",
    "sl-auto",
    "tdn-thread",
    "tdn-process",
    "spdl-thread",
    "grain-process",
    "grain-thread",
]
WORKLOADS = {  # name: (batch size, batches, quick batches): auto's hand-over to processes
    # (the pure-Python and tiny rows; ~1.5 s with a cold fork server) must fall in the first half
    "jpeg": (32, 120, 8),
    "python": (16, 800, 8),
    "tiny": (64, 10000, 100),
    "big": (32, 300, 12),
}
SHORT_WORKLOADS = {  # name: (batch size, batches, quick batches): a short first epoch
    "jpeg": (32, 60, 8),
    "python": (32, 60, 8),
    "tiny": (256, 782, 8),  # 200,192 samples: 60 batches would last about 50 ms
    "big": (32, 60, 8),
}
SHAPES = {"short": SHORT_WORKLOADS, "steady": WORKLOADS}
HARNESS_THREADS = "BENCH_PEERS_HARNESS_THREADS"  # --harness-threads, for the children

# The environment (benchmarks/peers_env.py): before torch is imported, python3 alone may
# not have it.
if __name__ == "__main__" and "--child" not in sys.argv and not in_peers_env():
    reexec_in_peers_env(__file__)

# -- datasets (module level: picklable by reference for process workers) -----------------
import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_datasets import Trivial  # noqa: E402  (the script's folder is on the path)
from torch.utils.data import Dataset  # noqa: E402
from torch.utils.data._utils.collate import default_collate  # noqa: E402


class Jpegs(Dataset[Any]):
    """JPEG files decoded and resized to 224x224 (uint8 CHW)."""

    def __init__(self, folder: str, n: int) -> None:
        self.paths = sorted(str(p) for p in Path(folder).glob("*.jpg"))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        from PIL import Image

        with Image.open(self.paths[i % len(self.paths)]) as img:  # files reused: page cache
            small = img.convert("RGB").resize((224, 224), Image.BILINEAR)
        return torch.from_numpy(np.asarray(small)).permute(2, 0, 1).contiguous()


def _spin(iterations: int, seed: int) -> int:
    acc = seed
    for k in range(iterations):
        acc = (acc * 31 + k) % 1_000_003
    return acc


class PythonWork(Dataset[Any]):
    """Pure-Python arithmetic per sample (holds the GIL)."""

    def __init__(self, n: int, iterations: int) -> None:
        self.n, self.iterations = n, iterations

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([_spin(self.iterations, i), i], dtype=torch.int64)


class Big(Dataset[Any]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, 224, 224), float(i % 251))


class FetchBatch:
    """Indices -> default_collate of the samples (the peers' map function)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        return default_collate([self.dataset[i] for i in indices])


class AsNumpy:
    """Grain's data source: samples as numpy (Grain batches numpy trees)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        sample = self.dataset[i]
        if isinstance(sample, tuple):
            return tuple(x.numpy() if isinstance(x, torch.Tensor) else np.int64(x) for x in sample)
        return sample.numpy()


def make_jpegs(folder: Path, count: int = 256) -> None:
    """``count`` 500x375 JPEGs of smooth noise (decode cost like photos), made once."""
    from PIL import Image

    if len(list(folder.glob("*.jpg"))) == count:
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        base = rng.integers(0, 255, (47, 63, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((500, 375), Image.BICUBIC)
        img.save(folder / f"{i:04d}.jpg", quality=90)


def dataset(workload: str, n: int) -> Any:
    if workload == "jpeg":
        folder = OUT / "peers-jpegs"
        make_jpegs(folder)
        return Jpegs(str(folder), n)
    if workload == "python":
        return PythonWork(n, 12_000)
    if workload == "tiny":
        return Trivial(n)
    return Big(n)


# -- one run, in a fresh process ----------------------------------------------------------
def _checksum(batch: Any) -> float:
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return float(sum(_checksum(x) for x in batch))
    # Summed in float64 without a float64 copy of the batch: a copy (38 MB for the JPEG and
    # big rows) made this process's own work outweigh the loaders' on those rows.
    return float(np.sum(np.asarray(batch), dtype=np.float64))


def _tree_pss(pid: int) -> int:
    import psutil

    try:
        me = psutil.Process(pid)
        tree = [me, *me.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def make_loader(kind: str, ds: Any, size: int) -> tuple[Any, Any]:
    """(loader or None, an iterator over ``ds`` in order): batches of ``size``, 2 workers,
    as ``kind`` does it."""
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = list(BatchSampler(SequentialSampler(range(len(ds))), size, drop_last=False))
    if kind.startswith("torch-"):
        loader = torch.utils.data.DataLoader(
            ds, batch_size=size, num_workers=2, multiprocessing_context=kind[6:]
        )
        return loader, iter(loader)
    if kind.startswith("sl-"):
        import steadyload as sl

        loader = sl.DataLoader(ds, batch_size=size, num_workers=2, worker_type=kind[3:])
        return loader, iter(loader)
    if kind.startswith("tdn-"):
        import torchdata.nodes as tn

        node = tn.IterableWrapper(batches)
        node = tn.ParallelMapper(
            node, map_fn=FetchBatch(ds), num_workers=2, method=kind[4:], in_order=True
        )
        return None, iter(tn.Loader(node))  # its mapper holds 2 x num_workers: 4 (see above)
    if kind == "spdl-thread":
        from spdl.dataloader import DataLoader as SpdlLoader

        return None, iter(
            SpdlLoader(
                batches,
                preprocessor=FetchBatch(ds),
                num_threads=2,
                buffer_size=2,  # beside its 2 threads' batches: 4 (see above)
                output_order="input",
            )
        )
    if kind.startswith("grain-"):
        import grain.python as gp

        if kind == "grain-process":
            sampler = gp.IndexSampler(
                len(ds), shard_options=gp.NoSharding(), shuffle=False, num_epochs=1
            )
            return None, iter(
                gp.DataLoader(
                    data_source=AsNumpy(ds),
                    sampler=sampler,
                    operations=[gp.Batch(size)],
                    worker_count=2,
                )
            )
        import grain

        pipe = (
            grain.MapDataset.source(AsNumpy(ds))
            .batch(size)
            .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
        )
        return None, iter(pipe)
    raise ValueError(kind)


def _import_for(kind: str) -> None:
    if kind.startswith("sl-"):
        import steadyload.loader  # noqa: F401
    elif kind.startswith("tdn-"):
        import torchdata.nodes  # noqa: F401
    elif kind.startswith("spdl"):
        import spdl.dataloader  # noqa: F401
    elif kind.startswith("grain"):
        import grain.python  # noqa: F401


def child(workload: str, kind: str, batches: int, shape: str) -> dict[str, Any]:
    # The harness's own ops (each batch's checksum, the "training step") on one intra-op
    # thread for every loader: torchdata.nodes' thread workers set torch's process-wide
    # count to 1 (its threads' torch.set_num_threads(1)), which made this thread's sums
    # several times faster beside busy workers for it alone (see --harness-threads).
    if threads := int(os.environ.get(HARNESS_THREADS, "1")):  # (0: torch's default)
        torch.set_num_threads(threads)
    size = SHAPES[shape][workload][0]
    ds = dataset(workload, size * batches)
    if kind == "reference":
        reference = torch.utils.data.DataLoader(ds, batch_size=size)
        return {"sums": [_checksum(b) for b in reference]}
    # Peak PSS is sampled by the parent (`_run_child`): a sampling thread here would be a
    # thread the loader sees (steadyload's start rule keeps forkserver while one runs).
    _import_for(kind)  # imports are not the loader's start-up
    # Nor is the garbage collector's first full pass over what importing torch left (about
    # 100 ms here): it falls in whichever loader allocates in this process first (thread
    # workers do), and every process pays it once either way.
    gc.collect()
    t0 = time.perf_counter()
    loader, it = make_loader(kind, ds, size)
    first = next(it)
    t_first = time.perf_counter()
    sums = [_checksum(first)]
    stamps = []  # batches 2..N
    for batch in it:
        sums.append(_checksum(batch))
        stamps.append(time.perf_counter())
    choice = loader.report().worker_type_choice if kind == "sl-auto" else None
    start = loader.report().start_method if kind.startswith("sl-") else None
    del it
    out = {"first_s": t_first - t0, "sums": sums, "choice": choice, "start": start}
    if shape == "steady":
        # Steady state: the second half of the batches (start-up, a hand-over and warm-up
        # are in the first half and in the first-batch time).
        half = stamps[len(stamps) // 2 :]
        out["rate"] = size * (len(half) - 1) / (half[-1] - half[0])
        return out
    # Short epoch: from the first batch in hand to the last, and the whole epoch from just
    # before the loader was built (what a validation pass costs).
    t_last = stamps[-1] if stamps else t_first
    if stamps:
        out["rate"] = size * len(stamps) / (t_last - t_first)
    out["epoch_s"] = t_last - t0
    out["epoch_rate"] = size * (len(stamps) + 1) / (t_last - t0)
    return out


def _run_child(workload: str, kind: str, batches: int, shape: str) -> dict[str, Any]:
    """One run in a fresh process; its process tree's peak PSS sampled from here every
    100 ms (the page-table walks cost loaders up to a third at 20 ms)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", workload, kind, str(batches), shape],
            stdout=out, stderr=err, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": child_pythonpath()},
        )  # fmt: skip
        peak, deadline = 0, time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            peak = max(peak, _tree_pss(proc.pid))
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        return {"error": (stderr or stdout).strip().splitlines()[-1][:120]}
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    result["peak_pss"] = peak
    return result


# -- the tables ---------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["short", "steady", "both"], default="both")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--close-reps", type=int, help="repetitions for the loaders near a line (see above)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer batches (a smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument(
        "--harness-threads", type=int, default=1,
        help="torch intra-op threads for the harness's checksums (0: torch's default)",
    )  # fmt: skip
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload, kind, batches, shape = args.child
        print(json.dumps(child(workload, kind, int(batches), shape)))
        return
    workloads, loaders = args.workloads.split(","), args.loaders.split(",")
    os.environ[HARNESS_THREADS] = str(args.harness_threads)
    shapes = ["short", "steady"] if args.shape == "both" else [args.shape]
    close_reps = max(args.reps, args.close_reps or args.reps)
    results: dict[str, Any] = {}
    for shape in shapes:
        runs = _measure(shape, workloads, loaders, (args.reps, close_reps), args.quick)
        table = _short_table if shape == "short" else _table
        summary = table(runs, workloads, loaders)
        prefix = "short_" if shape == "short" else ""
        results[f"{prefix}runs"] = {f"{w}/{k}": v for (w, k), v in runs.items()}
        results[f"{prefix}summary"] = summary
        if shape == "short":
            results["short_workloads"] = {
                w: {"batch_size": SHORT_WORKLOADS[w][0], "batches": _batches(shape, w, args)}
                for w in workloads
            }
    if args.json:
        from bench_json import write_json

        write_json(
            args.json,
            {
                "reps": args.reps,
                "close_reps": close_reps,
                "harness_threads": args.harness_threads,
                **results,
            },
        )


def _batches(shape: str, workload: str, args: argparse.Namespace) -> int:
    return SHAPES[shape][workload][2 if args.quick else 1]


def _measure(
    shape: str,
    workloads: list[str],
    loaders: list[str],
    reps: tuple[int, int],
    quick: bool,
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every loader's runs of one shape: fresh processes, repetitions interleaved; ``reps``
    is (every loader's, the close loaders')."""
    print(f"-- {shape} shape", flush=True)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for workload in workloads:
        batches = SHAPES[shape][workload][2 if quick else 1]
        reference = _run_child(workload, "reference", batches, shape)
        kinds = loaders
        for rep in range(reps[1]):
            if rep == reps[0]:
                kinds = _close(shape, runs, workload, loaders)
                print(f"  {workload}: to {reps[1]} repetitions: {', '.join(kinds)}", flush=True)
            # Interleaved: one of each, then again in the reverse order (see above).
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                began = time.perf_counter()
                r = _run_child(workload, kind, batches, shape)
                r["same"] = r.get("sums") == reference.get("sums")
                r["rep"] = rep
                r.pop("sums", None)
                runs.setdefault((workload, kind), []).append(r)
                print(
                    f"  {workload:6s} rep {rep + 1} {kind:16s} "
                    + (
                        r["error"]
                        if "error" in r
                        else f"{r.get('rate', float('nan')):9.1f}/s "
                        f"first {r['first_s'] * 1e3:7.1f} ms "
                        + (f"epoch {r['epoch_s']:6.2f} s " if "epoch_s" in r else "")
                        + f"PSS {r['peak_pss'] / 2**20:6.0f} MiB same={r['same']} "
                        f"[run {time.perf_counter() - began:.1f} s]"
                        + (f"\n      {r['choice']}" if r.get("choice") else "")
                    ),
                    flush=True,
                )
    return runs


def _close(
    shape: str,
    runs: dict[tuple[str, str], list[dict[str, Any]]],
    workload: str,
    loaders: list[str],
) -> list[str]:
    """The loaders near a line the tables judge (the module's docstring says which)."""
    rates = {k: _median(runs[(workload, k)], "rate") or 0.0 for k in loaders}
    ours = max((rates[k] for k in ("sl-process", "sl-thread") if k in rates), default=0.0)
    same = {k: all(r.get("same") for r in runs[(workload, k)]) for k in loaders}
    return [
        k
        for k in loaders
        if k.startswith("sl-")
        or (k == "torch-fork" and shape == "short")
        or (same[k] and rates[k] >= 0.8 * ours)
    ]


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def _table(
    runs: dict[tuple[str, str], list[dict[str, Any]]], workloads: list[str], loaders: list[str]
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for workload in workloads:
        base = _median(runs[(workload, "torch-fork")], "rate") if "torch-fork" in loaders else None
        print(f"\n{workload}: samples/s (x torch fork), first batch, peak PSS, same batches")
        rows = {}
        for kind in loaders:
            rs = runs[(workload, kind)]
            rate, first = _median(rs, "rate"), _median(rs, "first_s")
            pss, same = _median(rs, "peak_pss"), all(r.get("same") for r in rs)
            rows[kind] = dict(rate=rate, first_s=first, peak_pss=pss, same=same, reps=len(rs))
            if rate is None:
                print(f"  {kind:16s} failed: {rs[0].get('error')}")
                continue
            ratio = f"{rate / base:5.2f}x" if base else "   - "
            print(
                f"  {kind:16s} {rate:9.1f}/s {ratio}  first {first * 1e3:7.1f} ms  "
                f"PSS {pss / 2**20:6.0f} MiB  {'same' if same else 'DIFFERENT'}"
            )
        peers = {  # like for like: the peers whose batches are torch's
            k: v for k, v in rows.items() if not k.startswith("sl-") and v["rate"] and v["same"]
        }
        auto = rows.get("sl-auto", {})
        fixed = _better(rows, "rate")
        best = max(peers, key=lambda k: peers[k]["rate"]) if peers else None
        if fixed and auto.get("rate"):
            print(
                "  auto vs the better of sl-process/sl-thread "
                f"({fixed}): {auto['rate'] / rows[fixed]['rate']:.2f}x "
                f"({_spread(runs, workload, fixed)})"
            )
        if fixed and best:
            print(
                f"  {fixed} vs the best peer ({best}): "
                f"{rows[fixed]['rate'] / peers[best]['rate']:.2f}x "
                f"({_spread(runs, workload, best, fixed)})"
            )
        if best and auto.get("rate"):
            lean = min(peers, key=lambda k: peers[k]["peak_pss"])
            fork_first = rows.get("torch-fork", {}).get("first_s")
            print(
                f"  sl-auto vs the best peer ({best}): "
                f"{auto['rate'] / peers[best]['rate']:.2f}x; peak PSS vs the leanest ({lean}): "
                f"{auto['peak_pss'] / peers[lean]['peak_pss']:.2f}x; first batch vs torch "
                "fork: " + (f"{auto['first_s'] / fork_first:.2f}x" if fork_first else "-")
            )
        summary[workload] = rows
    return summary


def _better(rows: dict[str, Any], key: str) -> str | None:
    """The better of steadyload's fixed choices (sl-process, sl-thread) by ``key``."""
    fixed = [k for k in ("sl-process", "sl-thread") if rows.get(k, {}).get(key)]
    return max(fixed, key=lambda k: rows[k][key]) if fixed else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _spread(
    runs: dict[tuple[str, str], list[dict[str, Any]]],
    workload: str,
    base: str | None,
    kind: str = "sl-auto",
) -> str:
    """The range of ``kind``'s rate over ``base``'s in the same repetition: how far the
    run's noise moves the ratio (the medians' ratio is the figure)."""
    kinds, bases = runs.get((workload, kind), []), runs.get((workload, base or ""), [])
    by_rep = {b["rep"]: b for b in bases if b.get("rate")}  # pairs: the same repetition
    ratios = sorted(
        a["rate"] / by_rep[a["rep"]]["rate"]
        for a in kinds
        if a.get("rate") and a.get("rep") in by_rep
    )
    if not ratios:
        return "per repetition: -"
    return f"per repetition {ratios[0]:.2f}-{ratios[-1]:.2f}x"


def _short_table(
    runs: dict[tuple[str, str], list[dict[str, Any]]], workloads: list[str], loaders: list[str]
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for workload in workloads:
        print(
            f"\n{workload} (short epoch): samples/s from the first batch, first batch, epoch "
            "from iter() and its samples/s, peak PSS, same batches"
        )
        rows = {}
        for kind in loaders:
            rs = runs[(workload, kind)]
            row = {k: _median(rs, k) for k in ("rate", "first_s", "epoch_s", "epoch_rate")}
            row["peak_pss"] = _median(rs, "peak_pss")
            row["same"] = all(r.get("same") for r in rs)
            row["reps"] = len(rs)
            rows[kind] = row
            if row["epoch_s"] is None:
                print(f"  {kind:16s} failed: {rs[0].get('error')}")
                continue
            print(
                f"  {kind:16s} {row['rate'] or float('nan'):9.1f}/s  "
                f"first {row['first_s'] * 1e3:7.1f} ms  epoch {row['epoch_s']:6.2f} s "
                f"{row['epoch_rate']:9.1f}/s  PSS {row['peak_pss'] / 2**20:6.0f} MiB  "
                f"{'same' if row['same'] else 'DIFFERENT'}"
            )
        auto, fork = rows.get("sl-auto", {}), rows.get("torch-fork", {})
        fixed, fixed_epoch = _better(rows, "rate"), _better(rows, "epoch_rate")
        vs_fixed = _ratio(auto.get("rate"), rows[fixed]["rate"] if fixed else None)
        vs_fixed_epoch = _ratio(
            auto.get("epoch_rate"), rows[fixed_epoch]["epoch_rate"] if fixed_epoch else None
        )
        peers = {
            k: v for k, v in rows.items() if not k.startswith("sl-") and v["rate"] and v["same"]
        }
        best = max(peers, key=lambda k: peers[k]["rate"]) if peers else None
        print(
            f"  auto vs the better of sl-process/sl-thread: {vs_fixed} "
            f"(from the first batch; {_spread(runs, workload, fixed)}), "
            f"{vs_fixed_epoch} (epoch from iter()); sl-process first batch vs torch fork: "
            f"{_ratio(rows.get('sl-process', {}).get('first_s'), fork.get('first_s'))}; "
            "sl-auto first batch vs torch fork: "
            f"{_ratio(auto.get('first_s'), fork.get('first_s'))}; best peer: "
            + (f"{best} {peers[best]['rate']:.1f}/s" if best else "-")
        )
        summary[workload] = rows
    return summary


if __name__ == "__main__":
    main()
