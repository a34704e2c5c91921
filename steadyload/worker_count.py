"""Measure what loading a dataset costs and choose ``num_workers``.

Shared by ``DataLoader(num_workers="auto")`` (`choose_num_workers`: a probe of a few
samples in this process, well under a second for most datasets, and no worker processes)
and ``steadyload bench`` (`steadyload.cli._bench_run`: every worker count from 0 to the
usable CPUs, with steadyload and torch's DataLoader, within a time budget). The two share
`probe` (per-sample time in-process) and the bounds (CPUs, memory). Nothing here prints or
imports a UI library.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .host.system import available_memory_bytes, cpu_quota, gib

_LOG = logging.getLogger(__name__)

TRIVIAL_SAMPLE_S = 50e-6
"""Below this per-sample time, handing batches between processes costs more than it saves."""
TARGET_BATCH_INTERVAL_S = 0.005
"""auto: enough workers to deliver a batch every 5 ms (200 batches/s), faster than the
training steps of nearly every model, so the loop does not wait for data."""
MEMORY_SHARE = 0.5
"""Workers may take this share of the available memory; the rest is left to training."""
WORKER_BASE_BYTES = 100 << 20
"""auto's estimate of one idle worker, torch imported (above its PSS as measured on Linux:
docs/design/figures.md#worker-count)."""


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def fmt_s(seconds: float | None) -> str:
    """A duration as people read it: ``12 µs``, ``4.8 ms``, ``1.25 s``."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


@dataclass(frozen=True, slots=True)
class SampleProfile:
    """What loading samples costs in this process (no workers)."""

    per_sample_s: float | None
    """Median time of ``dataset[i]``, the first (warm-up) sample excluded; None: not measured."""
    collate_s: float | None
    """Time to collate one batch of ``batch_size`` samples. [Unit: second]"""
    samples: int
    """How many samples were timed."""
    batch_bytes: int
    """Bytes of CPU tensors in one collated batch (0 when unknown)."""
    note: str | None = None
    """Why nothing was measured, when so."""

    def per_batch_s(self, batch_size: int | None) -> float | None:
        """Loading plus collating one batch in this process. [Unit: second]"""
        if self.per_sample_s is None:
            return None
        return self.per_sample_s * (batch_size or 1) + (self.collate_s or 0.0)


def save_rngs() -> tuple[Any, ...]:
    """The global RNG states (torch, random, numpy), for `restore_rngs` after a probe."""
    from .engine.worker.rngs import process_rngs

    return process_rngs()


def restore_rngs(state: tuple[Any, ...]) -> None:
    """Put back what `save_rngs` returned."""
    from .engine.worker import rngs

    rngs.restore_rngs(state)


def probe(
    dataset: Any, batch_size: int | None, collate_fn: Callable[[list[Any]], Any] | None,
    budget_s: float = 0.5, max_samples: int = 32, stream_ok: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> SampleProfile:
    """Time ``dataset[0]``, ``dataset[1]``, ... in this process for about ``budget_s``.

    Map-style datasets are read at indices 0..k, never through the loader's sampler, and
    the global RNGs (torch, random, numpy) are restored afterwards, so the real iteration
    (shuffle order, worker seeds) is the same as without the probe. An IterableDataset is
    only read when ``stream_ok`` (bench owns its dataset; a user's stream may be one-shot).
    Never raises for the dataset's errors: they become ``note``. ``clock`` times the samples
    and the budget (tests inject one). [Unit: second]
    """
    from torch.utils.data import IterableDataset

    is_stream = isinstance(dataset, IterableDataset)
    if is_stream and not stream_ok:
        return SampleProfile(None, None, 0, 0, "an IterableDataset: reading it would consume "
                                               "the stream the loader is about to iterate")
    if not is_stream:
        try:
            length = len(dataset)
        except TypeError:
            return SampleProfile(None, None, 0, 0, "the dataset has no len()")
        if length == 0:
            return SampleProfile(None, None, 0, 0, "the dataset is empty")
    saved = save_rngs()
    samples: list[Any] = []
    times: list[float] = []
    deadline = clock() + budget_s
    try:
        stream = iter(dataset) if is_stream else None
        for k in range(max_samples + 1):
            if not is_stream and k >= length:
                break
            t = clock()
            try:
                sample = next(stream) if stream is not None else dataset[k]
            except StopIteration:
                break
            times.append(clock() - t)
            samples.append(sample)
            if clock() > deadline:
                break
        if not samples:
            return SampleProfile(None, None, 0, 0, "the dataset yielded no sample")
        collate_s, batch_bytes = _time_collate(samples, batch_size, collate_fn)
    except Exception as exc:  # the user's dataset or collate_fn: report, do not crash here
        return SampleProfile(None, None, 0, 0, f"loading sample {len(samples)} in this "
                                               f"process raised {type(exc).__name__}: {exc}")
    finally:
        restore_rngs(saved)
    timed = times[1:] or times  # the first sample often pays for lazy set-up
    # The median: a pause of this process (a busy machine) must not make samples look slow.
    return SampleProfile(statistics.median(timed), collate_s, len(timed), batch_bytes)


def _time_collate(
    samples: list[Any], batch_size: int | None, collate_fn: Callable[[list[Any]], Any] | None,
) -> tuple[float | None, int]:
    from torch.utils.data import default_collate, default_convert

    from .memory.advice import tensor_bytes

    if batch_size is None:  # no auto-collation: each sample is converted on its own
        fn = collate_fn or default_convert
        t = time.perf_counter()
        out = fn(samples[0])
        return time.perf_counter() - t, tensor_bytes(out)
    batch = samples[:batch_size]
    fn = collate_fn or default_collate
    t = time.perf_counter()
    out = fn(batch)
    elapsed = time.perf_counter() - t
    scale = batch_size / len(batch)  # collating is about linear in the batch size
    return elapsed * scale, int(tensor_bytes(out) * scale)


def memory_bound(per_worker_bytes: int | None, available: int | None) -> int | None:
    """How many workers of ``per_worker_bytes`` fit in `MEMORY_SHARE` of ``available``."""
    if not per_worker_bytes or available is None:
        return None
    return int(available * MEMORY_SHARE // per_worker_bytes)


# -- num_workers="auto" --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AutoChoice:
    """What ``num_workers="auto"`` chose, and why (shown by `DataLoader.report`)."""

    num_workers: int
    reason: str
    elapsed_s: float
    """Time the choice took. [Unit: second]"""
    per_sample_s: float | None = None


def choose_num_workers(
    dataset: Any, batch_size: int | None, collate_fn: Callable[[list[Any]], Any] | None,
    prefetch_factor: int | None = None, at_least: int = 0,
) -> AutoChoice:
    """Choose a worker count from a probe of a few samples in this process.

    workers = min(enough to deliver a batch every `TARGET_BATCH_INTERVAL_S`, usable CPUs - 1
    (one core runs the training loop), the memory bound), 0 for trivial samples (under
    `TRIVIAL_SAMPLE_S`). Not measured, by rule: an IterableDataset gets 1 worker (reading it
    would consume the stream, and more workers duplicate a stream that does not shard
    itself); a dataset that fails in this process gets usable CPUs - 1. ``at_least`` (1 when
    the caller set persistent_workers or prefetch_factor, which need workers) is a floor.
    Costs about half a second of loading; logs the choice at INFO.
    """
    from torch.utils.data import IterableDataset

    from .memory.advice import estimate_bytes, large_containers

    started = time.perf_counter()
    cpu_bound = usable_cpus() - 1
    cpus_why = f"{cpu_bound + 1} usable CPUs, one kept for the training loop"
    profile = probe(dataset, batch_size, collate_fn)
    per_batch = profile.per_batch_s(batch_size)
    # Each worker holds its own copy of large Python containers (pickled, or copied on read
    # under fork) and prefetch_factor batches in flight.
    copies = sum(estimate_bytes(v) for _, v in large_containers(dataset))
    per_worker = WORKER_BASE_BYTES + copies + (prefetch_factor or 2) * profile.batch_bytes
    available = available_memory_bytes()
    mem_bound = memory_bound(per_worker, available)
    if isinstance(dataset, IterableDataset):
        n = min(1, cpu_bound)
        why = (
            "an IterableDataset is not measured (that would consume the stream); 1 worker "
            "takes loading off the training loop without changing what the stream yields "
            "(with more, each worker yields the whole stream unless the dataset shards it "
            "with get_worker_info(): then set num_workers yourself)"
        )
    elif per_batch is None:
        n = cpu_bound
        why = f"not measured ({profile.note}); rule: {cpus_why}"
    elif profile.per_sample_s is not None and profile.per_sample_s < TRIVIAL_SAMPLE_S:
        n = 0
        why = (
            f"samples take {fmt_s(profile.per_sample_s)} each in this process (under "
            f"{fmt_s(TRIVIAL_SAMPLE_S)}): passing batches between processes would cost more "
            "than loading them here"
        )
    else:
        need = max(1, math.ceil(per_batch / TARGET_BATCH_INTERVAL_S))
        n = min(need, cpu_bound)
        why = (
            f"a batch takes {fmt_s(per_batch)} to load in this process "
            f"({fmt_s(profile.per_sample_s)} per sample, {profile.samples} timed); "
            f"{need} worker(s) would deliver one every {fmt_s(TARGET_BATCH_INTERVAL_S)}"
        )
        if cpu_bound < need:
            why += f"; bounded by CPUs ({cpus_why})"
    if mem_bound is not None and mem_bound < n:
        n = mem_bound
        why += (
            f"; bounded by memory: about {gib(per_worker)} per worker, "
            f"{gib(available)} available, half of it for workers"
        )
    if n < at_least:
        n = at_least
        why += f"; raised to {at_least}: persistent_workers/prefetch_factor need workers"
    elapsed = time.perf_counter() - started
    reason = f"num_workers='auto' chose {n}: {why} (decided in {elapsed:.2f} s)"
    _LOG.info("%s", reason)
    return AutoChoice(n, reason, elapsed, profile.per_sample_s)


def resolve_num_workers(
    num_workers: int | str, dataset: Any, batch_size: int | None, batch_sampler: Any,
    collate_fn: Callable[[list[Any]], Any] | None, prefetch_factor: int | None,
    persistent_workers: bool,
) -> tuple[int, AutoChoice | None]:
    """`DataLoader`'s ``num_workers``: an int passes through; "auto" is chosen here.

    Raises:
        ValueError: a string other than "auto".
    """
    if not isinstance(num_workers, str):
        return num_workers, None
    if num_workers != "auto":
        raise ValueError(f"num_workers must be an int >= 0 or 'auto', got {num_workers!r}")
    # With a batch_sampler, batch_size is torch's placeholder 1: take the sampler's own.
    size = getattr(batch_sampler, "batch_size", None) if batch_sampler is not None else None
    choice = choose_num_workers(
        dataset, size if isinstance(size, int) else batch_size, collate_fn, prefetch_factor,
        at_least=1 if persistent_workers or prefetch_factor is not None else 0,
    )
    return choice.num_workers, choice
