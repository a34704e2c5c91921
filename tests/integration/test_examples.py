"""The example scripts run and say what their docstrings promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(*args: str, stdin: str | None = None) -> str:
    out = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                         cwd=ROOT, env=ENV, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_per_worker_processor_example_builds_once_per_worker() -> None:
    out = _run("examples/per_worker_processor.py")
    builds = re.search(r"tokenizer builds per worker: \{(\d+): (\d+), (\d+): (\d+)\}", out)
    assert builds and builds.group(2) == builds.group(4) == "1", out
    assert "the main process built it 0 times" in out


def test_error_gallery_shows_each_message() -> None:
    out = _run("examples/error_gallery.py")
    assert "dataset.db: cannot pickle 'sqlite3.Connection' object" in out
    assert "note: steadyload: raised in worker 0 (pid" in out and "while loading sample 5" in out
    assert "steadyload.MainGuardError: DataLoader workers started from the top level of" in out
    assert "refusing to start DataLoader workers with fork" in out
