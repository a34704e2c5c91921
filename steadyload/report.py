"""`LoaderReport`: what a loader did, as data; `str()` formats it for people."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f}M"


def summarize_modules(names: tuple[str, ...], limit: int = 12) -> str:
    """Top-level packages of ``names`` (with how many modules), at most ``limit`` of them."""
    counts: dict[str, int] = {}
    for name in names:
        top = name.partition(".")[0]
        counts[top] = counts.get(top, 0) + 1
    parts = [f"{top} ({n} modules)" if n > 1 else top for top, n in counts.items()]
    more = len(parts) - limit
    return ", ".join(parts[:limit]) + (f", ... {more} more packages" if more > 0 else "")


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker process of the latest run."""

    worker_id: int
    pid: int | None
    start_s: float | None
    """From asking for the process to its Ready message. [Unit: second]"""
    uss_bytes: int | None = None
    """Memory only this worker uses (unique set size), at the last sample. [Unit: byte]"""
    pss_bytes: int | None = None
    """Its proportional share of all the memory it maps. [Unit: byte]"""
    peak_uss_bytes: int | None = None
    epoch_uss_bytes: tuple[int, ...] = ()
    """USS at the end of each epoch so far (growth per epoch)."""


@dataclass(frozen=True, slots=True)
class RestartReport:
    """A worker that was replaced: why, and what was re-run."""

    worker_id: int
    pid: int | None
    cause: str
    """E.g. "killed by SIGKILL", "hung for 5.0 s", "memory 4.2 GiB above max_worker_memory"."""
    sample: object
    """The sample it was loading, when known."""
    batches_rerun: int


@dataclass(frozen=True, slots=True)
class SkippedSample:
    """A sample left out of its batch (``on_error="skip"``)."""

    index: object
    """The dataset index (for a stream: "stream item N")."""
    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class LoaderReport:
    """What `DataLoader.report()` returns: how the workers started and ran.

    Attributes:
        start_method: "fork", "forkserver", "spawn", or "in-process" (num_workers=0).
        preload_requested: modules steadyload asked the fork server to import.
        preload_missing: those the fork server did not import (CPython skips a failing
            preload silently); None when unknown (the server was started by someone else).
        workers: one entry per worker of the latest run.
        restarts: workers replaced during the latest run, oldest first.
        skipped: samples left out during the latest run (``on_error="skip"``).
    """

    start_method: str
    preload_requested: tuple[str, ...]
    preload_missing: tuple[str, ...] | None
    workers: tuple[WorkerReport, ...]
    restarts: tuple[RestartReport, ...] = ()
    skipped: tuple[SkippedSample, ...] = ()

    def __str__(self) -> str:
        lines = [f"steadyload loader report: start method {self.start_method}"]
        if self.preload_requested:
            lines.append(
                f"  fork server preload: {summarize_modules(self.preload_requested)}"
            )
            if self.preload_missing is None:
                lines.append("  preload result: unknown (fork server started elsewhere)")
            elif self.preload_missing:
                lines.append(
                    f"  NOT preloaded (import failed in the fork server): "
                    f"{summarize_modules(self.preload_missing)}; each worker imports them itself"
                )
            else:
                lines.append("  preload result: all imported")
        if self.workers:
            lines.append(
                "  worker   pid       start      USS now   PSS now   USS peak  USS per epoch"
            )
            for w in self.workers:
                start = f"{w.start_s:.3f} s" if w.start_s is not None else "-"
                epochs = " ".join(_mib(x) for x in w.epoch_uss_bytes[-4:])
                lines.append(
                    f"  {w.worker_id:6d}   {w.pid or '-':<8}  {start:9s}  "
                    f"{_mib(w.uss_bytes):>8s}  {_mib(w.pss_bytes):>8s}  "
                    f"{_mib(w.peak_uss_bytes):>8s}  {epochs}"
                )
        for r in self.restarts:
            sample = f" while loading sample {r.sample!r}" if r.sample is not None else ""
            lines.append(
                f"  restart: worker {r.worker_id} (pid {r.pid}) {r.cause}{sample}; "
                f"{r.batches_rerun} batch(es) re-run"
            )
        if self.skipped:
            lines.append(f"  skipped samples: {len(self.skipped)}")
            for k in self.skipped[:20]:
                lines.append(f"    {k.index!r}: {k.error_type}: {k.message}")
            if len(self.skipped) > 20:
                lines.append(f"    ... {len(self.skipped) - 20} more")
        return "\n".join(lines)


class RunRecord:
    """What one iterator records while it runs; outlives it, for `DataLoader.report`."""

    def __init__(self, start_method: str, preload: tuple[str, ...]) -> None:
        self.start_method = start_method
        self.preload = preload
        self.preload_missing: tuple[str, ...] | None = None
        self.workers: dict[int, WorkerReport] = {}
        self.restarts: list[RestartReport] = []
        self.skipped: list[SkippedSample] = []
        self.memory: Any = None  # callable -> {worker: (uss, pss, peak, epochs)}, if sampled

    def to_report(self) -> LoaderReport:
        """A frozen snapshot."""
        memory = self.memory() if self.memory is not None else {}
        workers = []
        for k in sorted(self.workers):
            w = self.workers[k]
            if k in memory:
                uss, pss, peak, epochs = memory[k]
                w = WorkerReport(w.worker_id, w.pid, w.start_s, uss, pss, peak, tuple(epochs))
            workers.append(w)
        return LoaderReport(
            start_method=self.start_method,
            preload_requested=self.preload,
            preload_missing=self.preload_missing,
            workers=tuple(workers),
            restarts=tuple(self.restarts),
            skipped=tuple(self.skipped),
        )


# Public names report the package they are imported from (see steadyload/__init__.py).
for _public in (LoaderReport, WorkerReport,):
    _public.__module__ = "steadyload"
del _public
