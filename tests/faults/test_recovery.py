"""Self-healing: dead and hung workers are explained, replaced, and nothing is lost."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import steadyload as sl
from steadyload.iterators import hangs
from steadyload.start.context import zygote_pid
from tests.datasets import EndsUnevenly, FaultOnce, IterDS, JsonLines, Leaky, OpensFiles, Slow


def _reference(n: int, batch_size: int, **kwargs: Any) -> list[list[int]]:
    return [
        b.flatten().tolist()
        for b in torch.utils.data.DataLoader(FaultOnce(n, set(), "none", ""), batch_size=batch_size, **kwargs)
    ]


def _batches(loader: Any) -> list[list[int]]:
    return [b.flatten().tolist() for b in loader]


@pytest.mark.parametrize("how", ["sigkill", "segfault"])
def test_worker_killed_inside_is_replaced_and_batches_are_identical(
    how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = FaultOnce(40, {7, 22}, how, str(tmp_path))
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2)
    with caplog.at_level(logging.INFO, logger="steadyload"):
        got = _batches(loader)
    assert got == _reference(40, 4)
    report = loader.report()
    assert [r.sample for r in report.restarts] == [7, 22]
    signal_name = "SIGKILL" if how == "sigkill" else "SIGSEGV"
    assert all(r.cause == f"killed by {signal_name}" for r in report.restarts)
    restarts = [r.getMessage() for r in caplog.records if "replacement worker" in r.getMessage()
                and r.levelno == logging.WARNING]  # shown by Python's default logging
    assert len(restarts) == 2 and all("\n" not in line for line in restarts)
    assert f"was killed by {signal_name} while loading sample 7" in restarts[0]
    assert "steadyload started a replacement worker 1 (restart 1 of 3 this epoch); the 2 batches it held are re-run in order." in restarts[0]


def test_fifty_random_kills_inside_lose_and_repeat_nothing(tmp_path: Path) -> None:
    rng = random.Random(1234)
    faulty = set(rng.sample(range(400), 50))
    ds = FaultOnce(400, faulty, "sigkill", str(tmp_path))
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, shuffle=True, max_restarts=100,
                           generator=torch.Generator().manual_seed(7))
    got = _batches(loader)
    want = _reference(400, 4, shuffle=True, generator=torch.Generator().manual_seed(7))
    assert got == want
    assert len(loader.report().restarts) == 50
    assert {r.sample for r in loader.report().restarts} == faulty


def _worker_pids(min_age_s: float = 0.0) -> list[int]:
    server = zygote_pid() or forkserver._forkserver._forkserver_pid  # the default's server
    now = time.time()
    try:
        return [
            p.pid for p in psutil.Process(server).children()
            if p.status() != psutil.STATUS_ZOMBIE and now - p.create_time() >= min_age_s
        ]
    except psutil.Error:
        return []


def test_random_kills_from_outside_lose_and_repeat_nothing() -> None:
    # Kills land at random moments (loading, sending, idle), but never twice on the same
    # sample: two deaths on one sample would rightly count as a sample that kills workers.
    from steadyload.engine.worker.status import LOADING

    loader = sl.DataLoader(Slow(600, delay_s=0.004), batch_size=3, num_workers=2,
                           max_restarts=100)
    it = iter(loader)
    killed: set[tuple[int, int]] = set()
    kills: list[int] = []
    stop = threading.Event()

    def killer() -> None:
        rng = random.Random(99)
        while not stop.is_set() and len(kills) < 25:
            time.sleep(rng.uniform(0.02, 0.06))
            supervisor = it._pool
            handles = list(supervisor._live) if supervisor is not None else []
            if not handles:
                continue
            victim = rng.choice(handles)
            try:
                # Frozen first, so the sample it is on cannot change between look and kill.
                os.kill(victim.pid, signal.SIGSTOP)
                progress = victim.status.progress()
                spot = (progress.task_id, progress.position)
                if progress.stage == LOADING and spot in killed:
                    os.kill(victim.pid, signal.SIGCONT)
                    continue
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.add(spot)
            kills.append(victim.pid)

    thread = threading.Thread(target=killer, name="killer")
    thread.start()
    try:
        got = [b.tolist() for b in it]
    finally:
        stop.set()
        thread.join(timeout=10)
    assert got == [list(range(i, min(i + 3, 600))) for i in range(0, 600, 3)]
    assert len(kills) >= 10, f"only {len(kills)} kills happened: the test proved little"
    assert len(loader.report().restarts) >= 10


def test_sample_that_kills_twice_raises_by_default(tmp_path: Path) -> None:
    ds = FaultOnce(20, {9}, "sigkill", str(tmp_path), always=True)
    with pytest.raises(sl.WorkerDiedError, match=r"was killed by SIGKILL while loading sample 9 .*\n(?s:.*)steadyload did not retry it: sample 9 killed a worker twice\. Pass on_error='skip' to leave it out and go on\.") as info:
        list(sl.DataLoader(ds, batch_size=4, num_workers=2))
    assert 9 in info.value.sample_indices


def test_sample_that_kills_twice_is_skipped_and_recorded_with_on_error_skip(tmp_path: Path) -> None:
    ds = FaultOnce(20, {9}, "sigkill", str(tmp_path), always=True)
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, on_error="skip")
    got = _batches(loader)
    want = _reference(20, 4)
    want[2].remove(9)
    assert got == want
    (skipped,) = loader.report().skipped
    assert skipped.index == 9 and "killed the worker twice (SIGKILL)" in skipped.message


def test_restart_budget_is_per_epoch_and_then_raises(tmp_path: Path) -> None:
    ds = FaultOnce(30, {3, 13, 23}, "sigkill", str(tmp_path))
    with pytest.raises(sl.WorkerDiedError, match=r"steadyload did not restart it: max_restarts=2 restarts were already used in this epoch\."):
        list(sl.DataLoader(ds, batch_size=2, num_workers=2, max_restarts=2))


def test_iterable_dataset_death_is_diagnosed_not_replayed() -> None:
    loader = sl.DataLoader(IterDS(10_000), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    for pid in _worker_pids()[:1]:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(sl.WorkerDiedError, match=r"an IterableDataset's stream cannot be replayed"):
        for _ in it:
            pass


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_stream_that_ended_beside_a_slow_one_is_not_taken_for_a_lost_message(
    worker_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lost-message check ran while the loader awaited worker 1's slow item, and took the
    # task worker 0's stream ended at (no outcome, by design) for a batch lost on its way.
    monkeypatch.setattr(hangs, "LOST_CHECK_S", 0.1)
    ds = EndsUnevenly(slow_s=1.5)
    loader = sl.DataLoader(ds, batch_size=None, num_workers=2, worker_type=worker_type)
    assert [int(x) for x in loader] == [0, 1, 2, 3]


def test_hang_is_dumped_killed_and_retried_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ds = FaultOnce(16, {5}, "spin", str(tmp_path))
    loader = sl.DataLoader(ds, batch_size=2, num_workers=2, hang_timeout=1.0)
    with caplog.at_level(logging.INFO, logger="steadyload"):
        got = _batches(loader)
    assert got == _reference(16, 2)
    (restart,) = loader.report().restarts
    assert restart.cause == "hung for more than hang_timeout=1.0 s" and restart.sample == 5
    dumps = [r.getMessage() for r in caplog.records if "for more than hang_timeout" in r.getMessage()]
    assert any("tests/datasets.py" in d and "__getitem__" in d for d in dumps), dumps


def test_second_hang_raises_with_the_stack(tmp_path: Path) -> None:
    ds = FaultOnce(8, {3}, "sleep", str(tmp_path), always=True)
    with pytest.raises(sl.WorkerHangError, match=r"(?s)worker \d \(pid \d+\) hung while loading sample 3: it ran for more than hang_timeout=0\.5 s twice, on two fresh workers\.\nWhere it was stuck \(all threads, most recent call first\):\n.*tests/datasets\.py\", line \d+ in __getitem__.*\nLikely cause: a sample that never finishes loading") as info:
        list(sl.DataLoader(ds, batch_size=2, num_workers=2, hang_timeout=0.5))
    assert isinstance(info.value, TimeoutError)
    assert "in __getitem__" in str(info.value)


def test_corrupt_lines_are_skipped_and_listed(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [f'{{"value": {i}}}' for i in range(12)]
    lines[4] = '{"value": 4'          # truncated
    lines[9] = "not json at all"
    path.write_text("\n".join(lines))
    loader = sl.DataLoader(JsonLines(str(path)), batch_size=3, num_workers=2, on_error="skip")
    got = [b.tolist() for b in loader]
    assert got == [[0, 1, 2], [3, 5], [6, 7, 8], [10, 11]]
    report = loader.report()
    assert [(s.index, s.error_type) for s in report.skipped] == [
        (4, "json.decoder.JSONDecodeError"), (9, "json.decoder.JSONDecodeError"),
    ]
    assert "skipped samples: 2" in str(report)
    with pytest.raises(ValueError, match="Expecting") as info:  # on_error="raise": its own type
        list(sl.DataLoader(JsonLines(str(path)), batch_size=3, num_workers=2))
    assert any(n.endswith("while loading sample 4") for n in info.value.__notes__)


def test_skip_in_process_too(tmp_path: Path) -> None:
    ds = FaultOnce(6, {1}, "raise", str(tmp_path), always=True)
    loader = sl.DataLoader(ds, batch_size=2, on_error="skip")
    assert _batches(loader) == [[0], [2, 3], [4, 5]]
    assert [s.index for s in loader.report().skipped] == [1]


def test_worker_above_the_memory_cap_is_replaced_between_batches() -> None:
    loader = sl.DataLoader(Leaky(24, mib=40), batch_size=2, num_workers=2,
                           max_worker_memory="200MiB")
    assert _batches(loader) == _reference(24, 2)
    restarts = loader.report().restarts
    assert restarts, "no worker passed the cap: the test proved nothing"
    assert all("above max_worker_memory=200 MiB" in r.cause for r in restarts)


def test_too_many_open_files_gets_the_limit_and_fix() -> None:
    with pytest.raises(OSError, match="Too many open files") as info:
        list(sl.DataLoader(OpensFiles(), batch_size=1, num_workers=1))
    assert any("ulimit -n" in n and "sharing strategy" in n for n in info.value.__notes__)


def test_invalid_recovery_options() -> None:
    from tests.datasets import MapDS

    for kwargs, pattern in [
        (dict(max_restarts=-1), r"max_restarts must be an int >= 0, got -1"),
        (dict(on_error="ignore"), r"on_error must be 'raise' or 'skip', got 'ignore'"),
        (dict(hang_timeout=0), r"hang_timeout must be > 0 seconds or None, got 0"),
        (dict(max_worker_memory="lots"), r"max_worker_memory must be a size like '4GiB'"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            sl.DataLoader(MapDS(4), num_workers=1, **kwargs)


def test_stateful_iterable_dataset_resumes_where_the_dead_worker_stopped(tmp_path: Path) -> None:
    from tests.datasets import StatefulStream

    got = _batches(sl.DataLoader(StatefulStream(40, kill_at=17, marker_dir=str(tmp_path)),
                                 batch_size=3, num_workers=2))
    want = _batches(torch.utils.data.DataLoader(StatefulStream(40, kill_at=-1, marker_dir=""),
                                                batch_size=3, num_workers=2))
    assert got == want and (tmp_path / "k").exists()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skipping_every_sample_is_an_error_not_an_endless_loop(num_workers: int, tmp_path: Path) -> None:
    ds = FaultOnce(200, set(range(200)), "raise", str(tmp_path), always=True)
    loader = sl.DataLoader(ds, batch_size=4, num_workers=num_workers, on_error="skip")
    with pytest.raises(sl.SkipLimitError, match=r"on_error='skip' left out 64 samples in a row without loading a single one; the first was sample (\d+): builtins\.ValueError: sample \1 is corrupt\n.*\nFix: load that sample in this process \(dataset\[\1\]\)"):
        for _ in loader:
            pass


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("faulty", [{4, 5, 6, 7, 9}, {0, 1, 2, 3}], ids=["middle", "first"])
def test_skip_never_changes_the_number_of_batches(
    num_workers: int, faulty: set[int], tmp_path: Path
) -> None:
    # Ranks of a distributed run must stay in step: a batch whose every sample failed is
    # yielded empty (shaped like the others), never dropped.
    ds = FaultOnce(16, faulty, "raise", str(tmp_path), always=True)
    loader = sl.DataLoader(ds, batch_size=4, num_workers=num_workers, on_error="skip")
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    empty = min(faulty) // 4
    assert batches[empty].shape == (0, 1) and batches[empty].dtype == torch.int64
    seen = sorted(int(x) for b in batches for x in b.flatten())
    assert seen == sorted(set(range(16)) - faulty)
    assert sorted(k.index for k in loader.report().skipped) == sorted(faulty)
