"""load_state_dict checks a state whole before applying any of it (steadyload/resume/validate.py):
a damaged or hand-edited state, or one from another sampler, gets one ValueError naming the
field (or the sampler), and the loader then gives the epoch it would have given without it.
Loading on other ranks, with real ranks: tests/integration/test_world_change.py."""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import steadyload
from tests.compare import assert_same_batches
from tests.datasets import MapDS, StatefulStream

N, BATCH = 40, 4  # 10 batches an epoch


def _loader(shuffle: bool = True, generator: bool = True, workers: int = 0) -> Any:
    return steadyload.DataLoader(
        MapDS(N, "int"), batch_size=BATCH, shuffle=shuffle, num_workers=workers,
        generator=torch.Generator().manual_seed(7) if generator else None,
    )  # fmt: skip


def _state(after: int = 3, **kwargs: Any) -> dict[str, Any]:
    loader = _loader(**kwargs)
    it = iter(loader)
    for _ in range(after):
        next(it)
    state: dict[str, Any] = loader.state_dict()
    return state


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        state[key] = value

    return edit


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.pop(key)


def _rng(text: str) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        state["rng"][next(iter(state["rng"]))] = text

    return edit


TRUNCATED = base64.b64encode(b"\x00" * 100).decode()

# (what was done to the state, the edit, what the error must say: the field and the value)
CORRUPT: list[tuple[str, Callable[[dict[str, Any]], None], tuple[str, ...]]] = [
    ("no samplers", _drop("samplers"), ("'samplers' is missing",)),
    ("no rng", _drop("rng"), ("'rng' is missing",)),
    ("count as text", _set("batches_yielded", "3"), ("'batches_yielded' is '3'", "int >= 0")),
    ("negative count", _set("batches_yielded", -1), ("'batches_yielded' is -1",)),
    ("count past the end", _set("batches_yielded", 11), ("batches_yielded is 11", "at most 10")),
    ("count as bool", _set("finished", "no"), ("'finished' is 'no'", "True or False")),
    ("epoch as float", _set("epoch", 0.5), ("'epoch' is 0.5",)),
    ("beyond below the count", _set("yielded_beyond", [2]), ("yielded_beyond is [2]",)),
    ("beyond past the end", _set("yielded_beyond", [10]), ("yielded_beyond is [10]",)),
    ("seed out of range", _set("base_seed", -5), ("'base_seed' is -5",)),
    ("no seed mid-epoch", _set("base_seed", None), ("'base_seed' is None",)),
    ("garbled rng text", _rng("@@not base64@@"), ("rng[", "'@@not base64@@'", "Error")),
    ("truncated rng", _rng(TRUNCATED), ("rng[", "RuntimeError", "generator state")),
    ("no generator entry", lambda s: s["rng"].pop("generator"), ("no entry for 'generator'",)),
    ("no global entry", lambda s: s["rng"].pop("torch.global"), ("no 'torch.global' entry",)),
    ("sharding garbage", _set("sharding", {"kind": "mine"}), ("sharding['kind'] is 'mine'",)),
    ("world rank too big", lambda s: s["world"].update(rank=3), ("world['rank'] is 3", "expected 0 to 0")),
    ("no world", _drop("world"), ("'world' is missing",)),
    ("order garbage", _set("order", "RandomSampler"), ("'order' is 'RandomSampler'",)),
    ("dataset_states garbage", _set("dataset_states", {"workers": 3}), ("dataset_states['workers'] is 3",)),
    ("workers negative", _set("num_workers", -2), ("'num_workers' is -2",)),
]


@pytest.mark.parametrize(("edit", "said"), [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_a_corrupt_state_gets_one_value_error_and_the_loader_stays_fresh(
    edit: Callable[[dict[str, Any]], None], said: tuple[str, ...]
) -> None:
    state = _state()
    edit(state)
    loader = _loader()
    with pytest.raises(ValueError) as info:
        loader.load_state_dict(state)
    message = str(info.value)
    for part in said:
        assert part in message, message
    assert "\nWhy: " in message and "\nFix: " in message
    assert_same_batches(list(loader), list(_loader()))  # nothing of the bad state applied


def test_a_failed_load_keeps_the_state_loaded_before_it() -> None:
    state = _state(after=4)
    loader = _loader()
    loader.load_state_dict(state)
    with pytest.raises(ValueError, match="batches_yielded"):
        loader.load_state_dict({**state, "batches_yielded": -1})
    whole = list(_loader())
    assert_same_batches(list(loader), whole[4:])


def test_a_state_is_checked_without_being_changed() -> None:
    state = _state()
    kept = copy.deepcopy(state)
    loader = _loader()
    loader.load_state_dict(state)
    assert state == kept
    assert loader.state_dict() == kept  # loaded but not yet iterated: given back unchanged


@pytest.mark.parametrize(("saved", "loaded"), [(True, False), (False, True)])
def test_a_state_from_another_shuffle_is_refused(saved: bool, loaded: bool) -> None:
    state = _state(shuffle=saved)
    loader = _loader(shuffle=loaded)
    with pytest.raises(ValueError, match=r"(?s)RandomSampler.*SequentialSampler|Sequential.*Random"):
        loader.load_state_dict(state)
    assert_same_batches(list(loader), list(_loader(shuffle=loaded)))


def test_a_state_from_a_loader_with_another_generator_is_refused() -> None:
    state = _state(generator=True)
    with pytest.raises(ValueError, match=r"(?s)drew from 'generator', which this loader lacks"):
        _loader(generator=False).load_state_dict(state)
    unseeded = _state(generator=False)
    with pytest.raises(ValueError, match=r"no entry for 'generator'"):
        _loader(generator=True).load_state_dict(unseeded)


def test_a_stream_state_without_its_positions_is_refused(tmp_path: Any) -> None:
    loader = steadyload.DataLoader(StatefulStream(23, -1, str(tmp_path)), batch_size=3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["dataset_states"] = None
    other = steadyload.DataLoader(StatefulStream(23, -1, str(tmp_path)), batch_size=3)
    with pytest.raises(ValueError, match=r"dataset_states is None; expected the stream's"):
        other.load_state_dict(state)


def test_a_state_of_an_earlier_version_loads_with_a_warning() -> None:
    state = _state(after=5)
    state["version"] = 2
    del state["world"], state["order"]
    loader = _loader()
    with pytest.warns(UserWarning, match="version 2"):
        loader.load_state_dict(state)
    assert_same_batches(list(loader), list(_loader())[5:])


def test_state_dict_is_fresh_each_call_and_the_epoch_frame_is_not_shared() -> None:
    loader = _loader(workers=1)
    it = iter(loader)
    next(it)
    first = loader.state_dict()
    first["rng"]["generator"] = "x"
    first["sharding"] = "y"
    first["world"]["size"] = 9
    first["order"].append("z")
    next(it)
    second = loader.state_dict()
    assert second["batches_yielded"] == 2
    assert second["rng"]["generator"] != "x" and second["world"]["size"] == 1
    assert "z" not in second["order"]
    rest = list(it)
    resumed = _loader()
    resumed.load_state_dict(second)
    assert_same_batches(list(resumed), rest)
