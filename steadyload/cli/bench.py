"""`steadyload bench module:factory`: measure a dataset and recommend num_workers.

The measuring is `_bench_run.bench`; this module loads the factory, shows a
progress bar and a table (rich, on stderr and stdout), or prints ``--json`` (schema
version 1, nothing else on stdout), and draws ``--plot`` with matplotlib (an optional
extra). torch, rich and matplotlib are imported on dispatch, not at module level.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._bench_run import BenchResult

PLOT_INSTALL = "pip install 'steadyload[plot]'"


class UsageError(Exception):
    """A command-line argument that cannot be used; the message says why and the fix."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``steadyload bench`` and its options."""
    p = subparsers.add_parser(
        "bench", help="measure a dataset with 0..CPUs workers and recommend num_workers",
        description="Measure a dataset: per-sample time in this process, then samples/s, "
        "start time and per-worker memory for num_workers 0, 1, 2, ... up to the usable "
        "CPUs, with steadyload and with torch's DataLoader; recommend num_workers and "
        "prefetch_factor, with the reason.")
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="a function returning the dataset, called without arguments: "
                   "pkg.data:make_dataset or path/to/file.py:make_dataset (workers import "
                   "the module, so keep training code under `if __name__ == '__main__':`)")
    p.add_argument("--collate", metavar="MODULE:FN", help="collate_fn, as MODULE:FACTORY")
    p.add_argument("--batch-size", type=int, default=32, help="as in training (default 32)")
    p.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                   help="bound on the whole run (default 60); configurations that do not "
                   "fit are listed as not measured")
    p.add_argument("--max-workers", type=int, metavar="N",
                   help="highest worker count to measure (default: the usable CPUs)")
    p.add_argument("--no-torch", action="store_true",
                   help="skip torch's DataLoader (halves the configurations)")
    p.add_argument("--json", action="store_true", help="print the results as JSON only")
    p.add_argument("--plot", type=Path, metavar="OUT.png",
                   help=f"draw throughput and memory against num_workers ({PLOT_INSTALL})")


