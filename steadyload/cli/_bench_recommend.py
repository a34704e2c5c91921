"""Bench's recommendation from its measurements: workers, prefetch, worker type, and why."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..host.system import gib
from ..worker_count import TRIVIAL_SAMPLE_S, SampleProfile, fmt_s, memory_bound

WITHIN_BEST = 0.95
"""The smallest worker count within 5% of the best throughput is recommended."""
HIGH_CV = 0.5
"""Round-to-round time variation (stdev / mean) above which a deeper prefetch queue helps."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """One loader configuration run by `bench`."""

    loader: str
    """"steadyload" (process workers), "steadyload-thread", "steadyload-auto" or "torch"."""
    num_workers: int
    samples_per_s: float | None
    """Steady throughput, after start-up and one batch per worker. None: failed."""
    start_s: float | None
    """From ``iter(loader)`` to the first batch. [Unit: second]"""
    worker_uss_bytes: int | None
    """Mean memory only a worker uses (what one more worker costs). [Unit: byte]"""
    worker_pss_bytes: int | None
    """Mean proportional share of a worker's memory (shared pages split). [Unit: byte]"""
    batches: int
    """Batches in the measured window."""
    measured_s: float
    batch_time_cv: float | None
    """Stdev / mean of the time per round of one batch from each worker (0: even)."""
    error: str | None = None
    worker_type_choice: str | None = None
    """steadyload-auto: what ``worker_type="auto"`` chose, and its figures."""


@dataclass(frozen=True, slots=True)
class Recommendation:
    """What bench recommends, with the reasons in words."""

    num_workers: int
    prefetch_factor: int | None
    reason: str
    prefetch_reason: str
    worker_type: str
    """"process" or "thread": the faster at the recommended count (threads when within 5%:
    they cost less)."""
    worker_type_reason: str
    memory_bound: int | None
    """Workers that fit in half the available memory (`tuning.MEMORY_SHARE`); None: unknown."""
    cpu_bound: int


def recommend(
    measured: Sequence[Measurement],
    profile: SampleProfile,
    cpus: int,
    available: int | None,
    not_measured: Sequence[tuple[str, int]] = (),
) -> Recommendation:
    """The smallest steadyload worker count within 5% of the best throughput, within the
    CPU and memory bounds, and a prefetch_factor, each with the reason in words."""
    ok = [m for m in measured if m.loader == "steadyload" and m.samples_per_s]
    costs = [m.worker_uss_bytes for m in ok if m.worker_uss_bytes]
    per_worker = max(costs) if costs else None
    mem_bound = memory_bound(per_worker, available)
    if not ok:
        return Recommendation(
            0,
            None,
            "nothing was measured: "
            + (
                measured[0].error
                if measured and measured[0].error
                else "the budget ran out; run with a larger --budget"
            ),
            "-",
            "process",
            "-",
            mem_bound,
            cpus,
        )
    limit = min(cpus, mem_bound if mem_bound is not None else cpus)
    within = [m for m in ok if m.num_workers <= limit] or [min(ok, key=lambda m: m.num_workers)]
    # num_workers=0 loads in the training loop, adding its time to every step, while workers
    # overlap loading with the step: 0 wins only for trivial samples (or if it is all we have).
    trivial = (profile.per_sample_s or 0.0) < TRIVIAL_SAMPLE_S
    if not trivial and any(m.num_workers > 0 for m in within):
        within = [m for m in within if m.num_workers > 0]
    best = max(within, key=lambda m: m.samples_per_s or 0.0)
    top = best.samples_per_s or 0.0
    pick = min(
        (m for m in within if (m.samples_per_s or 0.0) >= WITHIN_BEST * top),
        key=lambda m: m.num_workers,
    )
    rate = f"{pick.samples_per_s:,.0f} samples/s"
    most = max(m.num_workers for m in within)
    workers = f"{pick.num_workers} worker{'s' if pick.num_workers != 1 else ''}"
    if pick.num_workers == 0:
        why = (
            f"loading in the training process (num_workers=0, {rate}) is within 5% of "
            f"the best; samples take {fmt_s(profile.per_sample_s)} each, so handing "
            "batches between processes does not pay"
        )
        if not trivial:
            why = f"only num_workers=0 was measured ({rate}); raise --budget"
    elif pick.num_workers < most:
        more = max(
            (m for m in within if m.num_workers > pick.num_workers),
            key=lambda m: m.samples_per_s or 0.0,
        )
        why = (
            f"throughput stops rising after {workers} ({rate}; the best with more: "
            f"{more.samples_per_s:,.0f} with {more.num_workers}, not 5% better)"
        )
    else:
        why = f"throughput is highest with {workers} ({rate}), the most measured"
        if pick.num_workers >= cpus:
            why += (
                " and the usable CPUs: more would only compete for them (the training "
                f"loop needs one too: with a CPU-heavy loop use {cpus - 1})"
            )
        elif mem_bound is not None and pick.num_workers >= mem_bound:
            why += f"; memory allows no more ({gib(available)} available, half for workers)"
        if any(k == "steadyload" and n > pick.num_workers for k, n in not_measured):
            why += "; higher counts were not measured within the budget (raise --budget)"
    if per_worker:
        why += f"; each worker costs {gib(per_worker)} (USS)"
    kind, kind_why = _worker_type(measured, pick)
    if pick.num_workers == 0:
        return Recommendation(
            0,
            None,
            why,
            "prefetch_factor applies only with workers",
            "process",
            "worker_type applies only with workers",
            mem_bound,
            cpus,
        )
    cv = pick.batch_time_cv
    in_flight_4 = profile.batch_bytes * 4 * pick.num_workers
    if cv is not None and cv > HIGH_CV and (available is None or in_flight_4 < available // 4):
        return Recommendation(
            pick.num_workers,
            4,
            why,
            f"batch times vary a lot (cv {cv:.2f}): 4 batches per worker "
            "in flight absorb the slow ones",
            kind,
            kind_why,
            mem_bound,
            cpus,
        )
    shown = f"cv {cv:.2f}" if cv is not None else "cv unknown"
    return Recommendation(
        pick.num_workers,
        2,
        why,
        f"batch times are even enough ({shown}): torch's default of 2 per "
        "worker keeps the workers busy; more only holds memory",
        kind,
        kind_why,
        mem_bound,
        cpus,
    )


def _worker_type(measured: Sequence[Measurement], pick: Measurement) -> tuple[str, str]:
    """Threads or processes at ``pick``'s worker count, from the two measurements."""
    threads = next(
        (
            m
            for m in measured
            if m.loader == "steadyload-thread"
            and m.num_workers == pick.num_workers
            and m.samples_per_s
        ),
        None,
    )
    if threads is None or not pick.samples_per_s:
        return "process", "thread workers were not measured at that count"
    ratio = (threads.samples_per_s or 0.0) / pick.samples_per_s
    figures = (
        f"thread workers {threads.samples_per_s:,.0f} samples/s, process workers "
        f"{pick.samples_per_s:,.0f} ({ratio:.2f}x)"
    )
    if ratio >= WITHIN_BEST:
        return "thread", f"{figures}: threads are as fast or faster, and cost less"
    return "process", f"{figures}: the work holds the GIL"
