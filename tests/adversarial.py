"""Datasets and helpers that misbehave on purpose, for the hardening tests.

At module level so that forkserver workers can import them (tests/faults/test_hardening*.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class BadStr(Exception):
    """An exception whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


class RaisesBadStr(Dataset[Any]):
    """Sample ``bad`` raises `BadStr`; the others are tensors."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise BadStr()
        return torch.tensor(i)


class BrokenStateStream(IterableDataset[Any]):
    """A stateful stream whose ``state_dict()`` raises after ``good`` calls."""

    def __init__(self, n: int, good: int) -> None:
        self.n, self.good, self.calls, self.position = n, good, 0, 0

    def state_dict(self) -> dict[str, int]:
        self.calls += 1
        if self.calls > self.good:
            raise ValueError(f"state_dict() broke at call {self.calls}")
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, self.n, nw):
            self.position += 1
            yield torch.tensor([i])


class BatchedOnly(Dataset[Any]):
    """A dataset with a batched ``__getitems__`` (counted per worker) and a slow path.

    ``__getitems__`` raises for any batch that holds ``bad``; each call is recorded in the
    sample it returns, so the test sees which path loaded it.
    """

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise KeyError(f"sample {i} is corrupt")
        return {"i": i, "path": "single"}

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if self.bad in indices:
            raise KeyError(f"batch {indices} holds corrupt sample {self.bad}")
        return [{"i": i, "path": "batched"} for i in indices]


class Numbers(Dataset[Any]):
    """Sample i is ``tensor(i)``: the simplest dataset whose batches can be checked."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor(i)


def timeout_error_to(queue: Any) -> None:
    """In a child process: hit a steadyload ``timeout`` and send the error back pickled."""
    import steadyload as sl
    from tests.datasets import Slow

    loader = sl.DataLoader(Slow(4, 5.0), num_workers=1, timeout=0.3)
    try:
        next(iter(loader))
    except Exception as exc:
        queue.put(exc)
    else:
        queue.put(None)


class KillingStream(IterableDataset[Any]):
    """A sharded stream over range(n) whose worker SIGKILLs itself before item ``at``."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __iter__(self) -> Any:
        import os
        import signal

        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, self.n, nw):
            if i == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
            yield torch.tensor(i)


class Hog(Dataset[Any]):
    """Sample ``kill_at`` SIGKILLs its worker; sample ``hog_at`` holds the GIL in one C call
    for seconds (its worker's reader thread cannot run: it cannot see a Stop)."""

    def __init__(self, n: int, kill_at: int, hog_at: int) -> None:
        self.n, self.kill_at, self.hog_at = n, kill_at, hog_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import os
        import signal

        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == self.hog_at:
            sum(range(400_000_000))  # one C call: no bytecode boundary for ~4 s
        return torch.tensor(i)


class ManyShared(Dataset[Any]):
    """Four samples read from ``count`` SharedLists (or SharedDicts): one per column."""

    def __init__(self, count: int, kind: str) -> None:
        import steadyload as sl

        self.kind = kind
        if kind == "list":
            self.columns = [sl.SharedList([f"c{c}-r{r}" for r in range(4)]) for c in range(count)]
        else:
            self.columns = [sl.SharedDict({r: f"c{c}-r{r}" for r in range(4)}) for c in range(count)]

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return (self.columns[0][i], self.columns[-1][i], len(self.columns))

    def expected(self, i: int) -> Any:
        return (f"c0-r{i}", f"c{len(self.columns) - 1}-r{i}", len(self.columns))


class LabelledImages(Dataset[Any]):
    """``(image, label)``: one cached 3x224x224 float32 image (32 of them: a 19 MB batch)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.image = torch.rand(3, 224, 224)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.image, i


class ImageAndRaw(Dataset[Any]):
    """``{"image": 3x224x224, "raw": 3x448x448}`` float32, filled with the index: a batch
    with one tensor a loop may keep beside a four times bigger neighbour."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"image": torch.full((3, 224, 224), float(i)),
                "raw": torch.full((3, 448, 448), float(i))}


class Aliased(Dataset[Any]):
    """``{"a": t, "b": t, "view": t[2:4]}``: one tensor twice and a view of it (``size``
    elements: small ones travel inline, big ones in shared memory)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        t = torch.arange(float(self.size)) + i
        return {"a": t, "b": t, "view": t[2:4]}


class Rows(Dataset[Any]):
    """Rows of one 16 MiB tensor (256 KiB each), as a TensorDataset returns them."""

    def __init__(self) -> None:
        self.x = torch.arange(64.0).repeat_interleave(1 << 16).reshape(64, 1 << 16)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        return self.x[i]


def as_list(samples: list[Any]) -> list[Any]:
    """A collate_fn that collates nothing: the samples as they came."""
    return samples


def collate_with_views(samples: list[Any]) -> Any:
    """default_collate's batch and two views of it (a storage already in shared memory)."""
    from torch.utils.data import default_collate

    x = default_collate(samples)
    return x, x[1:3], x.t()


def low_fd_limit(worker_id: int) -> None:
    """worker_init_fn: leave the worker no free descriptor (it can create no segment)."""
    import os
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The lowest free number: a new descriptor takes it, and the limit refuses it. (Not the
    # count of open ones: a worker forked from the zygote inherits numbers with gaps.)
    open_fds = {int(n) for n in os.listdir("/proc/self/fd")}
    lowest_free = min(set(range(len(open_fds) + 1)) - open_fds)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
