"""Lightning: steadyload loaders keep their class, options and workers through fit, predict
(re-instantiation) and DDP sampler injection, and heal a killed worker.

1 device runs in this process; DDP with 2 processes runs tests/frameworks/lightning_ddp_job.py
in a subprocess (Lightning's strategy="ddp" re-runs sys.argv for rank 1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import steadyload as sl
from tests.frameworks.ledger_check import (
    assert_each_sample_once,
    assert_resumed,
    recorded,
    timeline,
)
from tests.frameworks.samples import PidSquares, forkserver_pid

ROOT = Path(__file__).resolve().parents[2]
OPTIONS: dict[str, Any] = {"on_error": "skip", "max_restarts": 7, "hang_timeout": 60.0,
                           "max_worker_memory": "4GiB", "sample_seeds": True}  # fmt: skip
# Lightning's advice for tiny CPU runs (workers, logging interval), and its use of a torch
# API that torch 2.13 deprecates: not steadyload's concern.
pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning"),
]


class Recorder(L.LightningModule):
    """Records each batch's indices and the parent pids of the processes that loaded it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.batches: list[list[int]] = []
        self.ppids: set[int] = set()

    def _record(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.batches.append(batch["i"].tolist())
        self.ppids.update(batch["ppid"].tolist())
        return self.lin(batch["x"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._record(batch).pow(2).mean()

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._record(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class KillWorker(L.Callback):
    """SIGKILLs worker 0 of the loader Lightning iterates, after batch ``after``."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.victim: int | None = None

    def _maybe_kill(self, loader: Any, batch_idx: int) -> None:
        if batch_idx == self.after and self.victim is None:
            self.victim = loader.report().workers[0].pid
            assert self.victim is not None
            os.kill(self.victim, signal.SIGKILL)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._maybe_kill(trainer.train_dataloader, args[-1])

    def on_predict_batch_end(self, trainer: Any, *args: Any) -> None:
        self._maybe_kill(trainer.predict_dataloaders, args[-1])


def _trainer(*callbacks: L.Callback) -> Any:
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                     enable_progress_bar=False, enable_checkpointing=False,
                     enable_model_summary=False, callbacks=list(callbacks))  # fmt: skip


def _loader(n: int = 48, **kw: Any) -> sl.DataLoader[Any]:
    return sl.DataLoader(PidSquares(n, delay_s=0.01), batch_size=4, shuffle=True,
                         generator=torch.Generator().manual_seed(0), num_workers=2,
                         **OPTIONS, **kw)  # fmt: skip


def _options(loader: Any) -> dict[str, Any]:
    return {name: getattr(loader, name) for name in OPTIONS}


def test_fit_on_one_device_heals_a_killed_worker_with_the_same_batches() -> None:
    clean_model, killed_model, kill = Recorder(), Recorder(), KillWorker(after=2)
    clean = _loader()
    _trainer().fit(clean_model, clean)
    loader = _loader()
    trainer = _trainer(kill)
    trainer.fit(killed_model, loader)
    assert trainer.train_dataloader is loader  # one device: Lightning iterates ours
    assert clean_model.ppids == killed_model.ppids == {forkserver_pid()}  # steadyload's workers
    assert killed_model.batches == clean_model.batches  # same batches, same order
    assert sorted(i for b in clean_model.batches for i in b) == list(range(48))
    [restart] = loader.report().restarts
    assert (restart.worker_id, restart.pid, restart.cause) == (0, kill.victim, "killed by SIGKILL")


def test_predict_rebuilds_the_loader_as_steadyloads_with_its_options() -> None:
    model, kill = Recorder(), KillWorker(after=1)
    # Enough batches after the kill that worker 0 still has some to load when it dies.
    loader = sl.DataLoader(PidSquares(48, delay_s=0.01), batch_size=4, num_workers=2,
                           **OPTIONS)  # fmt: skip
    trainer = _trainer(kill)
    predictions = trainer.predict(model, dataloaders=loader)
    rebuilt = trainer.predict_dataloaders
    assert rebuilt is not loader  # re-instantiated (batch sampler wrapped for indices) ...
    assert type(rebuilt) is sl.DataLoader  # ... as steadyload's class
    assert _options(rebuilt) == OPTIONS and rebuilt.num_workers == 2  # and options
    assert model.ppids == {forkserver_pid()}
    assert model.batches == [list(range(k, k + 4)) for k in range(0, 48, 4)]  # healed, in order
    assert len(predictions) == 12
    [restart] = rebuilt.report().restarts
    assert (restart.worker_id, restart.cause) == (0, "killed by SIGKILL")


class Interrupt(L.Callback):
    """Saves a checkpoint after batch ``after`` of the first epoch, then fails the run
    ``then`` batches later."""

    def __init__(self, path: Path, after: int, then: int = 0) -> None:
        self.path, self.after, self.then = path, after, then

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.current_epoch == 0 and args[-1] == self.after:
            trainer.save_checkpoint(self.path)
        if trainer.current_epoch == 0 and args[-1] == self.after + self.then:
            raise RuntimeError("interrupted")


def test_resuming_from_a_mid_epoch_checkpoint_gives_the_uninterrupted_batches(
    tmp_path: Path,
) -> None:
    # Lightning saves a Stateful loader's state_dict() with its checkpoint and loads it on
    # resume (and does not prefetch from a loader that has a length): exact, no skipping.
    def fit(model: Recorder, *callbacks: L.Callback, ckpt: Path | None = None) -> None:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                            enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False, callbacks=list(callbacks))  # fmt: skip
        loader = _loader(24, ledger=str(tmp_path / "ledger") if model is not full else None)
        try:
            trainer.fit(model, loader, ckpt_path=ckpt)
        finally:
            loader.state_dict()  # (hands the ledger's last records to the OS)

    full, part, rest, ckpt = Recorder(), Recorder(), Recorder(), tmp_path / "mid.ckpt"
    fit(full)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(part, Interrupt(ckpt, after=2, then=2))  # trains 2 batches past its checkpoint
    fit(rest, ckpt=ckpt)
    assert len(part.batches) == 5 and len(full.batches) == 12
    assert part.batches[:3] + rest.batches == full.batches
    assert rest.ppids == {forkserver_pid()}
    # The ledger (ledger=): the resumed run continues the checkpoint's timeline, and what
    # the first run trained on after its checkpoint is superseded.
    line = timeline(tmp_path / "ledger")
    assert_resumed(line, [0, 3], ranks=1)
    assert sorted((s["e"], s["s"]) for s in line.superseded) == [(0, 3), (0, 4)]
    assert recorded(line, 0) == full.batches
    assert_each_sample_once(line, 24, complete=range(2))


def _ddp_job(out: Path, strategy: str = "ddp") -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.frameworks.lightning_ddp_job", str(out), strategy],
        cwd=ROOT, env=env, timeout=180, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(240)
def test_ddp_two_processes_inject_the_sampler_keep_steadyload_and_heal(tmp_path: Path) -> None:
    from tests.frameworks import lightning_ddp_job as job

    ranks = _ddp_job(tmp_path)
    shards = []
    for rank, info in enumerate(ranks):
        assert "error" not in info, info["error"]
        assert info["lazy"]  # sl.DataLoader first touched inside train_dataloader()
        for run in (info["clean"], info["killed"]):
            assert run["loader"] == "steadyload.DataLoader"
            assert run["sampler"] == "DistributedSampler"  # injected by Lightning
            assert (run["rank"], run["replicas"]) == (rank, 2)
            assert run["options"] == job.OPTIONS
            assert run["ppids"] == [info["forkserver_pid"]]  # steadyload's workers
        assert info["clean"]["restarts"] == []
        assert info["killed"]["batches"] == info["clean"]["batches"]
        [(worker_id, cause)] = info["killed"]["restarts"]
        assert (worker_id, cause) == (0, "killed by SIGKILL")
        shards.append({i for b in info["clean"]["batches"] for i in b})
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(job.N))
    # Elastic resume: the 2-process run's mid-epoch checkpoint (rank 0's loader state)
    # goes on with one device; over both runs every sample of the epoch once, in the
    # order the 2 ranks' DistributedSampler dealt.
    part = [info["part"]["batches"] for info in ranks]
    assert [len(p) for p in part] == [job.PART + 1] * 2
    model = job.Model("rest", str(tmp_path))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(model, ckpt_path=tmp_path / "part.ckpt")
    trainer.train_dataloader.state_dict()  # (hands the ledger's last records to the OS)
    taken = [i for b in part[0] + part[1] for i in b]
    rest = [i for b in model.batches for i in b]
    assert sorted(taken + rest) == list(range(job.N))
    order = torch.randperm(job.N, generator=torch.Generator().manual_seed(0)).tolist()
    assert rest == order[len(taken):]  # the rest of the permutation, in its order
    # The ledger (ledger=, kept by Lightning's rebuild): each rank's segment of the 2-process
    # run (rank and world size from torch.distributed), continued by the 1-device resume.
    assert [info["part"]["ledger"] for info in ranks] == [str(tmp_path / "ledger")] * 2
    line = timeline(tmp_path / "ledger")
    assert sorted((s.rank, s.header["world"]) for s in line.chain[0]) == [(0, 2), (1, 2)]
    assert_resumed(line, [0, job.PART + 1], ranks=1, went_on=False)
    assert [recorded(line, r)[: job.PART + 1] for r in (0, 1)] == part
    assert [s["i"] for s in line.chain[1][0].steps] == model.batches
    assert_each_sample_once(line, job.N, complete=range(1))
