"""Random reads: steadyload.SharedList against a Python list, in one run.

Usage: python benchmarks/bench_shared_list.py [--records N] [--json out.json]

Kinds of records: file paths (str, stored as UTF-8), dicts with the same keys and tuples of
the same length (stored by field: a struct of their numbers, then their strings), dicts
holding a list (that field stored with marshal), and records of mixed types (each stored
with marshal or pickle). Each is read at random positions directly (``rows[i]``) and
through a Dataset's ``__getitem__`` (what a DataLoader does); ratios SharedList / list.
Times are CPU time of this process (other processes on a shared box then cost less), best
of 7 rounds, the variants interleaved within each round.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
import steadyload as sl  # noqa: E402


class Rows:
    """A minimal Dataset: returns rows[i]."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]


def per_read_ns(obj: Any, idx: list[int]) -> float:
    t = time.process_time()
    for i in idx:
        obj[i]
    return (time.process_time() - t) / len(idx) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    n = args.records
    kinds = {
        "paths (str)": [f"images/{i:08d}.jpg" for i in range(n)],
        "dicts": [{"file": f"images/{i:08d}.jpg", "label": i % 10, "w": 640}
                  for i in range(n)],
        "tuples": [(f"images/{i:08d}.jpg", i % 10, 640) for i in range(n)],
        "ints": list(range(n)),
        "dicts with a list": [{"file": f"images/{i:08d}.jpg", "box": [i % 7, 2, 30, 40]}
                              for i in range(n)],
        "mixed (marshal)": [(i, f"{i}") if i % 2 else {"i": i} for i in range(n)],
    }
    rng = random.Random(0)
    idx = [rng.randrange(n) for _ in range(n)]
    print(f"{n:,} records, {n:,} random reads, best of 7 rounds [CPU ns per read]")
    for kind, rows in kinds.items():
        shared = sl.SharedList(rows)
        table: dict[str, list[float]] = {k: [] for k in ("list", "shared", "list_ds", "shared_ds")}
        for _ in range(7):
            table["list"].append(per_read_ns(rows, idx))
            table["shared"].append(per_read_ns(shared, idx))
            table["list_ds"].append(per_read_ns(Rows(rows), idx))
            table["shared_ds"].append(per_read_ns(Rows(shared), idx))
        m = {k: min(v) for k, v in table.items()}
        print(f"  {kind:18s} direct: list {m['list']:6.0f}  SharedList {m['shared']:6.0f}  "
              f"({m['shared'] / m['list']:.1f}x)   via __getitem__: list {m['list_ds']:6.0f}  "
              f"SharedList {m['shared_ds']:6.0f}  ({m['shared_ds'] / m['list_ds']:.1f}x)")
        results[kind] = m  # [Unit: nanosecond] of CPU time per read, best of 7
    if args.json:
        from bench_json import write_json

        write_json(args.json, {"records": n, "ns_per_read": results})


if __name__ == "__main__":
    main()
