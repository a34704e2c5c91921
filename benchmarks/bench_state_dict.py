"""What `loader.state_dict()` costs mid-epoch: steadyload against torchdata's StatefulDataLoader.

Usage: python3 benchmarks/bench_state_dict.py [--calls N] [--rounds N] [--quick] [--json out.json]
       python3 benchmarks/bench_state_dict.py --profile WORKLOAD [--calls N --rounds 1]

A training loop that saves the loader's position at every step calls ``state_dict()``
between two ``next()``: that call should cost nothing a user notices (issue #36). Both
loaders run the same workloads in one process, side by side:

  map       map-style dataset (16 floats + an int per sample), shuffle=True with
            generator=torch.Generator().manual_seed(0), num_workers=0
  map-w2    the same, num_workers=2
  stream-w2 a Stateful IterableDataset (state_dict/load_state_dict: its position in the
            stream, per worker), num_workers=2
  dist-w2   the map-style dataset through DistributedSampler(num_replicas=2, rank=0),
            torch.distributed not initialised, num_workers=2

batch 8, steadyload's default process workers, torchdata's default (fork). For each
workload both loaders are built and advanced a few batches (workers warm); then, in each
round, each loader in turn (the order alternates from round to round):

  repeated       ``state_dict()`` called N times in a row at the same position (what a
                 state cached until the next batch costs)
  after next()   N steps of ``next(it)`` then one ``state_dict()``: the save of a loop that
                 saves every step (a fresh position each time)
  next()         the ``next(it)`` of those steps, for scale

Every call is timed on its own with ``time.perf_counter_ns`` (the timer's own cost, a
few tens of ns, is printed and not subtracted); the table shows medians over all rounds,
in µs per call, and steadyload / torchdata (above 1: steadyload costs more).

torchdata (0.11.0) lives in the bench-only environment ``.venv-peers`` (benchmarks/
peers_env.py, shared with bench_peers.py: created on first use, torch==2.13.0 CPU build
pinned), never in steadyload's dependencies; run with any python3 and the script re-runs
itself there with steadyload (this checkout) on the path. ``--profile WORKLOAD`` prints
cProfile's view of steadyload's ``state_dict()`` after ``next()`` on one workload instead.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peers_env import ROOT, child_pythonpath, in_peers_env, reexec_in_peers_env

if __name__ == "__main__" and not in_peers_env():
    reexec_in_peers_env(__file__)  # before torch is imported: python3 alone may not have it

# steadyload from this checkout, here and in the workers (fork server included).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = child_pythonpath()

import torch  # noqa: E402
from bench_datasets import StatefulStream, Trivial  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

WORKLOADS = {
    "map": "map-style, shuffle=True, generator=, num_workers=0",
    "map-w2": "map-style, shuffle=True, generator=, num_workers=2",
    "stream-w2": "Stateful IterableDataset, num_workers=2",
    "dist-w2": "DistributedSampler(num_replicas=2, rank=0), num_workers=2",
}
LOADERS = ["steadyload", "torchdata"]
MEASURES = ["repeated", "after_next", "next"]
MEASURE_NAMES = {"repeated": "state_dict(), repeated", "after_next": "state_dict() after next()",
                 "next": "next()"}
BATCH = 8
WARM_BATCHES = 5


def make_loader(kind: str, workload: str, samples: int) -> Any:
    """``kind``'s loader over ``workload``, ``samples`` samples in the (rank's) epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    import steadyload as sl

    cls: Any = sl.DataLoader if kind == "steadyload" else StatefulDataLoader
    workers = 0 if workload == "map" else 2
    if workload == "stream-w2":
        return cls(StatefulStream(samples), batch_size=BATCH, num_workers=workers)
    if workload == "dist-w2":
        ds = Trivial(2 * samples)
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=0)
        return cls(ds, batch_size=BATCH, sampler=sampler, num_workers=workers)
    return cls(Trivial(samples), batch_size=BATCH, shuffle=True,
               generator=torch.Generator().manual_seed(0), num_workers=workers)


