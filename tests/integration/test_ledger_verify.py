"""`steadyload ledger verify|show` and `ledger_samples` on ledgers that real loaders wrote.

Every ledger here is written by `steadyload.DataLoader(..., ledger=folder)` (in-process and
with 2 worker processes); holes and repeats are planted by editing its files afterwards,
with each file's mtime put back (the timeline orders runs by their files' lifetimes).
Dropping a loader half-way through an epoch stands in for a crash: what it recorded after
the state that is resumed is superseded.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, WeightedRandomSampler

import steadyload
from steadyload.cli.__main__ import main
from steadyload.resume.ledger.timeline import resolve
from steadyload.resume.ledger.verify import verify
from tests.datasets import FailAt, IterDS, MapDS, SeedSeen

WORKERS = [0, 2]


def _loader(folder: Path, workers: int, n: int = 40, **kwargs: Any) -> steadyload.DataLoader[Any]:
    generator = torch.Generator()
    generator.manual_seed(7)
    kwargs.setdefault("shuffle", True)
    return steadyload.DataLoader(
        MapDS(n, "int"), batch_size=4, generator=generator, num_workers=workers,
        ledger=str(folder), **kwargs,
    )  # fmt: skip


def _collect() -> None:
    """After ``del`` of loaders and iterators: their workers stop, their ledger files close."""
    gc.collect()


def _files(folder: Path) -> list[Path]:
    """The segment files, oldest first."""
    launches = sorted(resolve(folder).launches, key=lambda launch: launch.start)
    return [segment.path for launch in launches for segment in launch.segments]


def _edit(path: Path, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    """Rewrite a segment's records, keeping its mtime (what the timeline reads)."""
    stat = path.stat()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in edit(records)))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["ledger", *argv])
    return code, capsys.readouterr().out


def _one_epoch(folder: Path, workers: int, **kwargs: Any) -> list[Any]:
    loader = _loader(folder, workers, **kwargs)
    batches = list(loader)
    del loader
    _collect()
    return batches


@pytest.mark.parametrize("workers", WORKERS)
def test_a_clean_epoch_verifies(
    tmp_path: Path, workers: int, capsys: pytest.CaptureFixture[str]
) -> None:
    _one_epoch(tmp_path, workers)
    verdict = verify(tmp_path)
    assert verdict.ok and [e.status for e in verdict.epochs] == ["exact"]
    digest = hashlib.sha256(json.dumps(list(range(40)), separators=(",", ":")).encode())
    assert verdict.epochs[0].digest == digest.hexdigest()[:12]
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert code == 0, out
    assert (
        f"epoch 0  exact  40 samples for 40 indices, 10 of 10 steps on 1 rank, 1 run, "
        f"plan full, digest {digest.hexdigest()[:12]}" in out
    )
    assert out.rstrip().endswith("verdict: exact")


@pytest.mark.parametrize("workers", WORKERS)
def test_a_resume_supersedes_what_the_crashed_run_did_after_the_state(
    tmp_path: Path, workers: int, capsys: pytest.CaptureFixture[str]
) -> None:
    crashed = _loader(tmp_path, workers)
    it = iter(crashed)
    for _ in range(3):
        next(it)
    state = crashed.state_dict()
    for _ in range(3):  # steps 3-5: the model trained on them, then the job died
        next(it)
    del it, crashed
    _collect()
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert code == 1 and "epoch 0  incomplete" in out and "incomplete: 6 of 10 steps" in out
    assert _cli(capsys, "verify", str(tmp_path), "--allow-incomplete")[0] == 0

    resumed = _loader(tmp_path, workers)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 7
    list(resumed)  # epoch 1
    del resumed
    _collect()
    first, second = (p.name.removesuffix(".ledger.jsonl") for p in _files(tmp_path))
    timeline = resolve(tmp_path)
    assert [(x.step.epoch, x.step.step) for x in timeline.superseded] == [(0, 3), (0, 4), (0, 5)]
    assert {x.why for x in timeline.superseded} == {
        f"superseded by the resume at epoch 0 step 3 (segment {second})"
    }
    assert [(s.step, s.segment) for s in timeline.steps(epoch=0)] == [
        *((n, first) for n in range(3)),
        *((n, second) for n in range(3, 10)),
    ]
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert code == 0, out
    assert "epoch 0  exact  40 samples for 40 indices, 10 of 10 steps on 1 rank, 2 runs" in out
    assert "epoch 1  exact" in out
    assert (
        f"superseded: epoch 0 step(s) 3-5 on rank 0 (run {first}): superseded by the "
        f"resume at epoch 0 step 3 (segment {second})"
    ) in out


