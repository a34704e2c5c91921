"""worker_count.py and cli/_bench_run.py without worker processes: the probe,
num_workers="auto", bench's budget split, the recommendation rules and the JSON schema."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import steadyload as sl
from steadyload import worker_count
from steadyload.cli import _bench_run
from steadyload.cli._bench_run import Measurement
from steadyload.worker_count import SampleProfile
from tests.datasets import MapDS

MEASUREMENT_KEYS = {
    "loader", "num_workers", "samples_per_s", "start_s", "worker_uss_bytes",
    "worker_pss_bytes", "batches", "measured_s", "batch_time_cv", "error", "worker_type_choice",
}
RECOMMENDATION_KEYS = {
    "num_workers", "prefetch_factor", "reason", "prefetch_reason", "worker_type",
    "worker_type_reason", "memory_bound", "cpu_bound",
}
TOP_KEYS = {
    "version", "dataset", "batch_size", "cpus", "available_memory_bytes", "start_method",
    "torch_start_method", "budget_s", "elapsed_s", "per_sample_s", "collate_s",
    "measurements", "not_measured", "recommendation", "worker_type_choice",
}


class RandomDS(Dataset[Any]):
    """Draws from all three global RNGs and records which indices were read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.read.append(i)
        return torch.rand(2) + random.random() + float(np.random.rand())


class CountingStream(IterableDataset[Any]):
    def __init__(self) -> None:
        self.iterated = 0

    def __iter__(self) -> Any:
        self.iterated += 1
        yield from range(4)


class Broken(MapDS):
    def __getitem__(self, i: int) -> Any:
        raise KeyError(f"no sample {i}")


def test_probe_reads_indices_from_zero_and_restores_the_rngs() -> None:
    ds = RandomDS(100)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    profile = worker_count.probe(ds, batch_size=8, collate_fn=None, max_samples=10)
    assert (torch.rand(1), random.random(), np.random.rand()) == expected
    assert ds.read == list(range(11))  # one warm-up sample, then 10 timed
    assert profile.samples == 10 and profile.per_sample_s is not None
    assert profile.batch_bytes == 8 * 2 * 4  # one collated batch of 8 float32 pairs


def test_probe_leaves_a_users_stream_alone_and_reports_errors() -> None:
    stream = CountingStream()
    profile = worker_count.probe(stream, 4, None)
    assert stream.iterated == 0 and profile.per_sample_s is None
    assert "IterableDataset" in (profile.note or "")
    assert worker_count.probe(stream, 4, None, stream_ok=True).per_sample_s is not None
    broken = worker_count.probe(Broken(4), 4, None)
    assert broken.note == "loading sample 0 in this process raised KeyError: 'no sample 0'"


@pytest.mark.parametrize("per_sample_s, workers", [
    (worker_count.TRIVIAL_SAMPLE_S * 0.99, 0), (worker_count.TRIVIAL_SAMPLE_S, 1)])
