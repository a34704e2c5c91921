"""Loader states saved on one number of ranks and loaded on another, one loader per kind of
sampler or dataset, for tests/integration/test_world_change.py (issue #36).

``torchrun ... -m tests.world_job OUT save`` builds each scenario's loader (`SCENARIOS`),
takes `SAVED_BATCHES` batches on every rank in lockstep (an all-reduce per step, as
gradients), and writes OUT/<scenario>_r<rank>.pt (``loader.state_dict()``) and
OUT/<scenario>_r<rank>.json (the items it yielded, and the world size).

``torchrun ... -m tests.world_job OUT load [--from-rank R]`` (on another number of ranks)
builds each scenario's loader afresh and every rank loads rank R's saved state (R=1 by
default, as the issue did; the README's recipe: any one rank's state, every rank loads
it), then runs the rest of the epoch. Each rank writes OUT/load_w<world>_r<rank>.json:
per scenario, where an error came (``"load"``: from ``load_state_dict``; ``"iter"``: from
``iter()``/``next()`` after ``batches`` batches; None), its type and message, and the items
it yielded. The ranks load and iterate on their own (no collective between a scenario's
load and its end), so that one rank's error cannot hang the others.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler

import steadyload

N, BATCH, WORKERS, SAVED_BATCHES = 60, 2, 2, 3
# 60 samples, batch 2, 3 batches saved: the rest after 2 -> 3 (48) and 4 -> 2 (36) ranks is
# a multiple of the new number of ranks, so DistributedSampler pads nothing.


class Ids(Dataset[int]):
    """Sample i is i."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


class RankStream(IterableDataset[Any]):
    """A stream sharded by rank (torch.distributed's, read when it is built) and by worker
    (``get_worker_info()``): rank r's worker w of W yields the items i with
    ``i % (world * W) == r * W + w``. Its state is its position in that shard."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.position = 0  # items of this replica's shard already yielded

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = list(range(self.rank * nw + wid, N, self.world * nw))
        while self.position < len(mine):
            i = mine[self.position]
            self.position += 1
            yield torch.tensor([i])


class RankShardSampler(Sampler[int]):
    """A user's sampler that deals rank r of world the indices r, r+world, ... (both from
    torch.distributed); its state is its position in that shard."""

    def __init__(self, n: int) -> None:
        self.n, self.rank, self.world = n, dist.get_rank(), dist.get_world_size()
        self.position = 0

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Iterator[int]:
        mine = list(range(self.rank, self.n, self.world))
        while self.position < len(mine):
            i = mine[self.position]
            self.position += 1
            yield i
        self.position = 0  # the next epoch starts at its beginning


def _stream() -> Any:
    return steadyload.DataLoader(RankStream(), batch_size=BATCH, num_workers=WORKERS)


def _sampler() -> Any:
    return steadyload.DataLoader(Ids(), batch_size=BATCH, sampler=RankShardSampler(N),
                                 num_workers=WORKERS)  # fmt: skip


def _shuffled(shuffle: bool) -> Any:
    return steadyload.DataLoader(Ids(), batch_size=BATCH, shuffle=shuffle,
                                 generator=torch.Generator().manual_seed(0))  # fmt: skip


def _distributed() -> Any:
    sampler: DistributedSampler[int] = DistributedSampler(Ids(), shuffle=True, seed=0)
    sampler.set_epoch(0)
    return steadyload.DataLoader(Ids(), batch_size=BATCH, sampler=sampler, num_workers=WORKERS)


# name -> (the saving run's loader, the loading run's loader)
SCENARIOS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "stream": (_stream, _stream),
    "sampler": (_sampler, _sampler),
    "shuffle_on_to_off": (lambda: _shuffled(True), lambda: _shuffled(False)),
    "shuffle_off_to_on": (lambda: _shuffled(False), lambda: _shuffled(True)),
    "distributed": (_distributed, _distributed),
}


def _items(batch: Any) -> list[int]:
    return [int(i) for i in batch.reshape(-1).tolist()]


def save(out: Path, rank: int, world: int) -> None:
    for name, (build, _) in SCENARIOS.items():
        loader = build()
        yielded: list[list[int]] = []
        it = iter(loader)
        for _ in range(SAVED_BATCHES):
            yielded.append(_items(next(it)))
            dist.all_reduce(torch.ones(1))  # lockstep, as a gradient all-reduce
        torch.save(loader.state_dict(), out / f"{name}_r{rank}.pt")
        (out / f"{name}_r{rank}.json").write_text(json.dumps({"world": world, "batches": yielded}))
        del it, loader
        gc.collect()
        dist.barrier()


def load(out: Path, rank: int, world: int, from_rank: int) -> None:
    results: dict[str, Any] = {}
    for name, (_, build) in SCENARIOS.items():
        loader = build()
        state = torch.load(out / f"{name}_r{from_rank}.pt", weights_only=True)
        result: dict[str, Any] = {"error": None, "type": None, "message": None, "batches": []}
        try:
            loader.load_state_dict(state)
        except Exception as e:  # noqa: BLE001 - what was raised is the result
            result.update(error="load", type=type(e).__name__, message=str(e))
        else:
            try:
                for batch in loader:
                    result["batches"].append(_items(batch))
            except Exception as e:  # noqa: BLE001
                result.update(error="iter", type=type(e).__name__, message=str(e))
        results[name] = result
        del loader
        gc.collect()
        dist.barrier()
    (out / f"load_w{world}_r{rank}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=("save", "load"))
    parser.add_argument("--from-rank", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mode == "save":
        save(args.out, rank, world)
    else:
        load(args.out, rank, world, args.from_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
