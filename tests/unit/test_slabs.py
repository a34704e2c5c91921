"""`BatchSlabs`: a slab is lent again only once every view of it is gone, what is kept is
bounded by what was in use at once, and nothing is kept without an open user."""

from __future__ import annotations

import gc

import numpy as np
import torch

from steadyload.host.heap import HeapFit
from steadyload.host.slabs import BatchSlabs

MIB = 1 << 20


class Mallopt:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


class User:
    """A user (a pool of thread workers, in the package)."""


def _slabs() -> tuple[BatchSlabs, Mallopt, User]:
    mallopt = Mallopt()
    slabs, user = BatchSlabs(HeapFit(mallopt)), User()
    slabs.open(user)
    return slabs, mallopt, user


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_a_slab_is_lent_again_once_its_batch_is_gone() -> None:
    slabs, _, _ = _slabs()
    first = slabs.take(2 * MIB)
    address = _address(first)
    del first
    again = slabs.take(2 * MIB)
    assert _address(again) == address and (slabs.made, slabs.lent_again) == (1, 1)


def test_a_slab_is_never_lent_while_any_view_of_it_lives() -> None:
    slabs, _, _ = _slabs()
    storage = torch.from_numpy(slabs.take(2 * MIB)).untyped_storage()
    batch = torch.empty(0, dtype=torch.uint8).set_(storage)
    row = batch[:16]  # a view the training loop keeps after dropping the batch
    del storage, batch
    gc.collect()
    other = slabs.take(2 * MIB)
    assert _address(other) != row.data_ptr() and slabs.made == 2
    address = row.data_ptr()
    del row
    assert _address(slabs.take(2 * MIB)) == address  # the last view gone: back and lent


def test_only_a_slab_of_at_most_a_quarter_more_is_lent_and_a_miss_evicts_one() -> None:
    slabs, _, _ = _slabs()
    big = slabs.take(8 * MIB)
    del big
    assert slabs.free_bytes == 8 * MIB
    small = slabs.take(2 * MIB)  # 8 MiB is too big for it: a new slab, the 8 MiB one goes
    assert small.nbytes == 2 * MIB and slabs.made == 2 and slabs.free_bytes == 0
    del small
    last = slabs.take(2 * MIB - 100)  # the last, shorter batch of an epoch fits
    assert last.nbytes == 2 * MIB - 100 and slabs.lent_again == 1


def test_what_is_kept_is_what_was_in_use_at_once() -> None:
    slabs, _, user = _slabs()
    for _epoch in range(3):
        live = [slabs.take(MIB) for _ in range(4)]
        del live
    assert slabs.made == 4 and slabs.free_bytes == 4 * MIB
    slabs.close(user)


def test_the_last_user_closing_drops_the_free_slabs_and_what_comes_back_later() -> None:
    slabs, _, user = _slabs()
    other = User()
    slabs.open(other)
    kept = slabs.take(MIB)
    slabs.take(MIB)  # dropped at once: free
    slabs.close(user)
    assert slabs.free_bytes == MIB  # another user still runs
    slabs.close(other)
    slabs.close(other)  # again: nothing
    assert slabs.free_bytes == 0
    del kept
    assert slabs.free_bytes == 0
    fresh = slabs.take(MIB)  # closed: fresh memory, nothing counted or kept
    del fresh
    assert slabs.free_bytes == 0 and slabs.made == 2


def test_a_user_gone_without_closing_stops_counting() -> None:
    slabs = BatchSlabs(HeapFit(Mallopt()))
    user = User()
    slabs.open(user)
    slabs.take(MIB)
    assert slabs.free_bytes == MIB
    del user
    gc.collect()
    slabs.take(MIB)
    assert slabs.free_bytes == 0


def test_a_new_slab_fits_the_heap_to_it_and_a_slab_lent_again_does_not() -> None:
    slabs, mallopt, _ = _slabs()
    slabs.take(16 * MIB)
    assert mallopt.calls == [(-3, 20 * MIB), (-1, 40 * MIB)]
    slabs.take(16 * MIB)
    assert len(mallopt.calls) == 2
