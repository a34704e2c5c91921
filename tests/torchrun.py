"""Run a test job under torchrun (``--standalone``, gloo on CPU): the one runner of the
multi-rank tests (test_elastic.py, test_world_change.py, test_ledger_ranks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(job: str, out: Path, ranks: int, *args: str, crash: bool = False) -> None:
    """``python -m torch.distributed.run ... -m job out *args`` on ``ranks`` ranks; it must
    succeed (or, ``crash``, fail: a job that kills itself). Its output is in the error."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={ranks}", "-m", job, str(out), *args],
        cwd=ROOT, env=ENV, timeout=240, capture_output=True, text=True,
    )  # fmt: skip
    assert (proc.returncode != 0) == crash, proc.stdout[-3000:] + proc.stderr[-6000:]
