"""Shared-memory transport, both ends in one process over a socketpair (no workers)."""

from __future__ import annotations

import errno
import gc
import os
import pickle
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils import worker as torch_worker

import steadyload
from steadyload.engine.protocol import NewSegment
from steadyload.engine.transport import arena as arena_module
from steadyload.engine.transport import channel, storage_table
from steadyload.engine.transport import segments as transport
from steadyload.engine.transport.segments import Arena, SegmentMap
from steadyload.engine.worker import torch_hooks

pytestmark = pytest.mark.skipif(not transport.HAVE_MEMFD, reason="memfd is Linux-only")

MIB = 1 << 20


class Pair:
    """A worker-side arena and a parent-side segment map joined by a socketpair."""

    def __init__(self) -> None:
        self.arena = Arena(worker_id=0)
        self.segments = SegmentMap()
        self.worker_sock, self.parent_sock = socket.socketpair()
        self.reader = channel.Reader(self.parent_sock)
        self.last_payload = b""

    def ship(self, make_batch: Any) -> tuple[Any, tuple[int, ...], int]:
        """Run one task: returns (rebuilt batch, its segment ids, new segments sent)."""
        self.arena.begin_task()
        body = self.arena.pack(make_batch())
        used, new, retired = self.arena.end_task(sent=True)
        payload = self.last_payload = self.arena.seal(body)
        if new:
            channel.send(self.worker_sock, "segments", transport.announce(new))
            transport.announced(new)
            assert self.reader.read() == ["segments"]
            self.segments.receive(
                tuple(NewSegment(s.segment_id, s.nbytes) for s in new),
                self.reader.take_fds(len(new)),
            )
        self.segments.retire(retired)
        return self.segments.unpack(payload, used), used, len(new)

    def hand_back(self) -> tuple[int, ...]:
        """What the parent would send with the next task (after a collection)."""
        gc.collect()
        freed = self.segments.drain_freed()
        self.arena.release(freed)
        return freed

    def close(self) -> None:
        self.arena.close()
        self.segments.close()
        self.worker_sock.close()
        self.parent_sock.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    old = torch_worker._worker_info
    torch_worker._worker_info = torch_worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    original = torch.UntypedStorage.__dict__.get("_new_shared")
    p = Pair()
    torch_hooks.route_shared_storage(p.arena)
    yield p
    p.close()
    torch_worker._worker_info = old
    if original is None:
        del torch.UntypedStorage._new_shared
    else:
        torch.UntypedStorage._new_shared = original


def _table(payload: bytes) -> storage_table.Parsed:
    parsed = storage_table.parse(payload)
    assert parsed is not None
    return parsed


def test_default_collate_writes_straight_into_the_arena(pair: Pair) -> None:
    samples = [torch.full((256, 256), float(i)) for i in range(4)]
    batch, used, new = pair.ship(lambda: {"x": default_collate(samples), "label": "a"})
    assert torch.equal(batch["x"], torch.stack(samples)) and batch["label"] == "a"
    assert len(used) == 1 and new == 1
    # Zero copy: the collated storage was carved from the segment, so the arena holds
    # exactly one batch's bytes for it.
    assert pair.arena._hint >= 4 * 256 * 256 * 4


def test_segment_is_reused_only_after_the_parent_lets_go(pair: Pair) -> None:
    make = lambda: default_collate([torch.ones(1000) for _ in range(8)])  # noqa: E731
    first, used1, _ = pair.ship(make)
    second, used2, new2 = pair.ship(make)
    assert used1 != used2 and new2 == 1, "a segment still in use must not be reused"
    assert torch.equal(first, torch.ones(8, 1000))
    del first
    assert pair.hand_back() == used1
    third, used3, new3 = pair.ship(make)
    assert used3 == used1 and new3 == 0, "the freed segment is reused, no new one sent"
    assert torch.equal(second, torch.ones(8, 1000)) and torch.equal(third, torch.ones(8, 1000))
    assert pair.segments.punched == 0, "whole batches dropped: no page is returned early"


