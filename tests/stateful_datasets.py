"""Datasets and samplers that speak torchdata's Stateful protocol in its several forms
(issue #23), at module level so that forkserver workers can import them."""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

from tests.datasets import worker_shard


def _kill_once(marker_dir: str) -> None:
    """SIGKILL this process the first time any process gets here (a marker file says so)."""
    try:
        os.close(os.open(os.path.join(marker_dir, "killed"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


class Rows:
    """A Stateful iterator over a list of rows; SIGKILLs its process once at ``kill_at``."""

    def __init__(self, rows: list[int], kill_at: int | None = None, marker_dir: str = "") -> None:
        self.rows, self.i = rows, 0
        self.kill_at, self.marker_dir = kill_at, marker_dir

    def __iter__(self) -> Rows:
        return self

    def __next__(self) -> torch.Tensor:
        if self.i >= len(self.rows):
            raise StopIteration
        row = self.rows[self.i]
        if row == self.kill_at:
            _kill_once(self.marker_dir)
        self.i += 1
        return torch.tensor([row])

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class IteratorKeepsPosition(IterableDataset[Any]):
    """Not Stateful itself: its ``__iter__`` returns a Stateful iterator (`Rows`) over this
    worker's shard, as torchdata's tests write them."""

    def __init__(self, n: int, kill_at: int | None = None, marker_dir: str = "") -> None:
        self.n, self.kill_at, self.marker_dir = n, kill_at, marker_dir

    def __iter__(self) -> Rows:
        return Rows(worker_shard(self.n), self.kill_at, self.marker_dir)


class Stateless(IterableDataset[Any]):
    """A plain generator stream: neither it nor its iterator can say where it stands."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        for row in worker_shard(self.n):
            yield torch.tensor([row])


class _Walk:
    """A Stateful iterator over an order drawn from Python's ``random`` when it is made:
    only its state says which order it walks."""

    def __init__(self, n: int) -> None:
        self.order, self.i = random.sample(range(n), n), 0

    def __iter__(self) -> _Walk:
        return self

    def __next__(self) -> int:
        if self.i >= len(self.order):
            raise StopIteration
        self.i += 1
        return self.order[self.i - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order, self.i = list(state["order"]), state["i"]


class IteratorKeepsOrder(Sampler[int]):
    """A sampler that is not Stateful itself and is none of torch's: its ``__iter__``
    returns a Stateful iterator (`_Walk`)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _Walk:
        return _Walk(self.n)

    def __len__(self) -> int:
        return self.n


class CountsPasses(IterableDataset[Any]):
    """A Stateful stream that counts its passes: each row is (row, pass). Its state at the
    end of an epoch is the pass counter (torchdata's GeneratorIterable, increment_epoch)."""

    def __init__(self, n: int) -> None:
        self.n, self.position, self.passes = n, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position, self.passes = state["position"], state["passes"]

    def __iter__(self) -> Any:
        mine = worker_shard(self.n)
        while self.position < len(mine):
            self.position += 1
            yield torch.tensor([mine[self.position - 1], self.passes])
        self.position, self.passes = 0, self.passes + 1


class OwnGenerator(Dataset[Any]):
    """A map-style dataset that draws from its own generator in ``__getitem__`` and saves
    it (torchdata's DummyMapDataset): each worker's copy draws its own sequence. (A
    ``random.Random``: torch 2.13 cannot send a dataset holding a ``torch.Generator`` to
    forkserver or spawn workers, with torch's loader as with ours.)"""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = random.Random(7)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, self.rng.randrange(1000)])

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])


class DrawsGlobally(Dataset[Any]):
    """A map-style dataset whose ``__getitem__`` draws from torch's global generator (the
    worker's, seeded by torch from the base seed)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, int(torch.randint(1000, (1,)))])


class CountsIters(IterableDataset[Any]):
    """A Stateful stream whose state says how often ``iter()`` ran on this replica (not
    restored: a resumed replica counts its own calls), as torchdata's CountIterCalls."""

    def __init__(self, n: int) -> None:
        self.n, self.iters, self.position = n, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"iters": self.iters, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Any:
        self.iters += 1  # counted when iter() runs, as CountIterCalls does (not lazily)
        return self._rows()

    def _rows(self) -> Any:
        mine = worker_shard(self.n)
        while self.position < len(mine):
            self.position += 1
            yield torch.tensor([mine[self.position - 1]])
