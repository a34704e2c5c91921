"""Resume without some samples: ``load_state_dict(state, skip_samples=...)`` (issue #37;
steadyload/resume/skip_samples.py). The batches before the saved position are the run's;
the rest is the epoch's own order without the skipped samples, batched again; states saved
later keep the skip. Elastic (N ranks to M, one process, each rank its own
``DistributedSampler``): the skipped samples leave the shared order before it is dealt, so
over all ranks every other sample is seen once. Nothing here depends on timing."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

import steadyload as sl
from steadyload.resume.skip_samples import Skip
from tests.datasets import IterDS, MapDS

N, BATCH = 42, 4  # 11 batches an epoch, the last of 2


def _loader(workers: int = 0, *, drop_last: bool = False, **kw: Any) -> sl.DataLoader[Any]:
    return sl.DataLoader(
        MapDS(N, "int"), batch_size=BATCH, shuffle=True, num_workers=workers,
        drop_last=drop_last, generator=torch.Generator().manual_seed(7), **kw,
    )  # fmt: skip


def _ints(batches: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


def _epochs(loader: Any, n: int) -> list[list[list[int]]]:
    return [_ints(loader) for _ in range(n)]


def _rebatched(batches: list[list[int]], skip: Any, drop_last: bool = False) -> list[list[int]]:
    """torch's BatchSampler over what is left of ``batches`` without ``skip``."""
    left = [i for b in batches for i in b if i not in set(skip)]
    out = [left[i : i + BATCH] for i in range(0, len(left), BATCH)]
    return out[:-1] if drop_last and out and len(out[-1]) < BATCH else out


def _saved(loader: Any, after: int) -> tuple[list[list[int]], dict[str, Any]]:
    """The first ``after`` batches and the state then, through JSON as a file keeps it."""
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(after)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return taken, state


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_rest_is_the_epoch_without_the_skipped_samples_batched_again(
    workers: int, drop_last: bool
) -> None:
    whole = _epochs(_loader(drop_last=drop_last), 2)
    taken, state = _saved(_loader(workers, drop_last=drop_last), 3)
    assert taken == whole[0][:3]
    skip = whole[0][5] + whole[0][6][:2]  # the samples of the steps after the spike
    resumed = _loader(workers, drop_last=drop_last)
    resumed.load_state_dict(state, skip_samples=iter(skip))  # any iterable
    assert resumed._checkpoints.last_skip == Skip(epoch=0, step=3, samples=frozenset(skip))
    rest = _ints(resumed)
    assert rest == _rebatched(whole[0][3:], skip, drop_last)
    assert _ints(resumed) == whole[1]  # the next epoch is the run's own


def test_skipped_samples_already_loaded_are_warned_about_and_ignored() -> None:
    whole = _ints(_loader())
    _, state = _saved(_loader(), 3)
    consumed = [whole[0][1], whole[2][3]]
    skip = [whole[7][0], *consumed, whole[9][2]]
    resumed = _loader()
    resumed.load_state_dict(state, skip_samples=skip)
    shown = ", ".join(map(str, sorted(consumed)))
    with pytest.warns(UserWarning, match=rf"2 of the 4 skip_samples had already been loaded "
                                         rf"before the saved position \({shown}\)"):  # fmt: skip
        it = iter(resumed)
    assert _ints(it) == _rebatched(whole[3:], skip)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_a_skip_resumes_exactly_and_a_second_skip_composes(
    workers: int,
) -> None:
    whole = _ints(_loader())
    _, state = _saved(_loader(), 3)
    first = whole[4][:2] + whole[8]
    resumed = _loader(workers)
    resumed.load_state_dict(state, skip_samples=first)
    expected = _rebatched(whole[3:], first)  # batches 3, 4, ... of the resumed epoch
    middle, again = _saved(resumed, 2)
    assert middle == expected[:2]
    assert again["batches_yielded"] == 5  # numbering goes on from the saved position
    assert again["skip"] == [{"at": 3, "beyond": [], "samples": sorted(first)}]

    plain = _loader(workers)
    plain.load_state_dict(again)
    assert _ints(plain) == expected[2:]  # the same rest, without the skipped samples

    second = expected[3][1:] + expected[5][:1]
    twice = _loader(workers)
    twice.load_state_dict(again, skip_samples=second)
    it = iter(twice)
    after = [next(it).tolist()]
    third = json.loads(json.dumps(twice.state_dict()))
    assert after + _ints(it) == _rebatched(expected[2:], second)
    assert [s["at"] for s in third["skip"]] == [3, 5]
    last = _loader()
    last.load_state_dict(third)
    assert _ints(last) == _rebatched(expected[2:], second)[1:]


