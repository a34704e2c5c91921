"""tests/conftest.py's /dev/shm leak check counts this test process's files only (#40 item 6):
another job's torch workers beside the suite must not fail a test; ours stay counted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest

SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_the_shm_leak_check_counts_our_files_and_not_another_jobs() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             start_new_session=True)  # fmt: skip
    # A child of this process (as a worker is) against a live process outside its tree (as
    # another job's worker is: pid 1, init, stands in for one).
    outsider = 1
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    names = {
        "mine": f"torch_{os.getpid()}_1_0",
        "child": f"torch_{other.pid}_1_0",
        "outsider": f"torch_{outsider}_1_0",
        "dead": f"torch_{int(dead.stdout)}_1_0",
        "ours": "sl-test-leak-check",
    }
    try:
        for name in names.values():
            (SHM / name).touch()
        found = conftest._shm_files()
        assert names["outsider"] not in found  # another job's live process made it
        for kind in ("mine", "child", "dead", "ours"):  # a dead maker may be a killed worker
            assert names[kind] in found, kind
    finally:
        for name in names.values():
            (SHM / name).unlink(missing_ok=True)
        other.kill()
        other.wait(timeout=10)
