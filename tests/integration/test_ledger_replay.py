"""steadyload.replay / ``steadyload replay``: a recorded step's batch rebuilt offline, bit for
bit with sample_seeds=True (steadyload/resume/ledger/replay.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

import steadyload
from tests.datasets import MapDS, StatefulStream
from tests.resume_job import Augmented

ROOT = Path(__file__).resolve().parents[2]


def _loader(folder: Path | None, workers: int = 2, seeds: bool = True) -> Any:
    return steadyload.DataLoader(
        Augmented(40), batch_size=4, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(1), sample_seeds=seeds, ledger=folder,
    )  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_a_step_replays_bit_for_bit_with_sample_seeds(tmp_path: Path, workers: int) -> None:
    trained = list(_loader(tmp_path, workers))  # random draws from each worker's seeding
    caller = torch.get_rng_state()
    for step in (0, 3, 9):
        again = steadyload.replay(_loader(None, 0), tmp_path, epoch=0, step=step)
        assert torch.equal(again, trained[step])
    assert torch.equal(torch.get_rng_state(), caller)  # the caller's RNGs are untouched


def test_without_sample_seeds_replay_says_what_differs(tmp_path: Path) -> None:
    trained = list(_loader(tmp_path, seeds=False))
    with pytest.warns(UserWarning, match="sample_seeds=False: a random transform"):
        again = steadyload.replay(_loader(None, 0, seeds=False), tmp_path, epoch=0, step=2)
    assert torch.equal(again[:, 0], trained[2][:, 0])  # the indices: the same samples


def test_a_step_of_several_ranks_needs_the_rank(tmp_path: Path) -> None:
    ds = MapDS(16, "int")
    batches = {}
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, seed=3)
        loader = steadyload.DataLoader(ds, batch_size=2, sampler=sampler, ledger=tmp_path)
        batches[rank] = list(loader)
        del loader
    replayer = steadyload.DataLoader(ds, batch_size=2)
    with pytest.raises(ValueError, match=r"(?s)recorded by ranks \[0, 1\].*pass rank="):
        steadyload.replay(replayer, tmp_path, epoch=0, step=1)
    for rank in (0, 1):
        with pytest.warns(UserWarning, match="sample_seeds=False"):  # (nothing random here)
            got = steadyload.replay(replayer, tmp_path, epoch=0, step=1, rank=rank)
        assert torch.equal(got, batches[rank][1])


def test_a_step_not_in_the_ledger_and_a_stream_are_refused(tmp_path: Path) -> None:
    list(_loader(tmp_path / "map", 0))
    with pytest.raises(ValueError, match="has no step 99 of epoch 0"):
        steadyload.replay(_loader(None, 0), tmp_path / "map", epoch=0, step=99)
    (tmp_path / "s").mkdir()
    stream = steadyload.DataLoader(StatefulStream(9, -1, str(tmp_path / "s")), batch_size=3,
                                   ledger=tmp_path / "stream")  # fmt: skip
    list(stream)
    with pytest.raises(ValueError, match="cannot replay step 1 of a stream"):
        steadyload.replay(stream, tmp_path / "stream", epoch=0, step=1)


def test_the_cli_prints_indices_and_digests_and_saves_the_batch(tmp_path: Path) -> None:
    trained = list(_loader(tmp_path / "ledger"))
    (tmp_path / "train.py").write_text(
        "import torch, steadyload\n"
        "from tests.resume_job import Augmented\n"
        "def make_loader():\n"
        "    return steadyload.DataLoader(Augmented(40), batch_size=4, shuffle=True,\n"
        "        generator=torch.Generator().manual_seed(1), sample_seeds=True)\n"
    )
    out = tmp_path / "step5.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "steadyload", "replay", "ledger", "--epoch", "0", "--step", "5",
         "--loader", "train:make_loader", "--out", str(out)],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    indices = [int(v) for v in trained[5][:, 0].tolist()]
    assert f"indices: {indices}" in proc.stdout
    assert "batch: (4, 4) torch.float64 sha256:" in proc.stdout
    assert torch.equal(torch.load(out, weights_only=True), trained[5])