def test_a_state_saved_between_epochs_skips_from_the_next_epochs_start() -> None:
    whole = _epochs(_loader(), 3)
    loader = _loader()
    assert _ints(loader) == whole[0]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["finished"] and state["skip"] == []
    skip = whole[1][0] + whole[1][10]
    resumed = _loader()
    resumed.load_state_dict(state, skip_samples=skip)
    assert resumed._checkpoints.last_skip == Skip(epoch=1, step=0, samples=frozenset(skip))
    pending = resumed.state_dict()  # loaded, not yet iterated: the state with its skip
    assert pending["skip"] == [{"at": 0, "beyond": [], "samples": sorted(skip)}]
    twin = _loader()
    twin.load_state_dict(pending)
    assert _ints(resumed) == _ints(twin) == _rebatched(whole[1], skip)
    assert _ints(resumed) == whole[2]  # one epoch only
    assert resumed.state_dict()["skip"] == []


def test_out_of_order_batches_yielded_before_the_state_are_not_repeated() -> None:
    whole = _ints(_loader())
    _, state = _saved(_loader(), 3)
    state["yielded_beyond"] = [5]  # in_order=False had yielded batch 5 early
    skip = whole[7][:2]
    resumed = _loader()
    resumed.load_state_dict(state, skip_samples=skip)
    saved = resumed.state_dict()
    assert saved["yielded_beyond"] == [] and saved["skip"][0]["beyond"] == [5]
    expected = _rebatched(whole[3:5] + whole[6:], skip)
    assert _ints(resumed) == expected
    again = _loader()
    again.load_state_dict(saved)
    assert _ints(again) == expected


def test_without_batching_the_skipped_indices_are_dropped() -> None:
    def make() -> sl.DataLoader[Any]:
        return sl.DataLoader(MapDS(N, "int"), batch_size=None, shuffle=True,
                             generator=torch.Generator().manual_seed(7))  # fmt: skip

    whole = list(make())
    loader = make()
    it = iter(loader)
    assert [next(it) for _ in range(5)] == whole[:5]
    resumed = make()
    resumed.load_state_dict(loader.state_dict(), skip_samples=whole[9:12])
    assert list(resumed) == whole[5:9] + whole[12:]


def test_a_custom_batch_sampler_keeps_its_batches_minus_the_skipped_indices() -> None:
    batches = [[0, 1, 2], [3, 4], [5, 6, 7], [8], [9, 10, 11]]

    def make() -> sl.DataLoader[Any]:
        return sl.DataLoader(MapDS(12, "int"), batch_sampler=batches)

    loader = make()
    it = iter(loader)
    next(it)
    resumed = make()
    resumed.load_state_dict(loader.state_dict(), skip_samples=[4, 8, 10])
    assert _ints(resumed) == [[3], [5, 6, 7], [9, 11]]  # not batched again; emptied: dropped


def _state_with_a_sampler(sampler: Any) -> dict[str, Any]:
    loader = sl.DataLoader(MapDS(N, "int"), batch_size=BATCH, sampler=sampler)
    return _saved(loader, 1)[1]


class _Dealer(DistributedSampler[int]):
    """A DistributedSampler subclass: steadyload cannot know how it deals."""

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]


BAD: list[tuple[str, Any, str]] = [
    ("a number", 5, r"an iterable of dataset indices \(ints\), got 5 \(int\)"),
    ("a string", "12", r"got '12' \(str\)"),
    ("text inside", [1, "2"], r"holds '2' \(str\)"),
    ("a bool", [3, True], r"holds True \(bool\)"),
    ("a float", [1.5], r"holds 1.5 \(float\)"),
    ("negative", [-1], rf"holds -1, which is not an index of this .* \(0 to {N - 1}\)"),
    ("past the end", [N], rf"holds {N}, which"),
]


