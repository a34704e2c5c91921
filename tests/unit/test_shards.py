"""Elastic resume (steadyload/resume/shards.py), in one process: each rank's loader is built with
its own ``DistributedSampler(num_replicas=N, rank=r)``, so N ranks are N loaders here. The
multi-process runs (gloo, torchrun) are in tests/integration/test_elastic.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

import steadyload as sl
from steadyload.resume import shards


class Ids(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(n: int, ranks: int, rank: int, *, batch: int = 4, shuffle: bool = True,
            drop_last: bool = False, seed: int = 3, **kw: Any) -> sl.DataLoader[Any]:  # fmt: skip
    sampler = DistributedSampler(Ids(n), num_replicas=ranks, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)  # fmt: skip
    return sl.DataLoader(Ids(n), batch_size=batch, sampler=sampler, **kw)


def _order(n: int, seed: int = 3, epoch: int = 0, shuffle: bool = True) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _flat(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b]


def _interleave(per_rank: list[list[int]]) -> list[int]:
    """Positions r, r+M, ... back into one order (what the ranks took together)."""
    out = []
    for j in range(max(map(len, per_rank))):
        out += [share[j] for share in per_rank if j < len(share)]
    return out


@pytest.mark.parametrize("n", [16, 17, 23, 5])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_dealing_from_the_start_is_torchs_distributed_sampler(n: int, ranks: int,
                                                             drop_last: bool) -> None:
    order = _order(n)
    for rank in range(ranks):
        torchs = list(DistributedSampler(Ids(n), num_replicas=ranks, rank=rank, seed=3,
                                         drop_last=drop_last))  # fmt: skip
        assert shards._deal(order, 0, ranks, rank, drop_last) == torchs


def _run(n: int, ranks: int, steps: int, **kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Every rank takes ``steps`` batches; rank 0's state, through JSON as a file keeps it."""
    loaders = [_loader(n, ranks, r, **kw) for r in range(ranks)]
    its = [iter(loader) for loader in loaders]
    taken = [_flat([next(it) for _ in range(steps)]) for it in its]
    state = json.loads(json.dumps(loaders[0].state_dict()))
    return taken, state


def _resume(n: int, ranks: int, state: dict[str, Any], **kw: Any) -> list[sl.DataLoader[Any]]:
    loaders = [_loader(n, ranks, r, **kw) for r in range(ranks)]
    for loader in loaders:
        loader.load_state_dict(state)
    return loaders


@pytest.mark.parametrize(("before", "after"), [(4, 2), (4, 3), (2, 4), (3, 3), (1, 2)])
def test_the_rest_of_the_epoch_is_dealt_to_the_new_ranks_each_sample_once(before: int,
                                                                        after: int) -> None:
    n = 48
    taken, state = _run(n, before, steps=2)
    assert state["sharding"]["replicas"] == before
    resumed = _resume(n, after, state)
    rest = [_flat(list(loader)) for loader in resumed]
    consumed = before * 2 * 4
    pad = -(n - consumed) % after  # as DistributedSampler pads: from the order's start
    assert _interleave(rest) == _order(n)[consumed:] + _order(n)[:pad]  # the order's order
    seen = [i for share in taken for i in share] + _interleave(rest)[: n - consumed]
    assert sorted(seen) == list(range(n))  # every sample of the epoch, once
    # later epochs are those of a run on `after` ranks from the start
    for r, loader in enumerate(resumed):
        loader.sampler.set_epoch(1)
        fresh = _loader(n, after, r)
        fresh.sampler.set_epoch(1)
        assert _flat(list(loader)) == _flat(list(fresh))


def test_padding_and_drop_last_deal_as_the_sampler_does() -> None:
    n = 30
    taken, state = _run(n, 4, steps=1)  # 16 consumed
    rest = [_flat(list(loader)) for loader in _resume(n, 3, state)]
    left = _order(n)[16:]  # 14 samples to 3 ranks: padded to 15 from the epoch's start
    assert [len(share) for share in rest] == [5, 5, 5]
    assert _interleave(rest) == left + _order(n)[:1]
    taken, state = _run(n, 4, steps=1, drop_last=True)
    rest = [_flat(list(loader)) for loader in _resume(n, 3, state, drop_last=True)]
    assert _interleave(rest) == _order(n)[16:28]  # cut to 12: every rank the same count


