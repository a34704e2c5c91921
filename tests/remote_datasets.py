"""Datasets for the remote-worker tests: importable by Ray's workers (the tests put the
repository on their PYTHONPATH), each a real workload or a real fault."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

import steadyload as sl


class Augmented(Dataset[Any]):
    """Index, a random augmentation drawn from torch's generator, and the loading pid."""

    def __init__(self, n: int = 48, sleep_s: float = 0.0) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.tensor(i), torch.rand(3)


class Faulty(Augmented):
    """Raises on ``bad`` indices; hangs once on ``hang`` (a marker file says it did)."""

    def __init__(self, n: int, bad: tuple[int, ...] = (), hang: int | None = None,
                 marker: str = "", sleep_s: float = 0.0) -> None:  # fmt: skip
        super().__init__(n, sleep_s)
        self.bad, self.hang, self.marker = bad, hang, marker

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i in self.bad:
            raise ValueError(f"corrupt sample {i}")
        if i == self.hang and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            time.sleep(600)  # the hang: hang_timeout kills the actor long before
        return super().__getitem__(i)


def _resource() -> dict[str, int]:
    return {"pid": os.getpid(), "built_at": time.monotonic_ns()}


class WithResource(Augmented):
    """Returns, per sample, the pid and the build time of a per_worker resource."""

    resource = sl.per_worker(_resource)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        r = self.resource
        return torch.tensor(i), torch.tensor([r["pid"], r["built_at"]])


class Big(Augmented):
    """A 1 MiB tensor per sample: results go through the object store (not inlined)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.tensor(i), torch.full((512, 512), float(i))


class Sharded(torch.utils.data.IterableDataset[int]):
    """A stream each worker reads its share of (``get_worker_info()``), as torch shards."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(worker, self.n, workers))


class Counted(Augmented):
    """Counts, in the process that pickles it, how often it was pickled."""

    pickled = 0

    def __getstate__(self) -> dict[str, Any]:
        type(self).pickled += 1
        return dict(self.__dict__)


def collated_where(samples: list[Any]) -> Any:
    """torch's default_collate, and whether each collated tensor's storage is shared
    memory where it was collated (default_collate asks for it in any worker)."""
    batch = torch.utils.data.default_collate(samples)
    return batch, torch.tensor([t.is_shared() for t in batch])


def unsendable(batch: Any) -> Any:
    """A collate_fn whose batch no pickler can send (a lock)."""
    import threading

    return threading.Lock()


def hang_once_in_init(marker: str, worker_id: int) -> None:
    """A worker_init_fn that hangs in worker 0 the first time (a marker file says it did)."""
    if worker_id == 0 and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        time.sleep(600)  # the hang: hang_timeout kills the actor long before


class Hungry(Augmented):
    """Sample ``at`` takes ``gib`` GiB and holds it, once (a marker file says it did)."""

    def __init__(self, n: int, at: int, gib: int, marker: str) -> None:
        super().__init__(n)
        self.at, self.gib, self.marker = at, gib, marker

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.at and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            held = np.ones(self.gib << 30, np.uint8)  # every page touched: resident
            time.sleep(60)  # Ray's memory monitor kills the actor long before
            del held
        return super().__getitem__(i)


def waits_for(event: Any) -> None:
    """Waits until ``event`` is set (at most 10 s): a frame to look at."""
    event.wait(10)  # the line a stack of this frame shows


class WaitsForTheAdded(Augmented):
    """Worker 0 loads ``alone`` samples, then stops until worker 1, added by the scaling
    rule, has loaded one (``folder``/added): the epoch cannot run out before the added
    actor joins. The stop lasts at most 120 s (then ``folder``/gave_up): with
    `held_until_stopped`, worker 1 says `Ready` while the loop waits for a batch worker 0
    holds, so only an actor that joins when it is ready ends the stop early."""

    def __init__(self, n: int, folder: str, alone: int, sleep_s: float) -> None:
        super().__init__(n, sleep_s)
        self.folder, self.alone, self.loaded = Path(folder), alone, 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        added = self.folder / "added"
        if info is not None and info.id == 1:
            added.touch()
        else:
            self.loaded += 1
            if self.loaded > self.alone and not added.exists():
                (self.folder / "stopped").touch()
                if not _appears(added, 120):
                    (self.folder / "gave_up").touch()
        return super().__getitem__(i)


def held_until_stopped(folder: str, worker_id: int) -> None:
    """A worker_init_fn: worker 1's set-up ends (at most 120 s) once worker 0 of
    `WaitsForTheAdded` has stopped."""
    if worker_id == 1:
        _appears(Path(folder) / "stopped", 120)


def _appears(path: Path, timeout_s: float) -> bool:
    """Waits until ``path`` exists (at most ``timeout_s``); whether it does."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
