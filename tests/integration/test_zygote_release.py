"""The zygote is let go when no loader may start a worker from it (start/zygote.py): it
pins this process's heap as it was at the fork, so after ``worker_type="auto"`` handed its
processes over to threads it is memory for nothing. Each case runs in a process of its own
(zygote_release_job.py): the test session keeps its zygote for every other test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _job(mode: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("zygote_release_job.py")), mode],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_auto_lets_the_zygote_go_once_no_loader_may_need_it() -> None:
    seen = _job("released")
    # Kept while a process loader may still start workers from it, which it then does.
    assert seen["auto_epoch"] == 64 and seen["kept_for_the_other"], seen
    assert seen["other_epoch"] == 64 and seen["other_start"] == "zygote", seen
    # With that loader gone, the next auto loader's hand-over to threads stops and reaps it.
    assert seen["auto2_epoch"] == 64 and seen["auto2_kind"] == "thread", seen
    assert seen["released"], seen
    # A process loader built later forks a new one (this process is still fork-safe).
    assert seen["later_epoch"] == 64 and seen["later_start"] == "zygote", seen
    assert isinstance(seen["exit_zygote"], int), seen
    # At exit it is stopped and reaped before the interpreter's teardown.
    assert seen["reaped_before_teardown"] and seen["after"] is None, seen


def test_a_zygote_asked_for_by_name_is_kept() -> None:
    seen = _job("asked")
    assert seen["auto_epoch"] == 64 and seen["kept"], seen
    assert seen["reaped_before_teardown"] and seen["after"] is None, seen