def test_a_state_saved_in_a_redealt_epoch_resumes_again() -> None:
    n = 48
    _, state = _run(n, 4, steps=1)  # 16 consumed
    on_three = _resume(n, 3, state)
    its = [iter(loader) for loader in on_three]
    middle = [_flat([next(it)]) for it in its]  # 12 more
    again = json.loads(json.dumps(on_three[1].state_dict()))  # any rank's
    assert again["sharding"]["offset"] == 16 and again["batches_yielded"] == 1
    rest = [_flat(list(loader)) for loader in _resume(n, 2, again)]
    assert _interleave(middle) == _order(n)[16:28]
    assert _interleave(rest) == _order(n)[28:]


def test_the_same_number_of_ranks_resumes_as_before() -> None:
    n = 40
    taken, state = _run(n, 2, steps=2)
    for r, loader in enumerate(_resume(n, 2, state)):
        whole = _flat(list(_loader(n, 2, r)))
        assert taken[r] + _flat(list(loader)) == whole


@pytest.mark.parametrize(("change", "what"), [
    ({"seed": 4}, "seed=3 \\(now 4\\)"),
    ({"shuffle": False}, "shuffle=True \\(now False\\)"),
    ({"drop_last": True}, "drop_last=False \\(now True\\)"),
])  # fmt: skip
def test_another_sampler_is_refused_with_what_differs(change: dict[str, Any], what: str) -> None:
    _, state = _run(24, 2, steps=1)
    with pytest.raises(ValueError, match=what):
        _loader(24, 3, 0, **change).load_state_dict(state)


def test_a_state_without_sharding_into_a_sharded_loader_is_refused() -> None:
    plain = sl.DataLoader(Ids(24), batch_size=4, shuffle=True)
    it = iter(plain)
    next(it)
    with pytest.raises(ValueError, match="saved with no sharding sampler, this loader has a "
                                         "torch.DistributedSampler over 2 ranks"):  # fmt: skip
        _loader(24, 2, 0).load_state_dict(plain.state_dict())


def test_a_subclass_resumes_only_on_the_same_number_of_ranks() -> None:
    class Mine(DistributedSampler[int]):
        def state_dict(self) -> dict[str, Any]:
            return {"epoch": self.epoch}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.epoch = state["epoch"]

    def loader(ranks: int) -> sl.DataLoader[Any]:
        return sl.DataLoader(Ids(24), batch_size=4,
                             sampler=Mine(Ids(24), num_replicas=ranks, rank=0))  # fmt: skip

    saving = loader(2)
    it = iter(saving)
    next(it)
    state = saving.state_dict()
    loader(2).load_state_dict(state)
    with pytest.raises(ValueError, match="DistributedSampler is a subclass of it"):
        loader(3).load_state_dict(state)


def test_out_of_order_batches_cannot_move_to_other_ranks() -> None:
    _, state = _run(24, 2, steps=1)
    state["yielded_beyond"] = [2]  # as in_order=False leaves it
    with pytest.raises(ValueError, match="in_order=True"):
        _loader(24, 3, 0).load_state_dict(state)


def test_with_workers_the_rest_is_the_same() -> None:
    n = 32
    taken, state = _run(n, 4, steps=1)
    rest = [_flat(list(loader)) for loader in _resume(n, 2, state, num_workers=2)]
    assert _interleave(rest) == _order(n)[16:]


def _accelerate_loader(n: int, ranks: int, rank: int, *, split: bool = False,
                       even: bool = True) -> sl.DataLoader[Any]:  # fmt: skip
    shard_cls = pytest.importorskip("accelerate.data_loader").BatchSamplerShard
    sampler = torch.utils.data.RandomSampler(Ids(n), generator=torch.Generator().manual_seed(9))
    batches = torch.utils.data.BatchSampler(sampler, 4, drop_last=False)
    shard = shard_cls(batches, num_processes=ranks, process_index=rank, split_batches=split,
                      even_batches=even)  # fmt: skip
    return sl.DataLoader(Ids(n), batch_sampler=shard)


def _global_batches(n: int) -> list[list[int]]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(9)).tolist()
    return [order[i:i + 4] for i in range(0, n, 4)]


@pytest.mark.parametrize(("before", "after", "split"), [(2, 1, False), (2, 3, False),
                                                        (4, 2, True)])  # fmt: skip