def _timer_ns(n: int = 10_000) -> float:
    """The median cost of one perf_counter_ns pair (included in every figure)."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        out.append(clock() - t0)
    return statistics.median(out)


def repeated(loader: Any, it: Any, calls: int) -> dict[str, list[int]]:
    clock, save = time.perf_counter_ns, loader.state_dict
    out = []
    for _ in range(calls):
        t0 = clock()
        save()
        out.append(clock() - t0)
    return {"repeated": out}


def after_next(loader: Any, it: Any, calls: int) -> dict[str, list[int]]:
    clock, save = time.perf_counter_ns, loader.state_dict
    saves, nexts = [], []
    for _ in range(calls):
        t0 = clock()
        next(it)
        t1 = clock()
        save()
        t2 = clock()
        nexts.append(t1 - t0)
        saves.append(t2 - t1)
    return {"after_next": saves, "next": nexts}


def run_workload(workload: str, calls: int, rounds: int) -> dict[str, Any]:
    """Both loaders over ``workload``, ``rounds`` interleaved rounds: the per-call times."""
    samples = BATCH * (rounds * calls + WARM_BATCHES + 64)  # the epoch outlasts the run
    loaders = {kind: make_loader(kind, workload, samples) for kind in LOADERS}
    iters = {}
    for kind, loader in loaders.items():
        it = iter(loader)
        for _ in range(WARM_BATCHES):
            next(it)
        loader.state_dict()  # the first one may build what later ones reuse
        iters[kind] = it
    times: dict[str, dict[str, list[int]]] = {k: {m: [] for m in MEASURES} for k in LOADERS}
    per_round: dict[str, dict[str, list[float]]] = {k: {m: [] for m in MEASURES}
                                                    for k in LOADERS}
    steps: list[Callable[[Any, Any, int], dict[str, list[int]]]] = [repeated, after_next]
    for r in range(rounds):
        order = LOADERS if r % 2 == 0 else LOADERS[::-1]
        for step in steps:
            for kind in order:
                gc.collect()
                for measure, ns in step(loaders[kind], iters[kind], calls).items():
                    times[kind][measure] += ns
                    per_round[kind][measure].append(statistics.median(ns) / 1e3)
        print(f"  {workload:9s} round {r + 1}: " + "  ".join(
            f"{kind} {per_round[kind]['after_next'][-1]:6.1f} µs" for kind in LOADERS),
            flush=True)
    state_bytes = {kind: len(pickle.dumps(loaders[kind].state_dict())) for kind in LOADERS}
    result: dict[str, Any] = {}
    for kind in LOADERS:
        result[kind] = {
            m: {"median_us": statistics.median(ns) / 1e3,
                "mean_us": statistics.fmean(ns) / 1e3,
                "p90_us": statistics.quantiles(ns, n=10)[-1] / 1e3,
                "per_round_median_us": per_round[kind][m]}
            for m, ns in times[kind].items()
        }
        result[kind]["state_bytes"] = state_bytes[kind]
    del iters, loaders  # workers shut down before the next workload
    gc.collect()
    return result


def profile(workload: str, calls: int) -> None:
    """cProfile of steadyload's ``state_dict()`` alone (enabled around each call), each
    after a ``next()``; the 25 functions with the most own time."""
    import cProfile
    import pstats

    samples = BATCH * (calls + WARM_BATCHES + 64)
    loader = make_loader("steadyload", workload, samples)
    it = iter(loader)
    for _ in range(WARM_BATCHES):
        next(it)
    loader.state_dict()
    prof = cProfile.Profile()
    for _ in range(calls):
        next(it)
        prof.enable()
        loader.state_dict()
        prof.disable()
    print(f"steadyload state_dict() after next(), {workload} ({WORKLOADS[workload]}), "
          f"{calls} calls (times include cProfile's own overhead):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    del it, loader


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for workload, r in results.items():
        summary[workload] = {}
        for m in MEASURES:
            sl, td = r["steadyload"][m]["median_us"], r["torchdata"][m]["median_us"]
            summary[workload][m] = {"steadyload": sl, "torchdata": td, "ratio": sl / td}
    return summary


def print_table(summary: dict[str, Any], results: dict[str, Any], calls: int,
                rounds: int) -> None:
    print(f"\nmedian µs per call ({calls} calls x {rounds} rounds, interleaved); "
          "ratio steadyload / torchdata")
    print(f"  {'workload':10s} {'measure':26s} {'steadyload':>10s} {'torchdata':>10s} "
          f"{'ratio':>7s}")
    for workload, rows in summary.items():
        for m in MEASURES:
            row = rows[m]
            print(f"  {workload:10s} {MEASURE_NAMES[m]:26s} {row['steadyload']:10.2f} "
                  f"{row['torchdata']:10.2f} {row['ratio']:6.2f}x")
        sizes = results[workload]
        print(f"  {workload:10s} {'pickled state, bytes':26s} "
              f"{sizes['steadyload']['state_bytes']:10d} {sizes['torchdata']['state_bytes']:10d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per loader per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="200 calls x 2 rounds (a smoke run)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--profile", choices=list(WORKLOADS), metavar="WORKLOAD",
                        help="instead: cProfile steadyload's state_dict() after next() on "
                        "WORKLOAD, by own time")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    calls, rounds = (200, 2) if args.quick else (args.calls, args.rounds)
    import torchdata.stateful_dataloader  # noqa: F401

    import steadyload  # noqa: F401  (imports before the clocks)

    if args.profile:
        profile(args.profile, calls * rounds)
        return
    timer = _timer_ns()
    load_before = os.getloadavg()
    print(f"perf_counter_ns pair: {timer:.0f} ns; load average {load_before[0]:.2f} "
          f"on {os.cpu_count()} CPUs", flush=True)
    results = {w: run_workload(w, calls, rounds) for w in args.workloads.split(",")}
    load_after = os.getloadavg()
    summary = summarize(results)
    print_table(summary, results, calls, rounds)
    print(f"load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    if args.json:
        from bench_json import write_json

        write_json(args.json, {
            "calls": calls, "rounds": rounds, "batch_size": BATCH, "timer_ns": timer,
            "load_average": [load_before[0], load_after[0]],
            "torchdata": _version("torchdata"), "workloads": WORKLOADS,
            "results": results, "summary": summary,
        })


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
