"""Real faults in real worker processes: each is reported at once, in plain words."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest
import torch

import steadyload as sl
from tests.conftest import processes_gone, wait_until
from tests.datasets import (
    BadUnpickle,
    FailAt,
    Fault,
    MapDS,
    OddError,
    PidDS,
    RaisesOdd,
    Slow,
    init_raises,
)

ROOT = Path(__file__).resolve().parents[2]


def test_worker_sigkilled_from_outside_is_reported_with_its_cause() -> None:
    # How soon a death is seen is not timed here (the machine's speed would decide it): the
    # pool reports it through the worker's sentinel (tests/integration/test_pool_contract.py).
    loader = sl.DataLoader(PidDS(40, delay_s=0.05), batch_size=2, num_workers=2, max_restarts=0)
    it = iter(loader)
    victim = int(next(it)[0, 1])  # worker 0's pid
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(sl.WorkerDiedError) as info:
        for _ in it:
            pass
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.worker_id == 0 and err.pid == victim and err.signal_name == "SIGKILL"
    assert err.exitcode == -signal.SIGKILL
    msg = str(err)
    assert msg.startswith(f"DataLoader worker (pid {victim}) is killed by signal: Killed.")
    assert re.search(rf"worker 0 \(pid {victim}\) was killed by SIGKILL while .*it held 2 batches(: | \()samples \[4, 5, 8, 9\]\)", msg), msg
    assert "Likely cause: another process sent SIGKILL" in msg
    assert "steadyload did not restart it: max_restarts=0 restarts were already used" in msg
    # It held batches 1 and 3 of the epoch (prefetch 2, round-robin): samples 4,5 and 8,9.
    assert err.sample_indices[:2] == [4, 5]
    # The iterator does not silently resume after losing batches.
    with pytest.raises(sl.WorkerDiedError):
        next(it)


@pytest.mark.parametrize("server_lags", [False, True], ids=["reported", "server-lags"])
def test_a_worker_killed_after_the_last_batch_is_said_when_the_epoch_ends(
    caplog: pytest.LogCaptureFixture, server_lags: bool,
) -> None:  # fmt: skip
    loader = sl.DataLoader(PidDS(4), batch_size=2, num_workers=2)  # one batch per worker
    it = iter(loader)
    batches = [next(it), next(it)]  # every batch yielded: the workers are idle
    victim = int(batches[0][0, 1])  # worker 0's pid
    server = psutil.Process(victim).ppid()
    assert server != os.getpid(), "the default start forks workers from a fork server"
    # Lagging, its fork server reports the exit only once resumed, while the epoch ends.
    resume = threading.Timer(0.3, os.kill, (server, signal.SIGCONT))
    if server_lags:
        os.kill(server, signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: processes_gone([victim]), 10, what="the killed worker to exit")
        if server_lags:
            resume.start()
        with caplog.at_level("WARNING", logger="steadyload"):
            assert list(it) == []  # the epoch ends as it would have
    finally:
        resume.cancel()
        os.kill(server, signal.SIGCONT)  # never left stopped, whatever failed
    assert re.search(
        rf"worker 0 \(pid {victim}\) was killed by SIGKILL after the last batch of the epoch: "
        "nothing was lost",
        caplog.text,
    ), caplog.text
    assert not loader.report().restarts  # nothing was restarted


@pytest.mark.parametrize(
    ("how", "pattern"),
    [
        ("sigkill", r"is killed by signal: Killed\.\nsteadyload: worker \d \(pid \d+\) was killed by SIGKILL while loading sample 7 \(it held 1 batch: samples \[6, 7\]\)"),
        ("exit", r"exited unexpectedly with exit code 123\.\nsteadyload: worker \d \(pid \d+\) exited with status 123 while loading sample 7 \(it held 1 batch: samples \[6, 7\]\)"),
        ("segfault", r"(?s)is killed by signal: Segmentation fault\.\n.*SIGSEGV.*\nLikely cause: SIGSEGV is a crash in native code.*\nWorker stack at the crash \(faulthandler\):\n.*Fatal Python error: Segmentation fault.*tests/datasets\.py\", line \d+ in __getitem__"),
    ],
)
def test_worker_fault_inside_the_dataset_names_the_samples(how: str, pattern: str) -> None:
    loader = sl.DataLoader(Fault(12, at=7, how=how), batch_size=2, num_workers=2, prefetch_factor=1,
                           max_restarts=0)
    with pytest.raises(sl.WorkerDiedError, match=pattern) as info:
        list(loader)
    assert 7 in info.value.sample_indices


def test_dataset_exception_keeps_its_type_index_and_worker_traceback() -> None:
    loader = sl.DataLoader(FailAt(10, bad=7), batch_size=2, num_workers=2)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    with pytest.raises(KeyError, match="sample 7 is corrupt") as info:
        next(it)
    notes = getattr(info.value, "__notes__", [])
    assert any(
        n.startswith("steadyload: raised in worker 1 (pid ") and n.endswith("while loading sample 7")
        for n in notes
    ), notes
    cause = info.value.__cause__
    assert cause is not None and "tests/datasets.py" in str(cause) and "__getitem__" in str(cause)
    # Like torch, the iterator goes on after a dataset error.
    got += [b.tolist() for b in it]
    assert got == [[0, 1], [2, 3], [4, 5], [8, 9]]


def test_dataset_exception_in_process_gets_the_same_note() -> None:
    with pytest.raises(KeyError) as info:
        list(sl.DataLoader(FailAt(10, bad=3), batch_size=2))
    assert "steadyload: raised in the main process while loading sample 3" in info.value.__notes__


def test_exception_that_cannot_be_pickled_keeps_type_name_and_text() -> None:
    with pytest.raises(Exception, match=r"tests\.datasets\.OddError: odd 0 2") as info:
        next(iter(sl.DataLoader(RaisesOdd(), batch_size=1, num_workers=1)))
    assert not isinstance(info.value, OddError)
    assert type(info.value).__name__ == "WorkerException"


def test_worker_init_fn_error_is_raised_with_its_type() -> None:
    with pytest.raises(ValueError, match="worker_init_fn failed in worker 0") as info:
        list(sl.DataLoader(MapDS(4), batch_size=1, num_workers=1, worker_init_fn=init_raises))
    assert any("in worker_init_fn" in n for n in info.value.__notes__)


def test_dataset_that_does_not_unpickle_in_the_worker() -> None:
    with pytest.raises(sl.WorkerStartError, match=r"DataLoader worker 0 \(pid \d+\) could not start: builtins.RuntimeError: cannot restore this dataset in a worker"):
        list(sl.DataLoader(BadUnpickle(), batch_size=1, num_workers=1))


def test_keyboard_interrupt_while_waiting_leaves_the_iterator_usable() -> None:
    # A shell that starts a job in the background makes it ignore SIGINT; Ctrl-C in a
    # terminal raises KeyboardInterrupt, so make sure this process does the same here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    got = []
    try:
        loader = sl.DataLoader(Slow(12, delay_s=0.1), batch_size=1, num_workers=2)
        it = iter(loader)
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for batch in it:
                got.append(int(batch))
        timer.join()
        pids = [w.pid for w in it._workers]
        got += [int(batch) for batch in it]  # as torch: the rest of the epoch, each once
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got == list(range(12))
    assert loader.report().restarts == ()
    del it
    wait_until(lambda: processes_gone(pids), 5, what="the workers to exit once the iterator went")


@pytest.mark.parametrize("ending", ["exhaust", "break", "del", "exception"])
def test_iterator_teardown_leaves_nothing_behind(ending: str) -> None:
    # The autouse no_leaks fixture asserts no process, /dev/shm file or fd remains.
    loader = sl.DataLoader(MapDS(20), batch_size=2, num_workers=2)
    if ending == "exhaust":
        assert len(list(loader)) == 10
    elif ending == "break":
        for i, _ in enumerate(loader):
            if i == 1:
                break
    elif ending == "del":
        it = iter(loader)
        next(it)
        del it
    else:
        with pytest.raises(ZeroDivisionError):
            for _ in loader:
                1 / 0  # noqa: B018


_SCENARIO = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {root!r})
    import steadyload as sl
    from tests.datasets import PidDS

    if __name__ == "__main__":
        loader = sl.DataLoader(PidDS(1000, delay_s=0.01), batch_size=2, num_workers=2,
                               persistent_workers=True)
        it = iter(loader)
        pids = set()
        while len(pids) < 2:
            pids.update(int(p) for p in next(it)[:, 1])
        print(" ".join(map(str, sorted(pids))), flush=True)
        if {mode!r} == "raise":
            raise SystemExit("boom")
        time.sleep(60)
    """
)


