"""Thread workers (worker_type="thread") keep steadyload's promises where threads allow,
and worker_type="auto" picks threads or processes by measuring the dataset."""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info  # bound before any thread worker runs

import steadyload as sl
from tests.datasets import FaultOnce, HandsOver, IterDS, KillsInAProcess, MapDS, StatefulStream

pytestmark = pytest.mark.timeout(120)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=3),
    dict(batch_size=3, drop_last=True),
    dict(batch_size=None),
    dict(batch_size=4, shuffle=True),
    dict(batch_size=3, in_order=False),
    dict(batch_size=2, prefetch_factor=1),
], ids=["batches", "drop_last", "no-batching", "shuffle", "in_order=False", "prefetch=1"])
def test_map_style_batches_and_order_are_torchs(kwargs: dict[str, Any]) -> None:
    def run(cls: Any, **extra: Any) -> list[Any]:
        loader = cls(MapDS(23), num_workers=2, generator=torch.Generator().manual_seed(5),
                     **kwargs, **extra)
        return list(loader)

    want = run(torch.utils.data.DataLoader, multiprocessing_context="fork")
    got = run(sl.DataLoader, worker_type="thread")
    if kwargs.get("in_order") is False:  # as they come: the same batches, maybe reordered
        key = lambda b: b.flatten().tolist()  # noqa: E731
        assert sorted(map(key, got)) == sorted(map(key, want))
    else:
        assert _same(got, want)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # torch's
@pytest.mark.filterwarnings("ignore:steadyload. IterDS drew random numbers")  # its torch.rand
def test_iterable_replicas_are_sharded_per_thread_and_persistent_epochs_repeat() -> None:
    # Each thread has its own replica, sharded by its own get_worker_info(): torch's items.
    loader = sl.DataLoader(IterDS(21), batch_size=4, num_workers=3, worker_type="thread",
                           persistent_workers=True)
    want = [b["i"].tolist() for b in torch.utils.data.DataLoader(IterDS(21), batch_size=4,
                                                                  num_workers=3)]
    for _ in range(2):
        assert [b["i"].tolist() for b in loader] == want
    assert loader.report().worker_kind == "thread"


class WhoLoads(Dataset[Any]):
    """Sample i: (i, worker id, worker method, thread name, a draw from the worker's own
    torch generator); counts the per_worker builds per thread."""

    builds: list[int] = []
    lock = threading.Lock()

    def __init__(self, n: int) -> None:
        self.n = n

    def _build() -> Any:  # type: ignore[misc]  # a per_worker factory, not a method
        with WhoLoads.lock:
            WhoLoads.builds.append(threading.get_ident())
        return threading.get_ident()

    resource = sl.per_worker(_build)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        assert info is not None and info.rng is not None
        assert self.resource == threading.get_ident()
        draw = float(torch.rand((), generator=info.rng.torch_generator))
        return i, info.id, info.worker_method, threading.current_thread().name, draw


