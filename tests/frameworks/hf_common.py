"""Datasets and helpers for the accelerate and transformers tests and their torchrun jobs.

Workers import this module to unpickle the datasets, so it imports no framework: that would
cost every worker seconds.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

VOCAB = 100  # of the tiny language models; token 0 of sample i is i, so N <= VOCAB
SEQ = 12


def forkserver_pid() -> int | None:
    """The pid of the server that forks steadyload's default workers here: the zygote when
    start_method="auto" took it (start/rule.py), else CPython's fork server."""
    from steadyload.start.context import zygote_pid

    return zygote_pid() or multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def _log_load(log_dir: str | None, index: int) -> None:
    if log_dir:
        with open(os.path.join(log_dir, f"loads-{os.getpid()}.txt"), "a") as f:
            f.write(f"{index} {os.getpid()} {os.getppid()}\n")


def read_loads(log_dir: str | Path) -> list[tuple[int, int, int]]:
    """Every sample load logged under ``log_dir``: (index, pid, parent pid)."""
    out = []
    for path in sorted(Path(log_dir).glob("loads-*.txt")):
        for line in path.read_text().splitlines():
            index, pid, ppid = map(int, line.split())
            out.append((index, pid, ppid))
    return out


class Indexed(Dataset[dict[str, Any]]):
    """Sample i: its index, features, a value drawn from the loading process's torch RNG (a
    random augmentation), and the parent pid of the process that loaded it."""

    def __init__(self, n: int = 40, delay_s: float = 0.0) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"index": torch.tensor(i), "x": torch.full((4,), float(i)),
                "noise": torch.randint(0, 1 << 30, ()), "ppid": torch.tensor(os.getppid())}


class Stream(IterableDataset[dict[str, Any]]):
    """Samples 0..n-1 as a stream, split between workers by worker id; each with the parent pid
    of the process that loaded it."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        step, first = (info.num_workers, info.id) if info else (1, 0)
        for i in range(first, self.n, step):
            yield {"index": torch.tensor(i), "ppid": torch.tensor(os.getppid())}


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Sample i: ``input_ids`` whose token 0 is i and token 1 comes from the loading process's
    RNG (a random augmentation), ``labels`` a copy; loads are logged to ``log_dir``."""

    def __init__(self, n: int = 64, log_dir: str | None = None, delay_s: float = 0.0) -> None:
        assert n <= VOCAB
        self.n = n
        self.log_dir = log_dir
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        _log_load(self.log_dir, i)
        if self.delay_s:
            time.sleep(self.delay_s)
        ids = torch.randint(2, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        ids[0] = i
        ids[1] = int(torch.randint(0, VOCAB, ()))
        return {"input_ids": ids, "labels": ids.clone()}


def batch_key(input_ids: torch.Tensor) -> list[list[int]]:
    """What identifies a Tokens batch: each sample's index and its augmented token."""
    return input_ids[:, :2].tolist()  # type: ignore[no-any-return]


def kill_worker(loader: Any) -> int:
    """SIGKILL one worker of a steadyload loader (or adopted shard); its pid."""
    from steadyload.integrations.accelerate import steadyload_base

    base = steadyload_base(loader)
    assert base is not None, f"not a steadyload loader: {type(loader)}"
    pids = [w.pid for w in base.report().workers if w.pid]
    assert pids, "the loader has no live worker to kill"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def tiny_gpt2() -> Any:
    """A 2-layer GPT-2 with hidden size 32 and a 100-token vocabulary, from a config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=32, bos_token_id=VOCAB - 2,
                                      eos_token_id=VOCAB - 3, pad_token_id=VOCAB - 4))
