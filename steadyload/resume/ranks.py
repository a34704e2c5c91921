"""Ranks: whether a state saved on one rank (of some number of ranks) can resume on this one.

A state records torch.distributed's world (`shards.world`); steadyload deals an epoch to
ranks itself only for torch's DistributedSampler and accelerate's sharding (`shards`).
`check_world` refuses, before any batch, what else a state loaded on another rank or world
holds of the saving rank's own (docs/design/resume.md, "Another rank, or another number of
ranks"); `another_rank` says when a state is another rank's.
"""

from __future__ import annotations

from typing import Any

import torch.utils.data as tud

from ..engine.worker.fetch import ITERABLE
from . import shards
from .epoch_order import ITERATOR, order_of, sampler_at
from .progress import fail


def check_world(
    loader: tud.DataLoader[Any], state: dict[str, Any], dealt: dict[str, Any] | None
) -> None:
    """A state loaded on another rank or number of ranks than saved it: refused unless
    steadyload deals the epoch to ranks itself (`shards`) and nothing in it is one rank's
    own (a dataset's position per worker)."""
    saved_world, now = state.get("world"), shards.world()
    saved = state["sharding"]
    known = saved is not None and dealt is not None
    if known:
        assert saved is not None and dealt is not None
        moved = (saved["replicas"], saved["rank"]) != (dealt["replicas"], dealt["rank"])
        where = f"rank {saved['rank']} of {saved['replicas']}"
        here = f"rank {dealt['rank']} of {dealt['replicas']}"
    else:
        if saved_world is None:  # (an earlier version's state: said by check's warning)
            return
        moved = saved_world != now
        where = f"rank {saved_world['rank']} of {saved_world['size']}"
        here = f"rank {now['rank']} of {now['size']}"
    if not moved:
        return
    iterable = loader._dataset_kind == ITERABLE
    what = None
    if state["dataset_states"] is not None:
        what = (
            f"the position of {type(loader.dataset).__qualname__}, which keeps its own state "
            "(state_dict()) per worker"
        )
    elif not known:
        held = list(state["samplers"])
        if held:
            sampler = sampler_at(loader, held[0].removesuffix(ITERATOR))
            kind = type(sampler).__qualname__ if sampler is not None else held[0]
            what = f"the position of {kind}, a sampler with its own state_dict()"
        elif not iterable:
            kinds = order_of(loader)
            last = kinds[-1].rsplit(".", 1)[-1] if kinds else "sampler"
            what = f"the order of the loader's {last}"
    if what is None:
        return  # a stream without a position of its own: nothing of the saving rank's is used
    raise fail(
        f"this loader state was saved on {where} and is loaded on {here}; steadyload cannot "
        f"deal {what} to other ranks.",
        (
            "a state says where one rank stood. steadyload deals the rest of an epoch again "
            "only for torch's DistributedSampler and accelerate's sharding, whose order it "
            f"knows; anything else in the state is {where}'s own, and on this rank it would "
            "repeat that rank's samples and skip this rank's."
        ),
        (
            "resume on the same ranks, each loading the state it saved (save "
            "loader.state_dict() on every rank); or shard with torch's DistributedSampler (or "
            "accelerate), which resume on any number of ranks; or start this epoch afresh "
            "(do not load the state)."
        ),
    )


def another_rank(state: dict[str, Any], dealt: dict[str, Any] | None) -> bool:
    """Whether the state is another rank's (of a run that steadyload deals, or of a stream
    that keeps nothing of the rank's own: `_check_world` let it through)."""
    saved = state["sharding"]
    if saved is not None and dealt is not None:
        return bool(saved["rank"] != dealt["rank"])
    world = state.get("world")
    return world is not None and world != shards.world()
