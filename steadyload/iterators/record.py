"""`RunRecord`: what an iterator records while it runs, epoch by epoch, and `History`: every
epoch a loader ran. `DataLoader.report` turns them into `LoaderReport`s (report.py)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..report import LoaderReport, RestartReport, SkippedSample, StreamCut, WorkerReport


class RunRecord:
    """What one iterator records while it runs, epoch by epoch; outlives it, for
    `DataLoader.report`. What lasts across epochs (the workers, the choices) stays; what
    happened in the epoch goes to the loader's `History` when the next epoch begins."""

    def __init__(
        self,
        kind: str,
        start_method: str | None,
        preload: tuple[str, ...],
        history: History | None = None,
    ) -> None:
        self.worker_kind = "thread" if kind == "auto" else kind  # auto: its pool's, once started
        if kind == "remote":
            self.worker_kind = "remote"
        self.start_method = start_method
        self.preload = preload
        self.preload_missing: tuple[str, ...] | None = None
        self.num_workers_choice: str | None = None  # num_workers="auto": what and why
        self.worker_type_choice: str | None = None  # worker_type="auto": what and why
        self.auto_kind: str | None = None  # and what it chose: "thread" or "process"
        self.workers: dict[int, WorkerReport] = {}
        self.memory: Any = None  # callable -> {worker: (uss, pss, peak, epochs)}, if sampled
        self.device: Any = None  # callable -> DeviceReport, with a device stage
        self.ready_at: dict[int, float] = {}  # worker -> perf_counter() at its Ready
        self.rss: dict[int, int] = {}  # remote worker -> resident memory it reported
        self.periodic: tuple[float, Callable[[LoaderReport], None]] | None = None
        self._last_periodic = time.perf_counter()
        self.ledger: Any = None  # the loader's ledger (`Recorder`): told of skipped samples
        self.history = history if history is not None else History()
        self.epoch = 0
        self._clear_epoch()
        self.history.follow(self)

    def started(self, pool: Any, kind: str) -> None:
        """The pool of a ``kind`` plan started: under "auto", on whichever kind starts
        faster (engine/choice/handover.py), so its workers are the pool's."""
        if kind == "auto":
            self.worker_kind = pool.kind
            self.start_method, self.preload = pool.start_method, pool.preload

    def _clear_epoch(self) -> None:
        self.restarts: list[RestartReport] = []
        self.skipped: list[SkippedSample] = []
        self.streams_cut: list[StreamCut] = []
        self.scaling: list[Any] = []  # remote_workers=(min, max): each change of the pool
        self.rows_lost: int | None = None
        self.finished = False  # the epoch ran to its end (`ended`)
        self.samples: dict[int, int] = {}  # worker -> samples delivered
        self.busy_s: dict[int, float] = {}  # worker -> seconds spent loading them
        self.batches = 0
        self.wait_s = 0.0
        self.first_call: float | None = None
        self.last_return = 0.0
        self.epoch_began = time.perf_counter()

    def begin_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` begins (persistent workers): the last one goes to the history."""
        self.history.close(self)
        self.epoch = epoch

    @property
    def eventful(self) -> bool:
        """Whether this epoch did anything worth keeping (a batch, a restart, a skip)."""
        return bool(
            self.batches or self.restarts or self.skipped or self.streams_cut or self.scaling
        )

    def restarted(self, report: RestartReport) -> None:
        """A worker (or, id -1, all of them) was replaced in this epoch."""
        self.restarts.append(replace(report, epoch=self.epoch))

    def skip(self, sample: SkippedSample) -> None:
        """A sample was left out of its batch in this epoch."""
        self.skipped.append(replace(sample, epoch=self.epoch))
        if self.ledger is not None:
            self.ledger.skipped(self.epoch, sample.index, f"{sample.error_type}: {sample.message}")

    def cut(self, cut: StreamCut) -> None:
        """A worker's stream ended at a bad item in this epoch."""
        self.streams_cut.append(replace(cut, epoch=self.epoch))

    def ended(self, rows: int | None) -> None:
        """The epoch ran to its end; ``rows`` is ``len(dataset)`` when a stream's length is
        known (and no partial batch was dropped), to count what cut streams lost."""
        self.finished = True
        if self.streams_cut and rows is not None:
            delivered = sum(self.samples.values())
            self.rows_lost = max(0, rows - delivered - len(self.skipped))

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
                    RuntimeWarning,
                    stacklevel=4,
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
                w = replace(
                    w,
                    uss_bytes=uss,
                    pss_bytes=pss,
                    peak_uss_bytes=peak,
                    epoch_uss_bytes=tuple(epochs),
                )
            if k in self.rss:
                w = replace(w, rss_bytes=self.rss[k])
            samples, busy = self.samples.get(k, 0), self.busy_s.get(k, 0.0)
            life = now - max(self.ready_at[k], self.epoch_began) if k in self.ready_at else 0.0
            w = replace(
                w,
                samples=samples,
                samples_per_s=samples / busy if busy > 0 else None,
                busy_share=min(1.0, busy / life) if life > 0 else None,
            )
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
            epoch=self.epoch,
            streams_cut=tuple(self.streams_cut),
            rows_lost=self.rows_lost,
            scaling=tuple(self.scaling),
            device=self.device() if self.device is not None else None,
        )


def not_started(info: Any, auto: Any) -> LoaderReport:
    """The report of a loader not yet iterated: how its workers will start (``info``: the
    `StartInfo`, None without processes; ``auto``: the num_workers="auto" choice)."""
    return LoaderReport(
        worker_kind="process" if info else "in-process",
        start_method=info.method if info else None,
        preload_requested=info.preload if info else (),
        preload_missing=None,
        workers=(),
        num_workers_choice=auto.reason if auto is not None else None,
    )


@dataclass
class _Totals:
    """What ``report(all_epochs=True)`` adds up over epochs: sums, each worker's samples and
    the events. Kept instead of each epoch's report, whose workers carry the USS at every
    epoch so far: a history of those reports grew with the square of the epochs."""

    epochs: int = 0
    batches: int = 0
    wait_s: float = 0.0
    loop_s: float = 0.0
    rows_lost: int | None = None
    samples: dict[int, int] = field(default_factory=dict)  # worker -> samples, all epochs
    restarts: list[RestartReport] = field(default_factory=list)
    skipped: list[SkippedSample] = field(default_factory=list)
    streams_cut: list[StreamCut] = field(default_factory=list)
    scaling: list[Any] = field(default_factory=list)

    def add(self, part: LoaderReport) -> None:
        """Count one more epoch, ``part``."""
        self.epochs += 1
        self.batches += part.batches
        self.wait_s += part.wait_s
        self.loop_s += part.loop_s
        if part.rows_lost is not None:
            self.rows_lost = (self.rows_lost or 0) + part.rows_lost
        for w in part.workers:
            self.samples[w.worker_id] = self.samples.get(w.worker_id, 0) + w.samples
        self.restarts += part.restarts
        self.skipped += part.skipped
        self.streams_cut += part.streams_cut
        self.scaling += part.scaling

    def plus(self, part: LoaderReport) -> _Totals:
        """These totals and ``part`` (an epoch still running), leaving these as they are."""
        out = replace(
            self,
            samples=dict(self.samples),
            restarts=list(self.restarts),
            skipped=list(self.skipped),
            streams_cut=list(self.streams_cut),
            scaling=list(self.scaling),
        )
        out.add(part)
        return out

    def over(self, last: LoaderReport) -> LoaderReport:
        """``last`` (the latest epoch's report: its workers and choices) with these totals."""
        return replace(
            last,
            workers=tuple(replace(w, samples=self.samples[w.worker_id]) for w in last.workers),
            restarts=tuple(self.restarts),
            skipped=tuple(self.skipped),
            streams_cut=tuple(self.streams_cut),
            scaling=tuple(self.scaling),
            rows_lost=self.rows_lost,
            batches=self.batches,
            wait_s=self.wait_s,
            loop_s=self.loop_s,
            data_stall_share=self.wait_s / self.loop_s if self.loop_s > 0 else None,
            epochs=self.epochs,
        )


class History:
    """Every epoch a loader ran, closed as the next one begins; for ``report(all_epochs=True)``.
    A twin a framework builds from the loader (`DataLoader.from_loader`) shares it. Its size
    grows with the events (restarts, skipped samples, cut streams, scaling), not the epochs:
    closed epochs are running totals, and only the latest is kept whole."""

    def __init__(self) -> None:
        self.closed = _Totals()  # every closed epoch that did anything
        self.latest: LoaderReport | None = None  # the latest of them, whole
        self._current: RunRecord | None = None

    def follow(self, record: RunRecord) -> None:
        """``record`` runs the next epoch: the one before closes."""
        if self._current is not None and self._current is not record:
            self.close(self._current)
        self._current = record

    def close(self, record: RunRecord) -> None:
        """Keep ``record``'s epoch (when it did anything) and clear it for the next one."""
        if record.eventful:
            self.latest = record.to_report()
            self.closed.add(self.latest)
        record._clear_epoch()

    def report(self, all_epochs: bool) -> LoaderReport | None:
        """The latest epoch's report, or with ``all_epochs`` every epoch in one (the latest
        epoch's workers and choices); None before any epoch began."""
        current = self._current
        if not all_epochs:
            return current.to_report() if current is not None else None
        totals, last = self.closed, self.latest
        if current is not None and (current.eventful or last is None):
            last = current.to_report()
            totals = totals.plus(last)
        return totals.over(last) if last is not None else None