def test_worker_info_init_fn_and_per_worker_are_per_thread() -> None:
    inits: list[tuple[int, str]] = []

    def init(worker_id: int) -> None:
        inits.append((worker_id, threading.current_thread().name))

    WhoLoads.builds.clear()
    loader = sl.DataLoader(WhoLoads(12), batch_size=2, num_workers=2, worker_type="thread",
                           worker_init_fn=init, collate_fn=list)
    seen_in_main = []
    rows = []
    for batch in loader:
        seen_in_main.append(get_worker_info())
        rows += batch
    assert seen_in_main == [None] * 6  # the main thread is no worker
    assert sorted(inits) == [(0, "steadyload-thread-0"), (1, "steadyload-thread-1")]
    # Task k goes to worker k % 2 (torch's round-robin); each thread says it is that worker.
    assert [(i, wid, how, name) for i, wid, how, name, _ in rows] == [
        (i, (i // 2) % 2, "thread", f"steadyload-thread-{(i // 2) % 2}") for i in range(12)
    ]
    assert len(WhoLoads.builds) == 2 and len(set(WhoLoads.builds)) == 2  # once per thread
    assert not WhoLoads.resource.built  # never built in the main thread


class CountsOpThreads(MapDS):
    def __getitem__(self, i: int) -> Any:
        return torch.tensor([torch.get_num_threads()])


def test_torch_ops_run_single_threaded_in_each_thread_worker_and_nowhere_else() -> None:
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("under torch's native pool the op thread count is process-wide")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the training thread's count, whatever the machine has
    try:
        batches = list(sl.DataLoader(CountsOpThreads(8), batch_size=2, num_workers=2,
                                     worker_type="thread"))  # fmt: skip
        assert [b.tolist() for b in batches] == [[[1], [1]]] * 4  # as in torch's processes
        assert torch.get_num_threads() == 2  # this thread keeps its own
        later: list[int] = []  # and a thread started since gets the process's default
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join(timeout=10)
        assert later == [2]
    finally:
        torch.set_num_threads(before)


def test_sample_seeds_make_the_workers_own_draws_independent_of_the_layout() -> None:
    def draws(**kwargs: Any) -> list[float]:
        loader = sl.DataLoader(WhoLoads(12), batch_size=3, collate_fn=list, sample_seeds=True,
                               generator=torch.Generator().manual_seed(3), **kwargs)
        return [row[4] for batch in loader for row in batch]

    one = draws(num_workers=1, worker_type="thread")
    assert draws(num_workers=3, worker_type="thread") == one
    assert draws(num_workers=2, worker_type="process") == one  # the same in processes
    assert len(set(one)) == 12


class DrawsGlobally(MapDS):
    def __getitem__(self, i: int) -> Any:
        # Slow enough that the training loop is waiting for this batch when the draw comes
        # (draws are checked over the loop's waits); instant samples could all be loaded
        # while the loop was busy elsewhere, on a fast or a loaded machine.
        time.sleep(0.02)
        return torch.rand(1)


def test_drawing_from_the_global_generator_in_threads_is_said_once() -> None:
    with pytest.warns(RuntimeWarning, match=r"DrawsGlobally drew random numbers from a process-wide generator .* get_worker_info\(\)\.rng\.torch_generator") as caught:
        for _ in range(2):
            list(sl.DataLoader(DrawsGlobally(8), batch_size=2, num_workers=2, worker_type="thread"))
    assert sum("process-wide generator" in str(w.message) for w in caught) == 1


def test_skip_and_dataset_errors_in_threads(tmp_path: Path) -> None:
    ds = FaultOnce(12, {4, 9}, "raise", str(tmp_path), always=True)
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread", on_error="skip")
    got = [b.flatten().tolist() for b in loader]
    assert got == [[0, 1, 2, 3], [5, 6, 7], [8, 10, 11]]
    assert {k.index for k in loader.report().skipped} == {4, 9}
    raising = sl.DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread")
    with pytest.raises(ValueError, match="sample 4 is corrupt") as info:
        list(raising)
    assert any("while loading sample 4" in note for note in info.value.__notes__)


class HangsOn(Dataset[Any]):
    """Sample ``at`` sleeps ``sleep_s`` the first ``times`` times it is loaded."""

    def __init__(self, n: int, at: int, sleep_s: float, times: int) -> None:
        self.n, self.at, self.sleep_s, self.times = n, at, sleep_s, times
        self.loads = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.at:
            with self.lock:
                self.loads += 1
                hang = self.loads <= self.times
            if hang:
                time.sleep(self.sleep_s)  # the line the stack points at
        return torch.tensor([i])


def _threads_end(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(t.name.startswith("steadyload-thread") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "an abandoned thread worker did not end"
        time.sleep(0.05)


def test_a_hung_thread_is_abandoned_and_its_batch_rerun_once() -> None:
    loader = sl.DataLoader(HangsOn(12, 5, sleep_s=2.0, times=1), batch_size=2, num_workers=2,
                           worker_type="thread", hang_timeout=0.5)
    got = [b.flatten().tolist() for b in loader]
    assert got == [[i, i + 1] for i in range(0, 12, 2)]  # every batch once, in order
    (restart,) = loader.report().restarts
    assert restart.cause.startswith("hung for more than hang_timeout=0.5 s")
    _threads_end(5)


def test_a_sample_that_hangs_twice_raises_with_the_threads_stack() -> None:
    loader = sl.DataLoader(HangsOn(8, 3, sleep_s=2.0, times=2), batch_size=2, num_workers=2,
                           worker_type="thread", hang_timeout=0.5)
    with pytest.raises(sl.WorkerHangError, match=r"(?s)thread worker 1 hung while loading sample 3: .*time\.sleep\(self\.sleep_s\).*A thread cannot be killed: steadyload abandoned it"):
        list(loader)
    _threads_end(5)


@pytest.mark.parametrize("resume_with", ["thread", "process"])
def test_resume_mid_epoch_from_thread_workers(resume_with: str) -> None:
    def loader(worker_type: str) -> sl.DataLoader[Any]:
        return sl.DataLoader(MapDS(30), batch_size=3, shuffle=True, num_workers=2,
                             generator=torch.Generator().manual_seed(11), worker_type=worker_type)

    want = [b.tolist() for b in loader("thread")]
    first = loader("thread")
    it = iter(first)
    head = [next(it).tolist() for _ in range(4)]
    state = first.state_dict()
    del it
    resumed = loader(resume_with)
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == want


def test_a_stateful_stream_resumes_in_threads(tmp_path: Path) -> None:
    ds = StatefulStream(24, kill_at=-1, marker_dir=str(tmp_path))
    make = lambda: sl.DataLoader(ds, batch_size=3, num_workers=2, worker_type="thread")  # noqa: E731
    want = [b.tolist() for b in make()]
    first = make()
    it = iter(first)
    head = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == want


def test_report_shows_each_thread() -> None:
    loader = sl.DataLoader(MapDS(40), batch_size=4, num_workers=2, worker_type="thread")
    list(loader)
    report = loader.report()
    assert report.worker_kind == "thread" and report.batches == 10
    assert [w.worker_id for w in report.workers] == [0, 1]
    assert sum(w.samples for w in report.workers) == 40
    assert all(w.busy_share is not None and w.samples_per_s for w in report.workers)
    assert "steadyload loader report: thread workers" in str(report)


def test_threads_cannot_take_a_memory_cap() -> None:
    with pytest.raises(ValueError, match="max_worker_memory needs process workers, got worker_type='thread'"):
        sl.DataLoader(MapDS(4), num_workers=2, worker_type="thread", max_worker_memory="1GiB")
    with pytest.raises(ValueError, match="worker_type must be 'process', 'thread' or 'auto', got 'threads'"):
        sl.DataLoader(MapDS(4), num_workers=2, worker_type="threads")


class PurePython(MapDS):
    """Holds the GIL: a Python loop per sample."""

    def __getitem__(self, i: int) -> Any:
        total = 0
        for k in range(30_000):
            total += k * i
        return torch.tensor([total % 997])


class Waits(MapDS):
    """Releases the GIL: waits (like a read from disk or network) per sample."""

    def __getitem__(self, i: int) -> Any:
        time.sleep(0.002)
        return torch.tensor([i])


def _warm_fork_server() -> None:
    # A cold fork server imports torch for a second; start from a warm one (as every loader
    # after the first does).
    list(sl.DataLoader(MapDS(2), num_workers=1))


def test_auto_keeps_threads_when_it_chooses_them(force_auto: Any) -> None:
    force_auto("thread")
    # From the fork server, processes start slowly: auto starts on threads (threads first).
    loader = sl.DataLoader(Waits(160), batch_size=4, num_workers=2, worker_type="auto",
                           start_method="forkserver")  # fmt: skip
    want = [b.tolist() for b in torch.utils.data.DataLoader(Waits(160), batch_size=4)]
    assert [b.tolist() for b in loader] == want
    report = loader.report()
    assert report.worker_kind == "thread" and report.start_method is None
    forced = "worker_type='auto' chose thread workers: forced by the test (thread)"
    assert report.worker_type_choice == forced
    assert all(w.pid == os.getpid() for w in report.workers)


def test_auto_hands_over_to_processes_when_it_chooses_them(
    force_auto: Any, tmp_path: Path
) -> None:
    _warm_fork_server()
    force_auto("process")
    ds = HandsOver(160, str(tmp_path), 0.002)
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, worker_type="auto",
                           start_method="forkserver")  # fmt: skip
    want = [b.tolist() for b in torch.utils.data.DataLoader(ds, batch_size=4)]
    assert [b.tolist() for b in loader] == want  # every batch once, in order, across it
    report = loader.report()
    assert report.worker_kind == "process" and report.start_method == "forkserver", report
    choice = report.worker_type_choice or ""
    assert choice.startswith("worker_type='auto' chose process workers: forced by the test")
    assert "the first batches came from thread workers while the processes started" in choice
    assert all(w.pid != os.getpid() for w in report.workers)
    # The next epoch starts on processes at once: the choice is kept.
    assert [b.tolist() for b in loader] == want
    assert loader.report().start_method == "forkserver"


class Images(MapDS):
    """3 MiB a sample: batches of 4 are past the size whose storage is numpy's."""

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, 512, 512), float(i))


def test_big_thread_batches_outlive_their_loader_and_behave_as_torch_worker_batches() -> None:
    loader = sl.DataLoader(Images(8), batch_size=4, num_workers=2, worker_type="thread")
    kept = list(loader)
    del loader
    gc.collect()
    assert _same(kept, list(torch.utils.data.DataLoader(Images(8), batch_size=4)))
    first = kept[0]
    first.share_memory_()  # as a batch of torch's workers can be passed on
    assert first.is_shared() and float(first[3, 0, 0, 0]) == 3.0
    kept[1].resize_(2, 3, 512, 512)  # shrinking works; growing does not, as for torch's
    with pytest.raises(RuntimeError, match="not resizable"):
        kept[1].resize_(8, 3, 512, 512)


def test_big_thread_batches_memory_is_given_again_only_once_a_batch_is_gone() -> None:
    # Every third batch is kept to the end: its memory must never be lent to a later one.
    from steadyload.host.slabs import SLABS

    made, again = SLABS.made, SLABS.lent_again
    loader = sl.DataLoader(Images(96), batch_size=4, num_workers=2, worker_type="thread")
    kept = []
    for i, batch in enumerate(loader):
        assert torch.equal(batch[:, 0, 0, 0], torch.arange(4 * i, 4 * i + 4, dtype=torch.float))
        if i % 3 == 0:
            kept.append((i, batch))
    for i, batch in kept:
        assert _same(batch, torch.stack([Images(96)[j] for j in range(4 * i, 4 * i + 4)]))
    # 24 batches from fewer slabs than batches: given again; the kept ones (8) and those in
    # flight at once (2 workers x prefetch 2, one each collating, the loop's) bound the count.
    assert SLABS.lent_again > again and SLABS.made - made <= len(kept) + 7
    del loader, batch
    gc.collect()
    assert SLABS.free_bytes == 0  # the threads stopped: nothing kept


def test_a_worker_killed_across_the_hand_over_loses_and_repeats_nothing(
    force_auto: Any, tmp_path: Path
) -> None:
    _warm_fork_server()
    force_auto("process")
    ds = KillsInAProcess(160, 0, str(tmp_path))
    want = [b.tolist() for b in torch.utils.data.DataLoader(ds, batch_size=4)]  # no worker: no kill
    loader = sl.DataLoader(ds, batch_size=4, num_workers=2, worker_type="auto",
                           start_method="forkserver")  # fmt: skip
    assert [b.tolist() for b in loader] == want
    report = loader.report()
    assert report.start_method == "forkserver"
    assert [r.cause for r in report.restarts] == ["killed by SIGKILL"]
    assert (tmp_path / "k").exists()


def test_auto_never_starts_a_stream_on_threads_and_an_explicit_choice_wins() -> None:
    loader = sl.DataLoader(IterDS(8), batch_size=4, num_workers=2, worker_type="auto")
    list(loader)
    assert "an IterableDataset's stream cannot move" in (loader.report().worker_type_choice or "")
    explicit = sl.DataLoader(PurePython(8), batch_size=4, num_workers=2, worker_type="thread")
    list(explicit)
    assert explicit.report().worker_kind == "thread"
    assert explicit.report().worker_type_choice is None


class WaitsAndDraws(MapDS):
    """Releases the GIL, but draws from torch's process-wide generator."""

    def __getitem__(self, i: int) -> Any:
        time.sleep(0.002)
        return torch.rand(1)


def test_auto_moves_a_dataset_that_draws_from_the_global_generators_to_processes() -> None:
    loader = sl.DataLoader(WaitsAndDraws(64), batch_size=4, num_workers=2, worker_type="auto",
                           start_method="forkserver")  # threads first  # fmt: skip
    with pytest.warns(RuntimeWarning, match="WaitsAndDraws drew random numbers"):
        assert len(list(loader)) == 16
    assert (loader.report().worker_type_choice or "").startswith(
        "worker_type='auto' chose process workers: the dataset draws from the process-wide "
        "random generators, which thread workers share")


@pytest.mark.parametrize("worker_type", ["thread", "auto"])
def test_the_training_loops_own_draws_are_not_blamed_on_the_dataset(
    worker_type: str, force_auto: Any
) -> None:
    force_auto(None)  # "auto" measures on and on: only a draw could decide it here
    first = {"start_method": "forkserver"} if worker_type == "auto" else {}  # threads first
    loader = sl.DataLoader(Waits(64), batch_size=2, num_workers=2, worker_type=worker_type,
                           **first)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _batch in loader:
            torch.rand(64)  # dropout, noise: the training loop's own draws
            time.sleep(0.002)  # a training step, while the workers load
    assert loader.report().worker_type_choice is None
