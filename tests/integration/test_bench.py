"""`steadyload bench` end to end: real workers (steadyload and torch), a short budget, the
JSON schema, the PNG, the table, and the exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from steadyload.cli.__main__ import main
from tests.unit.test_worker_count import MEASUREMENT_KEYS, RECOMMENDATION_KEYS, TOP_KEYS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fonts_loaded(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Draw once before the leak check's baseline: matplotlib keeps the font files it has
    used open for the life of the process (a cache that does not grow), which the check
    would otherwise count as leaked descriptors."""
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().set_title("warm-up")
    fig.savefig(tmp_path_factory.mktemp("fonts") / "warm.png")


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("fonts_loaded")
def test_bench_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "out.png"
    code = main(["bench", "tests.datasets:bench_small", "--budget", "8", "--batch-size", "16",
                 "--max-workers", "1", "--json", "--plot", str(png)])
    out = capsys.readouterr().out
    doc = json.loads(out)  # nothing but the JSON on stdout
    assert code == 0
    assert set(doc) == TOP_KEYS
    assert doc["version"] == 1 and doc["dataset"] == "tests.datasets:bench_small"
    assert doc["batch_size"] == 16 and doc["torch_start_method"] == "fork"
    # Whether bench keeps to its budget is unit-tested on a fake clock
    # (test_worker_count.py::test_bench_splits_the_budget_and_lists_what_did_not_fit).
    assert doc["budget_s"] <= 8 and doc["elapsed_s"] > 0  # what was left after set-up
    assert all(set(m) == MEASUREMENT_KEYS for m in doc["measurements"])
    assert set(doc["recommendation"]) == RECOMMENDATION_KEYS
    measured = {(m["loader"], m["num_workers"]) for m in doc["measurements"]}
    skipped = {(m["loader"], m["num_workers"]) for m in doc["not_measured"]}
    assert measured | skipped == {(k, n) for k in ("steadyload", "torch") for n in (0, 1)} | {
        ("steadyload-thread", 1), ("steadyload-auto", 1)}
    with_workers = [m for m in doc["measurements"] if m["num_workers"] == 1]
    assert with_workers and all(m["samples_per_s"] > 0 for m in with_workers)
    assert all(m["worker_uss_bytes"] > 0 for m in with_workers
               if m["loader"] in ("steadyload", "torch"))
    threads = [m for m in with_workers if m["loader"] == "steadyload-thread"]
    assert not threads or threads[0]["worker_uss_bytes"] is None  # no memory of their own
    if ("steadyload-auto", 1) in measured:  # the auto row says what it chose, with figures
        assert doc["worker_type_choice"].startswith("worker_type='auto' chose ")
    assert doc["recommendation"]["worker_type"] in ("process", "thread")
    assert doc["per_sample_s"] > 0.0005  # bench_small spins ~1 ms per sample
    assert doc["recommendation"]["num_workers"] == 1  # 1 ms samples: never in-process
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024


def test_bench_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "tests.datasets:bench_trivial", "--budget", "3", "--no-torch",
                 "--max-workers", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "steadyload bench tests.datasets:bench_trivial: batch 32" in out
    assert "Recommendation: num_workers=" in out and "why: " in out
    assert "threads" in out  # the thread workers' column


def test_bench_budget_too_small_measures_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "tests.datasets:bench_trivial", "--budget", "0.5"])
    out = capsys.readouterr().out
    assert code == 1
    assert "not measured within the 0 s budget: steadyload 0, torch 0" in out
    assert "nothing was measured: the budget ran out; run with a larger --budget" in out


def test_bench_usage_errors(capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["bench", "tests.datasets"]) == 2
    assert "must look like 'package.module:function'" in capsys.readouterr().err
    assert main(["bench", "tests.datasets:nope"]) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err
    assert main(["bench", "no/such/file.py:make"]) == 2
    assert "no such file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["bench", "tests.datasets:bench_trivial", "--plot", "x.png"]) == 2
    assert ("--plot needs matplotlib, which is not installed. Fix: pip install "
            "'steadyload[plot]'") in capsys.readouterr().err


def test_bench_from_the_command_line_exit_code() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "steadyload", "bench", "tests.datasets:bench_trivial",
         "--budget", "15", "--no-torch", "--max-workers", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=90,
    )  # the budget counts the dataset module's import (torch): seconds on a loaded machine
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["version"] == 1
