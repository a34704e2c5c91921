"""Real multi-process training: torchrun, gloo on CPU, DDP, steadyload loaders with workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import ddp_job

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _torchrun(out: Path, *flags: str, ok: bool = True) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "tests.ddp_job", str(out), *flags],
        cwd=ROOT, env=env, timeout=240, capture_output=True, text=True,
    )  # fmt: skip
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-6000:]


def _log(out: Path, rank: int) -> list[dict[str, Any]]:
    lines = (out / f"rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = torch.load(out / "weights.pt", weights_only=True)
    return weights


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k}: {wa[k]} != {wb[k]}"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clean")
    _torchrun(out)
    return out


def _samples_per_epoch(out: Path) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for rank in (0, 1):
        for entry in _log(out, rank):
            if "indices" in entry:
                seen.setdefault(entry["epoch"], []).extend(entry["indices"])
    return seen


def test_ranks_cover_the_dataset_exactly_each_epoch(clean_run: Path) -> None:
    seen = _samples_per_epoch(clean_run)
    assert sorted(seen) == list(range(ddp_job.EPOCHS))
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(ddp_job.N)), f"epoch {epoch}"
    steps = [sum("indices" in e for e in _log(clean_run, r)) for r in (0, 1)]
    assert steps[0] == steps[1] == ddp_job.EPOCHS * ddp_job.N // 2 // ddp_job.BATCH


def test_a_worker_killed_on_rank_1_changes_nothing(clean_run: Path, tmp_path: Path) -> None:
    _torchrun(tmp_path, "--kill-worker")
    restarts = [e["restarts"] for e in _log(tmp_path, 1) if "restarts" in e]
    assert restarts[0] == ["killed by SIGKILL"]  # the death happened and was healed
    assert _samples_per_epoch(tmp_path) == _samples_per_epoch(clean_run)
    _assert_same_weights(tmp_path, clean_run)


def test_a_rank_killed_and_restarted_from_its_checkpoint_ends_the_same(
    clean_run: Path, tmp_path: Path
) -> None:
    _torchrun(tmp_path, "--kill-rank", ok=False)  # rank 1 SIGKILLed: the job fails
    done = [e["step"] for e in _log(tmp_path, 1) if "indices" in e]
    assert 0 < len(done) < ddp_job.EPOCHS * ddp_job.N // 2 // ddp_job.BATCH
    _torchrun(tmp_path, "--resume")  # re-submitted: model, optimizer and loaders resume
    _assert_same_weights(tmp_path, clean_run)
    resumed = [e for e in _log(tmp_path, 1) if e.get("attempt") == 1 and "indices" in e]
    assert resumed[0]["step"] == done[-1] + 1  # not a sample repeated or skipped


def test_the_device_stage_on_each_rank_resumes_a_killed_rank_exactly(
    clean_run: Path, tmp_path: Path
) -> None:
    """With batches on their way to the device when each checkpoint is taken (three
    ahead), a rank killed and resumed from its loader state still trains on every sample
    once: the same weights as the clean run without the stage."""
    _torchrun(tmp_path, "--device", "--kill-rank", ok=False)
    _torchrun(tmp_path, "--device", "--resume")
    _assert_same_weights(tmp_path, clean_run)
    for epoch, indices in _samples_per_epoch(tmp_path).items():  # both attempts' steps
        assert sorted(indices) == list(range(ddp_job.N)), f"epoch {epoch}"


def test_a_fully_skipped_batch_keeps_ranks_in_step(tmp_path: Path) -> None:
    # Rank 1's second batch fails entirely: it is yielded empty, so both ranks take the same
    # number of steps and the gradient all-reduce never waits for a rank that moved on.
    _torchrun(tmp_path, "--corrupt")
    logs = [_log(tmp_path, r) for r in (0, 1)]
    steps = [[e for e in log if "indices" in e] for log in logs]
    assert len(steps[0]) == len(steps[1]) == ddp_job.EPOCHS * ddp_job.N // 2 // ddp_job.BATCH
    assert steps[1][1]["indices"] == [] and steps[1][1]["epoch"] == 0