def _run_scenario(mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCENARIO.format(root=str(ROOT), mode=mode)],
        stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.strip(), f"the scenario printed no worker pids (exit code {proc.poll()})"
    return proc, [int(p) for p in line.split()]


def _reap(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    if proc.stdout:
        proc.stdout.close()
    proc.wait(timeout=10)


def test_workers_exit_when_the_parent_is_sigkilled() -> None:
    proc, pids = _run_scenario("sleep")
    try:
        proc.kill()
        proc.wait(timeout=10)
        wait_until(lambda: processes_gone(pids), 5.0, what=f"workers {pids} to exit after the parent's SIGKILL")
    finally:
        _reap(proc)


def test_workers_exit_when_the_script_ends_with_an_error() -> None:
    proc, pids = _run_scenario("raise")
    try:
        assert proc.wait(timeout=20) == 1, "the script should end with SystemExit('boom')"
        wait_until(lambda: processes_gone(pids), 5.0, what=f"workers {pids} to exit with the script")
    finally:
        _reap(proc)


def test_fork_is_refused_when_a_gpu_context_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    loader = sl.DataLoader(MapDS(4), num_workers=1, multiprocessing_context="fork")
    with pytest.raises(sl.UnsafeForkError, match=r"refusing to start DataLoader workers with fork: this process already holds a CUDA context\.\nWhy: fork\(\) copies"):
        iter(loader)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    with pytest.raises(sl.UnsafeForkError, match=r"a ROCm/HIP GPU context \(HIP 6\.2\)"):
        iter(sl.DataLoader(MapDS(4), num_workers=1, start_method="fork"))
    # forkserver is fine with a GPU context: nothing is inherited.
    assert len(list(sl.DataLoader(MapDS(4), num_workers=1))) == 4
