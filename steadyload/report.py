"""`LoaderReport`: what a loader did, as data; `str()` formats it for people."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
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
    samples: int = 0
    """Samples it delivered in the latest run (re-runs after a restart count once)."""
    samples_per_s: float | None = None
    """Its loading speed: samples over the time it spent loading them. [Unit: 1/second]"""
    busy_share: float | None = None
    """The share of its life it spent loading (near 1: the workers are the bottleneck)."""


@dataclass(frozen=True, slots=True)
class RestartReport:
    """A worker that was replaced (or, with ``worker_id`` -1, all of them, when the fork
    server they came from died: ``pid`` is then the server's): why, and what was re-run."""

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
        worker_kind: the kind of worker that ran: "process", "thread" or "in-process"
            (num_workers=0); after ``worker_type="auto"`` handed over, "process".
        start_method: how process workers started: "fork", "forkserver", "spawn" or
            "zygote"; None when no process started (threads, in-process).
        preload_requested: modules steadyload asked the fork server to import.
        preload_missing: those the fork server did not import (CPython skips a failing
            preload silently); None when unknown (the server was started by someone else).
        workers: one entry per worker of the latest run.
        restarts: workers replaced during the latest run, oldest first.
        skipped: samples left out during the latest run (``on_error="skip"``).
        num_workers_choice: with ``num_workers="auto"``, what was chosen and why.
        worker_type_choice: with ``worker_type="auto"``, threads or processes, and the
            figures that decided it.
        batches: batches the training loop has taken in the latest run.
        wait_s: time the training loop spent inside ``next(loader)``. [Unit: second]
        loop_s: time from the first ``next(loader)`` to the latest return. [Unit: second]
        data_stall_share: ``wait_s / loop_s``: the fraction of the training loop's time
            spent waiting for data (the first batch, with worker start-up, included). Near
            0: data loading keeps up; large: more workers or cheaper samples would help.
    """

    start_method: str | None
    preload_requested: tuple[str, ...]
    preload_missing: tuple[str, ...] | None
    workers: tuple[WorkerReport, ...]
    worker_kind: str = "process"
    restarts: tuple[RestartReport, ...] = ()
    skipped: tuple[SkippedSample, ...] = ()
    num_workers_choice: str | None = None
    worker_type_choice: str | None = None
    batches: int = 0
    wait_s: float = 0.0
    loop_s: float = 0.0
    data_stall_share: float | None = None

    def __str__(self) -> str:
        how = f", start method {self.start_method}" if self.start_method else ""
        lines = [f"steadyload loader report: {self.worker_kind} workers{how}"]
        if self.data_stall_share is not None:
            lines.append(
                f"  data stall: {self.data_stall_share:.1%} of the training loop's time "
                f"({self.wait_s:.2f} s of {self.loop_s:.2f} s waiting in next(loader), "
                f"{self.batches} batches)"
            )
        for choice in (self.num_workers_choice, self.worker_type_choice):
            if choice:
                lines.append(f"  {choice}")
        if self.worker_kind == "thread":
            lines.append(
                "  thread workers: a sample that crashes native code ends this process; "
                "worker_type='process' replaces the worker and skips the sample"
            )
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
                "  worker   pid       start      samples  samples/s  busy   USS now   "
                "PSS now   USS peak  USS per epoch"
            )
            for w in self.workers:
                start = f"{w.start_s:.3f} s" if w.start_s is not None else "-"
                epochs = " ".join(_mib(x) for x in w.epoch_uss_bytes[-4:])
                rate = f"{w.samples_per_s:,.0f}" if w.samples_per_s is not None else "-"
                busy = f"{w.busy_share:.0%}" if w.busy_share is not None else "-"
                lines.append(
                    f"  {w.worker_id:6d}   {w.pid or '-':<8}  {start:9s}  {w.samples:7d}  "
                    f"{rate:>9s}  {busy:>4s}  {_mib(w.uss_bytes):>8s}  "
                    f"{_mib(w.pss_bytes):>8s}  {_mib(w.peak_uss_bytes):>8s}  {epochs}"
                )
        for r in self.restarts:
            sample = f" while loading sample {r.sample!r}" if r.sample is not None else ""
            who = "all workers: " if r.worker_id == -1 else f"worker {r.worker_id} "
            lines.append(
                f"  restart: {who}(pid {r.pid}) {r.cause}{sample}; "
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

    def __init__(self, kind: str, start_method: str | None, preload: tuple[str, ...]) -> None:
        self.worker_kind = "thread" if kind == "auto" else kind  # auto starts on threads
        self.start_method = start_method
        self.preload = preload
        self.preload_missing: tuple[str, ...] | None = None
        self.num_workers_choice: str | None = None  # num_workers="auto": what and why
        self.worker_type_choice: str | None = None  # worker_type="auto": what and why
        self.auto_kind: str | None = None  # and what it chose: "thread" or "process"
        self.workers: dict[int, WorkerReport] = {}
        self.restarts: list[RestartReport] = []
        self.skipped: list[SkippedSample] = []
        self.memory: Any = None  # callable -> {worker: (uss, pss, peak, epochs)}, if sampled
        self.samples: dict[int, int] = {}  # worker -> samples delivered
        self.busy_s: dict[int, float] = {}  # worker -> seconds spent loading them
        self.ready_at: dict[int, float] = {}  # worker -> perf_counter() at its Ready
        self.batches = 0
        self.wait_s = 0.0
        self.first_call: float | None = None
        self.last_return = 0.0
        self.periodic: tuple[float, Callable[[LoaderReport], None]] | None = None
        self._last_periodic = time.perf_counter()

    def loaded(self, worker_id: int, samples: int, load_s: float) -> None:
        """A worker delivered ``samples`` samples it took ``load_s`` seconds to load."""
        self.samples[worker_id] = self.samples.get(worker_id, 0) + samples
        self.busy_s[worker_id] = self.busy_s.get(worker_id, 0.0) + load_s

    def waited(self, called: float, returned: float, delivered: bool = True) -> None:
        """The training loop spent ``called``..``returned`` (perf_counter) in next()."""
        if self.first_call is None:
            self.first_call = called
        self.batches += delivered
        self.wait_s += returned - called
        self.last_return = returned
        periodic = self.periodic
        if delivered and periodic is not None and returned - self._last_periodic >= periodic[0]:
            self._last_periodic = returned
            try:
                periodic[1](self.to_report())
            except Exception as exc:  # raising here would lose the batch next() holds
                warnings.warn(
                    f"steadyload: the report_every callback raised {type(exc).__name__}: "
                    f"{exc}. The batch was still yielded and reports go on; fix the callback "
                    "or turn it off with report_every(loader, None).",
                    RuntimeWarning, stacklevel=4,
                )

    def to_report(self) -> LoaderReport:
        """A frozen snapshot."""
        memory = self.memory() if self.memory is not None else {}
        now = time.perf_counter()
        workers = []
        for k in sorted(self.workers):
            w = self.workers[k]
            if k in memory:
                uss, pss, peak, epochs = memory[k]
                w = replace(w, uss_bytes=uss, pss_bytes=pss, peak_uss_bytes=peak,
                            epoch_uss_bytes=tuple(epochs))  # fmt: skip
            samples, busy = self.samples.get(k, 0), self.busy_s.get(k, 0.0)
            life = now - self.ready_at[k] if k in self.ready_at else 0.0
            w = replace(
                w, samples=samples,
                samples_per_s=samples / busy if busy > 0 else None,
                busy_share=min(1.0, busy / life) if life > 0 else None,
            )  # fmt: skip
            workers.append(w)
        loop_s = self.last_return - self.first_call if self.first_call is not None else 0.0
        return LoaderReport(
            worker_kind=self.worker_kind,
            start_method=self.start_method,
            preload_requested=self.preload,
            preload_missing=self.preload_missing,
            workers=tuple(workers),
            restarts=tuple(self.restarts),
            skipped=tuple(self.skipped),
            num_workers_choice=self.num_workers_choice,
            worker_type_choice=self.worker_type_choice,
            batches=self.batches,
            wait_s=self.wait_s,
            loop_s=loop_s,
            data_stall_share=self.wait_s / loop_s if loop_s > 0 else None,
        )


_REPORT_LOG = logging.getLogger("steadyload.report")


def _log_report(report: LoaderReport) -> None:
    _REPORT_LOG.info("%s", report)


def report_every(
    loader: Any,
    seconds: float | None,
    callback: Callable[[LoaderReport], None] | None = None,
) -> None:
    """Every ``seconds`` of training, pass ``loader.report()`` to ``callback``.

    The default callback logs it at INFO on the ``steadyload.report`` logger. Checked when
    the training loop takes a batch, so it costs no thread and no wake-up; ``seconds=0``
    reports at every batch, ``None`` turns it off.

    Raises:
        ValueError: ``seconds`` is negative or not a number.
    """
    if seconds is None:
        loader._report_every = None
    else:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            raise ValueError(f"report_every needs seconds >= 0 or None, got {seconds!r}")
        loader._report_every = (float(seconds), callback or _log_report)
    if loader._last_run is not None:
        loader._last_run.periodic = loader._report_every


# Public names report the package they are imported from (see steadyload/__init__.py).
for _public in (LoaderReport, WorkerReport, report_every):
    _public.__module__ = "steadyload"
del _public
