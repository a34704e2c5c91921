"""steadyload yields the same batches as torch's DataLoader, over a matrix of settings."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, SequentialSampler, SubsetRandomSampler

import steadyload as sl
from tests.compare import assert_same, assert_same_batches
from tests.datasets import KINDS, GetItemsDS, IterDS, MapDS, collate_sum, collate_views


def both(dataset: Any, seed: int | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """The batches of steadyload and of torch for the same arguments (and generator seed).

    Where torch raises, the raised exception stands for the batches (and must match).
    """
    out: list[Any] = []
    for cls in (sl.DataLoader, torch.utils.data.DataLoader):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        # num_workers=0 draws from this process's global generators: same start for both.
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        try:
            out.append(list(cls(dataset, generator=gen, **kwargs)))
        except Exception as exc:  # compared below: same type and message as torch
            out.append((type(exc), str(exc)))
    return out[0], out[1]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(0, 23),
    batch_size=st.sampled_from([None, 1, 3, 8]),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    num_workers=st.sampled_from([0, 1, 2]),
    seed=st.integers(0, 2**31),
)
def test_map_style_matrix(
    kind: str, n: int, batch_size: int | None, drop_last: bool, shuffle: bool,
    num_workers: int, seed: int,
) -> None:
    if batch_size is None:
        drop_last = False
    got, want = both(
        MapDS(n, kind), seed, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle,
        num_workers=num_workers,
    )
    _check(got, want)


def _check(got: Any, want: Any) -> None:
    if isinstance(want, tuple):
        assert got == want
    else:
        assert_same_batches(got, want)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 30),
    batch_size=st.sampled_from([None, 1, 4]),
    drop_last=st.booleans(),
    num_workers=st.sampled_from([0, 1, 2]),
    shard=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_iterable_matrix(
    n: int, batch_size: int | None, drop_last: bool, num_workers: int, shard: bool, seed: int
) -> None:
    if batch_size is None:
        drop_last = False
    got, want = both(
        IterDS(n, shard=shard), seed, batch_size=batch_size, drop_last=drop_last,
        num_workers=num_workers,
    )
    _check(got, want)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_sampler_batch_sampler_and_collate(num_workers: int) -> None:
    ds = MapDS(20, "tensor")
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampler_a = SubsetRandomSampler(list(range(0, 20, 2)), generator=gen_a)
    sampler_b = SubsetRandomSampler(list(range(0, 20, 2)), generator=gen_b)
    got = list(sl.DataLoader(ds, batch_size=3, sampler=sampler_a, num_workers=num_workers))
    want = list(torch.utils.data.DataLoader(ds, batch_size=3, sampler=sampler_b))
    assert_same_batches(got, want)

    bs = BatchSampler(SequentialSampler(ds), batch_size=4, drop_last=False)
    got = list(sl.DataLoader(ds, batch_sampler=bs, num_workers=num_workers, collate_fn=collate_sum))
    want = list(torch.utils.data.DataLoader(ds, batch_sampler=bs, collate_fn=collate_sum))
    assert_same_batches(got, want)
    assert got[0]["n"] == 4


def test_getitems_is_used_like_torch() -> None:
    got, want = both(GetItemsDS(10), batch_size=4, num_workers=2, collate_fn=list)
    assert_same_batches(got, want)
    assert got[0][0] == ("batched", 0)


def test_random_values_in_workers_match_torch_across_persistent_epochs() -> None:
    ds = MapDS(24, "random")
    kwargs: dict[str, Any] = dict(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    loaders = [
        cls(ds, generator=torch.Generator().manual_seed(11), **kwargs)
        for cls in (sl.DataLoader, torch.utils.data.DataLoader)
    ]
    for _epoch in range(3):
        got, want = (list(loader) for loader in loaders)
        assert_same_batches(got, want)
    # Workers were reused: the random streams continued instead of restarting.
    first = list(sl.DataLoader(ds, generator=torch.Generator().manual_seed(11), **kwargs))
    assert not torch.equal(first[0]["torch"], got[0]["torch"]) or len(got) == 0
    del loaders


def test_in_order_false_yields_the_same_multiset() -> None:
    ds = MapDS(40, "int")
    got = list(sl.DataLoader(ds, batch_size=3, num_workers=2, in_order=False))
    want = list(torch.utils.data.DataLoader(ds, batch_size=3))
    key = lambda b: b.tolist()  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))


def test_tensor_views_and_dtypes_cross_intact() -> None:
    ds = MapDS(6, "int")

    got = list(sl.DataLoader(ds, batch_size=3, num_workers=1, collate_fn=collate_views))
    want = [collate_views(list(range(i, min(i + 3, 6)))) for i in range(0, 6, 3)]
    for g, w in zip(got, want, strict=True):
        w["conj"] = w["conj"].resolve_conj()
        g["conj"] = g["conj"].resolve_conj()
        assert_same(g, w)