def test_accelerates_batch_shards_are_dealt_again(before: int, after: int, split: bool) -> None:
    n = 48  # 12 global batches of 4
    loaders = [_accelerate_loader(n, before, r, split=split) for r in range(before)]
    its = [iter(loader) for loader in loaders]
    taken = [[[int(i) for i in next(it)] for _ in range(2)] for it in its]
    state = json.loads(json.dumps(loaders[-1].state_dict()))  # the last rank's serves too
    assert state["sharding"]["kind"] == shards.ACCELERATE
    resumed = [_accelerate_loader(n, after, r, split=split) for r in range(after)]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [[[int(i) for i in b] for b in loader] for loader in resumed]
    used = 2 if split else 2 * before  # global batches consumed
    if split:  # each rank took a slice of each of the 2 global batches
        assert [sorted(sum((t[s] for t in taken), [])) for s in range(2)] == [
            sorted(b) for b in _global_batches(n)[:2]]
        got = [sorted(sum((r[s] for r in rest), [])) for s in range(len(rest[0]))]
        assert got == [sorted(b) for b in _global_batches(n)[used:]]
    else:
        assert [t[s] for s in range(2) for t in taken] == _global_batches(n)[:used]
        dealt = [b for s in range(len(rest[0])) for r in rest if s < len(r) for b in [r[s]]]
        left = _global_batches(n)[used:]
        assert dealt[: len(left)] == left  # each remaining batch once, in order
        assert all(b in _global_batches(n) for b in dealt[len(left):])  # padding: repeats


def test_ranks_resume_in_one_process_whose_loader_has_no_sharding_sampler() -> None:
    n = 48
    _, state = _run(n, 4, steps=1)  # 16 consumed
    one = sl.DataLoader(Ids(n), batch_size=4, shuffle=True)  # as Lightning builds it on 1 device
    one.load_state_dict(state)
    assert _flat(list(one)) == _order(n)[16:]  # the saved sampler's order, from its arguments
    again = json.loads(json.dumps(one.state_dict()))
    assert sorted(_flat(list(one))) == list(range(n))  # then its own sampler's epochs
    assert again["sharding"] is None  # saved between epochs: an ordinary one-process epoch


