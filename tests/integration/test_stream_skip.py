"""on_error="skip" on streams: every row arrives, or what was lost is reported with its count.

A bad item raised inside a stream's generator ends that generator. A stream that saves its
position is restarted after the bad item; any other says which worker's stream ended where,
what it had yielded and how many rows the epoch lost (when ``len(dataset)`` tells).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import steadyload
from tests.datasets import BadItemStream

N = 40
BAD = 9  # worker 1's item 4 with two workers (worker w reads rows w, w+2, ...)


def _rows(loader: steadyload.DataLoader[Any]) -> list[int]:
    return [int(x) for batch in loader for x in batch.flatten()]


def _loader(state: str, workers: int, kind: str = "process", **kw: Any) -> Any:
    return steadyload.DataLoader(
        BadItemStream(N, {BAD}, state), batch_size=3, num_workers=workers,
        on_error="skip", worker_type=kind, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_stream_that_saves_its_position_goes_on_after_the_bad_item(kind: str) -> None:
    clean = _rows(steadyload.DataLoader(BadItemStream(N, set()), batch_size=3, num_workers=2))
    loader = _loader("past", 2, kind)
    got = _rows(loader)
    assert got == [r for r in clean if r != BAD]  # torch's order, the bad row alone left out
    report = loader.report()
    assert [(k.index, k.error_type) for k in report.skipped] == [
        ("worker 1, its item 4", "builtins.ValueError")
    ]
    assert report.streams_cut == () and report.rows_lost is None


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_generator_that_raised_is_reported_with_the_rows_it_lost(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    loader = _loader("none", 2, kind)
    with caplog.at_level(logging.WARNING, logger="steadyload"):
        got = _rows(loader)
    worker1 = list(range(1, N, 2))
    arrived_of_worker1 = worker1[: worker1.index(BAD)]
    assert sorted(got) == sorted(list(range(0, N, 2)) + arrived_of_worker1)
    report = loader.report()
    (cut,) = report.streams_cut
    assert (cut.worker_id, cut.item, cut.yielded, cut.error_type) == (1, 4, 4, "builtins.ValueError")
    assert "generator that raised cannot go on" in cut.reason
    assert report.rows_lost == N - len(got) - 1 == len(worker1) - len(arrived_of_worker1) - 1
    text = caplog.text
    assert "worker 1's stream ended at its item 4" in text and "handler=wds.warn_and_continue" in text
    assert f"{report.rows_lost} of the dataset's {N} rows were lost" in text
    assert "stream cut: worker 1's stream ended at its item 4" in str(report)


def test_a_state_that_still_points_at_the_bad_item_ends_the_stream_and_says_why() -> None:
    loader = _loader("at", 2)
    got = _rows(loader)
    report = loader.report()
    (cut,) = report.streams_cut
    assert "state_dict() still pointed at it" in cut.reason
    assert (cut.worker_id, cut.item, cut.yielded) == (1, 4, 4)
    assert [k.index for k in report.skipped] == ["worker 1, its item 4"]  # read twice, once
    assert report.rows_lost == N - len(got) - 1


@pytest.mark.parametrize("state", ["none", "past"])
def test_in_process_loading_says_the_same(state: str) -> None:
    loader = _loader(state, 0)
    got = _rows(loader)
    report = loader.report()
    if state == "past":
        assert got == [r for r in range(N) if r != BAD] and report.streams_cut == ()
    else:
        assert got == list(range(BAD))
        (cut,) = report.streams_cut
        assert (cut.worker_id, cut.item, cut.yielded) == (-1, BAD, BAD)
        assert report.rows_lost == N - BAD - 1
    assert [k.index for k in report.skipped] == [f"stream item {BAD}"]


def _source() -> Any:
    return iter(torch.arange(N).view(-1, 1))


def _check(row: Any) -> Any:
    if int(row) == BAD:
        raise ValueError(f"row {BAD} does not decode")
    return row


def test_a_webdataset_pipeline_loses_only_what_the_report_says() -> None:
    wds = pytest.importorskip("webdataset")
    pipeline = wds.DataPipeline(_source, wds.split_by_worker, wds.map(_check)).with_length(N, silent=True)
    loader = steadyload.DataLoader(pipeline, batch_size=3, num_workers=2, on_error="skip")
    got = _rows(loader)
    report = loader.report()
    (cut,) = report.streams_cut
    assert (cut.worker_id, cut.item, cut.yielded) == (1, 4, 4)
    assert report.rows_lost == N - len(got) - 1 > 0
    # The library's own handler keeps every other row, as the message advises.
    kept = wds.DataPipeline(
        _source, wds.split_by_worker, wds.map(_check, handler=wds.warn_and_continue)
    )
    rows = _rows(steadyload.DataLoader(kept, batch_size=3, num_workers=2))
    assert sorted(rows) == [r for r in range(N) if r != BAD]
