"""House style checks run with the tests: ruff (incl. implicit string concatenation) and mypy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff() -> None:
    out = _run("ruff", "check", "steadyload", "tests", "benchmarks", "examples", "dev.py")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_on_the_package() -> None:
    out = _run("mypy", "steadyload")
    assert out.returncode == 0, out.stdout + out.stderr
