"""torch-compatible features on steadyload's workers: worker info, seeds, epochs, options."""

from __future__ import annotations

import multiprocessing
import warnings
from typing import Any

import pytest
import torch

import steadyload as sl
from tests.compare import assert_same_batches
from tests.datasets import EnvDS, IterDS, MapDS, WorkerInfoDS, init_sets_env


def test_get_worker_info_inside_workers_matches_torch() -> None:
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    got = list(sl.DataLoader(WorkerInfoDS(), batch_size=2, num_workers=2, generator=gen()))
    want = list(torch.utils.data.DataLoader(WorkerInfoDS(), batch_size=2, num_workers=2, generator=gen()))
    for g, w in zip(got, want, strict=True):
        for key in ("id", "num_workers", "seed", "same_dataset_type"):
            assert torch.equal(torch.as_tensor(g[key]), torch.as_tensor(w[key])) if key != "same_dataset_type" else g[key] == w[key]
    assert {int(b["id"][0]) for b in got} == {0, 1}
    assert all(b["same_dataset_type"] == ["WorkerInfoDS"] * 2 for b in got)
    assert len({int(p) for b in got for p in b["pid"]}) == 2


def test_default_start_method_is_the_zygote_here() -> None:
    """This pytest process has no GPU context, no other thread and a lean heap: the rule
    (start/rule.py, tests/unit/test_start_rule.py) takes the zygote, and says why."""
    loader = sl.DataLoader(MapDS(4), num_workers=1)
    ctx, info = loader._plans.start_context(loader)
    assert info.method == "zygote" and "zygote" in info.why, info
    assert [int(b) for b in (x[0, 0] for x in loader)] == [0, 1, 2, 3]


def test_forkserver_start_method_preloads() -> None:
    loader = sl.DataLoader(MapDS(4), num_workers=1, start_method="forkserver")
    ctx, info = loader._plans.start_context(loader)
    assert info.method == "forkserver"
    # The session's fork server was started before this dataset's module was known, so it
    # has the preloads of that time; a fresh process preloads the dataset module too
    # (tests/integration/test_fork_safety.py::test_preloads_of_the_parents_imports...).
    assert "torch" in info.preload and "steadyload.start.server_hooks.probe" in info.preload
    assert [int(b) for b in (x[0, 0] for x in loader)] == [0, 1, 2, 3]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_context_is_honoured(method: str) -> None:
    for ctx in (method, multiprocessing.get_context(method)):
        loader = sl.DataLoader(MapDS(6), batch_size=2, num_workers=2, multiprocessing_context=ctx)
        assert loader._plans.start_context(loader)[1].method == method
        assert_same_batches(list(loader), list(torch.utils.data.DataLoader(MapDS(6), batch_size=2)))


def test_start_method_option() -> None:
    loader = sl.DataLoader(MapDS(6), batch_size=2, num_workers=1, start_method="fork")
    assert loader._plans.start_context(loader)[1].method == "fork"
    assert len(list(loader)) == 3
    with pytest.raises(ValueError, match=r"start_method must be one of .*got 'threads'"):
        sl.DataLoader(MapDS(6), num_workers=1, start_method="threads")


def test_persistent_workers_reuse_processes_across_three_epochs() -> None:
    loader = sl.DataLoader(WorkerInfoDS(), batch_size=2, num_workers=2, persistent_workers=True)
    pids = [{int(p) for b in loader for p in b["pid"]} for _ in range(3)]
    assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 2
    it = loader._iterator
    del loader, it


def test_non_persistent_workers_are_new_each_epoch() -> None:
    loader = sl.DataLoader(WorkerInfoDS(), batch_size=2, num_workers=2)
    first = {int(p) for b in loader for p in b["pid"]}
    second = {int(p) for b in loader for p in b["pid"]}
    assert first.isdisjoint(second)


def test_persistent_epoch_after_early_break_is_complete() -> None:
    loader = sl.DataLoader(MapDS(30, "int"), batch_size=2, num_workers=2, persistent_workers=True)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    full = [b.tolist() for b in loader]
    assert full == [[i, i + 1] for i in range(0, 30, 2)]


def test_worker_init_fn_runs_in_each_worker() -> None:
    got = list(sl.DataLoader(EnvDS(), batch_size=1, num_workers=2, worker_init_fn=init_sets_env))
    assert [b[0] for b in got] == ["0", "1", "0", "1"]


def test_len_matches_torch() -> None:
    for kwargs in (dict(batch_size=3), dict(batch_size=3, drop_last=True), dict(batch_size=None)):
        assert len(sl.DataLoader(MapDS(10), **kwargs)) == len(torch.utils.data.DataLoader(MapDS(10), **kwargs))
    assert len(sl.DataLoader(IterDS(10), batch_size=4)) == 3
    with pytest.raises(TypeError):
        len(sl.DataLoader(IterDS(10, with_len=False), batch_size=4))


def test_iterable_length_warning_like_torch() -> None:
    loader = sl.DataLoader(IterDS(10, shard=False), batch_size=None, num_workers=2)
    assert len(loader) == 10
    with pytest.warns(UserWarning, match=r"Length of IterableDataset .* was reported to be 10"):
        batches = list(loader)
    assert len(batches) == 20  # each worker replicates the unsharded stream, as under torch


def test_a_datapipe_runs_in_process_and_is_refused_in_workers() -> None:
    # torch shards a DataPipe in its own worker loop; ours would yield it once per worker.
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(6))
    assert [b.tolist() for b in sl.DataLoader(pipe, batch_size=3)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(TypeError, match=r"does not run a IterableWrapperIterDataPipe \(a torch DataPipe\) in worker processes: .*\nFix: use num_workers=0"):
        next(iter(sl.DataLoader(pipe, batch_size=3, num_workers=2)))


def test_pin_memory_without_accelerator_warns_like_torch() -> None:
    with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator"):
        got = list(sl.DataLoader(MapDS(4), batch_size=2, num_workers=1, pin_memory=True))
    assert len(got) == 2 and not got[0].is_pinned()


def test_too_many_workers_warns_with_torchs_words() -> None:
    with pytest.warns(UserWarning, match=r"This DataLoader will create 64 worker processes in total"):
        sl.DataLoader(MapDS(4), num_workers=64)


def test_timeout_raises_torchs_message_and_a_timeout_error() -> None:
    from tests.datasets import Slow

    # An int timeout prints as given, as torch's first line does ("after 1 seconds").
    loader = sl.DataLoader(Slow(4, delay_s=5), batch_size=1, num_workers=1, timeout=1)
    with pytest.raises(sl.WorkerHangError, match=r"DataLoader timed out after 1 seconds\n.*worker 0 \(pid \d+\) has held the next batch \(samples \[0\]\)") as info:
        next(iter(loader))
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RuntimeError)


def test_timeout_with_no_workers_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"timeout option needs num_workers > 0"):
        iter(sl.DataLoader(MapDS(4), timeout=1))


def test_dataloader_is_generic_and_a_torch_dataloader() -> None:
    alias: Any = sl.DataLoader[int]
    assert alias is not None
    assert isinstance(sl.DataLoader(MapDS(2)), torch.utils.data.DataLoader)


def test_no_warning_when_nothing_is_wrong() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(sl.DataLoader(MapDS(8), batch_size=2, num_workers=2))) == 4
