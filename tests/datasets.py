"""Datasets used by tests, at module level so that forkserver workers can import them."""

from __future__ import annotations

import collections
import math
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Pair = collections.namedtuple("Pair", ["index", "value"])

KINDS = ("tensor", "numpy", "dict", "tuple", "namedtuple", "str", "int", "random")


class MapDS(Dataset[Any]):
    """Map-style dataset whose samples are of the given kind."""

    def __init__(self, n: int, kind: str = "tensor") -> None:
        self.n = n
        self.kind = kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        k = self.kind
        if k == "tensor":
            return torch.arange(3, dtype=torch.float32) + i
        if k == "numpy":
            return np.full((2, 2), i, dtype=np.int64)
        if k == "dict":
            return {"x": torch.tensor([i, -i]), "name": f"s{i}", "w": float(i) / 2}
        if k == "tuple":
            return (torch.tensor(i), f"s{i}", i)
        if k == "namedtuple":
            return Pair(i, torch.full((2,), float(i)))
        if k == "str":
            return f"sample-{i}"
        if k == "int":
            return i
        if k == "random":
            return {
                "i": i,
                "torch": torch.rand(2),
                "random": random.random(),
                "numpy": np.random.rand(),
            }
        raise ValueError(k)


class IterDS(IterableDataset[Any]):
    """Iterable dataset over range(n), sharded across workers when ``shard`` is set."""

    def __init__(self, n: int, shard: bool = True, with_len: bool = True) -> None:
        self.n = n
        self.shard = shard
        self.with_len = with_len

    def __len__(self) -> int:
        if not self.with_len:
            raise TypeError("no len")
        return self.n

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None or not self.shard:
            lo, hi = 0, self.n
        else:
            per = int(math.ceil(self.n / info.num_workers))
            lo, hi = info.id * per, min(self.n, (info.id + 1) * per)
        for i in range(lo, hi):
            yield {"i": i, "t": torch.rand(1)}


class WorkerInfoDS(Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        assert info is not None
        return {
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "same_dataset_type": type(info.dataset).__name__,
            "pid": os.getpid(),
        }


class GetItemsDS(MapDS):
    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [("batched", i) for i in indices]


class FailAt(Dataset[Any]):
    """Raises ``exc_type`` when loading index ``bad``."""

    def __init__(self, n: int, bad: int, exc_type: type[BaseException] = KeyError) -> None:
        self.n, self.bad, self.exc_type = n, bad, exc_type

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise self.exc_type(f"sample {i} is corrupt")
        return torch.tensor(i)


class OddError(Exception):
    """An exception whose __init__ takes two arguments: it does not survive pickling."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"odd {a} {b}")


class RaisesOdd(Dataset[Any]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        raise OddError(i, 2)


class CorruptImage(Exception):
    """A decoder's error that keeps the open file: the exception does not pickle."""

    def __init__(self, message: str, file: Any = None) -> None:
        super().__init__(message)
        self.file = file


class Fault(Dataset[Any]):
    """A dataset that injects a real fault at index ``at``: kill, exit, segfault, hang;
    ``sys-exit`` (sys.exit(3), as a library's error path sometimes does), ``corrupt``
    (`CorruptImage` holding an open file: an exception that does not pickle)."""

    def __init__(self, n: int, at: int, how: str, delay_s: float = 0.0) -> None:
        self.n, self.at, self.how, self.delay_s = n, at, how, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        if i == self.at:
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "exit":
                os._exit(123)
            elif self.how == "segfault":
                import ctypes

                ctypes.string_at(0)
            elif self.how == "hang":
                time.sleep(3600)
            elif self.how == "sys-exit":
                sys.exit(3)
            elif self.how == "corrupt":
                raise CorruptImage(f"bad JPEG marker in image {i}", open(os.devnull, "rb"))  # noqa: SIM115
        return torch.tensor(i)


class Slow(Dataset[Any]):
    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay_s)
        return torch.tensor(i)


