"""What kept tensors cost, and aliasing, through real workers (issue 13 items 1, 10, 2).

Memory held is read from the kernel: the blocks allocated to the memfd segments this
process still has open (every mapping holds a descriptor), after the workers are gone.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

import steadyload as sl
from steadyload.engine.transport import segments as transport
from tests.adversarial import (
    Aliased,
    ImageAndRaw,
    LabelledImages,
    Rows,
    as_list,
    collate_with_views,
    low_fd_limit,
)

pytestmark = pytest.mark.skipif(not transport.HAVE_MEMFD, reason="memfd is Linux-only")

MIB = 1 << 20
IMAGE = 3 * 224 * 224 * 4


def segment_bytes() -> int:
    """Bytes of memory the batch segments open in this process hold (shared pages)."""
    seen, total = set(), 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:steadyload-w"):
                continue
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


def in_shared_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s data lies in a mapping of a batch segment (no copy was made here)."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, _, rest = line.partition(" ")
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return "memfd:steadyload-w" in rest
    return False


def maps_of(it: Any) -> list[transport.SegmentMap]:
    return [h.segments for h in it._pool._handles if h is not None]


def test_kept_labels_cost_their_own_bytes_and_dropped_batches_stay_zero_copy() -> None:
    before = segment_bytes()
    loader = sl.DataLoader(LabelledImages(32 * 40), batch_size=32, num_workers=2)
    labels, mapped, punched = [], 0, 0
    it = iter(loader)
    for step, (images, y) in enumerate(it):
        assert images.shape == (32, 3, 224, 224)
        if step < 4 or step % 10 == 0:
            assert in_shared_memory(images), "a collated batch is a view of shared memory"
        labels.append(y)
        maps = maps_of(it)
        mapped = max(mapped, sum(len(m._maps) for m in maps))
        punched += sum(m.punched for m in maps)
    del images, y, it
    gc.collect()
    assert torch.equal(torch.cat(labels), torch.arange(32 * 40))
    assert punched == 0, "whole batches were dropped: no page may be returned early"
    assert mapped <= 2 * 6, f"the pool grew to {mapped} segments for 2 workers"
    held = segment_bytes() - before
    # torch holds the labels' own bytes (40 x 256 B) and no shared image memory.
    assert held <= 64 << 10, f"kept labels hold {held / MIB:.1f} MiB of shared memory"
    assert all(y.untyped_storage().nbytes() == 32 * 8 for y in labels)


def test_a_kept_tensor_costs_its_own_bytes_not_its_neighbours() -> None:
    before = segment_bytes()
    loader = sl.DataLoader(ImageAndRaw(8 * 20), batch_size=8, num_workers=2)
    kept = [batch["image"] for batch in loader]  # each batch's 19 MB "raw" is dropped
    gc.collect()
    held = segment_bytes() - before
    own = 20 * 8 * IMAGE  # 4.8 MB per batch; with its neighbour 24 MB per batch
    assert held <= own * 1.05 + 20 * (16 << 10), (
        f"20 kept images hold {held / MIB:.1f} MiB; their own bytes are {own / MIB:.1f} MiB"
    )
    assert all(torch.equal(t[:, 0, 0, 0], torch.arange(8.0) + 8 * i) for i, t in enumerate(kept))
    del kept
    gc.collect()
    assert segment_bytes() - before <= 0, "dropping the kept tensors returns their memory"


@pytest.mark.parametrize("size", [8, 1 << 18], ids=["inline", "shared-memory"])
def test_aliases_arrive_as_one_storage(size: int) -> None:
    loader = sl.DataLoader(Aliased(4, size), batch_size=2, num_workers=2, collate_fn=as_list)
    for batch in loader:
        for sample in batch:
            a, b, view = sample["a"], sample["b"], sample["view"]
            assert a is b and view.storage_offset() == 2
            assert view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
            a[2] = -1.0
            assert view[0].item() == -1.0, "the view sees a write through its base"


def test_views_of_one_big_storage() -> None:
    # Adjacent rows of one storage share one copy of just those rows (torch would map
    # the whole 16 MiB storage for each).
    loader = sl.DataLoader(Rows(), batch_size=2, num_workers=2, collate_fn=as_list)
    for i, (first, second) in enumerate(loader):
        assert first[0].item() == 2 * i and second[0].item() == 2 * i + 1
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        assert first.untyped_storage().nbytes() == 2 << 18
    # Views of a collated batch (already in shared memory) keep its storage and offsets.
    x, rows, xt = next(iter(sl.DataLoader(
        Rows(), batch_size=4, num_workers=2, collate_fn=collate_with_views
    )))  # fmt: skip
    assert rows.storage_offset() == 1 << 16 and in_shared_memory(x)
    assert rows.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x[1, 0] = -1.0
    assert rows[0, 0].item() == -1.0 and xt[0, 1].item() == -1.0


def test_worker_out_of_descriptors_raises_torchs_words() -> None:
    loader = sl.DataLoader(LabelledImages(64), batch_size=32, num_workers=1,
                           worker_init_fn=low_fd_limit)
    with pytest.raises(sl.SharedMemoryError, match="ulimit -n") as raised:
        next(iter(loader))
    assert isinstance(raised.value, RuntimeError) and raised.value.where == "worker"
    assert "set_sharing_strategy" in str(raised.value)


def test_worker_descriptors_stay_bounded_whatever_is_kept() -> None:
    loader = sl.DataLoader(Rows(), batch_size=1, num_workers=1)  # 256 KiB batches
    it = iter(loader)
    kept = [next(it)]
    pid = it._pool._handles[0].pid

    def worker_segments() -> int:
        count = 0
        for n in os.listdir(f"/proc/{pid}/fd"):
            try:  # the worker opens and closes descriptors meanwhile
                count += os.readlink(f"/proc/{pid}/fd/{n}").startswith("/memfd:steadyload-w")
            except OSError:
                pass
        return count

    most = 0
    for _ in range(56):  # the worker is still running: 64 batches, prefetch 2
        kept.append(next(it))
        most = max(most, worker_segments())
    kept += list(it)
    assert [int(t[0, 0].item()) for t in kept] == list(range(64))
    assert 0 < most <= 24, f"the worker kept up to {most} segments open"
    del it, kept
