"""A dataset whose module takes 3 s to import anywhere but in the test job itself: in the
fork server that preloads it, a server slow to answer the first worker start."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch.utils.data import Dataset

if os.environ.get("STEADYLOAD_TEST_JOB_PID") not in (None, str(os.getpid())):
    time.sleep(3.0)


class SlowToImport(Dataset[Any]):
    """``n`` samples: the index as a tensor."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor(i)
