"""Memory of 2,000,000 metadata records over one epoch with 2 workers: torch + list (fork,
forkserver) against steadyload + SharedList (forkserver, and the opt-in zygote). Each
variant runs in a fresh process.

Usage: python benchmarks/bench_memory.py [--records N] [--repeat R] [--variants a,b]
                                         [--json out.json]

Printed for each: total PSS of the parent, the fork server or zygote (if any) and the
workers, before the loader, at the first batch and at the end of the epoch, as multiples of
the parent's PSS before the loader; growth over the epoch; and the same loader's total over
an (almost) empty dataset, 2 records of batch 1, measured once both workers have delivered
a batch (the fixed cost of the server and the workers), to isolate what the metadata costs.
With --repeat, each figure is the median of R fresh runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, os, sys, time
sys.path.insert(0, {root!r})
import psutil, torch
import steadyload as sl
from multiprocessing import forkserver

KIND, N, EMPTY = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "empty"


class Records(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, i):
        r = self.rows[i]
        return len(r["caption"]) + r["w"]


def total_pss():
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    # Both servers are children of this process (so are their workers): listed above.
    # CPython's fork server is looked up as well, in case it was started elsewhere.
    server = forkserver._forkserver._forkserver_pid
    if server:
        try:
            procs += [psutil.Process(server)] + psutil.Process(server).children()
        except psutil.Error:
            pass
    seen, pss = set(), 0
    for p in procs:
        if p.pid in seen:
            continue
        seen.add(p.pid)
        try:
            pss += p.memory_full_info().pss
        except psutil.Error:
            pass
    return pss


if __name__ == "__main__":
    # "empty": 2 records of batch 1, so that each worker delivers one batch (it is up and
    # has imported what it needs) before the fixed cost is measured.
    n = 2 if EMPTY else N
    rows = [{{"file": f"images/{{i:08d}}.jpg", "caption": f"a photo of object {{i % 977}}",
             "w": i % 640, "h": 480}} for i in range(n)]
    shared_bytes = 0
    if KIND in ("steadyload", "zygote"):
        rows = sl.SharedList(rows)  # the list itself is dropped, as users write it
        shared_bytes = rows.nbytes
    ds = Records(rows)
    del rows
    before = total_pss()
    # Persistent workers: still alive when the epoch ends, so their memory is measured.
    kwargs = dict(batch_size=1 if EMPTY else 1024, num_workers=2, persistent_workers=True)
    if KIND == "steadyload":
        loader = sl.DataLoader(ds, **kwargs)
    elif KIND == "zygote":
        loader = sl.DataLoader(ds, start_method="zygote", **kwargs)
    else:
        loader = torch.utils.data.DataLoader(ds, multiprocessing_context=KIND, **kwargs)
    it = iter(loader)
    next(it)
    first = total_pss()
    for _ in it:
        pass
    end = total_pss()
    print(json.dumps({{"before": before, "first": first, "end": end, "shared": shared_bytes}}))
'''


def run(kind: str, n: int, empty: bool, repeat: int = 1) -> dict[str, float]:
    """Median of ``repeat`` fresh runs of one variant. [Unit: byte]"""
    runs = [_run_once(kind, n, empty) for _ in range(repeat)]
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    # The median of the ratios, not the ratio of the medians: "before" varies from run to
    # run with how much of the freed list the allocator gave back.
    out["ratio"] = statistics.median(r["end"] / r["before"] for r in runs)
    return out


def _run_once(kind: str, n: int, empty: bool) -> dict[str, int]:
    # A script file, not `python -c`: torch's forkserver workers must import the dataset.
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "memory_child.py"
        script.write_text(CHILD.format(root=str(ROOT)))
        out = subprocess.run(
            [sys.executable, str(script), kind, str(n), "empty" if empty else "full"],
            capture_output=True, text=True, timeout=1800,
        )
    if out.returncode:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=1, help="fresh runs per figure (median)")
    ap.add_argument("--variants", default="fork,forkserver,steadyload,zygote",
                    help="comma-separated subset of fork,forkserver,steadyload,zygote")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    variants: dict[str, dict[str, float | None]] = {}
    gib = 1 << 30
    wanted = args.variants.split(",")
    print(f"{args.records:,} records, batch 1024, 2 workers; PSS totals (parent + fork "
          f"server or zygote + workers); medians of {args.repeat} run(s)")
    print(f"{'variant':32s} {'before':>8s} {'1st batch':>10s} {'end':>8s} {'end/before':>11s} "
          f"{'epoch growth':>13s} {'empty-dataset end':>18s}")
    for kind, label in (("fork", "(i) torch + list, fork"),
                        ("forkserver", "(ii) torch + list, forkserver"),
                        ("steadyload", "(iii) steadyload + SharedList"),
                        ("zygote", "(iv) (iii) + start_method=zygote")):
        if kind not in wanted:
            continue
        full = run(kind, args.records, empty=False, repeat=args.repeat)
        empty = run(kind, args.records, empty=True, repeat=args.repeat)
        print(f"{label:32s} {full['before'] / gib:7.2f}G {full['first'] / gib:9.2f}G "
              f"{full['end'] / gib:7.2f}G {full['ratio']:10.2f}x "
              f"{(full['end'] - full['first']) / full['first']:12.1%} "
              f"{empty['end'] / gib:17.2f}G")
        print(f"{'':32s} fixed cost of the workers (and fork server): "
              f"{(empty['end'] - empty['before']) / gib:.3f}G (empty dataset, end minus before)")
        if full["shared"]:
            paid = full["end"] - empty["end"]
            print(f"{'':32s} metadata paid: {paid / gib:.3f}G (end minus empty-dataset end) "
                  f"for a {full['shared'] / gib:.3f}G SharedList: {paid / full['shared']:.2f}x")
        variants[kind] = {  # [Unit: byte], but ratio and growth
            "before": full["before"], "first": full["first"], "end": full["end"],
            "ratio": full["ratio"], "growth": (full["end"] - full["first"]) / full["first"],
            "empty_end": empty["end"], "fixed_cost": empty["end"] - empty["before"],
            "shared": full["shared"] or None,
            "metadata_paid": full["end"] - empty["end"] if full["shared"] else None,
        }
    if args.json:
        from bench_json import write_json

        write_json(args.json, {"records": args.records, "repeat": args.repeat,
                               "variants": variants})


if __name__ == "__main__":
    main()