def test_worker_side_reference_blocks_reuse_and_punching(pair: Pair) -> None:
    kept: list[torch.Tensor] = []

    def make() -> dict[str, torch.Tensor]:
        out = default_collate([torch.ones(4096) for _ in range(2)])
        kept.append(out)  # user code that caches the collated batch in the worker
        return {"cached": out, "other": default_collate([torch.zeros(4096)] * 2)}

    first, used1, _ = pair.ship(make)
    assert _table(pair.last_payload).pinned == used1
    del first["other"]
    for _ in range(transport.PUNCH_AFTER + 1):
        pair.hand_back()
    assert pair.segments.punched == 0, "a segment the worker still views is never punched"
    del first
    pair.hand_back()
    _, used2, _ = pair.ship(lambda: default_collate([torch.zeros(4096)]))
    assert used2 != used1, "the worker still views the segment: it must not be overwritten"
    assert torch.equal(kept[0], torch.ones(2, 4096))


def test_tensors_outside_the_arena_are_copied_in(pair: Pair) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    big = torch.arange(64 * 1024.0).reshape(256, 256)
    batch, _, _ = pair.ship(lambda: [
        base[:, 1::2], base.t(), torch.tensor(True), torch.empty(0), big.t(), big[3],
        torch.tensor([1 + 2j]).conj(), -torch.ones(3)._neg_view(),
    ])  # fmt: skip
    assert torch.equal(batch[0], base[:, 1::2]) and torch.equal(batch[1], base.t())
    assert batch[2].item() is True and batch[3].shape == (0,)
    assert torch.equal(batch[4], big.t()) and torch.equal(batch[5], big[3])
    assert batch[6].item() == 1 - 2j and not batch[6].is_conj()
    assert torch.equal(batch[7], torch.ones(3))
    base.fill_(-1)  # the parent's copy is independent of the worker's tensors
    big.fill_(-1)
    assert batch[0][0, 0].item() == 1.0 and batch[4][0, 1].item() == 256.0


def test_small_tensors_travel_inline_and_own_their_bytes(pair: Pair) -> None:
    batch, used, new = pair.ship(lambda: default_collate([(torch.ones(3), i) for i in range(32)]))
    images, labels = batch
    assert used == () and new == 0, "small collate outputs never touch a segment"
    assert torch.equal(labels, torch.arange(32)) and torch.equal(images, torch.ones(32, 3))
    assert labels.untyped_storage().nbytes() == 32 * 8, "a kept label costs its own bytes"
    # Past the per-batch budget, small tensors go to shared memory instead.
    count = storage_table.INLINE_BUDGET // 4096 + 8
    many, used, _ = pair.ship(lambda: [torch.full((1024,), float(i)) for i in range(count)])
    assert len(used) == 1 and all(t[0].item() == i for i, t in enumerate(many))
    rows = _table(pair.last_payload).storages
    assert sum(r[0] == storage_table.INLINE for r in rows) == count - 8


def test_aliases_and_views_arrive_as_torch_keeps_them(pair: Pair) -> None:
    for n in (8, 1 << 18):  # inline, and in shared memory
        t = torch.arange(float(n))
        (sample,), _, _ = pair.ship(lambda t=t: [{"a": t, "b": t, "view": t[2:4]}])
        a, b, view = sample["a"], sample["b"], sample["view"]
        assert a is b and view.storage_offset() == 2
        assert view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        a[2] = -1.0
        assert view[0].item() == -1.0, "the view sees writes through its base"
    # Views with other dtypes at odd byte offsets keep their place in one storage.
    t = torch.arange(16, dtype=torch.float64)
    (wide, narrow), _, _ = pair.ship(lambda: (t[4:], t.view(torch.uint8)[35:41]))
    assert torch.equal(wide, t[4:]) and torch.equal(narrow, t.view(torch.uint8)[35:41])
    assert wide.untyped_storage().data_ptr() == narrow.untyped_storage().data_ptr()


