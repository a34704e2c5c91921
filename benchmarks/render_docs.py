"""Write docs/benchmarks.md (and its plots) from the committed JSON in benchmarks/results/.

Usage: python3 benchmarks/render_docs.py [--results DIR] [--out DIR] [--no-plots]

Each benchmark writes its figures with ``--json`` (see bench_json.py); a result worth
publishing is committed as ``benchmarks/results/<name>.json`` and this script turns all of
them into one page, each table under the provenance its file records (source, command,
date, commit, machine). The page is generated: edit the JSON or this script, never the
page. ``tests/unit/test_docs.py`` checks that the committed page is what this script
writes. Plots (PNG, matplotlib's Agg backend) go to ``docs/benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
PLOTS = "benchmarks"  # folder of the PNGs, relative to the page

Plot = Callable[[Path], None]
Section = tuple[list[str], list[tuple[str, Plot]]]

MIB, GIB = 2**20, 2**30

PEER_NAMES = {
    "torch-fork": "torch, fork",
    "torch-forkserver": "torch, forkserver",
    "sl-process": "steadyload, process",
    "sl-thread": "steadyload, thread",
    "sl-auto": "**steadyload, auto**",
    "tdn-thread": "torchdata.nodes, thread",
    "tdn-process": "torchdata.nodes, process",
    "spdl-thread": "SPDL, thread",
    "grain-process": "Grain, DataLoader (processes)",
    "grain-thread": "Grain, IterDataset (threads)",
}
WORKLOAD_NAMES = {
    "jpeg": "JPEG decode + resize",
    "python": "pure Python (GIL)",
    "tiny": "tiny samples",
    "big": "19 MB batches",
}


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:,.1f}"


def _provenance(data: dict[str, Any]) -> list[str]:
    lines = [f"> Source: {data['source']}.  "]
    lines.append(
        f"> Command: `{data['command']}`; date {data['date']}, commit "
        f"{data.get('commit') or 'unknown'}; machine: {data['machine']}."
    )
    return [*lines, ""]


def _notes(data: dict[str, Any]) -> list[str]:
    notes = data.get("notes") or []
    return [*(f"- {note}" for note in notes), *([""] if notes else [])]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


# -- one section per results file ---------------------------------------------------------
def foundation(data: dict[str, Any]) -> Section:
    med = data["medians"]
    fresh, warm = med["a_fresh"], med["a_warm"]
    sl_fresh, sl_warm = fresh["steadyload"], warm["steadyload"]
    rows = [
        [
            "(a) first batch, fresh process, vs torch fork",
            f"{fresh['torch-fork']:.3f} s",
            f"{sl_fresh:.3f} s",
            f"{sl_fresh / fresh['torch-fork']:.2f}x",
        ],
        [
            "(a) first batch, fresh process, vs torch forkserver with torch preloaded",
            f"{fresh['torch-forkserver-preload']:.3f} s",
            f"{sl_fresh:.3f} s",
            f"{sl_fresh / fresh['torch-forkserver-preload']:.2f}x",
        ],
        [
            "(a) first batch, fresh process, vs torch forkserver / spawn",
            f"{fresh['torch-forkserver']:.3f} / {fresh['torch-spawn']:.3f} s",
            f"{sl_fresh:.3f} s",
            f"{sl_fresh / fresh['torch-forkserver']:.2f}x / {sl_fresh / fresh['torch-spawn']:.2f}x",
        ],
        [
            "(a) first batch, 2nd loader in the process, vs torch fork",
            f"{warm['torch-fork']:.3f} s",
            f"{sl_warm:.3f} s",
            f"{sl_warm / warm['torch-fork']:.2f}x",
        ],
        [
            "(a) first batch, 2nd loader, vs torch forkserver with preload / plain / spawn",
            (
                f"{warm['torch-forkserver-preload']:.3f} / {warm['torch-forkserver']:.3f} / "
                f"{warm['torch-spawn']:.3f} s"
            ),
            f"{sl_warm:.3f} s",
            " / ".join(
                f"{sl_warm / warm[k]:.2f}x"
                for k in ("torch-forkserver-preload", "torch-forkserver", "torch-spawn")
            ),
        ],
    ]
    batch_gb = 32 * 3 * 224 * 224 * 4 / 1e9
    for key, label, unit in (
        ("b_cpu", "(b) CPU-bound dataset, ~5 ms/sample", "samples/s"),
        ("c_tiny", "(c) tiny samples, batch 64 (per-batch overhead)", "samples/s"),
        ("d_images", "(d) 19 MB batches (32x3x224x224 float32), no compute", "batches/s"),
    ):
        t, s = med[key]["torch-fork"], med[key]["steadyload"]
        extra = (lambda x: f" ({x * batch_gb:.1f} GB/s)") if key == "d_images" else (lambda x: "")
        rows.append(
            [label, f"{_rate(t)} {unit}{extra(t)}", f"{_rate(s)} {unit}{extra(s)}", f"{s / t:.2f}x"]
        )
    lines = [
        "## Time to the first batch and throughput against torch",
        "",
        "torch's DataLoader and steadyload side by side in one run, 2 workers each. (a) is the",
        "time from building the loader to the first batch, each loader in a fresh process",
        "(starting the fork server and importing torch there included), then a second loader",
        "in the same process. (b)-(d) run interleaved in one process, timed from the first",
        "batch to the last (worker start-up excluded); torch uses fork there. Ratios are",
        "steadyload / torch: above 1 is better for rates, below 1 for times.",
        "",
        *_provenance(data),
        *_table(["measurement", "torch", "steadyload", "steadyload / torch"], rows),
        (
            f"memcpy of the same 19 MB on this machine: {med['d_memcpy_gbps']['memcpy']:.1f} GB/s "
            "(warm cache)."
        ),
        "",
        *_notes(data),
    ]
    return lines, []


def _peer_rows(
    summary: dict[str, Any],
    workloads: list[str],
    loaders: list[str],
    cell: Callable[[dict[str, Any], dict[str, Any]], str],
) -> list[list[str]]:
    rows = []
    for kind in loaders:
        row = [PEER_NAMES.get(kind, kind)]
        for w in workloads:
            r, base = summary[w].get(kind), summary[w].get("torch-fork")
            row.append("-" if not r or r.get("rate") is None else cell(r, base or {}))
        rows.append(row)
    return rows


def peers(data: dict[str, Any]) -> Section:
    """The steady shape's tables (``summary``) and the short epoch's (``short_summary``),
    each when its file has it."""
    if "summary" not in data:
        return [
            "## steadyload against torch and the peer loaders",
            "",
            "steadyload against torch and the peer loaders (torchdata.nodes, SPDL, Grain;",
            "installed by the script into a bench-only `.venv-peers`, never steadyload's",
            "dependencies), four workloads, 2 workers each, every run a fresh process,",
            "repetitions interleaved (the order reversed every other one), medians. Every",
            "loader's batches are checked against torch's in-process batches; ‡ marks a loader",
            "whose batches differ (not like for like).",
            "",
            *_peers_reps(data),
            *_provenance(data),
            *_peers_short(data),
            *_notes(data),
        ], []
    lines, plots = _peers_steady(data)
    return [*lines, *_peers_short(data), *_notes(data)], plots


def _peers_reps(data: dict[str, Any]) -> list[str]:
    """How many repetitions the medians are of (``--close-reps``: more near a line)."""
    reps, close = data["reps"], data.get("close_reps", data["reps"])
    if close <= reps:
        return [f"Medians of {reps} repetitions.", ""]
    return [
        f"Medians of {reps} repetitions, and of {close} for the loaders near a line the tables",
        "judge (one run moves by a quarter or more here): steadyload's three, torch with fork in",
        "the short epoch (the first-batch reference) and every peer with the same batches",
        "within a fifth of steadyload's better fixed kind after the first repetitions.",
        "",
    ]


def _peers_steady(data: dict[str, Any]) -> Section:
    summary = data["summary"]
    workloads = [w for w in WORKLOAD_NAMES if w in summary]
    loaders = [k for k in PEER_NAMES if any(k in summary[w] for w in workloads)]

    def throughput(r: dict[str, Any], base: dict[str, Any]) -> str:
        ratio = f" {r['rate'] / base['rate']:.2f}x" if base.get("rate") else ""
        return f"{r['rate']:,.0f}/s{ratio}" + ("" if r["same"] else " ‡")

    def start(r: dict[str, Any], base: dict[str, Any]) -> str:
        return f"{r['first_s'] * 1e3:.0f} ms / {r['peak_pss'] / MIB:.0f} MiB"

    goals = []
    for w in workloads:
        rows = summary[w]
        auto = rows.get("sl-auto")
        same_peers = {
            k: r
            for k, r in rows.items()
            if not k.startswith("sl-") and r.get("rate") and r.get("same")
        }
        if not auto or not auto.get("rate") or not same_peers:
            continue
        best = max(same_peers, key=lambda k: same_peers[k]["rate"])
        lean = min(same_peers, key=lambda k: same_peers[k]["peak_pss"])
        fork = rows.get("torch-fork", {})
        goals.append(
            [
                WORKLOAD_NAMES[w],
                f"{auto['rate'] / same_peers[best]['rate']:.2f}x ({PEER_NAMES[best]})",
                f"{auto['first_s'] / fork['first_s']:.2f}x" if fork.get("first_s") else "-",
                f"{auto['peak_pss'] / same_peers[lean]['peak_pss']:.2f}x ({PEER_NAMES[lean]})",
            ]
        )
    names = [WORKLOAD_NAMES[w] for w in workloads]
    png = "peers_throughput.png"
    lines = [
        "## steadyload against torch and the peer loaders",
        "",
        "steadyload against torch and the peer loaders (torchdata.nodes, SPDL, Grain; installed",
        "by the script into a bench-only `.venv-peers`, never steadyload's dependencies), four",
        "workloads, 2 workers each, every run a fresh process, repetitions interleaved (the",
        "order reversed every other one), medians. samples/s is the steady state: the second",
        'half of the run (start-up, warm-up and `worker_type="auto"`\'s hand-over fall in the',
        'first half and in the first-batch time). "first" is the loader built to its first',
        "batch (imports and one garbage collection done before); PSS is the peak of the process",
        "tree, sampled every 100 ms. Every loader's batches are checked against torch's",
        "in-process batches; ‡ marks a loader whose batches differ (not like for like). Ratios",
        "are against torch with fork.",
        "",
        *_peers_reps(data),
        *_provenance(data),
        f"![samples/s per workload and loader]({PLOTS}/{png})",
        "",
        *_table(["loader", *names], _peer_rows(summary, workloads, loaders, throughput)),
        *_table(["first batch / peak PSS", *names], _peer_rows(summary, workloads, loaders, start)),
        '`worker_type="auto"` against the best loader with the same batches (throughput),',
        "torch with fork (first batch) and the leanest loader with the same batches (peak PSS):",
        "",
        *_table(["workload", "throughput", "first batch vs torch fork", "peak PSS"], goals),
    ]

    def plot(out: Path) -> None:
        import matplotlib.pyplot as plt

        fig, grid = plt.subplots(
            1, len(workloads), figsize=(4 * len(workloads), 4.5), sharey=True, squeeze=False
        )
        axes = grid[0]  # a row of Axes, one workload included
        for ax, w in zip(axes, workloads, strict=True):
            kinds = [k for k in loaders if summary[w].get(k, {}).get("rate")]
            rates = [summary[w][k]["rate"] for k in kinds]
            colors = [
                "tab:red" if k == "sl-auto" else "tab:orange" if k.startswith("sl-") else "tab:gray"
                for k in kinds
            ]
            ax.barh(range(len(kinds)), rates, color=colors)
            ax.set_yticks(range(len(kinds)), [PEER_NAMES[k].strip("*") for k in kinds], fontsize=8)
            ax.set_title(WORKLOAD_NAMES[w], fontsize=10)
            ax.set_xlabel("samples/s")
            ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k" if x >= 1000 else f"{x:g}")
            ax.tick_params(axis="x", labelsize=7)
        axes[0].invert_yaxis()  # shared: once for all, torch first
        fig.suptitle("Steady-state samples/s, 2 workers (medians)", fontsize=11)
        fig.tight_layout()
        fig.savefig(out / png, dpi=100)
        plt.close(fig)

    return lines, [(png, plot)]


SHORT_WORKLOAD_NAMES = {
    "jpeg": "JPEG decode + resize",
    "python": "~2 ms pure Python",
    "tiny": "tiny (16 floats + int)",
    "big": "19 MB batches (3x224x224 float32)",
}


def _peers_short(data: dict[str, Any]) -> list[str]:
    """The short epoch's table, from ``short_summary``; nothing when the file has none."""
    summary = data.get("short_summary")
    if not summary:
        return []
    shapes = data.get("short_workloads", {})

    def rates(r: dict[str, Any] | None) -> str:
        if not r or r.get("rate") is None:
            return "-"
        mark = "" if r.get("same", True) else " ‡"
        return f"{_rate(r['rate'])} / {_rate(r['epoch_rate'])}{mark}"

    def first(r: dict[str, Any] | None) -> str:
        return "-" if not r or r.get("first_s") is None else f"{r['first_s'] * 1e3:,.0f} ms"

    def ratio(auto: dict[str, Any], rows: dict[str, Any], key: str) -> str:
        fixed = [rows[k][key] for k in ("sl-process", "sl-thread") if rows.get(k, {}).get(key)]
        return f"{auto[key] / max(fixed):.2f}x" if fixed and auto.get(key) else "-"

    table = []
    for w in [w for w in WORKLOAD_NAMES if w in summary]:
        rows = summary[w]
        label = SHORT_WORKLOAD_NAMES.get(w, w)
        if w in shapes:
            size, batches = shapes[w]["batch_size"], shapes[w]["batches"]
            label += f", batch {size}, {size * batches:,} samples ({batches} batches)"
        peers = {
            k: r
            for k, r in rows.items()
            if not k.startswith("sl-") and r.get("rate") and r.get("same")
        }
        best = max(peers, key=lambda k: peers[k]["rate"]) if peers else None
        auto = rows.get("sl-auto") or {}
        table.append(
            [
                label,
                rates(rows.get("sl-process")),
                rates(auto),
                rates(rows.get("sl-thread")),
                f"{rates(peers[best])} ({PEER_NAMES.get(best, best)})" if best else "-",
                first(rows.get("torch-fork")),
                first(rows.get("sl-process")),
                first(auto),
                f"{ratio(auto, rows, 'rate')} / {ratio(auto, rows, 'epoch_rate')}",
            ]
        )
    return [
        "A short first epoch (each run a fresh process, about 60 batches; tiny: 782 batches of",
        "256, as 60 would last 50 ms): samples/s from the first batch's arrival to the last",
        "batch, then over the whole epoch, timed from just before the loader is built to its",
        "last batch (what a validation pass costs: start-up,",
        '`worker_type="auto"`\'s measurement and hand-over included). "processes (default)" is',
        'steadyload\'s default `worker_type="process"`; the best peer is the fastest loader',
        "other than steadyload's with the same batches (from the first batch). The last column",
        "is auto against the better of steadyload's two fixed choices (processes, threads), on",
        "each measure.",
        "",
        *_table(
            [
                "workload",
                "processes (default): samples/s from the first batch / over the epoch",
                "auto",
                "threads",
                "best peer",
                "torch fork first batch",
                "default first batch",
                "auto first batch",
                "auto / better fixed: from the first batch / epoch",
            ],
            table,
        ),
    ]


