"""Deep comparison of batches from two loaders."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    """Assert that two batches are equal in type, structure and values."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a!r} != {b!r}"
        assert torch.equal(a, b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {a.keys()} != {b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_same_batches(got: list[Any], want: list[Any]) -> None:
    """Assert two lists of batches are equal, batch by batch."""
    assert len(got) == len(want), f"{len(got)} batches != {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"batch {i}")