@pytest.mark.parametrize(("skip", "said"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_skip_samples_are_refused_before_anything_is_applied(skip: Any, said: str) -> None:
    whole = _ints(_loader())
    _, state = _saved(_loader(), 3)
    loader = _loader()
    loader.load_state_dict(state)  # a state loaded before stays loaded
    with pytest.raises(ValueError, match=said) as info:
        loader.load_state_dict({**state, "batches_yielded": 4}, skip_samples=skip)
    assert "\nWhy: " in str(info.value) and "\nFix: " in str(info.value)
    assert loader._checkpoints.last_skip is None
    assert _ints(loader) == whole[3:]


def test_an_iterable_dataset_refuses_skip_samples() -> None:
    loader = sl.DataLoader(IterDS(20), batch_size=4)
    state = loader.state_dict()  # between epochs: a stream without a state loads anywhere
    with pytest.raises(ValueError, match=r"needs a map-style dataset.*IterDS.*IterableDataset"):
        sl.DataLoader(IterDS(20), batch_size=4).load_state_dict(state, skip_samples=[1])


def test_a_sampler_steadyload_cannot_deal_again_refuses_skip_samples() -> None:
    state = _state_with_a_sampler(_Dealer(MapDS(N, "int"), num_replicas=2, rank=0, seed=3))
    loader = sl.DataLoader(MapDS(N, "int"), batch_size=BATCH,
                           sampler=_Dealer(MapDS(N, "int"), num_replicas=2, rank=0, seed=3))  # fmt: skip
    with pytest.raises(ValueError, match="DistributedSampler subclass"):
        loader.load_state_dict(state, skip_samples=[1])
    loader.load_state_dict(state)  # without a skip it resumes as before


def test_out_of_order_batches_on_ranks_refuse_skip_samples() -> None:
    _, state = _ranks_run(24, 2, steps=1)
    state["yielded_beyond"] = [2]  # as in_order=False leaves it
    with pytest.raises(ValueError, match=r"resumed with skip_samples.*out of order"):
        _rank(24, 2, 0).load_state_dict(state, skip_samples=[1])
    _rank(24, 2, 0).load_state_dict(state)  # on the same ranks without a skip: as before


CORRUPT: list[tuple[str, Any, str]] = [
    ("not a list", {"at": 0}, r"'skip' is \{'at': 0\}"),
    ("unsorted", [{"at": 1, "beyond": [], "samples": [5, 2]}], r"skip\[0\]\['samples'\]"),
    ("outside", [{"at": 1, "beyond": [], "samples": [N]}], rf"ints >= 0 below {N}"),
    ("past the count", [{"at": 4, "beyond": [], "samples": [1]}], r"at most batches_yielded \(3\)"),
    (
        "out of order",
        [{"at": 2, "beyond": [], "samples": [1]}, {"at": 1, "beyond": [], "samples": [2]}],
        r"an int >= 2",
    ),
]


@pytest.mark.parametrize(("skip", "said"), [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_a_damaged_skip_record_is_refused(skip: Any, said: str) -> None:
    _, state = _saved(_loader(), 3)
    with pytest.raises(ValueError, match=said):
        _loader().load_state_dict({**state, "skip": skip})


def test_a_version_2_state_without_skip_loads_with_one() -> None:
    whole = _ints(_loader())
    _, state = _saved(_loader(), 3)
    state["version"] = 2
    del state["world"], state["order"], state["skip"]
    resumed = _loader()
    with pytest.warns(UserWarning, match="version 2"):
        resumed.load_state_dict(state, skip_samples=whole[4])
    assert _ints(resumed) == _rebatched(whole[3:], whole[4])


# -- ranks: one process, each rank's loader with its own DistributedSampler -----------------


def _rank(n: int, ranks: int, rank: int, workers: int = 0) -> sl.DataLoader[Any]:
    sampler = DistributedSampler(MapDS(n, "int"), num_replicas=ranks, rank=rank, seed=3)
    return sl.DataLoader(MapDS(n, "int"), batch_size=2, sampler=sampler, num_workers=workers)


def _order(n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()


def _flat(batches: Any) -> list[int]:
    return [int(i) for b in batches for i in b]


def _interleave(per_rank: list[list[int]]) -> list[int]:
    """Positions r, r+M, ... back into one order (what the ranks took together)."""
    out = []
    for j in range(max(map(len, per_rank))):
        out += [share[j] for share in per_rank if j < len(share)]
    return out


def _ranks_run(n: int, ranks: int, steps: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Every rank takes ``steps`` batches; rank 0's state."""
    loaders = [_rank(n, ranks, r) for r in range(ranks)]
    its = [iter(loader) for loader in loaders]
    taken = [_flat([next(it) for _ in range(steps)]) for it in its]
    return taken, json.loads(json.dumps(loaders[0].state_dict()))


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_resumed_on_three_see_every_other_sample_once(workers: int) -> None:
    n = 30
    taken, state = _ranks_run(n, 2, steps=3)  # 12 consumed
    order = _order(n)
    assert _interleave(taken) == order[:12]
    skip = [order[13], order[20], order[29]]  # 15 left: 5 to each of 3 ranks, no padding
    resumed = [_rank(n, 3, r, workers) for r in range(3)]
    for loader in resumed:
        loader.load_state_dict(state, skip_samples=skip)
    rest = [_flat(loader) for loader in resumed]
    assert [len(share) for share in rest] == [5, 5, 5]  # as many batches on every rank
    assert _interleave(rest) == [i for i in order[12:] if i not in skip]
    seen = sum(taken, []) + sum(rest, [])
    assert sorted(seen) == sorted(set(range(n)) - set(skip))  # every other sample once


def test_on_the_same_ranks_the_rest_is_dealt_again_so_they_stay_in_lockstep() -> None:
    n = 32
    taken, state = _ranks_run(n, 2, steps=2)  # 8 consumed
    order = _order(n)
    skip = order[8::2][:4]  # all four from rank 0's share
    resumed = [_rank(n, 2, r) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state, skip_samples=skip)
    its = [iter(loader) for loader in resumed]
    middle = [_flat([next(it)]) for it in its]
    again = json.loads(json.dumps(resumed[1].state_dict()))  # any rank's
    rest = [_flat(it) for it in its]
    assert [len(m) + len(r) for m, r in zip(middle, rest, strict=True)] == [10, 10]
    left = [i for i in order[8:] if i not in skip]
    assert _interleave([m + r for m, r in zip(middle, rest, strict=True)]) == left

    later = [_rank(n, 3, r) for r in range(3)]  # saved in the re-dealt epoch, on 3 ranks
    for loader in later:
        loader.load_state_dict(again, skip_samples=[left[-1]])
    last = [_flat(loader) for loader in later]
    assert _interleave(last) == left[4:-1]
    seen = sum(taken, []) + sum(middle, []) + sum(last, [])
    assert sorted(seen) == sorted(set(range(n)) - set(skip) - {left[-1]})


def test_a_between_epochs_state_on_ranks_deals_the_next_epoch_without_the_samples() -> None:
    n = 24
    loaders = [_rank(n, 2, r) for r in range(2)]
    for loader in loaders:
        list(loader)
    state = loaders[0].state_dict()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(4)).tolist()  # epoch 1
    skip = order[:6:2]  # the first three of rank 0's
    resumed = [_rank(n, 2, r) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state, skip_samples=skip)
        loader.sampler.set_epoch(1)
    rest = [_flat(loader) for loader in resumed]
    assert [len(r) for r in rest] == [11, 11]  # 21 padded to 22 from the order's start
    assert _interleave(rest) == [i for i in order if i not in skip] + [order[1]]


def test_accelerates_batch_shards_are_batched_again_then_dealt() -> None:
    shard_cls = pytest.importorskip("accelerate.data_loader").BatchSamplerShard
    n = 48  # 12 global batches of 4

    def make(ranks: int, rank: int) -> sl.DataLoader[Any]:
        sampler = RandomSampler(MapDS(n, "int"), generator=torch.Generator().manual_seed(9))
        shard = shard_cls(BatchSampler(sampler, 4, drop_last=False), num_processes=ranks,
                          process_index=rank)  # fmt: skip
        return sl.DataLoader(MapDS(n, "int"), batch_sampler=shard)

    order = torch.randperm(n, generator=torch.Generator().manual_seed(9)).tolist()
    loaders = [make(2, r) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    for it in its:
        next(it)  # 2 global batches consumed
    state = json.loads(json.dumps(loaders[0].state_dict()))
    skip = order[8:14] + order[15:17]  # 32 left: 8 batches, 4 to each rank
    resumed = [make(2, r) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state, skip_samples=skip)
    rest = [[b.tolist() for b in loader] for loader in resumed]
    dealt = [b for s in range(len(rest[0])) for r in rest if s < len(r) for b in [r[s]]]
    left = order[14:15] + order[17:]
    assert dealt == [left[i : i + 4] for i in range(0, len(left), 4)]


def test_ranks_without_a_sharding_sampler_are_warned_they_may_fall_out_of_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from steadyload.resume import shards

    monkeypatch.setattr(shards, "world", lambda: {"size": 2, "rank": 0})  # saved and loaded
    whole = _ints(_loader())
    _, state = _saved(_loader(), 3)
    resumed = _loader()
    with pytest.warns(UserWarning, match=r"run of 2 ranks: each rank leaves the samples out"):
        resumed.load_state_dict(state, skip_samples=whole[5])
    assert _ints(resumed) == _rebatched(whole[3:], whole[5])


def test_no_warning_without_skip_samples() -> None:
    _, state = _saved(_loader(), 3)
    resumed = _loader()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(state, skip_samples=None)
        list(resumed)
    assert resumed._checkpoints.last_skip is None
