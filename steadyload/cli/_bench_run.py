"""The measuring behind `steadyload bench`: run loaders, then recommend.

For each worker count, a steadyload loader and torch's with the same arguments: start
time, steady samples/s, per-worker memory (`measure`); the budget split over them
(`bench`); the recommendation with its reasons is `_bench_recommend.py`'s. No UI here:
`bench.py` renders `BenchResult` (rich, matplotlib). The per-sample probe and the
memory/CPU bounds are `steadyload.worker_count`'s, shared with ``num_workers="auto"``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..host.system import available_memory_bytes
from ..worker_count import SampleProfile, probe, usable_cpus
from ._bench_recommend import Measurement, Recommendation, recommend

MIN_SLOT_S = 0.5
"""A configuration given less time than this is not started (left unmeasured)."""


@dataclass(frozen=True, slots=True)
class BenchResult:
    """Everything `bench` measured; `to_json` is the stable ``--json`` schema (version 1)."""

    dataset: str
    batch_size: int | None
    cpus: int
    available_memory_bytes: int | None
    start_method: str
    torch_start_method: str
    budget_s: float
    elapsed_s: float
    profile: SampleProfile
    measurements: tuple[Measurement, ...]
    not_measured: tuple[tuple[str, int], ...]
    recommendation: Recommendation

    @property
    def worker_type_choice(self) -> str | None:
        """What ``worker_type="auto"`` chose in its run, with the figures (None: not run)."""
        return next((m.worker_type_choice for m in self.measurements if m.worker_type_choice), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; its keys are a stable schema (``"version": 1``)."""
        profile = asdict(self.profile)
        return {
            "version": 1,
            "dataset": self.dataset,
            "batch_size": self.batch_size,
            "cpus": self.cpus,
            "available_memory_bytes": self.available_memory_bytes,
            "start_method": self.start_method,
            "torch_start_method": self.torch_start_method,
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "per_sample_s": profile["per_sample_s"],
            "collate_s": profile["collate_s"],
            "measurements": [asdict(m) for m in self.measurements],
            "not_measured": [{"loader": k, "num_workers": n} for k, n in self.not_measured],
            "recommendation": asdict(self.recommendation),
            "worker_type_choice": self.worker_type_choice,
        }


