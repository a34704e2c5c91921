"""SharedList / SharedDict: one copy of the metadata in shared memory for every worker."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch

import steadyload as sl
from tests.datasets import SharedRows

RECORDS: list[Any] = [
    "plain", "", "ünïcødé ✓", b"\x00bytes\xff", 7, 2.5, None, ("tuple", 1),
    {"file": "a.jpg", "caption": "a cat", "box": [1, 2, 3, 4]}, np.arange(3),
]


def test_records_round_trip_with_indexing_slicing_and_iteration() -> None:
    shared = sl.SharedList(RECORDS)
    assert len(shared) == len(RECORDS)
    for got, want in zip(shared, RECORDS, strict=True):
        if isinstance(want, np.ndarray):
            assert np.array_equal(got, want)
        else:
            assert got == want and type(got) is type(want)
    assert shared[-1].tolist() == [0, 1, 2] and shared[2] == "ünïcødé ✓"
    assert shared[1:4] == RECORDS[1:4] and shared[::-3][0].tolist() == [0, 1, 2]
    assert shared[np.int64(0)] == "plain" and shared[torch.tensor(0).item()] == "plain"
    with pytest.raises(IndexError, match=r"SharedList index 10 out of range \(len 10\)"):
        shared[10]
    with pytest.raises(IndexError):
        shared[-11]
    assert len(sl.SharedList([])) == 0 and list(sl.SharedList([])) == []


def test_pickled_outside_a_worker_start_it_carries_the_records() -> None:
    copy = pickle.loads(pickle.dumps(sl.SharedList(["a", "b"])))
    assert list(copy) == ["a", "b"]


@pytest.mark.parametrize("method", ["forkserver", "fork", "spawn"])
def test_workers_read_the_same_segment(method: str) -> None:
    rows = [f"images/{i:05d}.jpg" for i in range(50)]
    ds = SharedRows(rows)
    loader = sl.DataLoader(ds, batch_size=10, num_workers=2, start_method=method)
    got = [r for batch in loader for r in batch["row"]]
    assert got == rows
    # Workers mapped the memfd they were handed; nothing was created in /dev/shm (the
    # no_leaks fixture checks that, and that no descriptor is left behind).


def test_shared_dict_lookup() -> None:
    mapping = {f"key-{i}": {"value": i} for i in range(500)}
    mapping[("tuple", 1)] = "tuple key"
    shared = sl.SharedDict(mapping)
    assert len(shared) == 501 and shared["key-17"] == {"value": 17}
    assert shared[("tuple", 1)] == "tuple key" and "missing" not in shared
    with pytest.raises(KeyError):
        shared["key-500"]
    assert list(shared) == list(mapping)  # iteration keeps insertion order, like dict


@pytest.mark.parametrize(("method", "cost"), [
    ("forkserver", r"under forkserver each of the 2 workers gets a pickled copy: \d+ MiB in total"),
    ("fork", r"under fork each of the 2 workers copies the pages it reads"),
])
def test_large_python_metadata_is_flagged_once_with_the_fix(method: str, cost: str) -> None:
    from steadyload import memory
    from tests.datasets import BigMetadata

    memory._warned.clear()
    with pytest.warns(UserWarning, match=rf"steadyload: self\.rows of BigMetadata is a Python list of 150,000 items, about \d+ MiB; {cost}.*Fix: `self\.rows = steadyload\.SharedList\(self\.rows\)` in __init__"):
        assert len(list(sl.DataLoader(BigMetadata(), batch_size=4, num_workers=2, start_method=method))) == 2
    # Wrapped in a SharedList: nothing to say.
    memory._warned.clear()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(sl.DataLoader(BigMetadata(shared=True), batch_size=4, num_workers=2))) == 2


def test_report_gives_worker_memory_and_flags_growth_epoch_over_epoch(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from tests.datasets import Leaky

    loader = sl.DataLoader(Leaky(8, mib=20), batch_size=2, num_workers=2, persistent_workers=True)
    with caplog.at_level(logging.WARNING, logger="steadyload"):
        for _ in range(3):
            assert len(list(loader)) == 4
    report = loader.report()
    assert len(report.workers) == 2
    for w in report.workers:
        assert w.uss_bytes and w.pss_bytes and w.peak_uss_bytes and len(w.epoch_uss_bytes) == 3
        assert w.epoch_uss_bytes[2] > w.epoch_uss_bytes[0] + (50 << 20)  # 4 x 20 MiB per epoch
    assert "USS per epoch" in str(report)
    grows = [r.getMessage() for r in caplog.records if "grows epoch after epoch" in r.getMessage()]
    assert len(grows) == 2 and "MiB" in grows[0]


def test_dataset_tensors_that_do_not_fit_in_dev_shm_are_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    from steadyload import _system, memory
    from tests.datasets import TensorHeavy

    memory._shm_warned.clear()
    monkeypatch.setattr(_system, "shm_space", lambda path="/dev/shm": _system.Space("/dev/shm", 64 << 20, 1 << 20))
    with pytest.warns(UserWarning, match=r"the dataset holds 8 MiB of tensors, which torch moves to /dev/shm when it sends the dataset to forkserver workers, but /dev/shm has 1 MiB free of 64 MiB\. The workers would die with a bus error \(SIGBUS\)\. Fix: give the container more shared memory"):
        loader = sl.DataLoader(TensorHeavy(), batch_size=2, num_workers=1)
        it = iter(loader)
    del it, loader


def test_batches_in_flight_are_compared_with_available_memory(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from steadyload import _system
    from tests.datasets import MapDS

    monkeypatch.setattr(_system, "available_memory_bytes", lambda: 100)  # 96 bytes in flight
    with caplog.at_level(logging.WARNING, logger="steadyload"):
        assert len(list(sl.DataLoader(MapDS(8), batch_size=2, num_workers=2))) == 4
    (advice,) = [r.getMessage() for r in caplog.records if "in flight" in r.getMessage()]
    assert "x prefetch_factor 2 x 2 workers keep" in advice and "lower prefetch_factor" in advice


def test_soft_fd_limit_is_raised_to_the_hard_one() -> None:
    import resource

    from tests.datasets import MapDS

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert len(list(sl.DataLoader(MapDS(4), batch_size=2, num_workers=1))) == 2
        new_soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert new_soft == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
