"""A fork server (or zygote) that does not answer a worker start is an error, not a hang.

Each scenario runs in a job of its own (tests/faults/stalled_server_job.py): the server is
stopped (SIGSTOP) before a loader starts its workers, or slow past the start timeout; then
it answers again and the next loader works. How long each start waited is not asserted
(the machine's speed decides it): the watch's timing is unit-tested on an injected clock
(tests/unit/test_start_watch.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(how: str, method: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "faults" / "stalled_server_job.py"), how, method],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("method", ["forkserver", "zygote"])
def test_a_stopped_server_is_named_at_once(method: str) -> None:
    seen = _run("stopped", method)
    assert seen["first"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert seen["type"] == "WorkerStartError"
    error = str(seen["error"])
    assert "DataLoader worker 0 could not start: the fork server (pid " in error
    assert "is stopped (process state 'T': SIGSTOP, a debugger or a frozen cgroup)" in error
    assert "Fix: resume it (`kill -CONT " in error
    assert seen["after"] == seen["first"]


def test_a_server_slow_past_the_timeout_fails_the_start_with_what_was_seen() -> None:
    seen = _run("slow", "forkserver")
    error = str(seen["error"])
    # Still importing its preloads, asleep: no CPU time, no reads, not stopped.
    assert ("did not fork the worker and made no progress (no CPU time, no reads) for 1 s "
            "(process state '") in error, error
    assert "STEADYLOAD_START_STALL_S, in seconds, 120 by default" in error, error  # the knob
    assert "is stopped" not in error and "Fix: see what it is doing (`py-spy dump --pid " in error
    assert seen["after"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_server_slow_but_making_progress_is_waited_for() -> None:
    seen = _run("busy", "forkserver")  # 3 s of CPU in its import, 1 s allowed without progress
    assert "error" not in seen, seen
    assert seen["first"] == seen["after"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
