"""Hardening (issue 13): what adversarial use found, each fixed at its mechanism.

Real worker processes and real faults; every wait bounded; the leak fixture checks that no
process, fd or shared memory is left.
"""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import steadyload as sl
from steadyload.errors import (
    MainGuardError,
    NotPicklableError,
    SharedMemoryError,
    SkipLimitError,
    SteadyloadError,
    UnsafeForkError,
    WorkerDiedError,
    WorkerHangError,
    WorkerStartError,
)
from tests.adversarial import (
    BadStr,
    BatchedOnly,
    BrokenStateStream,
    KillingStream,
    RaisesBadStr,
    timeout_error_to,
)

ROOT = Path(__file__).resolve().parents[2]

ERRORS = [
    lambda: SteadyloadError("root"),
    lambda: WorkerDiedError("died", worker_id=1, pid=42, exitcode=-9, signal_name="SIGKILL",
                            sample_indices=[3, 4], evidence={"rss_bytes": 5}),
    lambda: WorkerStartError("start", worker_id=0, pid=None),
    lambda: WorkerHangError("DataLoader timed out after 1 seconds", timeout_s=1.0,
                            worker_id=0, sample_indices=[7]),
    lambda: UnsafeForkError("fork"),
    lambda: NotPicklableError("nope", path="dataset.conn"),
    lambda: MainGuardError("guard"),
    lambda: SkipLimitError("skipped", first_index=9, first_error="KeyError: 9"),
    lambda: SharedMemoryError("fds", worker_id=1, errno=24, where="main process",
                              evidence={"open_fds": 1024}),
]


def _fields(exc: BaseException) -> dict[str, object]:
    return {k: v for k, v in vars(exc).items() if k != "__notes__"}


@pytest.mark.parametrize("make", ERRORS, ids=lambda make: type(make()).__name__)
@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_every_public_error_round_trips_with_message_fields_and_notes(
    make: Callable[[], BaseException], how: str
) -> None:
    exc = make()
    exc.add_note("steadyload: a note")
    again = {"pickle": lambda e: pickle.loads(pickle.dumps(e)), "copy": copy.copy,
             "deepcopy": copy.deepcopy}[how](exc)
    assert type(again) is type(exc)
    assert str(again) == str(exc) and again.args == exc.args
    assert _fields(again) == _fields(exc)
    assert again.__notes__ == ["steadyload: a note"]


def test_every_public_error_is_in_the_round_trip_list() -> None:
    public = {name for name in sl.__all__ if isinstance(getattr(sl, name), type)
              and issubclass(getattr(sl, name), BaseException)}
    assert public == {type(make()).__name__ for make in ERRORS}


def test_a_timeout_error_crosses_a_process_with_its_fields() -> None:
    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.Queue()
    child = ctx.Process(target=timeout_error_to, args=(queue,))
    child.start()
    try:
        exc = queue.get(timeout=60)
    finally:
        child.join(30)
        queue.close()
        queue.join_thread()
    assert isinstance(exc, sl.WorkerHangError) and isinstance(exc, TimeoutError)
    assert str(exc).startswith("DataLoader timed out after 0.3 seconds")
    assert exc.timeout_s == 0.3 and exc.worker_id == 0 and exc.sample_indices == [0]
    assert child.exitcode == 0


def test_an_exception_whose_str_raises_is_reported_and_the_worker_lives() -> None:
    loader = sl.DataLoader(RaisesBadStr(8, bad=3), batch_size=2, num_workers=2)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(BadStr) as info:
        next(it)
    assert "steadyload: raised in worker 1" in "\n".join(info.value.__notes__)
    assert [b.tolist() for b in it] == [[4, 5], [6, 7]]  # torch goes on after an error
    assert loader.report().restarts == ()


def test_an_exception_whose_str_raises_is_skipped_with_a_readable_message() -> None:
    loader = sl.DataLoader(RaisesBadStr(8, bad=3), batch_size=2, num_workers=2,
                           on_error="skip")
    assert [b.tolist() for b in loader] == [[0, 1], [2], [4, 5], [6, 7]]
    (skipped,) = loader.report().skipped
    assert skipped.index == 3 and skipped.error_type == "tests.adversarial.BadStr"
    assert skipped.message.startswith("<str() of the exception raised RuntimeError")
    assert loader.report().restarts == ()


def test_a_stream_whose_state_dict_raises_is_reported_not_fatal() -> None:
    loader = sl.DataLoader(BrokenStateStream(8, good=2), batch_size=2, num_workers=1)
    it = iter(loader)
    assert [next(it).tolist(), next(it).tolist()] == [[[0], [1]], [[2], [3]]]
    with pytest.raises(ValueError, match="state_dict\\(\\) broke at call 3") as info:
        next(it)
    notes = "\n".join(info.value.__notes__)
    assert "while saving the dataset's position (state_dict())" in notes
    assert loader.report().restarts == ()
    del it


def test_skip_keeps_the_batched_getitems_path_and_falls_back_only_where_it_raised() -> None:
    loader = sl.DataLoader(BatchedOnly(12, bad=5), batch_size=4, num_workers=2,
                           on_error="skip", collate_fn=list)
    batches = list(loader)
    assert [[s["i"] for s in b] for b in batches] == [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10, 11]]
    assert [{s["path"] for s in b} for b in batches] == [{"batched"}, {"single"}, {"batched"}]
    (skipped,) = loader.report().skipped
    assert skipped.index == 5 and "sample 5 is corrupt" in skipped.message


def test_skip_keeps_getitems_in_process_too() -> None:
    loader = sl.DataLoader(BatchedOnly(8, bad=5), batch_size=4, on_error="skip",
                           collate_fn=list)
    assert [{s["path"] for s in b} for b in loader] == [{"batched"}, {"single"}]


def test_a_dead_stream_worker_names_its_batches_not_none_indices() -> None:
    loader = sl.DataLoader(KillingStream(40, at=6), batch_size=2, num_workers=2)
    with pytest.raises(sl.WorkerDiedError) as info:
        list(loader)
    msg = str(info.value)
    assert "None" not in msg.split("Likely cause")[0], msg
    assert "of the epoch; an IterableDataset's items have no indices" in msg
    assert info.value.sample_indices == []


def test_the_fork_server_gets_our_sys_path_without_touching_the_environment(
    tmp_path: Path,
) -> None:
    (tmp_path / "local_rows.py").write_text(textwrap.dedent(
        """
        import torch

        class Rows(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, i):
                return i
        """
    ))
    (tmp_path / "main.py").write_text(textwrap.dedent(
        """
        import os, sys
        import numpy, torch
        import steadyload as sl
        from local_rows import Rows

        calls = []  # every change to this process's environment from here on
        real_putenv, real_unsetenv = os.putenv, os.unsetenv
        os.putenv = lambda k, v: (calls.append(k), real_putenv(k, v))[1]
        os.unsetenv = lambda k: (calls.append(k), real_unsetenv(k))[1]

        if __name__ == "__main__":
            loader = sl.DataLoader(Rows(), batch_size=2, num_workers=1, start_method="forkserver")
            print(list(loader), calls)
            print(loader.report())
        """
    ))
    out = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "[tensor([0, 1]), tensor([2, 3])] []" in out.stdout  # no environment change
    assert "local_rows" in out.stdout and "preload result: all imported" in out.stdout