def test_views_of_one_big_storage_copy_only_what_they_reach(pair: Pair) -> None:
    big = torch.zeros(64, 1 << 16)  # 16 MiB, rows of 256 KiB
    big[63] = 7.0
    rows, _, _ = pair.ship(lambda: [big[0], big[1], big[63], big[:, 5]])
    assert rows[0].untyped_storage().data_ptr() == rows[1].untyped_storage().data_ptr()
    assert rows[0].untyped_storage().nbytes() == 2 * (1 << 18)
    assert rows[2].untyped_storage().nbytes() == 1 << 18 and rows[2][0].item() == 7.0
    assert torch.equal(rows[3], big[:, 5]) and rows[3].untyped_storage().nbytes() == 64 * 4
    copied = sum(r[2] for r in _table(pair.last_payload).storages)
    assert copied < 4 * (1 << 18), f"copied {copied} bytes of a 16 MiB storage"


def test_a_kept_tensor_keeps_its_own_pages_only(pair: Pair) -> None:
    images = [torch.full((3 * MIB // 4,), float(i)) for i in range(4)]  # 3 MiB each
    pair.ship(lambda: list(images))  # the first batch sizes the pool: then one segment
    pair.hand_back()
    batch, used, _ = pair.ship(lambda: list(images))
    assert len(used) == 1
    kept = batch[1]
    del batch
    pair.hand_back()
    assert pair.segments.punched == 0, "pages are returned lazily, not at the first death"
    for _ in range(transport.PUNCH_AFTER):
        pair.hand_back()
    assert 3 * 3 * MIB - 3 * 4096 <= pair.segments.punched <= 3 * 3 * MIB
    assert torch.equal(kept, images[1]), "the kept tensor's bytes are untouched"
    del kept
    assert pair.hand_back() == used, "the segment goes back once its last storage died"


def test_once_closed_dead_storages_return_their_pages_at_once(pair: Pair) -> None:
    images = [torch.full((MIB // 2,), float(i)) for i in range(2)]  # 2 MiB each
    pair.ship(lambda: list(images))
    pair.hand_back()
    (first, second), used, _ = pair.ship(lambda: list(images))
    assert len(used) == 1
    pair.segments.close()  # the workers are gone: no segment will be reused
    del first
    assert pair.segments.punched >= 2 * MIB - 2 * 4096, "no drain will come: punched now"
    assert torch.equal(second, images[1])
    del second
    assert not pair.segments._held, "the last storage's death lets the mapping go"


def test_segments_held_for_long_are_closed_in_the_worker(pair: Pair) -> None:
    kept = []
    for i in range(arena_module.HELD_TASKS + 8):
        batch, _, _ = pair.ship(lambda i=i: default_collate([torch.full((2048,), float(i))] * 4))
        kept.append(batch)
        pair.hand_back()
    assert len(pair.arena._segments) <= arena_module.HELD_TASKS + 1
    assert all(t[0, 0].item() == i for i, t in enumerate(kept)), "kept batches stay valid"
    del kept, batch
    pair.hand_back()
    assert not pair.segments._held and not pair.segments._partial


def test_out_of_descriptors_in_the_worker_is_diagnosed(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(name: str, flags: int = 0) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "memfd_create", refuse)
    pair.arena.begin_task()
    with pytest.raises(steadyload.SharedMemoryError) as raised:
        default_collate([torch.ones(4096)] * 2)
    pair.arena.end_task(sent=False)
    error = pickle.loads(pickle.dumps(raised.value))  # it crosses to the parent in `Failed`
    assert isinstance(error, RuntimeError) and error.errno == errno.EMFILE
    assert "ulimit -n" in str(error) and "set_sharing_strategy" in str(error)
    assert error.where == "worker" and error.worker_id == 0


def test_a_plain_pickle_still_unpacks() -> None:
    segments = SegmentMap()
    assert segments.unpack(pickle.dumps({"x": torch.ones(2)}), ())["x"].sum().item() == 2.0
    segments.close()