def kept_tensors(data: dict[str, Any]) -> Section:
    res = data["results"]

    def med(section: str, kind: str) -> float:
        values = sorted(res[section][kind])
        return values[len(values) // 2]

    rows = []
    n = data["batches_kept"]
    if "mem_shared_mib" in res:
        rows.append(
            [
                (f"labels of {n} batches of 19 MB images kept: shared memory held after the epoch"),
                f"{med('mem_shared_mib', 'torch'):.1f} MiB",
                f"{med('mem_shared_mib', 'steadyload'):.1f} MiB",
            ]
        )
    if "mem_fds" in res:
        rows.append(
            [
                "the same: descriptors held",
                f"+{med('mem_fds', 'torch'):.0f}",
                f"+{med('mem_fds', 'steadyload'):.0f}",
            ]
        )
    for section, label, unit in (
        ("images", "19 MB batches", "batches/s"),
        ("tiny", "tiny samples, batch 64", "samples/s"),
        ("many_small", "32 small tensors per sample, batch 32", "samples/s"),
    ):
        t, s = med(section, "torch"), med(section, "steadyload")
        rows.append([label, f"{_rate(t)} {unit}", f"{_rate(s)} {unit} ({s / t:.2f}x)"])
    lines = [
        "## What kept tensors cost",
        "",
        "What the tensors a training loop keeps cost, and the transport figures that must not",
        "regress: 2 workers, the memory run with each loader in a fresh process, throughput",
        "interleaved in one process (torch with fork), timed from the first batch to the last.",
        "",
        *_provenance(data),
        *_table(["measurement", "torch", "steadyload"], rows),
        *_notes(data),
    ]
    return lines, []


def recipe_start(data: dict[str, Any]) -> Section:
    med = data["medians"]
    names = {
        "forkserver": "torch, forkserver",
        "fork": "torch, fork (not GPU-safe)",
        "steadyload": "steadyload, loader built before the model",
        "steadyload-prestart": "steadyload + `prestart()` as the script's first statement",
    }
    base = med["forkserver"]
    rows = [
        [
            names[k],
            f"{m['wait_s']:.2f} s",
            f"{m['wait_s'] / base['wait_s']:.2f}x",
            f"{m['script_s']:.2f} s",
            f"{m['script_s'] / base['script_s']:.2f}x",
        ]
        for k, m in med.items()
    ]
    model_s = med.get("steadyload", base)["model_s"]
    lines = [
        "## First batch of a script shaped like the LoRA recipe",
        "",
        "A script shaped like the LoRA recipe (torch, transformers and peft imported at the",
        "top, dataset in `__main__`, loader built with 2 workers, then a Qwen2 model built from",
        "a config and wrapped with LoRA, then the first batch), each variant in fresh",
        "processes: the wait for the first batch inside `next()`, and the script's start to",
        "the first batch.",
        "",
        *_provenance(data),
        *_table(
            [
                f"variant (medians of {data['reps']}, model build {model_s:.2f} s)",
                "first-batch wait",
                "ratio",
                "script start to first batch",
                "ratio",
            ],
            rows,
        ),
        *_notes(data),
    ]
    return lines, []


def recovery(data: dict[str, Any]) -> Section:
    m = data["medians"]
    rows = [
        ["epoch without a fault", f"{m['clean_epoch_s']:.3f} s"],
        [
            "epoch with worker 0 SIGKILLed after the 10th batch",
            (
                f"{m['faulty_epoch_s']:.3f} s "
                f"(+{(m['faulty_epoch_s'] - m['clean_epoch_s']) * 1e3:.0f} ms)"
            ),
        ],
        ["kill to the next batch in the loop", f"{m['next_s'] * 1e3:.1f} ms"],
        [
            "kill to every batch the dead worker held delivered again",
            f"{m['recovered_s'] * 1e3:.0f} ms",
        ],
        ["torch's DataLoader with the same kill", f"the epoch is lost: `{data['torch_error']}`"],
    ]
    lines = [
        "## Recovery from a worker killed mid-epoch",
        "",
        "An epoch of 400 samples (about 2 ms of work each, batch 4, 2 workers) without a fault",
        "and with worker 0 SIGKILLed from outside after the 10th batch, interleaved; medians",
        f"of {data['reps']}.",
        "",
        *_provenance(data),
        *_table(["steadyload", "time"], rows),
        *_notes(data),
    ]
    return lines, []


MEMORY_NAMES = {
    "fork": "(i) torch + list, fork",
    "forkserver": "(ii) torch + list, forkserver",
    "steadyload": "(iii) steadyload + SharedList (the default start: the zygote here)",
    "zygote": '(iv) steadyload + SharedList, `start_method="zygote"`',
}

MEMORY_SHORT = {
    "fork": "torch + list,\nfork",
    "forkserver": "torch + list,\nforkserver",
    "steadyload": "SharedList,\nforkserver",
    "zygote": "SharedList,\nzygote",
}


def memory(data: dict[str, Any]) -> Section:
    variants = data["variants"]

    def gib(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x / GIB:.{digits}f} GiB"

    rows = []
    for kind, v in variants.items():
        paid = (
            "-"
            if v["metadata_paid"] is None
            else f"{gib(v['metadata_paid'], 3)} for a {gib(v['shared'], 3)} SharedList "
            f"({v['metadata_paid'] / v['shared']:.2f}x)"
        )
        rows.append(
            [
                MEMORY_NAMES.get(kind, kind),
                gib(v["before"]),
                gib(v["first"]),
                gib(v["end"]),
                f"{v['ratio']:.2f}x",
                f"{v['growth']:+.1%}",
                gib(v["empty_end"]),
                gib(v["fixed_cost"], 3),
                paid,
            ]
        )
    png = "memory.png"
    lines = [
        "## Memory of metadata records over an epoch",
        "",
        f"{data['records']:,} metadata dicts, batch 1024, 2 persistent workers: total PSS of",
        "the parent, the fork server or zygote (if any) and the workers, before the loader, at",
        "the first batch and at the end of the epoch; growth over the epoch; the same loader's",
        "total over a 2-record dataset (the fixed cost of the server and the workers, which",
        "isolates what the metadata costs). Each variant runs in fresh processes; medians of",
        f"{data['repeat']}.",
        "",
        *_provenance(data),
        f"![total PSS before, at the first batch and at the end of the epoch]({PLOTS}/{png})",
        "",
        *_table(
            [
                "variant",
                "before the loader",
                "first batch",
                "end of epoch",
                "end / before",
                "growth over the epoch",
                "same loader, 2 records",
                "fixed cost of the workers",
                "metadata paid",
            ],
            rows,
        ),
        *_notes(data),
    ]

    def plot(out: Path) -> None:
        import matplotlib.pyplot as plt

        kinds = list(variants)
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.27
        for i, (key, label) in enumerate(
            (("before", "before the loader"), ("first", "first batch"), ("end", "end of epoch"))
        ):
            ax.bar(
                [x + (i - 1) * width for x in range(len(kinds))],
                [variants[k][key] / GIB for k in kinds],
                width,
                label=label,
            )
        ax.set_xticks(range(len(kinds)), [MEMORY_SHORT.get(k, k) for k in kinds], fontsize=8)
        ax.set_ylabel("total PSS [GiB]")
        ax.set_title(f"{data['records']:,} metadata records, 2 workers (medians)", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / png, dpi=100)
        plt.close(fig)

    return lines, [(png, plot)]


def shared_list(data: dict[str, Any]) -> Section:
    rows = []
    for kind, m in data["ns_per_read"].items():
        rows.append(
            [
                kind,
                f"{m['list']:.0f}",
                f"{m['shared']:.0f}",
                f"{m['shared'] / m['list']:.1f}x",
                f"{m['list_ds']:.0f} / {m['shared_ds']:.0f}",
                f"{m['shared_ds'] / m['list_ds']:.1f}x",
            ]
        )
    lines = [
        "## SharedList random reads",
        "",
        f"Random reads from {data['records']:,} records: CPU time per read in ns, best of 7",
        "rounds, the variants interleaved; directly (`rows[i]`) and through a Dataset's",
        "`__getitem__` (what a DataLoader does). Ratios are SharedList / list.",
        "",
        *_provenance(data),
        *_table(
            [
                "records",
                "Python list",
                "SharedList",
                "ratio",
                "through `__getitem__`: list / SharedList",
                "ratio",
            ],
            rows,
        ),
        *_notes(data),
    ]
    return lines, []


def short_epoch(data: dict[str, Any]) -> Section:
    medians = data["medians"]
    fork = medians["torch-fork"]
    names = {
        "torch-fork": "torch, fork",
        "sl-process": "steadyload, processes",
        "sl-thread": "steadyload, threads",
        "sl-auto": "steadyload, auto",
    }
    rows = [
        [label, f"{medians[k]:,.0f}/s", f"{medians[k] / fork:.2f}x"]
        for k, label in names.items()
        if k in medians
    ]
    lines = [
        "## A short first epoch of GIL-bound work",
        "",
        f"{data['samples']:,} samples of about 2 ms of pure Python each (a 4-element tensor),",
        "batch 32, 2 workers, the first epoch of a fresh process: the clock runs from the",
        "loader's construction to the epoch's end, so a fork server's start and",
        '`worker_type="auto"`\'s measurement and hand-over count. Repetitions interleaved;',
        (
            f"medians. auto against the better of steadyload's fixed choices: "
            f"{data['auto_ratio']:.2f}x (the goal: at least 0.9x)."
        ),
        "",
        *_provenance(data),
        *_table(["loader", "samples/s", "vs torch fork"], rows),
        *_notes(data),
    ]
    return lines, []


def auto_choice(data: dict[str, Any]) -> Section:
    names = {
        "jpeg": "JPEG decode + resize",
        "big": "19 MB batches",
        "py-op-0.2": "0.2 ms Python, then a torch op",
        "py-op-0.45": "0.45 ms Python, then a torch op",
        "py-op-1": "1 ms Python, then a torch op",
        "python-2": "2 ms pure Python",
    }
    rows = []
    for workload, s in data["summary"].items():
        faster = {"either": "either (within 10%)", "thread": "threads", "process": "processes"}[
            s["faster"]
        ]
        rows.append(
            [
                names.get(workload, workload),
                _rate(s["thread"]),
                _rate(s["process"]),
                faster,
                f"{s['chose_thread']} / {s['chose_process']}",
                f"{s['right']} of {s['runs']}",
            ]
        )
    hog = data.get("hog")
    lines = [
        "## What auto chooses, run after run" + (", on a busy machine" if hog else ""),
        "",
        'Each run a fresh process: `worker_type="auto"`\'s choice, against the rates of fixed',
        f"thread and process workers (2 workers, batch {data['batch']}, persistent workers,",
        "the second epoch timed, medians). A choice is right when it is the faster kind, or",
        "either kind when they are within 10%."
        + (" A CPU-bound process ran beside every run." if hog else ""),
        "",
        *_provenance(data),
        *_table(
            [
                "workload",
                "threads, samples/s",
                "processes, samples/s",
                "faster",
                "auto chose threads / processes",
                "right",
            ],
            rows,
        ),
        *_notes(data),
    ]
    return lines, []


REMOTE_FAULTS = {
    "sl-node": "steadyload, node removed",
    "sl-sigkill": "steadyload, actor SIGKILLed",
    "torch-sigkill": "torch, worker SIGKILLed",
    "raydata-node": "Ray Data, node removed",
}


def _workers_label(name: str) -> str:
    """``sl-local-2`` -> "0 remote (2 local processes)", ``sl-remote-4`` -> "4 remote"."""
    kind, _, k = name.rpartition("-")
    if kind == "sl-local":
        return f"0 remote ({k} local process{'' if k == '1' else 'es'})"
    return f"{k} remote" if kind == "sl-remote" else name


def _secs(x: float | None, unit: str = "s", scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f} {unit}"


def _gap(params: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The first epoch after the script's set-up: prestarted actors, cold ones, Ray Data."""
    gap = summary.get("gap")
    if not gap:
        return []
    labels = {
        "sl-prestarted": "steadyload, actors prestarted at build (default)",
        "sl-cold": "steadyload, `RemoteWorkers(prestart=False)`",
        "raydata": "Ray Data",
    }
    rows = []
    for name, g in gap.items():
        kind, _, k = name.rpartition("-")
        if g.get("first_s") is None:
            rows.append([f"{labels.get(kind, kind)}, {k} workers", "failed", "-", "-", "-"])
            continue
        rows.append(
            [
                f"{labels.get(kind, kind)}, {k} workers",
                _secs(g["first_s"]),
                _secs(g["epoch_s"]),
                _rate(g["epoch_rate"]),
                f"{g['vs_raydata']:.2f}x" if g.get("vs_raydata") else "-",
            ]
        )
    return [
        (
            f"The first epoch {params['gap_s']:g} s after the loader was built (the training "
            "script's own set-up"
        ),
        "between the two, a sleep here: the CPU free, as while a model loads), timed from",
        "`iter()`, on the scaling workload: a loader built while the process is connected to",
        "Ray starts its actors then (they are placed and import torch during the set-up),",
        "against actors started by the first iteration, and Ray Data's pipeline built before",
        "the set-up. samples/s is over the whole epoch, the first batch included.",
        "",
        *_table(
            ["loader", "first batch", "epoch", "samples/s over the epoch", "against Ray Data"], rows
        ),
    ]


def remote(data: dict[str, Any]) -> Section:
    params, summary = data["params"], data["summary"]
    reps = params["reps"]

    scaling = []
    for name, r in summary["scaling"].items():
        rate, ideal = r.get("rate"), r.get("ideal")
        mark = "" if r.get("same", True) else " ‡"
        if rate is None:
            cells = ["failed", _rate(ideal) if ideal else "-", "-", "-"]
        else:
            cells = [
                f"{_rate(rate)}{mark}" + (f" ({rate / ideal:.2f}x)" if ideal else ""),
                _rate(ideal) if ideal else "-",
                _secs(r.get("first_s")),
                _secs(r.get("cpu_ms"), "ms"),
            ]
        k = name.rpartition("-")[2]
        rd_runs = (
            data.get("scaling", {}).get(f"raydata-{k}") if name.startswith("sl-remote-") else None
        )
        if r.get("raydata_rate"):
            epoch = r.get("ratio_epoch")
            cells += [
                _rate(r["raydata_rate"]) + ("" if r.get("raydata_all_rows", True) else " ‡"),
                f"{_secs(r.get('raydata_first_s'))} / {_secs(r.get('raydata_cpu_ms'), 'ms')}",
                f"{r['ratio_steady']:.2f}x / " + (f"{epoch:.2f}x" if epoch is not None else "-"),
            ]
        elif rd_runs:
            cells += ["failed", "-", "-"]
        else:
            cells += ["-", "-", "-"]
        scaling.append([_workers_label(name), *cells])

    jpeg_sum = summary.get("jpeg", {})
    jpeg_local = next(
        (r for n, r in jpeg_sum.items() if n.startswith("sl-local-") and isinstance(r, dict)), {}
    )
    jpeg = []
    for name, r in jpeg_sum.items():
        if not isinstance(r, dict):
            continue
        rate, base = r.get("rate"), jpeg_local.get("rate")
        ratio = f" ({rate / base:.2f}x)" if rate and base and name.startswith("sl-remote-") else ""
        jpeg.append(
            [
                _workers_label(name).removeprefix("0 remote (").removesuffix(")"),
                f"{_rate(rate)}{ratio}" if rate else "failed",
                _secs(r.get("first_s")),
                _secs(r.get("epoch_s")),
                _secs(r.get("cpu_ms"), "ms"),
            ]
        )

    workloads = {
        "sleep": f"{params['sleep_ms']:g} ms wait per sample, batch {params['batch']}",
        "jpeg": f"JPEG decode + resize, batch {params['jpeg_batch']}",
    }
    overhead = []
    for name, o in summary.get("overhead", {}).items():
        firsts = [
            r["first_s"]
            for r in data.get("overhead", {}).get(name, [])
            if r.get("first_s") is not None
        ]
        overhead.append(
            [
                workloads.get(name, name),
                f"{_secs(o['p50_ms'], 'ms')} / {_secs(o['p99_ms'], 'ms')} ({o['n']} batches)",
                f"{_secs(o['collector_p50_ms'], 'ms')} / {_secs(o['collector_p99_ms'], 'ms')}",
                f"{o['bytes_back_per_sample']:,.0f} B / {o['bytes_sent_per_sample']:,.0f} B",
                _secs(statistics.median(firsts) if firsts else None),
            ]
        )

    fault_rows = summary.get("faults", {})
    faults = []
    for key in [
        *(k for k in REMOTE_FAULTS if k in fault_rows),
        *(k for k in fault_rows if k not in REMOTE_FAULTS),
    ]:
        f = fault_rows[key]
        if not isinstance(f, dict) or "delivered" not in f:
            continue
        stall = (
            "-"
            if f.get("stall_s") is None
            else (
                f"{f['stall_s']:.2f} s"
                + (f" ({f['normal_gap_s'] * 1e3:.0f} ms)" if f.get("normal_gap_s") else "")
            )
        )
        faults.append(
            [
                REMOTE_FAULTS.get(key, key),
                f"{f['delivered']} of {f['n']}",
                str(f["lost"]),
                str(f["duplicated"]),
                "yes" if f["in_order"] else "no",
                stall,
                f"`{f['error'].replace('|', '/')}`" if f.get("error") else "completed",
            ]
        )

    lines = [
        "## Remote workers",
        "",
        "steadyload's remote workers (Ray actors) against local process workers, Ray Data and",
        "torch, in one run: one Ray cluster on loopback, a head with no CPU (the training",
        "process) and two 1-CPU worker nodes. Each remote worker is an actor asking for",
        (
            f"{params['num_cpus_per_actor']:g} CPU; the loaders are remote-only "
            "(`num_workers=0`). Every epoch is a"
        ),
        "fresh loader, so starting its actors counts. The nodes, Ray's own processes and the",
        "training process share the machine's cores: the wait-bound workload shows how the",
        "protocol scales, not how CPUs do. "
        + (
            f"Repetitions interleaved, medians of {reps}."
            if reps > 1
            else "One repetition of each configuration."
        ),
        "",
        *_provenance(data),
        (
            f"Scaling, on a workload that waits {params['sleep_ms']:g} ms per sample "
            "(the CPU free), batch"
        ),
        (
            f"{params['batch']}, {params['samples_per_worker']} samples per worker. "
            "samples/s is the steady rate, from the k-th"
        ),
        "batch to the last (in brackets: against the linear ideal, k times the rate of one",
        "local process worker). The first batch is timed from right after building the loader",
        "(Ray was just asked for its actors). Trainer CPU is the training process's CPU time",
        "per batch over the same batches (a local worker's own CPU is not in it; Ray Data's",
        "threads in that",
        "process are). Ray Data runs the same wait in `map_batches` over k tasks with the same",
        "CPU share, read with `iter_torch_batches`; the ratio is steadyload's samples/s over",
        "Ray Data's, steady and over the whole epoch. ‡ marks an epoch whose batches were not",
        "torch's in torch's order (for Ray Data, whose order is its own: not every row once).",
        "",
        *_table(
            [
                "workers",
                "samples/s (vs linear)",
                "linear ideal",
                "first batch",
                "trainer CPU per batch",
                "Ray Data, k tasks: samples/s",
                "Ray Data: first batch / trainer CPU per batch",
                "steadyload / Ray Data: steady / whole epoch",
            ],
            scaling,
        ),
        *_gap(params, summary),
        (
            f"JPEG decode + resize to 224x224, batch {params['jpeg_batch']}, "
            f"{params['jpeg_samples']} samples: local process"
        ),
        "workers against as many remote workers on the same cores (in brackets: remote against",
        "local).",
        "",
        *_table(["workers", "samples/s", "first batch", "epoch", "trainer CPU per batch"], jpeg),
        "Overhead per batch, 2 remote workers with `prefetch_factor=1` (no task waits behind",
        "another in an actor): the added latency is the time from sending a task to the",
        "iterator having its batch, less the time the actor spent loading it; beside it, the",
        "same up to the collector thread receiving the batch. The first task of each actor (it",
        "waits for the actor's start) is left out. Bytes per sample are the pickled size of",
        "what a task returns and of what is sent to it.",
        "",
        *_table(
            [
                "workload",
                "added latency p50 / p99",
                "at the collector thread p50 / p99",
                "bytes per sample back / sent",
                "first batch",
            ],
            overhead,
        ),
        (
            f"After a fault: an epoch of {params['fault_samples']} samples, batch 4, "
            "the same wait per sample, 2"
        ),
        "workers (Ray Data: 2 tasks). After the 10th batch, from another thread while the loop",
        "keeps iterating, a node is removed (that of remote worker 0, or the one that made Ray",
        "Data's latest batch) or a worker process is SIGKILLed. Samples delivered, lost and",
        "duplicated are counted against the expected sequence; the stall is the longest gap",
        "between batches from the fault on (in brackets: the mean gap before it).",
        "",
        *_table(
            [
                "loader, fault",
                "delivered",
                "lost",
                "duplicated",
                "order kept",
                "stall (gap before)",
                "the epoch",
            ],
            faults,
        ),
        *_notes(data),
    ]
    return lines, []


STATE_DICT_WORKLOADS = {
    "map": "map-style, `shuffle=True`, `generator=`, 0 workers",
    "map-w2": "map-style, `shuffle=True`, `generator=`, 2 workers",
    "stream-w2": "Stateful IterableDataset, 2 workers",
    "dist-w2": "DistributedSampler (2 replicas, rank 0), 2 workers",
}
STATE_DICT_MEASURES = {
    "after_next": "`state_dict()` after a `next()`",
    "repeated": "`state_dict()` again, same position",
    "next": "`next()` itself",
}


def state_dict(data: dict[str, Any]) -> Section:
    summary, results = data["summary"], data["results"]
    rows = []
    for w, by_measure in summary.items():
        for m, label in STATE_DICT_MEASURES.items():
            r = by_measure[m]
            rows.append(
                [
                    STATE_DICT_WORKLOADS.get(w, w),
                    label,
                    f"{r['steadyload']:.2f}",
                    f"{r['torchdata']:.2f}",
                    f"{r['ratio']:.2f}x",
                ]
            )
        sizes = results[w]
        rows.append(
            [
                STATE_DICT_WORKLOADS.get(w, w),
                "the state, pickled (bytes)",
                f"{sizes['steadyload']['state_bytes']:,}",
                f"{sizes['torchdata']['state_bytes']:,}",
                "-",
            ]
        )
    load = data.get("load_average")
    torchdata = f"torchdata {data['torchdata']}" if data.get("torchdata") else "torchdata"
    batch, calls, rounds = data["batch_size"], data["calls"], data["rounds"]
    timer = data["timer_ns"]
    lines = [
        "## state_dict() per call against torchdata",
        "",
        "What saving the loader's position at every training step costs: `loader.state_dict()`",
        f"mid-epoch, steadyload against torchdata's `StatefulDataLoader` ({torchdata}, in the",
        f"bench-only `.venv-peers`), the same workloads in one process, batch {batch}. Each",
        f"round times {calls:,} calls of each loader in turn (the order alternating), {rounds}",
        f"rounds; every call is timed on its own (`perf_counter_ns`, {timer:.0f} ns of it",
        'included). "After a `next()`" is the save of a loop that saves every step (a new',
        'position each time); "again" calls it repeatedly at one position; `next()` is there',
        "for scale. Medians, in µs per call; the ratio is steadyload / torchdata (above 1:",
        "steadyload costs more)."
        + (f" Load average (1 min): {load[0]:.2f} before, {load[1]:.2f} after." if load else ""),
        "",
        *_provenance(data),
        *_table(
            ["workload", "measure", "steadyload µs", "torchdata µs", "steadyload / torchdata"], rows
        ),
        *_notes(data),
    ]
    return lines, []


def ledger(data: dict[str, Any]) -> Section:
    rows = [
        [name, f"{r['epoch_s_without']:.3f}", f"{r['epoch_s_with']:.3f}",
         f"{r['overhead']:+.1%}", f"{r['bytes_per_sample']:.2f}", f"{r['bytes_per_step']:.0f}"]
        for name, r in data["results"].items()
    ]  # fmt: skip
    lines = [
        "## The ledger's cost",
        "",
        "What `ledger=` costs (benchmarks/bench_ledger.py): the peers benchmark's tiny-batch",
        f"workload ({data['batch_size']} samples of 16 floats and an int per batch,",
        f"{data['batches']:,} batches, one epoch per run, `shuffle=True`), steadyload without",
        "and with a ledger, interleaved (the order alternating), median of",
        f"{data['rounds']} rounds; the ledger's size on disk per sample and per step.",
        "",
        *_provenance(data),
        *_table(
            [
                "loader",
                "without, s",
                "with ledger, s",
                "overhead",
                "bytes per sample",
                "bytes per step",
            ],
            rows,
        ),  # fmt: skip
        *_notes(data),
    ]
    return lines, []


def device(data: dict[str, Any]) -> Section:
    shape = "GPU" if data["gpu"] else "CPU (no GPU: `device=\"cpu\"`, the same stage, no copy)"
    rows = []
    for key, s in data["summary"].items():
        if "error" in s:
            rows.append([key, "failed: " + s["error"], "", "", "", ""])
            continue
        bound = max(s["compute_s"], s.get("copy_alone_s", 0.0))
        h2d = f"{s['h2d_of_peak']:.0%}" if "h2d_of_peak" in s else "-"
        rows.append(
            [key.replace("/", ", "), f"{s['step_s'] * 1e3:.1f}", f"{bound * 1e3:.1f}",
             f"{s['step_over_bound']:.2f}x", h2d,
             f"{s['loop_cpu_s'] * 1e3:.2f} / {s['helper_cpu_s'] * 1e3:.2f}"]
        )  # fmt: skip
    lines = [
        "## The device stage",
        "",
        "Is the copy to the device hidden? (benchmarks/bench_device.py; the guide:",
        "[feeding the GPU](guide/feeding-the-gpu.md)). A synthetic training step (matmuls",
        "sized to about 40 ms) fed by 4 MB and 20 MB batches, 2 workers, each loader a fresh",
        "process, interleaved; medians of the steady half. `torch-pin`: torch's loader with",
        "`pin_memory=True` and `.to(device, non_blocking=True)` in the loop; `sl-device`:",
        "steadyload with `device=`; `tnt-prefetch`: torchtnt's `CudaDataPrefetcher`. The",
        "bound is max(compute, copy), each measured alone in the same run; CPU per batch is",
        "the training thread's and the loader's helper thread's (torch's pin thread,",
        "steadyload's stage thread).",
        "",
        f"Shape measured: {shape}.",
        "",
        *_provenance(data),
        *_table(
            ["batch, loader", "step, ms", "bound, ms", "step / bound", "H2D of peak",
             "CPU per batch: loop / helper, ms"],
            rows,
        ),  # fmt: skip
        *_notes(data),
    ]
    return lines, []


SECTIONS: dict[str, Callable[[dict[str, Any]], Section]] = {
    "foundation": foundation,
    "peers": peers,
    "kept_tensors": kept_tensors,
    "recipe_start": recipe_start,
    "recovery": recovery,
    "memory": memory,
    "shared_list": shared_list,
    "short_epoch": short_epoch,
    "auto_choice": auto_choice,
    "auto_choice_hog": auto_choice,
    "remote": remote,
    "state_dict": state_dict,
    "ledger": ledger,
    "device": device,
}

HEADER = [
    "<!-- Generated by `python3 benchmarks/render_docs.py` from benchmarks/results/*.json:",
    "     do not edit by hand (tests/unit/test_docs.py checks it). -->",
    "# Benchmarks",
    "",
    "This page is generated by `python3 benchmarks/render_docs.py` from the JSON files in",
    "[benchmarks/results/](../benchmarks/results/); do not edit it by hand. Each table says",
    "where its figures come from: the command that measured them, the date, the commit and",
    "the machine. To publish new figures, run a benchmark with",
    "`--json benchmarks/results/NAME.json`, then the renderer. Every benchmark compares",
    "loaders in one run on one machine, so the ratios are the figures to read; absolute",
    "rates depend on the machine.",
    "",
]


def render(results: Path, out: Path, plots: bool = True) -> Path:
    """Write ``out/benchmarks.md`` (and, with ``plots``, ``out/benchmarks/*.png``)."""
    lines = list(HEADER)
    toc: list[str] = []
    figures: list[tuple[str, Plot]] = []
    for name, section in SECTIONS.items():
        path = results / f"{name}.json"
        if not path.exists():
            continue
        body, section_plots = section(json.loads(path.read_text()))
        title = body[0].removeprefix("## ")
        anchor = "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")
        toc.append(f"- [{title}](#{anchor}) (`benchmarks/results/{name}.json`)")
        lines += body
        figures += section_plots
    lines[len(HEADER) : len(HEADER)] = [*toc, ""]
    page = out / "benchmarks.md"
    page.write_text("\n".join(lines).rstrip() + "\n")
    if plots and figures:
        import matplotlib

        matplotlib.use("Agg")
        (out / PLOTS).mkdir(exist_ok=True)
        for _, plot in figures:
            plot(out / PLOTS)
    return page


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=DOCS)
    ap.add_argument("--no-plots", action="store_true", help="write the page only")
    args = ap.parse_args()
    print(render(args.results, args.out, plots=not args.no_plots))


if __name__ == "__main__":
    main()