class HandsOver(Slow):
    """For worker_type="auto" with a forced choice of processes: on a thread worker, samples
    from ``at`` on wait (at most 60 s) until a process worker has unpickled the dataset, so
    the hand-over falls inside the epoch on any machine, however slow processes start."""

    def __init__(self, n: int, marker_dir: str, delay_s: float, at: int = 8) -> None:
        super().__init__(n, delay_s)
        self.marker_dir, self.at = marker_dir, at

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # only a process worker unpickles the dataset
        open(os.path.join(self.marker_dir, "process"), "w").close()

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        if i >= self.at and info is not None and info.worker_method == "thread":
            marker, deadline = os.path.join(self.marker_dir, "process"), time.monotonic() + 60
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.005)
        return super().__getitem__(i)


class KillsInAProcess(HandsOver):
    """Hands over (see `HandsOver`); the first sample from ``at`` on that a process loads
    kills that process, once (with ``at=0``, while threads still hold tasks)."""

    def __init__(self, n: int, at: int, marker_dir: str) -> None:
        super().__init__(n, marker_dir, 0.002)
        self.at_kill = at

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        if i >= self.at_kill and info is not None and info.worker_method == "multiprocessing":
            try:
                os.close(os.open(os.path.join(self.marker_dir, "k"), os.O_CREAT | os.O_EXCL))
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        return super().__getitem__(i)


class FaultInAProcess(HandsOver):
    """Hands over (`HandsOver`); a process worker then faults on every sample: ``how`` is
    "hang" (60 s) or "sigkill"."""

    def __init__(self, n: int, marker_dir: str, how: str) -> None:
        super().__init__(n, marker_dir, 0.002)
        self.how = how

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        if info is not None and info.worker_method == "multiprocessing":
            if self.how == "hang":
                time.sleep(60)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class MatMuls(Dataset[Any]):
    """A 256x256 matmul per sample: torch's C++ ops, the GIL released (seeded by the
    index, so nothing is drawn from the process-wide generator)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(i))
        return (a @ a).sum()


class PythonWork(Dataset[Any]):
    """About a millisecond of pure Python per sample: holds the GIL."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        total = 0
        for k in range(20_000):
            total += k * i
        return torch.tensor(i + 0 * total)


def seed_worker(worker_id: int) -> None:
    """torch's reproducibility recipe (and the transformers Trainer's ``seed_worker``):
    seeds the process-wide generators from ``torch.initial_seed()``."""
    seed = torch.initial_seed() % 2**32
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


RELEASE = threading.Event()
"""Set by a test to end the hangs below in thread workers (processes are killed)."""


def hang_in_init(worker_id: int) -> None:
    """A ``worker_init_fn`` that never returns (until `RELEASE`, at most 60 s)."""
    RELEASE.wait(60)


class HangsInIter(IterableDataset[Any]):
    """A stream whose ``iter()`` never returns (until `RELEASE`, at most 60 s)."""

    def __iter__(self) -> Any:
        RELEASE.wait(60)
        return iter(range(4))


class BigError(Exception):
    """An exception that carries a big tensor (a decoder's partial output)."""

    def __init__(self, tensor: Any) -> None:
        super().__init__("partial output attached")
        self.tensor = tensor


BIG = torch.zeros(16 << 20, dtype=torch.uint8)  # 16 MiB, made once per process


