"""Lightning DDP on CPU (gloo, 2 processes) with a steadyload loader built in a hook, for
tests/frameworks/test_lightning.py.

``python -m tests.frameworks.lightning_ddp_job OUT [ddp|ddp_spawn]``: fits one epoch twice,
each with a new Trainer, and a loader built inside ``train_dataloader()``, where
``sl.DataLoader`` is first touched (``import steadyload as sl`` at the top only): the class
does not exist yet when Lightning patches DataLoader subclasses for the hook, the case that
used to crash with "got multiple values for argument 'sampler'". Lightning rebuilds the
loader to inject a DistributedSampler. The second fit SIGKILLs worker 0 of each rank's
loader after its 2nd batch. A third fit saves a checkpoint after batch PART (every rank's
3rd) and stops: tests/frameworks/test_lightning.py resumes it on one device (elastic
resume, 2 processes -> 1); both record the ledger in OUT/ledger (``ledger=``). Each rank
writes OUT/rank<r>.json.

strategy="ddp" re-runs this module for rank 1 (LOCAL_RANK=1); "ddp_spawn" imports it in
spawned children as __mp_main__ instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

import steadyload as sl  # the class itself is created on first use, in the hook
from tests.frameworks.samples import PidSquares, forkserver_pid

N, BATCH, KILL_AFTER, PART = 64, 4, 1, 2
OPTIONS: dict[str, Any] = {"on_error": "skip", "max_restarts": 7, "hang_timeout": 60.0,
                           "sample_seeds": True}  # fmt: skip
_LAZY: list[bool] = []  # whether steadyload.loader was not yet imported at the first hook


class Model(L.LightningModule):
    """Trains on the loader it builds; records batches and who loaded them."""

    def __init__(self, run: str, out: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.run, self.out = run, out
        self.batches: list[list[int]] = []
        self.ppids: set[int] = set()

    def train_dataloader(self) -> Any:
        if not _LAZY:
            _LAZY.append("steadyload.loader" not in sys.modules)
        ledger = str(Path(self.out, "ledger")) if self.run in ("part", "rest") else None
        return sl.DataLoader(PidSquares(N, delay_s=0.01), batch_size=BATCH, shuffle=True,
                             num_workers=2, ledger=ledger, **OPTIONS)  # fmt: skip

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.batches.append(batch["i"].tolist())
        self.ppids.update(batch["ppid"].tolist())
        return self.lin(batch["x"]).pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.run == "killed" and batch_idx == KILL_AFTER:
            pid = self.trainer.train_dataloader.report().workers[0].pid
            os.kill(pid, signal.SIGKILL)
        self._save_part_and_stop(batch_idx)

    def _save_part_and_stop(self, batch_idx: int) -> None:
        if self.run == "part" and batch_idx == PART:
            self.trainer.save_checkpoint(Path(self.out, "part.ckpt"))  # rank 0 writes it
            self.trainer.should_stop = True  # the job ends here, mid-epoch

    def on_train_end(self) -> None:  # in every rank, under ddp_spawn too
        loader = self.trainer.train_dataloader
        sampler = loader.sampler
        result = {
            "loader": f"{type(loader).__module__}.{type(loader).__qualname__}",
            "sampler": type(sampler).__qualname__,
            "rank": getattr(sampler, "rank", None),
            "replicas": getattr(sampler, "num_replicas", None),
            "options": {k: getattr(loader, k, None) for k in OPTIONS},
            "ledger": loader.ledger,
            "batches": self.batches,
            "ppids": sorted(self.ppids),
            "restarts": [[r.worker_id, r.cause] for r in loader.report().restarts],
            "forkserver_pid": forkserver_pid(),
            "lazy": _LAZY[0],
        }
        path = Path(self.out, f"rank{self.global_rank}-{self.run}.json")
        path.write_text(json.dumps(result))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _merge(out: Path, rank: int) -> None:
    runs = {run: json.loads((out / f"rank{rank}-{run}.json").read_text())
            for run in ("clean", "killed", "part")}  # fmt: skip
    merged = {"clean": runs["clean"], "killed": runs["killed"], "part": runs["part"],
              "forkserver_pid": runs["clean"]["forkserver_pid"], "lazy": runs["clean"]["lazy"]}
    (out / f"rank{rank}.json").write_text(json.dumps(merged))


def main() -> None:
    """Fit twice (clean, then a worker killed on each rank); see the module docstring."""
    warnings.filterwarnings("ignore")  # Lightning's advice for tiny CPU runs
    out = Path(sys.argv[1]).resolve()
    strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    out.mkdir(parents=True, exist_ok=True)
    rank = None
    for run in ("clean", "killed", "part"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                            logger=False, enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False)  # fmt: skip
        trainer.fit(Model(run, str(out)))
        rank = trainer.global_rank
    ranks = (0, 1) if strategy == "ddp_spawn" else (rank,)  # spawn: only the parent is here
    for r in ranks:
        assert r is not None
        _merge(out, r)


if __name__ == "__main__":
    main()