def test_accelerates_shards_resume_in_one_process() -> None:
    n = 48
    loaders = [_accelerate_loader(n, 2, r) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    for it in its:
        next(it)
    state = loaders[0].state_dict()
    sampler = torch.utils.data.RandomSampler(Ids(n), generator=torch.Generator().manual_seed(9))
    one = sl.DataLoader(Ids(n), batch_sampler=torch.utils.data.BatchSampler(sampler, 4, False))
    one.load_state_dict(state)
    assert [[int(i) for i in b] for b in one] == _global_batches(n)[2:]



def test_a_redealt_epoch_left_early_is_delivered_before_the_next() -> None:
    # A framework counting the resumed epoch in the new world size's len() starts its next
    # epoch early: the new iterator delivers the rest of the re-dealt epoch first.
    n = 48
    _, state = _run(n, 4, steps=1)  # 16 consumed
    resumed = _resume(n, 2, state)
    first = [_flat([next(iter(loader))]) for loader in resumed]  # 8 more, then left
    rest = [_flat(list(loader)) for loader in resumed]  # a new iter(): the rest first
    assert _interleave(first) + _interleave(rest) == _order(n)[16:]
    for r, loader in enumerate(resumed):  # then ordinary epochs
        loader.sampler.set_epoch(1)
        fresh = _loader(n, 2, r)
        fresh.sampler.set_epoch(1)
        assert _flat(list(loader)) == _flat(list(fresh))


def test_a_rank_without_a_state_file_of_its_own_gets_the_lowest_ranks(tmp_path: Any) -> None:
    from steadyload.integrations.accelerate import rank_state

    pattern = "steadyload_loader_0_rank{rank}.pt"
    assert rank_state(str(tmp_path), pattern, 0) is None  # nothing saved
    for rank in (1, 0, 10):
        (tmp_path / pattern.format(rank=rank)).write_bytes(b"")
    (tmp_path / "steadyload_loader_1_rank0.pt").write_bytes(b"")  # another loader's
    assert rank_state(str(tmp_path), pattern, 1) == str(tmp_path / pattern.format(rank=1))
    assert rank_state(str(tmp_path), pattern, 3) == str(tmp_path / pattern.format(rank=0))


def test_without_shuffling_the_rest_is_the_dataset_in_order() -> None:
    n = 40
    _, state = _run(n, 4, steps=1, shuffle=False)  # 16 consumed: samples 0..15
    rest = [_flat(list(loader)) for loader in _resume(n, 3, state, shuffle=False)]
    assert _interleave(rest) == list(range(16, 40))  # 24 to 3 ranks


class Flaky(Ids):
    def __getitem__(self, i: int) -> int:
        if i % 7 == 3:
            raise ValueError(f"sample {i} is corrupt")
        return i


def test_skipped_samples_do_not_shift_what_counts_as_consumed() -> None:
    n = 48
    def loader(ranks: int, rank: int) -> sl.DataLoader[Any]:
        sampler = DistributedSampler(Flaky(n), num_replicas=ranks, rank=rank, seed=3)
        return sl.DataLoader(Flaky(n), batch_size=4, sampler=sampler, on_error="skip")

    saving = [loader(4, r) for r in range(4)]
    for it in [iter(x) for x in saving]:
        next(it)  # batches with corrupt samples left out: still one index batch each
    state = saving[0].state_dict()
    resumed = [loader(2, r) for r in range(2)]
    for x in resumed:
        x.load_state_dict(state)
    rest = [_flat(list(x)) for x in resumed]
    left = _order(n)[16:]  # 4 index batches were consumed, whatever was left out of them
    assert rest == [[i for i in left[r::2] if i % 7 != 3] for r in range(2)]


def test_a_distributed_sampler_inside_a_custom_batch_sampler_stays_on_its_ranks() -> None:
    class Pairs(torch.utils.data.Sampler[list[int]]):
        def __init__(self, sampler: DistributedSampler[int]) -> None:
            self.sampler = sampler

        def __iter__(self) -> Any:
            it = iter(self.sampler)
            return iter(lambda: [next(it), next(it)], None)

        def __len__(self) -> int:
            return len(self.sampler) // 2

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    def loader(ranks: int) -> sl.DataLoader[Any]:
        inner = DistributedSampler(Ids(24), num_replicas=ranks, rank=0)
        return sl.DataLoader(Ids(24), batch_sampler=Pairs(inner))

    saving = loader(2)
    next(iter(saving))
    state = saving.state_dict()
    loader(2).load_state_dict(state)  # the same number of ranks: as before
    with pytest.raises(ValueError, match="sits inside a custom batch sampler"):
        loader(3).load_state_dict(state)


class _Held(torch.utils.data.Sampler[list[int]]):
    """A custom batch sampler holding its DistributedSampler under another name than
    ``.sampler``, one level down (``self._source.order``)."""

    class _Source:
        def __init__(self, order: DistributedSampler[int]) -> None:
            self.order = order

    def __init__(self, sampler: DistributedSampler[int]) -> None:
        self._source = self._Source(sampler)

    def __iter__(self) -> Any:
        it = iter(self._source.order)
        return iter(lambda: [next(it), next(it)], None)

    def __len__(self) -> int:
        return len(self._source.order) // 2

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_distributed_sampler_held_under_any_attribute_is_recognised() -> None:
    """The guide: one held by a custom batch sampler, under any attribute, is refused on
    another number of ranks (it was recognised only as `.sampler` / `.batch_sampler`)."""

    def loader(ranks: int) -> sl.DataLoader[Any]:
        return sl.DataLoader(Ids(24), batch_sampler=_Held(DistributedSampler(
            Ids(24), num_replicas=ranks, rank=0)))  # fmt: skip

    saving = loader(2)
    next(iter(saving))
    state = saving.state_dict()
    loader(2).load_state_dict(state)
    with pytest.raises(ValueError, match="sits inside a custom batch sampler"):
        loader(3).load_state_dict(state)


def test_an_in_order_false_state_without_batches_out_of_order_moves_to_other_ranks() -> None:
    """The guide: what is refused is a state whose rank had yielded batches out of order,
    not every state of an in_order=False loader."""
    n = 32
    saving = [_loader(n, 2, r, in_order=False) for r in range(2)]
    for it in [iter(x) for x in saving]:
        next(it)
    state = saving[0].state_dict()
    assert not state["yielded_beyond"]  # nothing overtook: in lockstep
    resumed = [_loader(n, 3, r) for r in range(3)]
    for x in resumed:
        x.load_state_dict(state)
    rest = [_flat(list(x)) for x in resumed]
    assert sorted(i for r in rest for i in r) == sorted(_order(n)[8:])  # each once
