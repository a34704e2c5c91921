"""Datasets and helpers for the framework tests, light to import (no framework imported here).

Workers import this module to unpickle the datasets, so it must not import Lightning, Ray
or datasets: that would cost every worker seconds.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import time
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info


class PidSquares(Dataset[dict[str, Any]]):
    """Sample i: its index, features, and the pid and parent pid of the process that loaded it.

    A steadyload worker's parent is the fork server; torch's workers are children of the
    training process; ``pid == os.getpid()`` of the trainer means in-process loading.
    """

    def __init__(self, n: int = 64, delay_s: float = 0.0) -> None:
        self.n = n
        self.delay_s = delay_s  # slow enough that a killed worker is holding batches

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return {
            "i": torch.tensor(i),
            "x": torch.full((4,), float(i)),
            "pid": torch.tensor(os.getpid()),
            "ppid": torch.tensor(os.getppid()),
        }


def forkserver_pid() -> int | None:
    """The pid of the server that forks steadyload's default workers here: the zygote when
    start_method="auto" took it (start/rule.py), else CPython's fork server."""
    from steadyload.start.context import zygote_pid

    pid: int | None = zygote_pid() or multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return pid


def table_of_worker_dataset(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """collate_fn for a Hugging Face dataset: the rows' ids, and where the worker's copy of
    the dataset keeps its Arrow table (``MemoryMappedTable``: the worker maps the file)."""
    info = get_worker_info()
    table = type(info.dataset._data).__name__ if info is not None else None  # type: ignore[attr-defined]
    return {"ids": [row["id"] for row in rows], "table": table, "ppid": os.getppid()}