def test_a_relaunch_from_the_same_state_supersedes_the_first_relaunch(tmp_path: Path) -> None:
    # Both resumes of one state share a token: their launches are told apart by lifetime.
    loader = _loader(tmp_path, 0)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    del it, loader
    _collect()
    for steps in (4, None):  # the first relaunch dies after 4 more steps
        again = _loader(tmp_path, 0)
        again.load_state_dict(state)
        it = iter(again)
        for _ in range(steps or 8):
            next(it)
        del it, again
        _collect()
    _, dead, last = (p.name.removesuffix(".ledger.jsonl") for p in _files(tmp_path))
    timeline = resolve(tmp_path)
    assert len(timeline.launches) == 3 and [p.launch.name for p in timeline.parts][-1] == last
    assert {(s.step.segment, s.why) for s in timeline.superseded} == {
        (dead, f"superseded by the resume at epoch 0 step 2 (segment {last})")
    }
    assert verify(tmp_path).ok


def test_a_planted_hole_fails_naming_rank_step_and_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _one_epoch(tmp_path, 0)
    (path,) = _files(tmp_path)
    lost: list[int] = []

    def drop_step_4(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        lost.extend(next(r["i"] for r in records if r.get("s") == 4))
        return [r for r in records if r.get("s") != 4]

    _edit(path, drop_step_4)
    code, out = _cli(capsys, "verify", str(tmp_path))
    run = path.name.removesuffix(".ledger.jsonl")
    assert code == 1, out
    assert "epoch 0  FAIL  2 holes; 36 samples for 40 indices, 9 of 10 steps" in out
    assert f"    hole: rank 0 step 4 has no record (run {run})" in out
    assert f"    hole: 4 index(es) never delivered: {', '.join(map(str, sorted(lost)))}" in out
    assert "verdict: FAIL (epoch 0 fail)" in out
    code = main(["ledger", "verify", str(tmp_path), "--epoch", "5"])
    assert code == 2 and "epoch 5 has no record on the timeline" in capsys.readouterr().err


@pytest.mark.parametrize("workers", WORKERS)
def test_a_planted_repeat_fails_naming_both_runs(
    tmp_path: Path, workers: int, capsys: pytest.CaptureFixture[str]
) -> None:
    loader = _loader(tmp_path, workers)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it, loader
    _collect()
    resumed = _loader(tmp_path, workers)
    resumed.load_state_dict(state)
    list(resumed)
    del resumed
    _collect()
    assert verify(tmp_path).ok
    first, second = _files(tmp_path)
    step0 = next(json.loads(x) for x in first.read_text().splitlines() if '"s":0' in x)
    _edit(second, lambda records: [*records, step0])  # step 0 again, in the resumed run
    code, out = _cli(capsys, "verify", str(tmp_path))
    runs = [p.name.removesuffix(".ledger.jsonl") for p in (first, second)]
    assert code == 1, out
    assert "epoch 0  FAIL  4 repeats;" in out
    assert (
        f"    repeat: index {step0['i'][0]} delivered 2 times: rank 0 step 0 (run {runs[0]}); "
        f"rank 0 step 0 (run {runs[1]})"
    ) in out


def test_a_changed_index_is_a_repeat_and_a_hole(tmp_path: Path) -> None:
    batches = _one_epoch(tmp_path, 0)
    (path,) = _files(tmp_path)
    was, now = int(batches[1][0]), int(batches[0][0])

    def change(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r in records:
            if r.get("s") == 1:
                r["i"][0] = now
        return records

    _edit(path, change)
    verdict = verify(tmp_path)
    texts = [(f.kind, f.text) for f in verdict.epochs[0].findings]
    run = path.name.removesuffix(".ledger.jsonl")
    assert not verdict.ok and verdict.epochs[0].status == "fail"
    assert ("hole", f"1 index(es) never delivered: {was}") in texts
    assert (
        "repeat",
        f"index {now} delivered 2 times: rank 0 step 0 (run {run}); rank 0 step 1 (run {run})",
    ) in texts


@pytest.mark.parametrize("workers", WORKERS)
def test_distributed_padding_verifies_with_ranks_told_apart_by_the_dealing(
    tmp_path: Path, workers: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two ranks fed by one process (a world of 1): both headers say rank 0; the epoch
    # line's dealing (deal.rank) is what tells them apart.
    delivered = []
    for rank in range(2):
        sampler = DistributedSampler(MapDS(19), num_replicas=2, rank=rank, seed=3)
        batches = _one_epoch(tmp_path, workers, n=19, shuffle=None, sampler=sampler)
        delivered += [int(i) for batch in batches for i in batch]
    timeline = resolve(tmp_path)
    assert {p.launch.segments[0].rank for p in timeline.parts} == {0}
    assert len(timeline.parts) == 1 and {s.rank for s in timeline.steps(0)} == {0, 1}
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert code == 0, out
    assert "epoch 0  exact  20 samples for 19 indices, 6 of 6 steps on 2 ranks, 2 runs" in out
    assert "    padding: index " in out and "delivered 2 times (the dealing's padding)" in out
    assert steadyload.ledger_samples(tmp_path, epoch=0, steps=range(3)) == sorted(delivered)
    rank1 = [i for s in timeline.steps(0, rank=1) if s.step in (1, 2) for i in s.indices]
    assert steadyload.ledger_samples(tmp_path, epoch=0, steps=[1, 2], rank=1) == sorted(rank1)


def test_drop_last_cuts_verify_as_cuts(tmp_path: Path) -> None:
    for rank in range(2):  # 21 samples over 2 ranks: one cut by the sampler, 2 by batches
        sampler = DistributedSampler(MapDS(21), num_replicas=2, rank=rank, drop_last=True)
        _one_epoch(tmp_path / "sharded", 0, n=21, shuffle=None, sampler=sampler, drop_last=True)
    _one_epoch(tmp_path / "plain", 0, n=22, drop_last=True)
    for folder, cut in (("sharded", 5), ("plain", 2)):
        verdict = verify(tmp_path / folder)
        (epoch,) = verdict.epochs
        assert verdict.ok and epoch.status == "exact", verdict.text()
        (finding,) = [f for f in epoch.findings if f.kind == "cut"]
        assert finding.text.startswith(
            f"{cut} sample(s) left out by drop_last or the dealing (up to {cut} allowed): "
        )


def test_a_sampler_with_replacement_verifies_by_its_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sampler = WeightedRandomSampler(
        [1.0] * 10, num_samples=30, replacement=True, generator=torch.Generator().manual_seed(1)
    )
    _one_epoch(tmp_path, 0, n=10, shuffle=None, sampler=sampler)
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert (
        code == 0
        and "epoch 0  exact  30 samples, 8 of 8 steps on 1 rank, 1 run, plan sampler" in out
    ), out
    (path,) = _files(tmp_path)
    _edit(path, lambda records: [*records, {**records[3], "i": [0, 0, 0, 0]}])
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert code == 1 and "rank 0 step 1 recorded 2 times with different indices" in out, out
    assert _cli(capsys, "verify", str(tmp_path), "--plan")[0] == 1


@pytest.mark.parametrize("workers", WORKERS)
def test_a_sample_skipped_on_error_is_listed(
    tmp_path: Path, workers: int, capsys: pytest.CaptureFixture[str]
) -> None:
    loader = steadyload.DataLoader(
        FailAt(10, 3), batch_size=4, num_workers=workers, on_error="skip", ledger=str(tmp_path)
    )
    assert sum(len(b) for b in loader) == 9
    del loader
    _collect()
    code, out = _cli(capsys, "verify", str(tmp_path))
    assert code == 0, out
    assert "epoch 0  exact  9 samples for 10 indices" in out
    assert (
        "    skipped on error: index 3 (builtins.KeyError: 'sample 3 is corrupt'): rank 0 "
        "step 0 (run " in out
    )
    code, out = _cli(
        capsys, "show", str(tmp_path), "--epoch", "0", "--step", "0", "--rank", "0", "--json"
    )
    assert json.loads(out)["events"] == [
        "skipped on error: sample 3 (builtins.KeyError: 'sample 3 is corrupt')"
    ]


def keys_of(batch: Any) -> list[int]:
    """The ledger keys of an `IterDS` batch (``ledger_key``)."""
    return [int(i) for i in batch["i"]]


def test_a_stream_verifies_by_its_keys(tmp_path: Path) -> None:
    loader = steadyload.DataLoader(
        IterDS(10), batch_size=2, num_workers=2, ledger=str(tmp_path), ledger_key=keys_of
    )
    assert sum(len(b["i"]) for b in loader) == 10
    del loader
    _collect()
    verdict = verify(tmp_path)
    assert verdict.ok and verdict.epochs[0].plan == "stream", verdict.text()
    (path,) = _files(tmp_path)
    _edit(path, lambda records: [*records, {**records[2], "s": 6}])  # step 0's samples again
    verdict = verify(tmp_path)
    repeats = [f.text for f in verdict.epochs[0].findings if f.kind == "repeat"]
    assert not verdict.ok and sum("delivered 2 times" in r for r in repeats) == 2
    assert any("step 6 is outside its epoch's steps" in r for r in repeats)  # past its end


@pytest.mark.parametrize("workers", WORKERS)
def test_show_json_gives_each_ranks_step(
    tmp_path: Path, workers: int, capsys: pytest.CaptureFixture[str]
) -> None:
    loader = steadyload.DataLoader(
        SeedSeen(12), batch_size=4, num_workers=workers, sample_seeds=True, ledger=str(tmp_path)
    )
    batches = list(loader)
    del loader
    _collect()
    code, out = _cli(
        capsys, "show", str(tmp_path), "--epoch", "0", "--step", "1", "--rank", "0", "--json"
    )
    shown = json.loads(out)
    assert code == 0 and set(shown) == {
        "epoch",
        "step",
        "rank",
        "run",
        "indices",
        "seeds",
        "workers",
        "events",
    }
    assert (shown["epoch"], shown["step"], shown["rank"]) == (0, 1, 0)
    assert shown["indices"] == batches[1][:, 0].tolist() == [4, 5, 6, 7]
    assert shown["seeds"] == batches[1][:, 1].tolist()
    (worker,) = shown["workers"]
    assert worker["kind"] == ("process" if workers else "in-process")
    assert worker["id"] == (1 if workers else -1) and isinstance(worker["pid"], int)
    assert shown["run"] == _files(tmp_path)[0].name.removesuffix(".ledger.jsonl")
    assert shown["events"] == []
    code, out = _cli(capsys, "show", str(tmp_path), "--epoch", "0", "--step", "1", "--json")
    assert json.loads(out) == [shown]
    code, out = _cli(capsys, "show", str(tmp_path), "--epoch", "0", "--step", "2")
    assert (
        code == 0
        and out.startswith("epoch 0 step 2 rank 0 (run seg-")
        and "  indices: 8, 9, 10, 11\n" in out
    )
    code = main(["ledger", "show", str(tmp_path), "--epoch", "0", "--step", "3"])
    assert code == 2 and "has no epoch 0 step 3 on its timeline" in capsys.readouterr().err


def test_show_without_sample_seeds_has_no_seeds(tmp_path: Path) -> None:
    _one_epoch(tmp_path, 0, n=8)
    from steadyload.resume.ledger.show import show

    (step,) = show(tmp_path, 0, 0)
    assert step["seeds"] is None and len(step["indices"]) == 4
    assert steadyload.ledger_samples(tmp_path, epoch=0, steps=0) == sorted(step["indices"])


def test_samples_skipped_on_purpose_are_listed(tmp_path: Path) -> None:
    # As load_state_dict(..., skip_samples=) records them: the resumed run's header names
    # the samples, and its steps leave them out.
    loader = _loader(tmp_path, 0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it, loader
    _collect()
    resumed = _loader(tmp_path, 0)
    resumed.load_state_dict(state)
    list(resumed)
    del resumed
    _collect()
    _, second = _files(tmp_path)
    left_out: list[int] = []

    def skip_two(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        step = next(r for r in records if r.get("s") == 2)
        left_out.extend(step["i"][:2])
        step["i"] = step["i"][2:]
        records[0]["skip"] = {"epoch": 0, "at": 1, "samples": left_out}
        return records

    _edit(second, skip_two)
    verdict = verify(tmp_path)
    assert verdict.ok, verdict.text()
    assert ("skipped on purpose", f"2 sample(s): {', '.join(map(str, sorted(left_out)))}") in [
        (f.kind, f.text) for f in verdict.epochs[0].findings
    ]


def test_a_resume_whose_parent_is_elsewhere_is_incomplete_before_its_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loader = _loader(tmp_path / "before", 0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it, loader
    _collect()
    resumed = _loader(tmp_path / "after", 0)
    resumed.load_state_dict(state)
    list(resumed)
    del resumed
    _collect()
    code, out = _cli(capsys, "verify", str(tmp_path / "after"))
    assert code == 1 and "epoch 0  incomplete  28 samples for 40 indices, 7 of 10 steps" in out
    assert "    incomplete: steps 0-2 are not recorded here" in out
    assert (
        "note: the timeline begins with a resume from root, whose records are not in "
        "this folder" in out
    )
