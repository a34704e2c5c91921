"""The pinned pool (steadyload/device/pinned.py): capped, reused oldest first, and never
handing out a buffer whose copy's event is not done (a fake device's events)."""

from __future__ import annotations

import torch

from steadyload.device.pinned import GRAIN, PinnedPool, pack, packed_size
from tests.device_fakes import LazyDevice

MIB = 1 << 20


def test_a_buffer_comes_back_only_once_its_copys_event_is_done_oldest_first() -> None:
    device = LazyDevice()
    pool = PinnedPool(device, cap_bytes=4 * MIB)
    a, b = pool.take(MIB), pool.take(MIB)
    first, second = device.record(), device.record()
    pool.give_back(a, first)
    pool.give_back(b, second)
    c = pool.take(MIB)  # neither copy is done: a new buffer, not a or b
    assert c is not a and c is not b and pool.figures.allocations == 3
    device.complete(second)  # the stream ran past both events (they run in order)
    assert pool.take(MIB) is a and pool.take(MIB) is b  # oldest first
    assert pool.figures.reuses == 2 and device.synchronized == 0


def test_at_the_cap_a_take_waits_for_the_oldest_copy_instead_of_pinning_more() -> None:
    device = LazyDevice()
    pool = PinnedPool(device, cap_bytes=2 * MIB)
    a, b = pool.take(10), pool.take(10)
    pool.give_back(a, device.record())
    pool.give_back(b, device.record())
    again = pool.take(10)
    assert again is a  # waited for a's copy (synchronized), not a third buffer
    f = pool.figures
    assert (f.allocations, f.waits, f.held_bytes, f.peak_bytes) == (2, 1, 2 * MIB, 2 * MIB)
    assert device.synchronized == 1


def test_buffers_too_small_make_room_and_a_batch_over_the_cap_is_unpinned() -> None:
    device = LazyDevice()
    pool = PinnedPool(device, cap_bytes=3 * MIB)
    small = pool.take(MIB)
    pool.give_back(small, device.record())
    device.flush()
    big = pool.take(3 * MIB)  # the free 1 MiB buffer is dropped to stay within the cap
    assert big is not None and big.numel() == 3 * MIB and pool.figures.buffers == 1
    assert pool.take(3 * MIB + 1) is None and pool.figures.unpinned == 1
    snapshot = pool.snapshot()
    assert (snapshot.held_bytes, snapshot.allocations) == (3 * MIB, 2)
    pool.close()
    assert pool.figures.held_bytes == 0


def test_pack_places_each_tensor_aligned_and_keeps_its_values() -> None:
    tensors = [torch.arange(5, dtype=torch.int16), torch.ones(2, 3, dtype=torch.float64),
               torch.zeros(0), torch.tensor([True, False])]  # fmt: skip
    sizes = [t.numel() * t.element_size() for t in tensors]
    need = packed_size(sizes)
    assert need % 512 == 0 and need >= sum(sizes) and need <= GRAIN
    buffer = torch.empty(need, dtype=torch.uint8)
    views = pack(tensors, buffer)
    for t, v in zip(tensors, views, strict=True):
        assert v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
    assert views[1].data_ptr() - buffer.data_ptr() == 512  # after the first, aligned
