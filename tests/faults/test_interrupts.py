"""Ctrl-C and teardown: no batch lost or repeated, no worker outliving its iterator.

Real SIGINTs to this process (with Python's default handler installed, as in a terminal);
see engine/interrupts.py and docs/design/shutdown.md.
"""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import steadyload as sl
from steadyload.engine.process import handles
from steadyload.engine.process.pool import ProcessPool
from steadyload.iterators import delivery, feeding, workers
from tests.adversarial import Hog
from tests.conftest import processes_gone, wait_until
from tests.datasets import FailAt, FaultOnce, Slow


@pytest.fixture(autouse=True)
def ctrl_c_raises() -> Iterator[None]:
    # A shell that starts a job in the background makes it ignore SIGINT; in a terminal
    # Ctrl-C raises KeyboardInterrupt: make this process behave like the latter.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("stage", ["no stage", "device stage"])
def test_ctrl_c_while_a_batch_is_taken_out_keeps_that_batch_for_the_next_call(
    monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    # With the device stage the batch is handed over when the stage yields it (feeding.py).
    module = feeding if stage == "device stage" else workers
    device = {"device": "cpu"} if stage == "device stage" else {}
    interrupted = []

    def commit_after_ctrl_c(progress: Any, task: Any, stream: bool) -> Any:
        if not interrupted:  # a real SIGINT, in the last window before the batch is returned
            interrupted.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return delivery.commit(progress, task, stream)

    monkeypatch.setattr(module, "commit", commit_after_ctrl_c)
    loader = sl.DataLoader(Slow(10, 0.01), batch_size=2, num_workers=2, **device)
    got = []
    it = iter(loader)
    with pytest.raises(KeyboardInterrupt):
        got.append(next(it).tolist())
    got += [b.tolist() for b in it]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # the held batch came next, once
    assert interrupted == [True]


def test_a_batch_held_back_by_ctrl_c_is_not_yielded_in_the_next_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def ctrl_c_at_the_last_batch(progress: Any, task: Any, stream: bool) -> Any:
        calls.append(task.ordinal)
        if len(calls) == 2:  # the epoch's last batch, at the last moment
            os.kill(os.getpid(), signal.SIGINT)
        return delivery.commit(progress, task, stream)

    monkeypatch.setattr(workers, "commit", ctrl_c_at_the_last_batch)
    loader = sl.DataLoader(Slow(4, 0.0), batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(KeyboardInterrupt):
        next(it)
    # The user gives up on that epoch and starts the next one: it is whole, and only its own.
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    it._shutdown_workers()


def test_ctrl_c_while_a_dead_worker_is_buried_loses_and_repeats_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bury = ProcessPool._bury
    buried = []

    def bury_and_press_ctrl_c(self: ProcessPool, h: handles.Handle) -> Any:
        buried.append(h.worker_id)
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C half-way through the burial
        return bury(self, h)

    monkeypatch.setattr(ProcessPool, "_bury", bury_and_press_ctrl_c)
    loader = sl.DataLoader(FaultOnce(8, {3}, "sigkill", str(tmp_path)), batch_size=1,
                           num_workers=2)
    it = iter(loader)
    got, interrupts = [], 0
    while True:
        try:
            got.append(next(it).item())
        except KeyboardInterrupt:
            interrupts += 1
        except StopIteration:
            break
    assert buried == [1] and interrupts == 1
    assert got == list(range(8))  # sample 3 reloaded by the replacement, every batch once
    assert [(r.worker_id, r.sample) for r in loader.report().restarts] == [(1, 3)]


def test_ctrl_c_twice_during_teardown_still_stops_every_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request_stop = handles.Handle.request_stop
    pressed = []

    def stop_and_press_ctrl_c_twice(self: handles.Handle) -> None:
        if not pressed:  # teardown has begun: two real Ctrl-C while a worker is busy in C
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        request_stop(self)

    monkeypatch.setattr(handles.Handle, "request_stop", stop_and_press_ctrl_c_twice)
    # Worker 0 dies at sample 0 (max_restarts=0: fatal, so the workers are stopped);
    # worker 1 holds the GIL in C at sample 1, so it cannot see the Stop.
    loader = sl.DataLoader(Hog(8, kill_at=0, hog_at=1), batch_size=1, num_workers=2,
                           max_restarts=0)
    it = iter(loader)
    pids = [w.pid for w in it._workers]
    with pytest.raises(KeyboardInterrupt) as info:
        next(it)
    assert pressed == [True]
    assert isinstance(info.value.__context__, sl.WorkerDiedError)  # what was being handled
    assert processes_gone(pids), "a worker outlived the interrupted teardown"
    assert it._pool is None
    with pytest.raises(sl.WorkerDiedError):  # the error again, never "handle is closed"
        next(it)


def test_a_teardown_that_failed_half_way_finishes_on_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    finish = handles.Handle.finish
    failed = []

    def finish_fails_once(self: handles.Handle) -> None:
        if not failed:
            failed.append(self.worker_id)
            raise RuntimeError("teardown broke here")
        finish(self)

    loader = sl.DataLoader(Slow(8, 0.01), batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    pids = [w.pid for w in it._workers]
    monkeypatch.setattr(handles.Handle, "finish", finish_fails_once)
    with pytest.raises(RuntimeError, match="teardown broke here"):
        it._shutdown_workers()
    assert it._pool is not None  # not done: kept to finish the job
    monkeypatch.setattr(handles.Handle, "finish", finish)
    it._shutdown_workers()
    assert it._pool is None
    wait_until(lambda: processes_gone(pids), 5, what="the workers to exit")


@pytest.mark.parametrize("gc_enabled", [True, False], ids=["gc", "no-gc"])
def test_workers_of_an_iterator_that_raised_go_when_the_loop_is_left(gc_enabled: bool) -> None:
    loader = sl.DataLoader(FailAt(40, bad=5, exc_type=ValueError), batch_size=1, num_workers=2)
    was_enabled = gc.isenabled()
    if not gc_enabled:
        gc.disable()
    try:
        pids: list[int] = []
        try:
            for _batch in (it := iter(loader)):
                pids = pids or [w.pid for w in it._workers]
        except ValueError:
            pass
        del it
        # No reference cycle through the exception: refcounting alone frees the iterator.
        wait_until(lambda: processes_gone(pids), 1.0, what="the workers to exit")
    finally:
        if was_enabled:
            gc.enable()
