"""Shared-memory transport, both ends in one process over a socketpair (no workers)."""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils import worker as torch_worker

from steadyload.engine import channel, transport
from steadyload.engine.protocol import NewSegment
from steadyload.engine.transport import Arena, SegmentMap

pytestmark = pytest.mark.skipif(not transport.HAVE_MEMFD, reason="memfd is Linux-only")


class Pair:
    """A worker-side arena and a parent-side segment map joined by a socketpair."""

    def __init__(self) -> None:
        self.arena = Arena(worker_id=0)
        self.segments = SegmentMap()
        self.worker_sock, self.parent_sock = socket.socketpair()
        self.reader = channel.Reader(self.parent_sock)

    def ship(self, make_batch: Any) -> tuple[Any, tuple[int, ...], int]:
        """Run one task: returns (rebuilt batch, its segment ids, new segments sent)."""
        self.arena.begin_task()
        payload = self.arena.pack(make_batch())
        used, new, retired = self.arena.end_task(sent=True)
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
    transport.install_collate_hook(p.arena)
    yield p
    p.close()
    torch_worker._worker_info = old
    if original is None:
        del torch.UntypedStorage._new_shared
    else:
        torch.UntypedStorage._new_shared = original


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
    gc.collect()
    freed = pair.segments.drain_freed()
    assert freed == used1
    pair.arena.release(freed)
    third, used3, new3 = pair.ship(make)
    assert used3 == used1 and new3 == 0, "the freed segment is reused, no new one sent"
    assert torch.equal(second, torch.ones(8, 1000)) and torch.equal(third, torch.ones(8, 1000))


def test_worker_side_reference_blocks_reuse(pair: Pair) -> None:
    kept: list[torch.Tensor] = []

    def make() -> torch.Tensor:
        out = default_collate([torch.ones(10) for _ in range(2)])
        kept.append(out)  # user code that caches the collated batch in the worker
        return out

    first, used1, _ = pair.ship(make)
    del first
    gc.collect()
    pair.arena.release(pair.segments.drain_freed())
    _, used2, _ = pair.ship(lambda: default_collate([torch.zeros(10)]))
    assert used2 != used1, "the worker still views the segment: it must not be overwritten"
    assert torch.equal(kept[0], torch.ones(2, 10))


def test_tensors_outside_the_arena_are_copied_in(pair: Pair) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    batch, _, _ = pair.ship(lambda: [base[:, 1::2], base.t(), torch.tensor(True), torch.empty(0)])
    assert torch.equal(batch[0], base[:, 1::2]) and torch.equal(batch[1], base.t())
    assert batch[2].item() is True and batch[3].shape == (0,)
    base.fill_(-1)  # the parent's copy is independent of the worker's tensors
    assert batch[0][0, 0].item() == 1.0
