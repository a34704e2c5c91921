"""What a batch whose every sample was skipped is yielded as (iterators/common.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from steadyload.iterators.common import EmptyBatches


def _no_empty_list(samples: list[object]) -> object:
    if not samples:
        raise IndexError("cannot collate nothing")
    return samples


def test_a_loaded_batch_gives_the_shape_of_the_empty_one() -> None:
    empty = EmptyBatches(_no_empty_list)
    empty.learn({"x": torch.ones(4, 3), "y": torch.arange(4)})
    assert empty.ready
    made = empty.make()
    assert made["x"].shape == (0, 3) and made["y"].shape == (0,) and made["y"].dtype == torch.int64


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("kind", ["object", "nested-tensor"])
def test_a_batch_no_empty_one_can_be_shaped_like_says_how_to_fix_it(kind: str) -> None:
    batch = (  # a nested tensor raises RuntimeError there, not TypeError
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]) if kind == "nested-tensor"
        else object()
    )
    empty = EmptyBatches(_no_empty_list)
    empty.learn(batch)
    assert empty.ready
    with pytest.raises(TypeError, match=r"every sample of a batch was skipped .*\nFix: let your collate_fn accept an empty list"):
        empty.make()


def test_learning_an_unshapeable_batch_leaves_no_reference_cycle() -> None:
    # A stored exception holds its traceback, whose frame holds the iterator: after `del`
    # the workers would live on until the garbage collector ran.
    gc.disable()
    try:
        empty = EmptyBatches(_no_empty_list)
        empty.learn(object())
        gone = weakref.ref(empty)
        del empty
        assert gone() is None
    finally:
        gc.enable()
