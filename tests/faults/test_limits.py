"""Running out, for real: descriptors, mappings, and the fork server's descriptor limit.

Each low limit is set in a process of its own (tests/faults/limits_job.py); every outcome
is a diagnosed error, never a hang (each run is bounded by a timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import steadyload as sl
from tests.adversarial import ManyShared

ROOT = Path(__file__).resolve().parents[2]
TORCH_CONTRACT = ("ulimit -n", "set_sharing_strategy")


def _run(mode: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "faults" / "limits_job.py"), mode],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pytorchs_fd_limit_test_passes() -> None:
    # PyTorch's test_fd_limit_exceeded: 200 kept (2, 2) tensors under `ulimit -n 100`; it
    # passes when the loop completes or raises a RuntimeError with torch's advice.
    seen = _run("torch-test")
    if seen["outcome"] == "raised":
        assert all(words in seen["message"] for words in TORCH_CONTRACT), seen["message"]
    else:
        assert seen["batches"] == 200


def test_out_of_descriptors_in_the_main_process_is_a_diagnosed_error_not_a_hang() -> None:
    seen = _run("parent-fds")
    assert seen["outcome"] == "raised" and seen["type"] == "SharedMemoryError"
    message = seen["message"]
    assert all(words in message for words in TORCH_CONTRACT), message
    assert "steadyload: the main process ran out of file descriptors while a batch of worker 0 crossed" in message
    assert "soft limit" in message and "shared-memory mapping(s)" in message
    assert "Fix: raise the limit (`ulimit -n " in message and "keep fewer batches alive" in message


def test_out_of_address_space_for_mappings_is_a_diagnosed_error_not_a_hang() -> None:
    seen = _run("parent-maps")
    assert seen["outcome"] == "raised" and seen["type"] == "SharedMemoryError"
    message = seen["message"]
    assert message.startswith("DataLoader: a batch's shared memory could not be mapped (ENOMEM")
    assert "memory mappings of vm.max_map_count=" in message and "ulimit -v" in message


@pytest.mark.parametrize("kind,count", [("list", 300), ("dict", 80)])
def test_any_number_of_shared_lists_reaches_forkserver_workers(kind: str, count: int) -> None:
    # CPython's fork server takes at most ~250 descriptors with a start; each SharedList is
    # one (a SharedDict four): they travel beside the arguments instead.
    dataset = ManyShared(count, kind)
    loader = sl.DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=list)
    assert [row for batch in loader for row in batch] == [dataset.expected(i) for i in range(4)]


def test_the_workers_attribute_shows_the_processes_as_torch_does() -> None:
    from tests.adversarial import Numbers

    loader = sl.DataLoader(Numbers(8), batch_size=2, num_workers=2)
    it = iter(loader)
    workers = it._workers
    assert all(w.is_alive() for w in workers)
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [w.pid for w in workers] == [w.pid for w in loader.report().workers]
    for w in workers:  # stopped at the epoch's end; still readable, as torch's Process
        w.join(5)
        assert not w.is_alive() and w.exitcode == 0
