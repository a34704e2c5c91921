"""loader.report(): per-worker throughput, the data-stall share, report_every."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

import steadyload
from steadyload.iterators.record import History, RunRecord
from steadyload.report import RestartReport, WorkerReport
from tests.datasets import Busy, FaultOnce, MapDS


def test_per_worker_figures_add_up() -> None:
    loader = steadyload.DataLoader(Busy(96, 0.001), batch_size=4, num_workers=2)
    batches = sum(1 for _ in loader)
    report = loader.report()
    assert report.batches == batches == len(loader)
    assert sum(w.samples for w in report.workers) == 96
    for w in report.workers:
        assert w.samples_per_s is not None and w.samples_per_s > 0
        assert w.busy_share is not None and 0 < w.busy_share <= 1
    assert report.data_stall_share is not None and 0 <= report.data_stall_share <= 1
    assert 0 < report.wait_s <= report.loop_s
    text = str(report)
    assert "data stall:" in text and "samples/s" in text and "busy" in text


def _stall(steps: list[tuple[float, float]]) -> float | None:
    """The data-stall share of a loop whose next() calls ran ``(called, returned)``, on
    injected times (not measured: the machine's speed would decide the figure)."""
    record = RunRecord("process", "forkserver", ())
    for called, returned in steps:
        record.waited(called, returned)
    return record.to_report().data_stall_share


def test_data_stall_share_tells_slow_data_from_a_slow_loop() -> None:
    # The loop only waits for data: 0.9 s of each 1 s step is spent in next().
    assert _stall([(k, k + 0.9) for k in range(10)]) == pytest.approx(10 * 0.9 / 9.9)
    # Data is always ready: 0.01 s in next(), the rest is the training step's.
    assert _stall([(k, k + 0.01) for k in range(10)]) == pytest.approx(10 * 0.01 / 9.01)
    assert _stall([(0.0, 0.5)]) == 1.0  # one call: all of the loop was that wait
    assert _stall([]) is None  # not iterated: no figure


@pytest.mark.parametrize("workers", [0, 2])
def test_report_every_calls_back_and_can_be_turned_off(workers: int) -> None:
    loader = steadyload.DataLoader(MapDS(12), batch_size=2, num_workers=workers)
    got: list[steadyload.LoaderReport] = []
    steadyload.report_every(loader, 0, got.append)
    list(loader)
    assert [r.batches for r in got] == [1, 2, 3, 4, 5, 6]
    steadyload.report_every(loader, None)
    list(loader)
    assert len(got) == 6
    with pytest.raises(ValueError, match="report_every needs seconds >= 0 or None, got -1"):
        steadyload.report_every(loader, -1)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_report_every_callback_that_raises_loses_no_batch(workers: int) -> None:
    def broken(report: steadyload.LoaderReport) -> None:
        raise KeyError("no such metric")

    loader = steadyload.DataLoader(MapDS(6), batch_size=2, num_workers=workers)
    steadyload.report_every(loader, 0, broken)
    with pytest.warns(RuntimeWarning, match=r"the report_every callback raised KeyError: 'no such metric'\. The batch was still yielded"):
        got = [b[:, 0].tolist() for b in loader]
    assert got == [[0, 1], [2, 3], [4, 5]]


def test_report_every_logs_at_info_by_default(caplog: pytest.LogCaptureFixture) -> None:
    loader = steadyload.DataLoader(MapDS(4), batch_size=2)
    steadyload.report_every(loader, 0)
    with caplog.at_level("INFO", logger="steadyload.report"):
        list(loader)
    assert sum("steadyload loader report" in r.message for r in caplog.records) == 2


@pytest.mark.parametrize("persistent", [False, True])
def test_a_restart_in_epoch_0_is_still_in_the_report_after_epoch_2(
    persistent: bool, tmp_path: Path
) -> None:
    # Sample 5 SIGKILLs its worker the first time it loads; sample 7 is corrupt every time.
    dataset = FaultOnce(24, {5}, "sigkill", str(tmp_path))
    bad = FaultOnce(24, {7}, "raise", str(tmp_path / "bad"), always=True)
    (tmp_path / "bad").mkdir()
    loader = steadyload.DataLoader(dataset, batch_size=4, num_workers=2,
                                   persistent_workers=persistent)  # fmt: skip
    skipping = steadyload.DataLoader(bad, batch_size=4, num_workers=2, on_error="skip",
                                     persistent_workers=persistent)  # fmt: skip
    for _ in range(3):
        assert [int(x) for b in loader for x in b] == list(range(24))
        assert [int(x) for b in skipping for x in b] == [i for i in range(24) if i != 7]
    latest, whole = loader.report(), loader.report(all_epochs=True)
    assert (latest.epoch, latest.epochs, latest.restarts, latest.batches) == (2, 1, (), 6)
    assert (whole.epoch, whole.epochs, whole.batches) == (2, 3, 18)
    assert [(r.epoch, r.cause) for r in whole.restarts] == [(0, "killed by SIGKILL")]
    assert sum(w.samples for w in whole.workers) == 72
    assert "restart: epoch 0: worker" in str(whole) and "3 epochs, to epoch 2" in str(whole)
    # One skip per epoch: each epoch's report has its own; all_epochs has the three.
    assert [k.index for k in skipping.report().skipped] == [7]
    assert [(k.epoch, k.index) for k in skipping.report(all_epochs=True).skipped] == [
        (0, 7), (1, 7), (2, 7)
    ]


def test_a_twin_built_by_a_framework_keeps_the_history() -> None:
    loader = steadyload.DataLoader(MapDS(8), batch_size=4, num_workers=0)
    list(loader)
    twin = steadyload.DataLoader.from_loader(loader)
    list(twin)
    assert twin.report(all_epochs=True).epochs == 2 and twin.report().epochs == 1


def test_all_epochs_history_grows_with_the_epochs_not_their_square() -> None:
    # Persistent workers: one record for every epoch, and the memory sampler's list of each
    # worker's USS at every epoch end grows by one an epoch (as MemorySampler.end_epoch's).
    uss: dict[int, list[int]] = {0: [], 1: []}
    history = History()
    record = RunRecord("process", "forkserver", (), history)
    record.memory = lambda: {w: (1 << 30, 1 << 29, 1 << 30, list(e)) for w, e in uss.items()}
    record.workers = {w: WorkerReport(w, 1000 + w, 0.1) for w in uss}
    record.restarted(RestartReport(1, 1001, "killed by SIGKILL", 5, 1))
    size: dict[int, int] = {}
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for epoch in range(3001):
            if epoch:
                record.begin_epoch(epoch)  # closes epoch - 1
            if epoch in (1000, 3000):
                gc.collect()
                size[epoch] = tracemalloc.get_traced_memory()[0] - base
            for w, figures in uss.items():
                record.loaded(w, 4, 0.01)
                figures.append((1 << 30) + epoch)
            record.waited(epoch, epoch + 0.5)  # injected times: the machine's speed is moot
    finally:
        tracemalloc.stop()
    # What each epoch leaves is one USS figure per worker (in the sampler's lists and the
    # latest report's tuples): about 100 bytes an epoch with two workers, 0.3 MB here. A
    # history of whole reports held 75 MB after 3000 epochs (8.8 MB after 1000).
    assert size[3000] < 3 * size[1000] + (64 << 10)
    assert size[3000] < 1 << 20
    whole = history.report(all_epochs=True)
    assert whole is not None and (whole.epochs, whole.epoch, whole.batches) == (3001, 3000, 3001)
    assert [(w.samples, len(w.epoch_uss_bytes)) for w in whole.workers] == [(12004, 3001)] * 2
    assert (whole.wait_s, whole.loop_s) == (1500.5, 1500.5)
    assert [(r.epoch, r.worker_id) for r in whole.restarts] == [(0, 1)]


def test_all_epochs_adds_up_every_persistent_epoch() -> None:
    loader = steadyload.DataLoader(MapDS(24), batch_size=4, num_workers=2,
                                   persistent_workers=True)  # fmt: skip
    latest = []
    for _ in range(4):
        assert len(list(loader)) == 6
        latest.append(loader.report())
    before = loader.report(all_epochs=True)
    it = iter(loader)  # epoch 4 begins, closing epoch 3: its report is the latest still
    for whole in (before, loader.report(all_epochs=True)):
        assert (whole.epochs, whole.epoch, whole.batches) == (4, 3, 24)
        assert whole.wait_s == pytest.approx(sum(r.wait_s for r in latest))
        assert whole.loop_s == pytest.approx(sum(r.loop_s for r in latest))
        assert [w.samples for w in whole.workers] == [
            sum(r.workers[k].samples for r in latest) for k in range(2)
        ]
        # Memory is the latest epoch's: each worker's USS at the end of epochs 0 to 3.
        assert [len(w.epoch_uss_bytes) for w in whole.workers] == [4, 4]
    assert len(list(it)) == 6 and loader.report(all_epochs=True).epochs == 5