def test_auto_gives_trivial_samples_no_workers(
    per_sample_s: float, workers: int, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Injected figures, at both sides of the line: timing real samples is the machine's speed.
    monkeypatch.setattr(worker_count, "probe",
                        lambda *a, **k: SampleProfile(per_sample_s, 0.0, 10, 1024))  # fmt: skip
    monkeypatch.setattr(worker_count, "usable_cpus", lambda: 8)
    monkeypatch.setattr(worker_count, "available_memory_bytes", lambda: 64 << 30)
    with caplog.at_level(logging.INFO, logger="steadyload.worker_count"):
        choice = worker_count.choose_num_workers(MapDS(1000), 32, None)
    assert choice.num_workers == workers
    assert caplog.records[-1].name == "steadyload.worker_count"
    assert caplog.records[-1].getMessage() == choice.reason
    if workers == 0:
        assert choice.reason.startswith("num_workers='auto' chose 0: samples take ")
        assert "passing batches between processes would cost more" in choice.reason
    else:
        assert choice.reason.startswith("num_workers='auto' chose 1: a batch takes ")


class Ticks(MapDS):
    """Each sample takes 1 s on the list-cell clock ``now``."""

    def __init__(self, n: int, now: list[float]) -> None:
        super().__init__(n)
        self.now = now

    def __getitem__(self, i: int) -> Any:
        self.now[0] += 1.0
        return super().__getitem__(i)


@pytest.mark.parametrize("budget_s, read", [(1.99, 2), (2.0, 3)])
def test_probe_stops_once_its_budget_is_spent_on_its_clock(budget_s: float, read: int) -> None:
    # Samples end at 1, 2, 3 s: the probe stops after the first past the budget.
    now = [0.0]
    profile = worker_count.probe(Ticks(100, now), 8, None, budget_s=budget_s,
                                 clock=lambda: now[0])  # fmt: skip
    assert now[0] == read
    assert profile.samples == read - 1  # the first (warm-up) sample is not counted
    assert profile.per_sample_s == 1.0


def test_auto_is_bounded_by_cpus_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fixed probe result: timing real samples on a busy 2-core CI box is noise.
    monkeypatch.setattr(worker_count, "probe", lambda *a, **k: SampleProfile(0.001, 0.0, 10, 1024))
    monkeypatch.setattr(worker_count, "usable_cpus", lambda: 8)
    monkeypatch.setattr(worker_count, "available_memory_bytes", lambda: 64 << 30)
    ds = MapDS(64)
    few = worker_count.choose_num_workers(ds, 8, None)  # 8 ms a batch: 2 workers, one per 4 ms
    assert few.num_workers == 2
    assert few.reason.startswith(
        "num_workers='auto' chose 2: a batch takes 8.0 ms to load in this process (1.0 ms "
        "per sample, 10 timed); 2 worker(s) would deliver one every 5.0 ms (decided in ")
    busy = worker_count.choose_num_workers(ds, 64, None)  # 64 ms a batch: 13 wanted, 7 CPUs
    assert busy.num_workers == 7
    assert "; bounded by CPUs (8 usable CPUs, one kept for the training loop)" in busy.reason
    monkeypatch.setattr(worker_count, "available_memory_bytes", lambda: 600 << 20)
    tight = worker_count.choose_num_workers(ds, 64, None)
    assert tight.num_workers == 2  # half of 600 MiB / ~100 MiB per worker
    assert "; bounded by memory: about 100 MiB per worker, 600 MiB available" in tight.reason
    monkeypatch.setattr(worker_count, "usable_cpus", lambda: 1)
    assert worker_count.choose_num_workers(ds, 64, None).num_workers == 0
    floor = worker_count.choose_num_workers(ds, 64, None, at_least=1)
    assert floor.num_workers == 1 and "raised to 1" in floor.reason


def test_auto_does_not_read_a_stream() -> None:
    stream = CountingStream()
    choice = worker_count.choose_num_workers(stream, 4, None)
    assert stream.iterated == 0
    assert choice.num_workers == min(1, worker_count.usable_cpus() - 1)
    assert "an IterableDataset is not measured" in choice.reason


def test_resolve_num_workers() -> None:
    assert worker_count.resolve_num_workers(3, MapDS(4), 1, None, None, None, False) == (3, None)
    with pytest.raises(ValueError, match=r"^num_workers must be an int >= 0 or 'auto', got 'max'$"):
        worker_count.resolve_num_workers("max", MapDS(4), 1, None, None, None, False)
    sampler = torch.utils.data.BatchSampler(range(4), batch_size=2, drop_last=False)
    n, choice = worker_count.resolve_num_workers("auto", MapDS(4), 1, sampler, None, 2, False)
    assert n == 1 and choice is not None  # prefetch_factor needs a worker


def test_dataloader_auto_in_report_and_rejects_other_strings() -> None:
    loader = sl.DataLoader(MapDS(64), batch_size=8, num_workers="auto")
    assert loader.num_workers == 0
    assert [b.shape for b in loader][0] == (8, 3)
    report = loader.report()
    assert report.num_workers_choice is not None
    assert report.num_workers_choice.startswith("num_workers='auto' chose 0")
    assert report.num_workers_choice in str(report)
    assert sl.DataLoader(MapDS(4), num_workers=0).report().num_workers_choice is None
    with pytest.raises(ValueError, match="got 'many'"):
        sl.DataLoader(MapDS(4), num_workers="many")


def _m(n: int, rate: float | None, uss: int | None = 10 << 20, cv: float = 0.1,
       loader: str = "steadyload") -> Measurement:
    return Measurement(loader, n, rate, 0.1, uss if n else None, None, 50, 1.0, cv)


SLOW = SampleProfile(0.001, 0.0001, 10, 1 << 20)


def test_recommend_the_smallest_count_within_5_percent_of_the_best() -> None:
    ms = [_m(0, 900), _m(1, 1000), _m(2, 1900), _m(3, 2700), _m(4, 2800), _m(5, 2750),
          _m(4, 9999, loader="torch")]
    rec = _bench_run.recommend(ms, SLOW, cpus=5, available=64 << 30)
    assert (rec.num_workers, rec.prefetch_factor) == (3, 2)
    assert rec.reason == (
        "throughput stops rising after 3 workers (2,700 samples/s; the best with more: "
        "2,800 with 4, not 5% better); each worker costs 10 MiB (USS)"
    )
    assert rec.prefetch_reason.startswith("batch times are even enough (cv 0.10)")


def test_recommend_bounds_and_edge_cases() -> None:
    rising = [_m(0, 100), _m(1, 200), _m(2, 400)]
    rec = _bench_run.recommend(rising, SLOW, cpus=2, available=None)
    assert rec.num_workers == 2 and "the most measured and the usable CPUs: more would only compete" in rec.reason
    # 1 GiB available, half for workers, 400 MiB each: 1 worker fits.
    heavy = [_m(0, 100), _m(1, 200, uss=400 << 20), _m(2, 400, uss=400 << 20)]
    rec = _bench_run.recommend(heavy, SLOW, cpus=4, available=1 << 30)
    assert (rec.num_workers, rec.memory_bound) == (1, 1)
    # Trivial samples: in-process wins; slow ones never recommend 0 while workers ran.
    trivial = SampleProfile(5e-6, 1e-5, 10, 0)
    assert _bench_run.recommend([_m(0, 1000), _m(1, 980)], trivial, 2, None).num_workers == 0
    assert _bench_run.recommend([_m(0, 1000), _m(1, 700)], SLOW, 2, None).num_workers == 1
    uneven = _bench_run.recommend([_m(0, 10), _m(1, 100, cv=0.9)], SLOW, 1, None)
    assert uneven.prefetch_factor == 4 and "vary a lot (cv 0.90)" in uneven.prefetch_reason
    budget = _bench_run.recommend([_m(0, 10), _m(1, 100)], SLOW, 4, None, [("steadyload", 2)])
    assert "not measured within the budget (raise --budget)" in budget.reason
    nothing = _bench_run.recommend([], SLOW, 2, None, [("steadyload", 0)])
    assert nothing.num_workers == 0 and "the budget ran out" in nothing.reason


def test_bench_splits_the_budget_and_lists_what_did_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]
    windows: list[float] = []

    def fake_measure(kind: str, dataset: Any, n: int, *args: Any, **kw: Any) -> Measurement:
        windows.append(args[2])
        now[0] += 4.0  # every configuration overruns: 4 s of a 10 s budget
        return _m(n, 100.0 * (n + 1))

    monkeypatch.setattr(_bench_run, "measure", fake_measure)
    steps: list[tuple[str, int, int]] = []
    result = _bench_run.bench(MapDS(64), budget_s=20, worker_counts=[0, 1, 2, 3],
                          compare_torch=False, on_step=lambda *a: steps.append(a),
                          clock=lambda: now[0])
    # 8 configurations: processes at 0..3, threads at 1..3, auto at 3. Slots: 20/8, 16/7,
    # 12/6, 8/5, 4/4, then nothing left: the last three do not start.
    assert windows == pytest.approx([2.5 * 0.8, 16 / 7 * 0.5, 2.0 * 0.5, 1.6 * 0.5, 0.5])
    assert result.not_measured == (
        ("steadyload", 3), ("steadyload-thread", 3), ("steadyload-auto", 3))
    assert [s[1:] for s in steps] == [(k, 9) for k in range(6)] + [(9, 9)]
    doc = result.to_json()
    assert set(doc) == TOP_KEYS and doc["version"] == 1
    assert all(set(m) == MEASUREMENT_KEYS for m in doc["measurements"])
    assert doc["not_measured"][0] == {"loader": "steadyload", "num_workers": 3}
    assert set(doc["recommendation"]) == RECOMMENDATION_KEYS


def test_formatting_helpers() -> None:
    assert [worker_count.fmt_s(x) for x in (None, 12e-6, 4.84e-3, 1.254)] == [
        "-", "12 µs", "4.8 ms", "1.25 s"]
    assert worker_count.usable_cpus() >= 1
    assert worker_count.memory_bound(100, 1000) == 5 and worker_count.memory_bound(None, 1000) is None
