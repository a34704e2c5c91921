"""The ledger records what every step trained on (steadyload/resume/ledger/record.py): the
indices of each yielded batch, which worker made it and what touched it, in one
append-only file per segment, flushed before state_dict() returns. Verifying, showing and
replaying the records: test_ledger_verify.py, test_ledger_replay.py; real ranks:
test_ledger_ranks.py."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import steadyload
from steadyload.resume.ledger.files import read_folder
from steadyload.resume.ledger.verify import verify
from tests.conftest import wait_until
from tests.datasets import FaultOnce, MapDS, StatefulStream

N, BATCH = 24, 4


def _loader(folder: Path | None, workers: int = 2, **kwargs: Any) -> Any:
    return steadyload.DataLoader(
        MapDS(N, "int"), batch_size=BATCH, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(3), ledger=folder, **kwargs,
    )  # fmt: skip


def _steps(folder: Path) -> list[dict[str, Any]]:
    return [s for seg in read_folder(folder) for s in seg.steps]


@pytest.mark.parametrize(
    ("workers", "kwargs", "kind"),
    [(0, {}, "in-process"), (2, {}, "process"), (2, {"worker_type": "thread"}, "thread")],
)
def test_every_yielded_batch_is_a_step_with_its_indices_and_worker(
    tmp_path: Path, workers: int, kwargs: dict[str, Any], kind: str
) -> None:
    loader = _loader(tmp_path, workers, **kwargs)
    batches = [b.tolist() for b in loader]  # sample i is i: a batch is its indices
    del loader
    [segment] = read_folder(tmp_path)
    assert segment.header["token"] == "root" and segment.header["rank"] == 0
    assert segment.header["dataset"] == {"type": "tests.datasets.MapDS", "kind": "map", "len": N}
    [epoch] = segment.epochs
    assert epoch["epoch"] == 0 and epoch["first_step"] == 0 and epoch["length"] == N // BATCH
    assert epoch["plan"] == "full" and epoch["deal"]["pad"] == epoch["deal"]["cut"] == 0
    assert [(s["e"], s["s"]) for s in segment.steps] == [(0, k) for k in range(N // BATCH)]
    assert [s["i"] for s in segment.steps] == batches
    assert {s["k"] for s in segment.steps} == {kind}
    if workers:
        assert {s["w"] for s in segment.steps} == {0, 1}
        assert all(isinstance(s["p"], int) for s in segment.steps)
    else:
        assert {(s["w"], s["p"]) for s in segment.steps} == {(-1, os.getpid())}


def test_state_dict_hands_every_step_to_the_os_first(tmp_path: Path) -> None:
    loader = _loader(tmp_path)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state["ledger"] == {"token": "root", "steps": 3}
    assert [s["s"] for s in _steps(tmp_path)] == [0, 1, 2]  # on disk, before the flusher ran
    del it, loader


def test_records_reach_the_os_within_a_second_without_a_state(tmp_path: Path) -> None:
    loader = _loader(tmp_path)
    it = iter(loader)
    next(it)
    wait_until(lambda: len(_steps(tmp_path)) == 1, 5, what="the flusher to write the step")
    del it, loader


def test_a_resume_begins_a_segment_that_continues_the_timeline(tmp_path: Path) -> None:
    loader = _loader(tmp_path)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it, loader
    resumed = _loader(tmp_path)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    del resumed
    old, new = read_folder(tmp_path)
    assert new.header["parent"] == "root" and new.header["cut"] == [0, 2]
    assert new.header["token"] not in ("root", None)
    assert new.epochs[0]["first_step"] == 2
    assert [s["s"] for s in new.steps] == [2, 3, 4, 5]
    assert [s["i"] for s in old.steps + new.steps] == first + rest


def test_a_killed_worker_re_runs_its_batches_and_the_step_says_so(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    loader = steadyload.DataLoader(
        FaultOnce(N, {9}, "sigkill", str(markers)), batch_size=BATCH, num_workers=2,
        ledger=tmp_path / "ledger",
    )  # fmt: skip
    batches = [b.flatten().tolist() for b in loader]
    del loader
    steps = _steps(tmp_path / "ledger")
    assert [s["i"] for s in steps] == batches == [list(range(k, k + BATCH)) for k in range(0, N, 4)]
    touched = [s for s in steps if s.get("ev")]
    assert 9 in [i for s in touched for i in s["i"]]  # the batch that killed its worker
    assert all(e.startswith("re-run: killed by SIGKILL") for s in touched for e in s["ev"])
    pids = {s["p"] for s in steps if s["w"] == steps[2]["w"]}
    assert len(pids) == 2  # the replacement worker has its own pid


def test_a_sample_skipped_on_error_is_an_event(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    loader = steadyload.DataLoader(
        FaultOnce(N, {5}, "raise", str(markers), always=True), batch_size=BATCH,
        num_workers=2, on_error="skip", ledger=tmp_path / "ledger",
    )  # fmt: skip
    list(loader)
    del loader
    [segment] = read_folder(tmp_path / "ledger")
    skips = [e for e in segment.events if e["ev"] == "skip"]
    assert [(e["e"], e["index"]) for e in skips] == [(0, 5)]
    assert "sample 5 is corrupt" in skips[0]["cause"]
    assert segment.events[-1] == {"ev": "end", "e": 0, "steps": N // BATCH}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_step_is_its_worker_and_positions_in_its_stream(
    tmp_path: Path, workers: int
) -> None:
    def loader() -> Any:
        stream = StatefulStream(11, -1, str(tmp_path / "stream"))
        return steadyload.DataLoader(stream, batch_size=3, num_workers=workers, ledger=tmp_path)

    (tmp_path / "stream").mkdir()
    first = loader()
    it = iter(first)
    next(it)
    next(it)
    state = first.state_dict()
    del it, first
    second = loader()
    second.load_state_dict(state)
    list(second)
    del second
    steps = _steps(tmp_path)
    assert all(s["i"] is None for s in steps)
    spans: dict[int, list[list[int]]] = {}
    for s in steps:
        spans.setdefault(s["w"], []).append(s["pos"])
    for worker_spans in spans.values():  # each worker's items once, in order, across the resume
        flat = [i for a, b in worker_spans for i in range(a, b)]
        assert flat == list(range(len(flat)))
    assert sum(len(v) for v in spans.values()) == len(steps)


def test_nothing_is_recorded_without_ledger(tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    loader = _loader(None)
    list(loader)
    assert loader.state_dict().get("ledger") is None
    assert "steadyload-ledger" not in {t.name for t in threading.enumerate()} - before


def test_a_torn_last_line_is_ignored_and_the_lines_before_it_kept(tmp_path: Path) -> None:
    loader = _loader(tmp_path)
    list(loader)
    del loader
    [path] = list(tmp_path.iterdir())
    with open(path, "a") as f:
        f.write('{"e":0,"s":6,"i":[1,')  # what a SIGKILL in the middle of a write leaves
    [segment] = read_folder(tmp_path)
    assert segment.torn and len(segment.steps) == N // BATCH
    json.loads(path.read_text().splitlines()[1])  # the lines before it are whole


def test_the_story_a_spike_found_replayed_skipped_on_resume_and_the_epoch_proved(
    tmp_path: Path,
) -> None:
    """docs/guide/ledger.md, end to end: steps 4-5 of a run spiked; resume from the state
    of step 3 without their samples; verify accounts for them as skipped on purpose."""
    loader = _loader(tmp_path, sample_seeds=True)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()  # the checkpoint of step 3
    spiked = [next(it), next(it)]  # steps 3 and 4; then the run is stopped
    del it, loader
    wait_until(lambda: len(_steps(tmp_path)) == 5, 5, what="the flusher to write steps 3, 4")
    bad = steadyload.ledger_samples(tmp_path, epoch=0, steps=range(3, 5))
    assert bad == sorted(int(i) for b in spiked for i in b)
    again = steadyload.replay(_loader(None, 0, sample_seeds=True), tmp_path, epoch=0, step=4)
    assert torch.equal(again, spiked[1])
    resumed = _loader(tmp_path, sample_seeds=True)
    resumed.load_state_dict(state, skip_samples=bad)
    rest = [int(i) for b in resumed for i in b]
    del resumed
    assert not set(rest) & set(bad)
    verdict = verify(tmp_path)
    assert verdict.ok, verdict.text()
    text = verdict.text()
    assert "skipped on purpose" in text and "superseded" in text


def test_a_stream_verifies_by_positions_and_a_planted_gap_fails(tmp_path: Path) -> None:
    (tmp_path / "stream").mkdir()
    stream = StatefulStream(11, -1, str(tmp_path / "stream"))
    list(steadyload.DataLoader(stream, batch_size=3, num_workers=2, ledger=tmp_path / "l"))
    verdict = verify(tmp_path / "l")
    assert verdict.ok and verdict.epochs[0].samples == 11, verdict.text()
    [path] = list((tmp_path / "l").iterdir())
    lines = path.read_text().splitlines(keepends=True)
    gone = next(i for i, line in enumerate(lines) if '"s":0,' in line)
    path.write_text("".join(lines[:gone] + lines[gone + 1 :]))  # step 0's items unrecorded
    verdict = verify(tmp_path / "l")
    holes = [f.text for f in verdict.epochs[0].findings if f.kind == "hole"]
    assert not verdict.ok and any("items 0-2 of its stream are in no recorded step" in h for h in holes)