class RaisesBig(Dataset[Any]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        raise BigError(BIG)


class LockedStream(IterableDataset[Any]):
    """A stream that holds a lock: it cannot be copied or pickled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __iter__(self) -> Any:
        return iter(range(4))


class ReadAhead(IterableDataset[Any]):
    """A stream read by a producer thread that shards by ``get_worker_info()``, as a
    read-ahead or decode pool does."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        import queue

        items: queue.Queue[Any] = queue.Queue()

        def produce() -> None:
            info = get_worker_info()
            workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
            for i in range(me, self.n, workers):
                items.put(torch.tensor(i))
            items.put(None)

        producer = threading.Thread(target=produce, name="read-ahead", daemon=True)
        producer.start()
        while (item := items.get(timeout=30)) is not None:
            yield item
        producer.join(timeout=30)


class EndsUnevenly(IterableDataset[Any]):
    """Worker 0's stream holds 0 and 2; worker 1's holds 1, then 3 after ``slow_s``: the
    loader awaits 3 long after worker 0's stream ended."""

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None or info.id == 0:
            yield from (0, 2)
            return
        yield 1
        time.sleep(self.slow_s)
        yield 3


class DrawsFromItsWorker(Dataset[Any]):
    """The documented way to draw in any worker: the worker's own generators, or the
    process-wide ones where there is no worker (``num_workers=0``)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        generator = info.rng.torch_generator if info is not None else None
        rng = info.rng.random_generator if info is not None else random
        return torch.cat([torch.rand(2, generator=generator), torch.tensor([rng.random()])])


class SlowAt(Dataset[Any]):
    """Sample ``at`` takes ``delay_s`` (or until `RELEASE`); ``finished`` is set after it."""

    def __init__(self, n: int, at: int, delay_s: float) -> None:
        self.n, self.at, self.delay_s = n, at, delay_s
        self.finished = threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.at:
            RELEASE.wait(self.delay_s)
            self.finished.set()
        return torch.tensor(i)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "finished"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, finished=threading.Event())


class BadUnpickle(Dataset[Any]):
    """Pickles fine in the parent, fails to unpickle in the worker."""

    def __init__(self) -> None:
        self.state = "something to restore"

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return i

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("cannot restore this dataset in a worker")


def collate_sum(batch: list[Any]) -> Any:
    """A custom collate_fn: the sum of the batch's tensors plus the batch size."""
    return {"sum": torch.stack([torch.as_tensor(b) for b in batch]).sum(0), "n": len(batch)}


def init_raises(worker_id: int) -> None:
    raise ValueError(f"worker_init_fn failed in worker {worker_id}")


def init_sets_env(worker_id: int) -> None:
    os.environ["STEADYLOAD_TEST_WORKER"] = str(worker_id)


class EnvDS(Dataset[Any]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return os.environ.get("STEADYLOAD_TEST_WORKER", "unset")


def collate_views(batch: list[int]) -> Any:
    """Tensors that are views, transposes, odd dtypes, scalars, empty and conjugated."""
    base = torch.arange(40, dtype=torch.float64).reshape(5, 8)
    return {
        "view": base[1:4, ::2],  # non-contiguous view of a larger storage
        "t": base.t(),
        "bool": torch.tensor([True, False]),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(7),
        "empty": torch.empty(0, 4),
        "conj": torch.tensor([1 + 2j]).conj(),
        "batch": batch,
    }


class PidDS(Dataset[Any]):
    """Returns (index, worker pid), optionally slowly."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.tensor([i, os.getpid()])


# -- fork-safety helpers (issue: per-worker resources, picklability) ------------------------

import sqlite3  # noqa: E402
import threading  # noqa: E402
import uuid  # noqa: E402

import steadyload as sl  # noqa: E402


class _Built:
    """A resource that remembers which build it came from."""

    def __init__(self, payload: Any) -> None:
        self.build = uuid.uuid4().hex
        self.payload = payload


def _word_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "square": 2, "is": 3, "red": 4, "blue": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


class ResourceDS(Dataset[Any]):
    """Each sample uses per-worker resources that cannot (or should not) be pickled."""

    db = sl.per_worker(lambda: _Built(sqlite3.connect(":memory:")))
    lock = sl.per_worker(lambda: _Built(threading.Lock()))
    source = sl.per_worker(lambda: _Built(open(__file__, encoding="utf-8")))  # noqa: SIM115
    tokenizer = sl.per_worker(lambda: _Built(_word_tokenizer()))
    TEXTS = ("the square is red", "the square is blue", "the circle is red")

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        (value,) = self.db.payload.execute("select ?", (i,)).fetchone()
        with self.lock.payload:
            self.source.payload.seek(0)
            first_line = self.source.payload.readline().strip()
        ids = self.tokenizer.payload.encode(self.TEXTS[i % 3]).ids
        builds = "|".join(r.build for r in (self.db, self.lock, self.source, self.tokenizer))
        return {
            "i": value, "ids": torch.tensor(ids), "pid": os.getpid(), "builds": builds,
            "first_line": first_line,
        }


class HoldsConnection(Dataset[Any]):
    """A dataset with a live sqlite3 connection two attributes down: not picklable."""

    class Index:
        def __init__(self) -> None:
            self.conn = sqlite3.connect(":memory:")

    def __init__(self) -> None:
        self.index = HoldsConnection.Index()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return i


class HoldsLock(MapDS):
    def __init__(self) -> None:
        super().__init__(4, "int")
        self.lock = threading.Lock()


# -- self-healing helpers: faults that happen once (a marker file per sample) ---------------


class FaultOnce(Dataset[Any]):
    """Sample i is ``i`` (a tensor); samples in ``faulty`` fault the first time they load.

    The marker directory records which faults already happened, across worker processes,
    so a retried sample loads normally (unless ``always``).
    """

    def __init__(self, n: int, faulty: set[int], how: str, marker_dir: str,
                 always: bool = False) -> None:
        self.n, self.faulty, self.how, self.marker_dir, self.always = n, faulty, how, marker_dir, always

    def __len__(self) -> int:
        return self.n

    def _first_time(self, i: int) -> bool:
        try:
            os.close(os.open(os.path.join(self.marker_dir, str(i)), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return self.always

    def __getitem__(self, i: int) -> Any:
        if i in self.faulty and self._first_time(i):
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "segfault":
                import ctypes

                ctypes.string_at(0)
            elif self.how == "spin":
                while True:
                    pass
            elif self.how == "sleep":
                time.sleep(3600)
            elif self.how == "raise":
                raise ValueError(f"sample {i} is corrupt")
        return torch.tensor([i])


class JsonLines(Dataset[Any]):
    """One JSON object per line of a real file; corrupt lines raise json.JSONDecodeError."""

    def __init__(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            self.lines = f.read().splitlines()

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> Any:
        import json

        return torch.tensor(json.loads(self.lines[i])["value"])


_LEAK: list[bytearray] = []


class Leaky(Dataset[Any]):
    """Every sample leaks ``mib`` MiB in the worker (a cache that never empties)."""

    def __init__(self, n: int, mib: int) -> None:
        self.n, self.mib = n, mib

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        _LEAK.append(bytearray(os.urandom(1)) * (self.mib << 20))
        return torch.tensor([i])


class OpensFiles(Dataset[Any]):
    """Opens files and never closes them: runs out of descriptors under a low limit."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(64, hard), hard))
        self.kept = [open(__file__, encoding="utf-8") for _ in range(100)]  # noqa: SIM115
        return torch.tensor([i])


def worker_shard(n: int) -> list[int]:
    """Rows ``0..n-1`` of this worker's shard of a stream (every ``num_workers``-th row)."""
    info = get_worker_info()
    wid, nw = (info.id, info.num_workers) if info else (0, 1)
    return list(range(wid, n, nw))


class StatefulStream(IterableDataset[Any]):
    """A sharded stream that can resume: its position is its state. Kills itself once."""

    def __init__(self, n: int, kill_at: int, marker_dir: str) -> None:
        self.n, self.kill_at, self.marker_dir = n, kill_at, marker_dir
        self.position = 0  # items of this worker's shard already yielded

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Any:
        mine = worker_shard(self.n)
        while self.position < len(mine):
            i = mine[self.position]
            if i == self.kill_at:
                try:
                    os.close(os.open(os.path.join(self.marker_dir, "k"), os.O_CREAT | os.O_EXCL))
                    os.kill(os.getpid(), signal.SIGKILL)
                except FileExistsError:
                    pass
            self.position += 1
            yield torch.tensor([i])


class SharedRows(Dataset[Any]):
    """Metadata in a SharedList; samples return the record and the list's segment size."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = sl.SharedList(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return {"row": self.rows[i], "pid": os.getpid()}


class BigMetadata(Dataset[Any]):
    """Metadata in a plain Python list of 150,000 dicts: every worker would copy it."""

    def __init__(self, shared: bool = False) -> None:
        rows = [{"file": f"img/{i:06d}.jpg", "label": i % 10} for i in range(150_000)]
        self.rows = sl.SharedList(rows) if shared else rows

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]["label"]


class TensorHeavy(Dataset[Any]):
    """Holds an 8 MiB tensor, which torch moves to /dev/shm for forkserver/spawn workers."""

    def __init__(self) -> None:
        self.table = torch.zeros(2 << 20)  # 2 Mi float32 = 8 MiB

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return self.table[i]


# -- tuning / bench helpers (steadyload bench, num_workers="auto") --------------------------


class Busy(Dataset[Any]):
    """Each sample keeps a CPU busy for ``work_s`` (a spin, not a sleep: workers compete)."""

    def __init__(self, n: int, work_s: float) -> None:
        self.n, self.work_s = n, work_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:
            pass
        return torch.full((4,), float(i))


def bench_small() -> Dataset[Any]:
    """2048 samples of ~1 ms CPU work each: `steadyload bench tests.datasets:bench_small`."""
    return Busy(2048, 0.001)


def bench_trivial() -> Dataset[Any]:
    """4096 tensors of 3 floats: no work at all."""
    return MapDS(4096)


def bench_busy_5ms() -> Dataset[Any]:
    """400 samples of ~5 ms CPU work each."""
    return Busy(400, 0.005)


class BadItemStream(IterableDataset[Any]):
    """A sharded stream of ``n`` rows (row i is ``tensor([i])``) whose rows in ``bad`` raise
    ValueError. ``state``: "none" (a plain generator), "past" (a state_dict() that counts the
    bad row as read, as HF's IterableDataset.map does) or "at" (one that still points at it)."""

    def __init__(self, n: int, bad: set[int], state: str = "none") -> None:
        self.n, self.bad, self.state = n, bad, state
        self.position = 0  # rows of this worker's shard read

    def __len__(self) -> int:
        return self.n

    def __getattr__(self, name: str) -> Any:
        if name in ("state_dict", "load_state_dict") and self.__dict__.get("state") != "none":
            return getattr(self, "_" + name)
        raise AttributeError(name)

    def _state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def _load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Any:
        mine = worker_shard(self.n)
        if self.state == "none":
            self.position = 0
        while self.position < len(mine):
            i = mine[self.position]
            if self.state != "at":
                self.position += 1
            if i in self.bad:
                raise ValueError(f"row {i} is corrupt")
            if self.state == "at":
                self.position += 1
            yield torch.tensor([i])


class ResetsOnIter(IterableDataset[Any]):
    """A sharded stream whose ``__iter__`` (a plain function, as torchdata's tests write them)
    resets its position and whose ``load_state_dict`` sets it: a resume must apply the state
    after ``iter()``, as torchdata's StatefulDataLoader does."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0
        self._mine: list[int] = []

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]

    def __iter__(self) -> Any:
        self._mine = worker_shard(self.n)
        self.position = 0
        return self

    def __next__(self) -> Any:
        if self.position >= len(self._mine):
            raise StopIteration
        self.position += 1
        return torch.tensor([self._mine[self.position - 1]])


class SeedSeen(Dataset[Any]):
    """Sample i is ``[i, the torch seed it was loaded under]``: with ``sample_seeds=True``,
    the per-sample seed (`steadyload ledger show` computes the same)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, torch.initial_seed()], dtype=torch.int64)


def minor_faults() -> int:
    """This process's minor page faults so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class CountsFaults(Dataset[Any]):
    """600 KB float samples, with this process's minor page faults when loading began."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, 224, 224), float(i)), minor_faults()


def heap_thresholds_of_one_sample(worker_id: int) -> None:
    """glibc as a worker can find itself: the largest mapping it freed was about one sample
    (mmap threshold 256 KiB, free heap beyond 512 KiB given back). Set, so not by luck."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 512 << 10)  # M_TRIM_THRESHOLD