def load_object(spec: str, what: str) -> Any:
    """Import ``module:name`` or ``path/to/file.py:name`` and return the attribute.

    A file's directory (or, for a module name, the current directory, as ``python -m``
    does) is put on sys.path, so that workers can import the module by the same name.

    Raises:
        UsageError: for a malformed spec, a missing file or module, or a missing name.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise UsageError(f"{what} must look like 'package.module:function' or "
                         f"'path/to/file.py:function', got {spec!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name).resolve()
        if not path.is_file():
            raise UsageError(f"{what}: no such file {str(path)!r}")
        directory, module_name = str(path.parent), path.stem
    else:
        directory = os.getcwd()
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{what}: cannot import {module_name!r} ({exc}); run from the "
                         "directory that contains it, or give a path to the .py file") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"{what}: module {module_name!r} ({module.__file__}) has no "
                         f"attribute {attr!r}") from None


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table or JSON, and return the exit status.

    0: done; 1: no configuration could be measured; 2: bad arguments (message on stderr).
    """
    started = time.perf_counter()
    try:
        return _run(args, started)
    except UsageError as exc:
        print(f"steadyload bench: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, started: float) -> int:
    if not args.budget > 0:
        raise UsageError(f"--budget must be > 0 seconds, got {args.budget!r}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size!r}")
    if args.max_workers is not None and args.max_workers < 0:
        raise UsageError(f"--max-workers must be >= 0, got {args.max_workers!r}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401  (checked before spending the budget)
        except ImportError:
            raise UsageError(f"--plot needs matplotlib, which is not installed. Fix: "
                             f"{PLOT_INSTALL} (or pip install matplotlib)") from None
    factory = load_object(args.factory, "the dataset factory")
    collate = load_object(args.collate, "--collate") if args.collate else None
    dataset = factory()

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from . import _bench_run

    counts = None if args.max_workers is None else range(args.max_workers + 1)
    budget = args.budget - (time.perf_counter() - started)  # the import counts too
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("steadyload bench", total=None)

        def step(description: str, done: int, total: int) -> None:
            progress.update(task, description=description, completed=done, total=total)

        result = _bench_run.bench(dataset, name=args.factory, batch_size=args.batch_size,
                                  collate_fn=collate, budget_s=max(budget, 0.0),
                                  worker_counts=counts, compare_torch=not args.no_torch,
                                  on_step=step)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        Console(highlight=False).print(render(result))
    if args.plot is not None:
        plot(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0 if any(m.samples_per_s for m in result.measurements) else 1


def render(result: BenchResult) -> Any:
    """The results as a rich renderable: the table, then the recommendation."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ..host.system import gib
    from ..worker_count import fmt_s

    rows: dict[int, dict[str, Any]] = {}
    for m in result.measurements:
        rows.setdefault(m.num_workers, {})[m.loader] = m
    for kind, n in result.not_measured:
        rows.setdefault(n, {}).setdefault(kind, None)
    profile = result.profile
    table = Table(
        title=f"steadyload bench {result.dataset}: batch {result.batch_size}, "
        f"{result.cpus} usable CPUs, {fmt_s(profile.per_sample_s)} per sample in-process",
        caption=f"samples/s, start and memory are steadyload's (workers start with "
        f"{result.start_method}); threads: steadyload's with worker_type='thread'; torch: "
        "torch's samples/s, with {result.torch_start_method} "
        "(its default here); ratio: steadyload/torch. start: building the loader to its "
        "first batch (the first row with workers also starts the fork server, once per "
        "process). Memory per worker: USS (its own) / PSS (plus its share of shared pages).",
        caption_justify="left",
    )
    for header in ("workers", "samples/s", "threads", "torch", "ratio", "start", "torch start",
                   "USS/worker", "PSS/worker"):
        table.add_column(header, justify="right")

    def rate(m: Any) -> str:
        if m is None:
            return "not measured"
        return f"{m.samples_per_s:,.0f}" if m.samples_per_s else "failed (below)"

    for n in sorted(rows):
        sl, tc, th = (rows[n].get(k) for k in ("steadyload", "torch", "steadyload-thread"))
        ratio = (f"{sl.samples_per_s / tc.samples_per_s:.2f}x"
                 if sl and tc and sl.samples_per_s and tc.samples_per_s else "-")
        style = "bold green" if n == result.recommendation.num_workers else None
        table.add_row(str(n), rate(sl), rate(th) if "steadyload-thread" in rows[n] else "-",
                      rate(tc) if "torch" in rows[n] else "-", ratio,
                      fmt_s(sl.start_s) if sl else "-", fmt_s(tc.start_s) if tc else "-",
                      gib(sl.worker_uss_bytes) if sl and sl.worker_uss_bytes else "-",
                      gib(sl.worker_pss_bytes) if sl and sl.worker_pss_bytes else "-",
                      style=style)
    rec = result.recommendation
    lines = Text()
    pf = f", prefetch_factor={rec.prefetch_factor}" if rec.prefetch_factor else ""
    lines.append(f"Recommendation: num_workers={rec.num_workers}{pf}\n", style="bold")
    lines.append(f"  why: {rec.reason}\n  prefetch_factor: {rec.prefetch_reason}\n")
    if rec.num_workers:
        lines.append(f"  worker_type={rec.worker_type!r}: {rec.worker_type_reason}\n")
    if result.worker_type_choice:
        lines.append(f"  {result.worker_type_choice}\n")
    for m in result.measurements:
        if m.error:
            first = m.error.splitlines()[0]
            lines.append(f"  {m.loader} with {m.num_workers} workers failed: {first}\n")
    if result.not_measured:
        missing = ", ".join(f"{k} {n}" for k, n in result.not_measured)
        lines.append(f"  not measured within the {result.budget_s:.0f} s budget: {missing} "
                     "(raise --budget)\n")
    lines.append(f"  measured in {result.elapsed_s:.1f} s")
    return Group(table, lines)


def plot(result: BenchResult, path: Path) -> None:
    """Draw samples/s and worker memory against num_workers into ``path`` (PNG).

    Uses matplotlib's object API with the Agg canvas: no pyplot, no global backend change.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 6), layout="constrained")
    FigureCanvasAgg(fig)
    rate_ax, mem_ax = fig.subplots(2, 1, sharex=True)
    for kind, marker in (("steadyload", "o"), ("torch", "s")):
        ms = [m for m in result.measurements if m.loader == kind and m.samples_per_s]
        if ms:
            rate_ax.plot([m.num_workers for m in ms], [m.samples_per_s for m in ms],
                         marker=marker, label=kind)
    sl = [m for m in result.measurements
          if m.loader == "steadyload" and m.worker_uss_bytes and m.num_workers > 0]
    for attr, label in (("worker_uss_bytes", "USS"), ("worker_pss_bytes", "PSS")):
        pts = [(m.num_workers, m.num_workers * getattr(m, attr) / (1 << 20))
               for m in sl if getattr(m, attr)]
        if pts:
            mem_ax.plot(*zip(*pts, strict=True), marker="o", label=f"all workers, {label}")
    pick = result.recommendation.num_workers
    for ax in (rate_ax, mem_ax):
        ax.axvline(pick, linestyle="--", color="grey", label=f"recommended: {pick}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    rate_ax.set_ylabel("samples/s")
    rate_ax.set_title(f"steadyload bench {result.dataset} (batch {result.batch_size})")
    mem_ax.set_ylabel("worker memory [MiB]")
    mem_ax.set_xlabel("num_workers")
    mem_ax.xaxis.get_major_locator().set_params(integer=True)
    fig.savefig(path, format="png", dpi=100)
