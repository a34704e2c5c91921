"""House style checks run with the tests: ruff (incl. implicit string concatenation), mypy,
and codespell over the docs, code, examples, benchmarks and tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_ruff() -> None:
    out = _run("ruff", "check", "steadyload", "tests", "benchmarks", "examples", "dev.py")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(600)  # a fresh clone has no mypy cache: it reads torch's stubs cold
def test_mypy_strict_on_the_package() -> None:
    out = _run("mypy", "steadyload", timeout=540)
    assert out.returncode == 0, out.stdout + out.stderr


# What people read: the front page, guides, design notes, changelog, and every comment,
# docstring and message in the code. Its configuration (skips, words it must not flag) is
# [tool.codespell] in pyproject.toml.
SPELLCHECKED = (
    "README.md", "CHANGELOG.md", "docs", "steadyload", "examples", "benchmarks", "tests",
)  # fmt: skip


def test_codespell() -> None:
    out = _run("codespell_lib", *SPELLCHECKED)
    assert out.returncode == 0, "codespell found typos:\n" + out.stdout + out.stderr
