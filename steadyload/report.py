"""`LoaderReport`: what a loader did, as data; `str()` formats it for people."""

from __future__ import annotations

import logging
from collections.abc import Callable
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
    """One worker of the epoch a report describes."""

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
    """Samples it delivered in the epoch (re-runs after a restart count once)."""
    samples_per_s: float | None = None
    """Its loading speed: samples over the time it spent loading them. [Unit: 1/second]"""
    busy_share: float | None = None
    """The share of its life it spent loading (near 1: the workers are the bottleneck)."""
    node: str | None = None
    """A remote worker's Ray node, "<node id> (<address>)"; None for a local worker."""
    rss_bytes: int | None = None
    """A remote worker's resident memory after its latest batch, as it reported it (its
    USS cannot be sampled from here). [Unit: byte]"""


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
    epoch: int = 0
    """The epoch it happened in (the loader's count, from 0)."""


@dataclass(frozen=True, slots=True)
class SkippedSample:
    """A sample left out of its batch (``on_error="skip"``)."""

    index: object
    """The dataset index; for a stream, "worker W, its item N" (the worker's own count, from 0)."""
    error_type: str
    message: str
    epoch: int = 0
    """The epoch it happened in (the loader's count, from 0)."""


def _stream_owner(worker_id: int) -> str:
    return "the main process's" if worker_id < 0 else f"worker {worker_id}'s"


def describe_cut(cut: StreamCut) -> str:
    """A cut stream, what it cost and how to keep going, for the log (one paragraph)."""
    return (
        f"{_stream_owner(cut.worker_id)} stream ended at its item {cut.item}, which raised "
        f"{cut.error_type}: {cut.message} ({cut.reason}): it had yielded {cut.yielded} items "
        "and the rest of its share of the epoch is lost; on_error='skip' leaves out the item, "
        "not what came after it. To keep going past bad items, catch them inside the stream "
        "(webdataset: handler=wds.warn_and_continue; HF datasets: in the map function), or "
        "give the dataset state_dict()/load_state_dict() whose state counts the bad item as "
        "read (HF's IterableDataset.map does): steadyload then restarts the stream after it."
    )


