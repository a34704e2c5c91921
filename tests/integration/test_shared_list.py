"""SharedList / SharedDict: one copy of the metadata in shared memory for every worker."""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import steadyload as sl
from steadyload.memory import layout as _records
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


def _same(got: Any, want: Any) -> bool:
    """Equal, of the same types all the way down (1 is not True nor 1.0), -0.0 and NaN too."""
    if type(got) is not type(want):
        return False
    if isinstance(want, float):
        return (math.isnan(got) and math.isnan(want)) or (
            got == want and math.copysign(1, got) == math.copysign(1, want))
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, dict):
        return _same(list(got), list(want)) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, (set, frozenset)):
        return got == want and {type(x) for x in got} == {type(x) for x in want}
    if isinstance(want, np.ndarray):
        return want.dtype == got.dtype and np.array_equal(got, want)
    return bool(got == want)


_SCALARS: list[st.SearchStrategy[Any]] = [
    st.integers(-(1 << 7), (1 << 7) - 1), st.integers(-(1 << 31), 1 << 31),
    st.integers(-(1 << 63), (1 << 63) - 1), st.integers(), st.floats(), st.booleans(),
    st.none(), st.text(), st.binary(),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),  # surrogates
]
_ANY_SCALAR = st.one_of(*_SCALARS)
_NESTED = st.recursive(
    _ANY_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.frozensets(st.integers(), max_size=3),
        st.builds(np.array, st.lists(st.integers(-9, 9), max_size=3)),  # pickled
    ),
    max_leaves=6,
)
_COLUMN = st.sampled_from([*_SCALARS, _ANY_SCALAR, _NESTED])  # a field's values


@st.composite
def _records_of_one_shape(draw: st.DrawFn) -> list[Any]:
    """Lists that hit every layout: values, same-key dicts, same-length tuples, mixed."""
    n = draw(st.integers(0, 12))
    shape = draw(st.sampled_from(["value", "dict", "tuple", "mixed"]))
    if shape == "value":
        return draw(st.lists(draw(_COLUMN), min_size=n, max_size=n))
    if shape == "mixed":
        return draw(st.lists(_NESTED, min_size=n, max_size=n))
    width = draw(st.integers(1, 4))
    columns = [draw(st.lists(draw(_COLUMN), min_size=n, max_size=n)) for _ in range(width)]
    if shape == "tuple":
        return [tuple(c[j] for c in columns) for j in range(n)]
    keys = draw(st.lists(st.text(max_size=4) | st.integers() | st.booleans(), min_size=width,
                         max_size=width, unique_by=lambda k: (type(k), k)))
    return [dict(zip(keys, (c[j] for c in columns), strict=True)) for j in range(n)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=_records_of_one_shape(), data=st.data())
def test_any_records_round_trip_with_their_types(records: list[Any], data: st.DataObject) -> None:
    shared = sl.SharedList(records)
    assert isinstance(shared, sl.SharedList) and len(shared) == len(records)
    assert _same(list(shared), records)
    if records:
        i = data.draw(st.integers(-len(records), len(records) - 1), label="index")
        assert _same(shared[i], records[i])
    window = data.draw(st.slices(len(records) + 2), label="slice")
    assert _same(shared[window], records[window])
    assert _same(list(pickle.loads(pickle.dumps(shared))), records)


@pytest.mark.parametrize(("records", "shape", "codes"), [
    ([{"file": "a.jpg", "label": 3, "w": 640.0}] * 3, "dict", "sbd"),
    ([("a", 1 << 40, True, None, b"x")] * 2, "tuple", "sq?Ny"),
    ([{"a": 1}, {"b": 1}], "value", "m"),  # different keys: whole records
    ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], "value", "m"),  # same keys, another order
    ([{"box": [1, 2]}, {"box": [3]}], "dict", "m"),  # only that field with marshal
    ([{"x": 1}, {"x": "1"}], "dict", "m"),  # one field of two types
    ([1 << 64, 1], "value", "m"),  # past int64
    ([1, True], "value", "m"),  # bool is not int
    ([np.arange(2), "x"], "value", "o"),  # marshal would give bytes back: pickled
    (["a", "\udcff"], "value", "S"),  # lone surrogates
    ([], "value", "o"),
])
def test_layout_is_by_field_where_records_are_uniform(records: list[Any], shape: str, codes: str) -> None:
    layout, _ = _records.plan(records)
    assert (layout.shape, layout.codes) == (shape, codes)
    assert _same(list(sl.SharedList(records)), records)


def test_bad_index_types_say_what_was_given() -> None:
    shared = sl.SharedList([{"a": 1}])
    with pytest.raises(TypeError, match="SharedList indices must be integers or slices, not float"):
        shared[1.0]  # type: ignore[call-overload]  # the wrong type is the point
    assert shared[False] == {"a": 1} and shared[np.int32(-1)] == {"a": 1}
    with pytest.raises(IndexError, match=r"SharedList index -2 out of range \(len 1\)"):
        shared[-2]


ROWS_OF_EACH_LAYOUT = {
    "dicts": [{"file": f"{i}.jpg", "label": i % 3, "w": i / 2, "ok": i % 2 == 0, "x": None}
              for i in range(20)],
    "tuples": [(f"{i}.jpg", i, b"\x00" * i) for i in range(20)],
    "mixed": [i if i % 3 else {"i": [i, str(i)]} for i in range(20)],
    "floats": [i / 7 for i in range(20)],
}


@pytest.mark.parametrize(("method", "kind"), [
    *(("forkserver", kind) for kind in ROWS_OF_EACH_LAYOUT), ("spawn", "dicts"),
])
def test_each_layout_is_read_the_same_in_workers(method: str, kind: str) -> None:
    # The workers rebuild each layout's reader from the segment's header, not from a cache.
    rows = ROWS_OF_EACH_LAYOUT[kind]
    loader = sl.DataLoader(SharedRows(rows), batch_size=5, num_workers=2, start_method=method,
                           collate_fn=list)
    got = [sample["row"] for batch in loader for sample in batch]
    assert _same(got, rows)


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
    from steadyload.memory import advice as memory
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
    from steadyload.host import system
    from steadyload.memory import advice as memory
    from tests.datasets import TensorHeavy

    memory._shm_warned.clear()
    monkeypatch.setattr(system, "shm_space", lambda path="/dev/shm": system.Space("/dev/shm", 64 << 20, 1 << 20))
    with pytest.warns(UserWarning, match=r"the dataset holds 8 MiB of tensors, which torch moves to /dev/shm when it sends the dataset to zygote workers, but /dev/shm has 1 MiB free of 64 MiB\. The workers would die with a bus error \(SIGBUS\)\. Fix: give the container more shared memory"):
        loader = sl.DataLoader(TensorHeavy(), batch_size=2, num_workers=1)
        it = iter(loader)
    del it, loader


def test_batches_in_flight_are_compared_with_available_memory(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from steadyload.host import system
    from tests.datasets import MapDS

    monkeypatch.setattr(system, "available_memory_bytes", lambda: 100)  # 96 bytes in flight
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
