"""A thread worker hangs once on a sample (a 30 s sleep), is abandoned after hang_timeout and
its tasks re-run; the epoch completes and the script ends. Run by test_thread_workers.py.

``python abandoned_exit_job.py WORKER_TYPE``: prints "done <seconds since start>" as its
last line; the exit that follows is what is timed.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import torch

import steadyload as sl
from tests.datasets import MapDS


class SleepsOnce(MapDS):
    """Sample 5 sleeps 30 s the first time it is loaded (a marker file says it did)."""

    def __init__(self, n: int, marker: str) -> None:
        super().__init__(n)
        self.marker = marker

    def __getitem__(self, i: int) -> Any:
        if i == 5:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
                time.sleep(30)
            except FileExistsError:
                pass
        return torch.tensor([i])


if __name__ == "__main__":
    began = time.monotonic()
    marker = os.path.join(tempfile.mkdtemp(), "slept")
    loader = sl.DataLoader(SleepsOnce(16, marker), batch_size=2, num_workers=2,
                           worker_type=sys.argv[1], hang_timeout=2, start_method="forkserver")  # fmt: skip
    got = [int(x) for batch in loader for x in batch]
    assert got == list(range(16)), got
    print(f"done {time.monotonic() - began:.1f}", flush=True)
