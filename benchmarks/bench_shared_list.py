"""Random reads: steadyload.SharedList against a Python list, in one run.

Usage: python benchmarks/bench_shared_list.py [--records N]

Two kinds of records: file paths (str: stored as UTF-8, the fast path) and small dicts
(pickled). Each is read at random positions directly (``rows[i]``) and through a Dataset's
``__getitem__`` (what a DataLoader does); medians of 5 rounds; ratios SharedList / list.
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    t = time.perf_counter()
    for i in idx:
        obj[i]
    return (time.perf_counter() - t) / len(idx) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    args = ap.parse_args()
    n = args.records
    kinds = {
        "paths (str)": [f"images/{i:08d}.jpg" for i in range(n)],
        "dicts (pickled)": [{"file": f"images/{i:08d}.jpg", "label": i % 10, "w": 640}
                            for i in range(n)],
    }
    rng = random.Random(0)
    idx = [rng.randrange(n) for _ in range(n)]
    print(f"{n:,} records, {n:,} random reads, medians of 5 rounds [ns per read]")
    for kind, rows in kinds.items():
        shared = sl.SharedList(rows)
        table: dict[str, list[float]] = {k: [] for k in ("list", "shared", "list_ds", "shared_ds")}
        for _ in range(5):
            table["list"].append(per_read_ns(rows, idx))
            table["shared"].append(per_read_ns(shared, idx))
            table["list_ds"].append(per_read_ns(Rows(rows), idx))
            table["shared_ds"].append(per_read_ns(Rows(shared), idx))
        m = {k: statistics.median(v) for k, v in table.items()}
        print(f"  {kind:16s} direct: list {m['list']:6.0f}  SharedList {m['shared']:6.0f}  "
              f"({m['shared'] / m['list']:.1f}x)   via __getitem__: list {m['list_ds']:6.0f}  "
              f"SharedList {m['shared_ds']:6.0f}  ({m['shared_ds'] / m['list_ds']:.1f}x)")


if __name__ == "__main__":
    main()
