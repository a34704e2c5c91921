"""Invalid arguments raise what torch raises, word for word; steadyload's own are checked too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import SequentialSampler

import steadyload as sl
from tests.datasets import IterDS, MapDS

BAD: list[dict[str, Any]] = [
    dict(num_workers=-1),
    dict(timeout=-1),
    dict(prefetch_factor=2),
    dict(num_workers=1, prefetch_factor=-1),
    dict(persistent_workers=True),
    dict(sampler=SequentialSampler(range(4)), shuffle=True),
    dict(batch_sampler=[[0, 1]], batch_size=2),
    dict(batch_sampler=[[0, 1]], drop_last=True),
    dict(batch_size=None, drop_last=True),
    dict(num_workers=1, multiprocessing_context="threads"),
    dict(num_workers=1, multiprocessing_context=42),
    dict(multiprocessing_context="spawn"),
]


def _error(cls: type, dataset: Any, kwargs: dict[str, Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        cls(dataset, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("kwargs", BAD, ids=[",".join(k) for k in BAD])
def test_same_error_as_torch(kwargs: dict[str, Any]) -> None:
    ours = _error(sl.DataLoader, MapDS(4), kwargs)
    assert ours == _error(torch.utils.data.DataLoader, MapDS(4), kwargs)
    assert ours[0] in (ValueError, TypeError)


@pytest.mark.parametrize("kwargs", [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])])
def test_iterable_dataset_errors_match_torch(kwargs: dict[str, Any]) -> None:
    assert _error(sl.DataLoader, IterDS(4), kwargs) == _error(torch.utils.data.DataLoader, IterDS(4), kwargs)


def test_attributes_are_frozen_like_torch() -> None:
    loader = sl.DataLoader(MapDS(4))
    with pytest.raises(ValueError, match="batch_size attribute should not be set after DataLoader is initialized"):
        loader.batch_size = 3


def test_unknown_start_method() -> None:
    with pytest.raises(ValueError, match=r"start_method must be one of 'auto', 'fork', 'spawn', 'forkserver', 'zygote', got 'thread'"):
        sl.DataLoader(MapDS(4), num_workers=1, start_method="thread")