@dataclass(frozen=True, slots=True)
class StreamCut:
    """A worker's stream that ended early: an item raised (``on_error="skip"``) inside a
    generator, and a Python generator that raised cannot go on, so the rest of that worker's
    share of the stream was lost for the epoch."""

    worker_id: int
    item: int
    """The item that raised, in the worker's own count (from 0)."""
    yielded: int
    """Items the worker's stream yielded before it ended."""
    error_type: str
    message: str
    reason: str = ""
    """Why the stream could not go on past the item."""
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """The device stage (``device=``, or ``pin_memory=True``): its batches, its time, and
    its pinned buffer pool. Times are totals over the iterator's batches."""

    device: str
    prefetch: int
    """``device_prefetch``: batches kept on their way beyond the one yielded."""
    batches: int = 0
    wait_s: float = 0.0
    """The training loop's time waiting for the stage (not ahead enough). [Unit: second]"""
    pack_s: float = 0.0
    """The stage thread's time packing batches into pinned memory. [Unit: second]"""
    transform_s: float = 0.0
    """``device_transform``'s time on the device (the stage's stream). [Unit: second]"""
    copy_s: float = 0.0
    """The copies' time on the device, from pinned buffers. [Unit: second]"""
    copied_bytes: int = 0
    """What they copied (``copied_bytes / copy_s``: the host-to-device rate). [Unit: byte]"""
    skipped_batches: int = 0
    """Batches whose ``device_transform`` raised, yielded empty (``on_error="skip"``)."""
    pinned_bytes: int = 0
    """Pinned host memory the pool holds. [Unit: byte]"""
    pinned_peak_bytes: int = 0
    pinned_cap_bytes: int = 0
    pinned_buffers: int = 0
    pinned_allocations: int = 0
    """Buffers pinned; every other batch reused one."""
    pinned_reuses: int = 0
    unpinned_batches: int = 0
    """Batches bigger than the cap, copied from unpinned memory (raise the cap)."""
    pool_waits: int = 0
    """Times a batch waited for an earlier copy to free pinned memory (the cap was reached)."""

    def __str__(self) -> str:
        pool = (
            f"; pinned pool {_mib(self.pinned_bytes)} of {_mib(self.pinned_cap_bytes)} cap "
            f"(peak {_mib(self.pinned_peak_bytes)}, {self.pinned_buffers} buffers, "
            f"{self.pinned_allocations} pinned, {self.pinned_reuses} reused"
            + (f", {self.unpinned_batches} too big: unpinned" if self.unpinned_batches else "")
            + (f", waited {self.pool_waits}x at the cap" if self.pool_waits else "")
            + ")"
            if self.pinned_allocations or self.unpinned_batches
            else ""
        )
        skipped = f", {self.skipped_batches} skipped" if self.skipped_batches else ""
        rate = self.copied_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0
        copies = f", copies {self.copy_s:.2f} s ({rate:.1f} GB/s)" if self.copy_s > 0 else ""
        return (
            f"device stage ({self.device}, {self.prefetch} ahead): {self.batches} batches"
            f"{skipped}; the loop waited {self.wait_s:.2f} s for it; packing "
            f"{self.pack_s:.2f} s (its thread), device_transform {self.transform_s:.2f} s"
            f"{copies}{pool}"
        )


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
        epoch: the epoch this report describes (the loader's count, from 0); with
            ``all_epochs=True``, the latest of them.
        epochs: how many epochs it covers: 1, or with ``all_epochs=True`` every epoch the
            loader (and the loaders a framework rebuilt from it) ran.
        workers: one entry per worker of the latest epoch (with ``all_epochs=True``,
            ``samples`` counts every epoch; speed, busy share and memory are the latest's).
        restarts: workers replaced, oldest first, each with its epoch.
        skipped: samples left out (``on_error="skip"``), each with its epoch.
        streams_cut: workers' streams that ended at a bad item, losing the rest of their
            share of the epoch (a generator that raised cannot go on).
        rows_lost: rows those cut streams did not deliver, when ``len(dataset)`` tells
            (None: no stream was cut, or the total is unknown).
        device: with ``device=`` (or ``pin_memory=True``), the device stage (`DeviceReport`).
        scaling: with ``remote_workers=(min, max)``, each change of the remote pool's size
            (`at_s`, `workers`, `change`, `stall_share`, `batches_per_s`, `reason`, `epoch`).
        num_workers_choice: with ``num_workers="auto"``, what was chosen and why.
        worker_type_choice: with ``worker_type="auto"``, threads or processes, and the
            figures that decided it.
        batches: batches the training loop has taken in the epoch (or epochs).
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
    epoch: int = 0
    epochs: int = 1
    streams_cut: tuple[StreamCut, ...] = ()
    rows_lost: int | None = None
    scaling: tuple[Any, ...] = ()
    device: DeviceReport | None = None

    def __str__(self) -> str:
        how = f", start method {self.start_method}" if self.start_method else ""
        span = (
            f"epoch {self.epoch}"
            if self.epochs == 1
            else f"{self.epochs} epochs, to epoch {self.epoch}"
        )
        lines = [f"steadyload loader report: {self.worker_kind} workers{how}; {span}"]
        if self.data_stall_share is not None:
            lines.append(
                f"  data stall: {self.data_stall_share:.1%} of the training loop's time "
                f"({self.wait_s:.2f} s of {self.loop_s:.2f} s waiting in next(loader), "
                f"{self.batches} batches)"
            )
        for choice in (self.num_workers_choice, self.worker_type_choice):
            if choice:
                lines.append(f"  {choice}")
        if self.device is not None:
            lines.append(f"  {self.device}")
        if self.worker_kind == "thread":
            lines.append(
                "  thread workers: a sample that crashes native code ends this process; "
                "worker_type='process' replaces the worker and skips the sample"
            )
        if self.preload_requested:
            lines.append(f"  fork server preload: {summarize_modules(self.preload_requested)}")
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
            for w in self.workers:
                if w.node is not None:
                    lines.append(
                        f"  worker {w.worker_id} is remote: Ray node {w.node}, "
                        f"RSS {_mib(w.rss_bytes)}"
                    )
        when = (lambda epoch: f"epoch {epoch}: ") if self.epochs > 1 else (lambda epoch: "")
        for d in self.scaling:
            lines.append(
                f"  remote pool: {when(d.epoch)}{'grew' if d.change > 0 else 'shrank'} to "
                f"{d.workers} at {d.at_s:.1f} s ({d.reason}; {d.batches_per_s:.1f} batches/s)"
            )
        for r in self.restarts:
            sample = f" while loading sample {r.sample!r}" if r.sample is not None else ""
            who = "all workers: " if r.worker_id == -1 else f"worker {r.worker_id} "
            if r.worker_id == -1 and r.pid is None:  # a lost node: the cause names them
                who = ""
            lines.append(
                f"  restart: {when(r.epoch)}{who}{f'(pid {r.pid}) ' if who else ''}{r.cause}"
                f"{sample}; "
                f"{r.batches_rerun} batch(es) re-run"
            )
        if self.skipped:
            lines.append(f"  skipped samples: {len(self.skipped)}")
            for k in self.skipped[:20]:
                lines.append(f"    {when(k.epoch)}{k.index!r}: {k.error_type}: {k.message}")
            if len(self.skipped) > 20:
                lines.append(f"    ... {len(self.skipped) - 20} more")
        for c in self.streams_cut:
            lines.append(
                f"  stream cut: {when(c.epoch)}{_stream_owner(c.worker_id)} stream ended at its "
                f"item {c.item} ({c.error_type}: {c.message}; {c.reason}) after {c.yielded} "
                "items; the rest of its share was lost"
            )
        if self.rows_lost is not None:
            lines.append(f"  rows lost with cut streams: {self.rows_lost}")
        return "\n".join(lines)


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
for _public in (DeviceReport, LoaderReport, WorkerReport, report_every):
    _public.__module__ = "steadyload"
del _public
