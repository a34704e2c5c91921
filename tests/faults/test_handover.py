"""After worker_type="auto" hands over to processes, every fault is a process's: a hang, a
SIGKILL and the fork server's death are diagnosed and reported as they are for process
workers (not with the threads' wording, nor without the fork-server diagnosis).

The choice is forced (the rule is tested with injected measurements in
tests/unit/test_worker_kind.py); `tests.datasets.HandsOver` makes the hand-over fall inside
the epoch on any machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import steadyload as sl
from steadyload.engine.choice import handover, worker_kind
from tests.datasets import FaultInAProcess, MapDS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _processes_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    list(sl.DataLoader(MapDS(2), num_workers=1))  # a warm fork server, as after any loader
    monkeypatch.setattr(handover, "live_choice", lambda measured, workers, probe, on="": (
        worker_kind.chose("process", "forced by the test")))


def test_a_process_that_hangs_after_the_hand_over_is_reported_as_a_process(
    tmp_path: Path,
) -> None:
    ds = FaultInAProcess(64, str(tmp_path), "hang")
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, worker_type="auto",
                           hang_timeout=5.0, start_method="forkserver")  # fmt: skip
    with pytest.raises(sl.WorkerHangError) as caught:
        list(loader)
    text = str(caught.value)
    assert "thread worker" not in text and "abandoned" not in text, text
    assert f"(pid {os.getpid()})" not in text, text  # a worker process's pid, not ours
    assert "Where it was stuck (all threads, most recent call first)" in text, text
    assert "time.sleep(60)" in text or "__getitem__" in text, text
    assert "_pytest" not in text and "_run_zygote" not in text, text  # no inherited frames


def test_a_process_killed_after_the_hand_over_is_diagnosed_as_a_process(
    tmp_path: Path,
) -> None:
    ds = FaultInAProcess(64, str(tmp_path), "sigkill")
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, worker_type="auto",
                           max_restarts=0, start_method="forkserver")  # fmt: skip
    with pytest.raises(sl.WorkerDiedError) as caught:
        list(loader)
    err = caught.value
    assert err.evidence["start_method"] in ("forkserver", "zygote"), err.evidence
    assert err.pid is not None and err.pid != os.getpid()
    assert "SIGKILL" in str(err) and "thread worker" not in str(err), str(err)
    assert loader.report().worker_kind == "process"


def test_the_fork_server_dying_after_the_hand_over_is_one_restart() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "faults" / "server_death_job.py"), "handover"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["got"] == list(range(48))  # every sample once, in order
    (restart,) = seen["restarts"]
    assert restart[:3] == [-1, "the forkserver died (SIGKILL)", None]  # the server's diagnosis
    assert seen["kind"] == "process" and seen["old_workers_alive"] == []
