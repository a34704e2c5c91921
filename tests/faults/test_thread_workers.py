"""Thread workers keep the promises process workers keep (issue #21), each shown in a child
interpreter where the process itself may die or be signalled, every wait bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _job(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "faults" / script), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


@pytest.mark.parametrize("worker_type", ["thread", "auto"])
@pytest.mark.parametrize("mode, status", [("break", 0), ("raise", 1), ("module", 0)])
def test_a_script_that_ends_mid_epoch_exits_with_its_own_status(
    mode: str, status: int, worker_type: str
) -> None:
    out = _job("thread_exit_job.py", mode, worker_type)
    assert out.returncode == status, out.stderr[-3000:]
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
    if mode == "raise":
        assert "RuntimeError: the training step failed" in out.stderr


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_caught_ctrl_c_loses_no_batch(worker_type: str) -> None:
    out = _job("ctrl_c_job.py", worker_type)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["interrupts"] > 0  # the signals landed
    assert seen["got"] == list(range(240)), seen  # every sample once, in order
