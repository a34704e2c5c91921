"""The fork server's death is one event: one restart, every worker back, no sample blamed.

Each scenario runs in a job of its own (tests/faults/server_death_job.py), with 4 workers
and max_restarts=3: the server is SIGKILLed, or the job's process group gets SIGTERM while
the loop waits (a scheduler's preemption, which the trainer handles).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(how: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "faults" / "server_death_job.py"), how],
        capture_output=True, text=True, timeout=120, cwd=ROOT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EOFError" not in out.stderr, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["kill", "term", "term"], ids=["sigkill", "sigterm-group", "sigterm-group-again"])
def test_a_dead_fork_server_is_one_restart_and_loses_nothing(how: str) -> None:
    seen = _run(how)
    assert seen["got"] == list(range(48))  # every sample once, in order
    (restart,) = seen["restarts"]
    signal_name = "SIGKILL" if how == "kill" else "SIGTERM"
    assert restart[:3] == [-1, f"the forkserver died ({signal_name})", None]  # no sample blamed
    assert seen["new_server"] != seen["server"]
    assert seen["old_workers_alive"] == []
    assert seen["preload_after"] == seen["preload_before"] > 0  # report() shows the preloads


def test_a_dead_auto_zygote_that_cannot_be_forked_again_gives_way_to_the_fork_server() -> None:
    """The default took the zygote; it dies after the GPU is in use (injected), when a new
    fork of this process would be unsafe: the workers restart from the fork server and the
    epoch completes, where a forced start_method="zygote" raises UnsafeForkError."""
    seen = _run("zygote-gpu")
    assert seen["got"] == list(range(48))  # every sample once, in order
    (restart,) = seen["restarts"]
    assert restart[:3] == [-1, "the zygote died (SIGKILL)", None], restart
    assert seen["old_workers_alive"] == []
    assert seen["parents"] == [seen["new_server"]], seen  # forked by CPython's fork server
