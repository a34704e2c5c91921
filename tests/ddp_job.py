"""DDP training under torchrun (gloo, CPU) with steadyload loaders, for tests/integration/test_ddp.py.

``torchrun --nproc_per_node=2 -m tests.ddp_job OUT [--kill-worker|--kill-rank|--resume|--corrupt]``

Each rank trains a small model for two epochs on its DistributedSampler shard with a
steadyload loader (2 workers), checkpointing model, optimizer and loader state after every
step. It logs the samples of every step to OUT/rank<r>.jsonl; rank 0 saves the final
weights to OUT/weights.pt. Faults: ``--kill-worker`` SIGKILLs a loader worker of rank 1
mid-epoch; ``--kill-rank`` kills rank 1 itself mid-epoch (the job fails; run it again with
``--resume`` and both ranks resume from their checkpoints, as a re-submitted job would);
``--corrupt`` makes a whole batch
of rank 1's shard fail to load (on_error="skip" yields it empty: the ranks stay in step);
``--device`` feeds the batches through the device stage (``device="cpu"`` here, each
rank's ``LOCAL_RANK`` GPU with ``device="cuda"``), three batches ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

import steadyload

N, BATCH, EPOCHS = 64, 4, 2
KILL_AT = (0, 1)  # (epoch, step) of rank 1 where --kill-worker strikes
CRASH_AT = (1, 2)  # (epoch, step) after which --kill-rank kills rank 1


class Regression(Dataset[Any]):
    """Sample i: (index, features, target) of a fixed linear problem."""

    def __init__(self, corrupt: frozenset[int] = frozenset()) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=g)
        self.y = self.x @ torch.arange(1.0, 9.0) + 0.1 * torch.randn(N, generator=g)
        self.corrupt = corrupt

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        if i in self.corrupt:
            raise ValueError(f"sample {i} is corrupt")
        time.sleep(0.01)  # slow enough that a killed worker is always holding batches
        return i, self.x[i], self.y[i]


def _checkpoint(ckpt: Path, rank: int, payload: dict[str, Any]) -> None:
    tmp = ckpt / f"rank{rank}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, ckpt / f"rank{rank}.pt")  # never a half-written checkpoint


def main() -> None:
    """Train; see the module docstring."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kill-worker", action="store_true")
    p.add_argument("--kill-rank", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--corrupt", action="store_true")
    p.add_argument("--device", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + args.resume
    out = Path(args.out)
    ckpt = out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(Regression(), num_replicas=world, rank=rank, seed=1)
    corrupt = frozenset()
    if args.corrupt and rank == 1:
        sampler.set_epoch(0)
        corrupt = frozenset(list(sampler)[BATCH : 2 * BATCH])  # rank 1's whole second batch
    device = {"device": "cpu", "device_prefetch": 3} if args.device else {}
    loader = steadyload.DataLoader(
        Regression(corrupt), batch_size=BATCH, sampler=sampler, num_workers=2,
        on_error="skip", sample_seeds=True, **device,
    )  # fmt: skip
    first_epoch, step = 0, 0
    resume = ckpt / f"rank{rank}.pt"
    if attempt > 0 and resume.exists():
        state = torch.load(resume, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        first_epoch, step = state["epoch"], state["step"]
    log = (out / f"rank{rank}.jsonl").open("a")
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for index, x, y in loader:
            out_y = model(x).squeeze(1)
            # Sum / max(n, 1): an empty batch (every sample skipped) still takes part in
            # the gradient all-reduce, with zero gradient, so no rank waits forever.
            loss = F.mse_loss(out_y, y, reduction="sum") / max(len(y), 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            log.write(json.dumps({"attempt": attempt, "epoch": epoch, "step": step,
                                  "indices": index.tolist()}) + "\n")  # fmt: skip
            log.flush()
            _checkpoint(ckpt, rank, {
                "model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "loader": loader.state_dict(), "epoch": epoch, "step": step,
            })  # fmt: skip
            position = (epoch, step - epoch * len(loader))
            if args.kill_worker and rank == 1 and position == KILL_AT:
                pid = loader.report().workers[0].pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
            if args.kill_rank and position == CRASH_AT:
                dist.barrier()  # both ranks have checkpointed this step
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
        causes = [r.cause for r in loader.report().restarts]  # this epoch's replaced workers
        log.write(json.dumps({"attempt": attempt, "epoch": epoch, "restarts": causes}) + "\n")
    log.close()
    if rank == 0:
        torch.save(model.module.state_dict(), out / "weights.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
