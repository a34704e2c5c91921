"""A data-parallel job that checkpoints every step and resumes on another world size, for
tests/integration/test_elastic.py.

``torchrun ... -m tests.elastic_job OUT [--steps S] [--workers W] [--kill-worker]
[--lose-node-at STEP] [--ledger DIR] [--crash-after K]``

Each rank iterates its ``DistributedSampler`` shard through a steadyload loader for
`EPOCHS` epochs; an all-reduce per step keeps the ranks in lockstep, as gradients do. After
every step rank 0 writes one checkpoint (the step's indices from every rank, gathered, and
its own loader's ``state_dict()``) to OUT/ckpt.pt and appends the step to OUT/steps.jsonl:
what was committed. At start the job resumes from OUT/ckpt.pt if there is one, whatever the
number of ranks that wrote it. ``--steps S`` stops after S steps (a job that ends);
``--kill-worker`` SIGKILLs a loader worker of rank 1 at its first step; ``--lose-node-at
STEP`` makes rank 1 kill its torchrun agent and itself after STEP steps (a lost node: an
elastic torchrun restarts the rest on fewer ranks); ``--ledger DIR`` records every step
(steadyload's ledger); ``--crash-after K`` commits K steps, takes two more without a
checkpoint, then every rank SIGKILLs itself (a crash: those two steps are superseded by
the resume). At the end each rank writes
OUT/report_w<world>_r<rank>.json (its loader's restarts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

import steadyload

N, BATCH, EPOCHS = 60, 2, 2


class Ids(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(0.1)  # a worker killed at the first step is loading the third batch
        return i


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-worker", action="store_true")
    parser.add_argument("--lose-node-at", type=int, default=None)
    parser.add_argument("--ledger", default=None)
    parser.add_argument("--crash-after", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(Ids(), shuffle=True, seed=5)
    loader = steadyload.DataLoader(Ids(), batch_size=BATCH, sampler=sampler,
                                   num_workers=args.workers, ledger=args.ledger)  # fmt: skip
    ckpt = args.out / "ckpt.pt"
    start, step = 0, 0
    if ckpt.exists():  # any world size wrote it: rank 0's loader state serves every rank
        saved = torch.load(ckpt, weights_only=True)
        loader.load_state_dict(saved["loader"])
        start, step = saved["epoch"], saved["step"]
    taken = 0
    for epoch, batch in _epochs(loader, sampler, start):
        if args.kill_worker and rank == 1 and taken == 0:  # it holds the next batches
            pid = loader.report().workers[0].pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        mine = [int(i) for i in batch]
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)  # lockstep, as a gradient all-reduce
        step, taken = step + 1, taken + 1
        if args.crash_after is not None and taken > args.crash_after:
            if taken == args.crash_after + 2:  # two steps past the last checkpoint
                loader.state_dict()  # (its records on disk: what a crash leaves)
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            continue
        if rank == 0:
            _commit(args.out, {"epoch": epoch, "step": step, "world": world,
                               "indices": every}, loader)  # fmt: skip
        dist.barrier()  # the checkpoint of this step is written before any rank goes on
        if args.lose_node_at is not None and rank == 1 and step == args.lose_node_at:
            os.kill(os.getppid(), signal.SIGKILL)  # the node's agent, then the rank
            os.kill(os.getpid(), signal.SIGKILL)
        if args.steps is not None and taken == args.steps:
            break
    report = {"world": world, "restarts": [r.cause for r in loader.report().restarts]}
    (args.out / f"report_w{world}_r{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _epochs(loader: Any, sampler: Any, epoch: int) -> Iterator[tuple[int, Any]]:
    """(epoch, batch) from ``epoch`` (resumed: the loader continues it) to the last."""
    while epoch < EPOCHS:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def _commit(out: Path, entry: dict[str, Any], loader: steadyload.DataLoader[Any]) -> None:
    tmp = out / "ckpt.tmp"
    torch.save({"epoch": entry["epoch"], "step": entry["step"], "loader": loader.state_dict()},
               tmp)  # fmt: skip
    os.replace(tmp, out / "ckpt.pt")
    with open(out / "steps.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


if __name__ == "__main__":
    main()