def bench(
    dataset: Any,
    *,
    name: str = "",
    batch_size: int | None = 32,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    budget_s: float = 60.0,
    worker_counts: Sequence[int] | None = None,
    compare_torch: bool = True,
    on_step: Callable[[str, int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> BenchResult:
    """Measure ``dataset`` with every worker count and recommend one.

    First the per-sample time in this process, then for each count (0 to the usable CPUs
    unless ``worker_counts``) a steadyload loader and, when ``compare_torch``, torch's with
    the same arguments: start time, steady samples/s, per-worker memory. The budget [Unit:
    second] is re-split evenly over the configurations still to run, so a slow start is
    absorbed by the rest; those left less than `MIN_SLOT_S` are listed in ``not_measured``.
    ``on_step(description, done, total)`` is called before each configuration; ``clock``
    (seconds) is injectable for tests.
    """
    import multiprocessing

    from ..start.context import default_method

    started = clock()
    deadline = started + budget_s
    cpus = usable_cpus()
    counts = list(worker_counts) if worker_counts is not None else list(range(cpus + 1))
    kinds = (
        ["steadyload", "steadyload-thread", "torch"]
        if compare_torch
        else ["steadyload", "steadyload-thread"]
    )
    configs = [(kind, n) for n in counts for kind in kinds if n > 0 or kind != "steadyload-thread"]
    if max(counts, default=0) > 0:  # what "auto" chooses, at the most workers measured
        configs.append(("steadyload-auto", max(counts)))
    total = len(configs) + 1
    if on_step:
        on_step("per-sample time in this process", 0, total)
    profile = probe(
        dataset, batch_size, collate_fn, budget_s=min(1.0, 0.05 * budget_s), stream_ok=True
    )
    measured: list[Measurement] = []
    skipped: list[tuple[str, int]] = []
    for i, (kind, n) in enumerate(configs):
        slot = (deadline - clock()) / (len(configs) - i)
        if slot < MIN_SLOT_S:
            skipped = configs[i:]
            break
        if on_step:
            on_step(f"{kind}, {n} workers", i + 1, total)
        # Start-up, warm-up and shutdown take their share of the slot; the window the rest.
        window = slot * (0.8 if n == 0 else 0.5)
        measured.append(
            measure(
                kind,
                dataset,
                n,
                batch_size,
                collate_fn,
                window,
                timeout_s=max(10.0, deadline - clock()),
            )
        )
    if on_step:
        on_step("done", total, total)
    available = available_memory_bytes()
    return BenchResult(
        dataset=name or type(dataset).__name__,
        batch_size=batch_size,
        cpus=cpus,
        available_memory_bytes=available,
        start_method=default_method(),
        # torch uses the process default: the first of get_all_start_methods (fork on Linux
        # before Python 3.14).
        torch_start_method=multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_all_start_methods()[0],
        budget_s=budget_s,
        elapsed_s=clock() - started,
        profile=profile,
        measurements=tuple(measured),
        not_measured=tuple(skipped),
        recommendation=recommend(measured, profile, cpus, available, skipped),
    )


def measure(
    kind: str,
    dataset: Any,
    num_workers: int,
    batch_size: int | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    window_s: float,
    timeout_s: float = 60.0,
) -> Measurement:
    """Run one loader configuration for about ``window_s`` of steady loading and shut it down.

    Workers are persistent, so a small dataset's epochs follow each other without a restart
    (epoch boundaries stay in the window, as in training). The first batch times the start;
    one more batch per worker is warm-up (each worker's first batch was loaded in parallel
    with the first). Errors are recorded in ``error``, never raised.
    """
    import torch.utils.data

    from ..loader import DataLoader

    ours = kind.startswith("steadyload")
    options: dict[str, Any] = {"worker_type": kind.partition("-")[2] or "process"} if ours else {}
    cls = DataLoader if ours else torch.utils.data.DataLoader
    counter = _Counter(dataset, batch_size)
    loader: Any = None
    it: Any = None
    t0 = time.perf_counter()
    try:
        loader = cls(
            dataset,
            batch_size=batch_size,
            collate_fn=collate_fn,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            timeout=timeout_s if num_workers else 0,
            **options,
        )
        it = iter(loader)
        next(it)
        start_s = time.perf_counter() - t0
        counter.take()
        for _ in range(num_workers):
            it = _next(loader, it, counter)
        begin = last = time.perf_counter()
        samples, intervals = 0, []
        while last - begin < window_s:
            it = _next(loader, it, counter)
            now = time.perf_counter()
            samples += counter.last
            intervals.append(now - last)
            last = now
        uss, pss = _worker_memory(kind, loader, it)
    except Exception as exc:  # the dataset's error or a dead worker: a row, not a crash
        return Measurement(
            kind,
            num_workers,
            None,
            None,
            None,
            None,
            0,
            time.perf_counter() - t0,
            None,
            f"{type(exc).__name__}: {exc}",
        )
    finally:
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        if loader is not None:
            loader._iterator = None
    # n workers deliver in bursts of n: the variation that matters is that of whole rounds.
    step = max(1, num_workers)
    rounds = [sum(intervals[k : k + step]) for k in range(0, len(intervals) - step + 1, step)]
    mean = statistics.fmean(rounds) if rounds else 0.0
    cv = statistics.pstdev(rounds) / mean if len(rounds) > 1 and mean > 0 else None
    choice = loader.report().worker_type_choice if kind == "steadyload-auto" else None
    return Measurement(
        kind,
        num_workers,
        samples / (last - begin),
        start_s,
        uss,
        pss,
        len(intervals),
        last - begin,
        cv,
        worker_type_choice=choice,
    )


class _Counter:
    """Samples in each batch: batch_size, except the last batch of a map-style epoch."""

    def __init__(self, dataset: Any, batch_size: int | None) -> None:
        from torch.utils.data import IterableDataset

        self.size = batch_size or 1
        self.length: int | None = None
        if batch_size and not isinstance(dataset, IterableDataset):
            self.length = len(dataset)
        self.seen = 0
        self.last = 0

    def take(self) -> None:
        if self.length is None:
            self.last = self.size
        else:
            self.last = min(self.size, self.length - self.seen)
        self.seen += self.last

    def new_epoch(self) -> None:
        self.seen = 0


def _next(loader: Any, it: Any, counter: _Counter) -> Any:
    """Take the next batch into ``counter``, starting the next epoch at the end of one."""
    try:
        next(it)
    except StopIteration:
        it = iter(loader)  # persistent workers: the same workers, reset
        counter.new_epoch()
        next(it)
    counter.take()
    return it


def _worker_memory(kind: str, loader: Any, it: Any) -> tuple[int | None, int | None]:
    """Mean (USS, PSS) of the loader's live workers, read now with psutil."""
    import psutil

    if kind.startswith("steadyload"):
        report = loader.report()
        if report.worker_kind == "thread":
            return None, None  # threads have no memory of their own
        pids = [w.pid for w in report.workers if w.pid]
    else:
        pids = [w.pid for w in getattr(it, "_workers", [])]
    uss, pss = [], []
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except (psutil.Error, OSError):
            continue
        uss.append(int(info.uss))
        pss.append(int(getattr(info, "pss", 0)))
    if not uss:
        return None, None
    return int(statistics.fmean(uss)), int(statistics.fmean(pss)) or None
