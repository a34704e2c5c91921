"""Apply: a checked state (`validate.Resume`) put into the loader as its epoch begins.

Nothing here checks (`validate.check` did, before the state was kept): `replay` sets the
generators and samplers back to the saved epoch's start and re-creates its index order
minus the batches already yielded, or deals its rest again to this loader's ranks
(`shards`). Called by `Checkpoints.begin_epoch` (docs/design/resume.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.utils.data as tud

from . import shards, skip_samples
from .epoch_order import (
    ITERATOR,
    EpochStart,
    Indices,
    YieldedBatches,
    capture,
    epoch_holder,
    load_samplers,
    sampler_iterator,
    set_generators,
)
from .validate import Resume


def replay(
    loader: tud.DataLoader[Any], index_sampler: Any, resume: Resume, base_seed: int
) -> tuple[EpochStart, Indices, YieldedBatches]:
    """Re-create a saved epoch's index order, minus the batches it had yielded.

    Sets the loader's generators (and samplers) back to the saved epoch start, captures
    that start again (so that saving later in this epoch works), draws the sampler's first
    item while torch's global generator holds the saved state (a RandomSampler without
    ``generator`` draws its permutation then), and gives the caller's global state back.
    Returns the epoch start, the indices to load and what was yielded.

    Saved on another number of ranks (or in an epoch that was re-dealt so, or with skipped
    samples), the rest of the epoch is dealt again to this loader's ranks (`shards`): a new
    dealing, none of it yielded yet. Skipped samples (`skip_samples`) leave the order.
    """
    caller_rng = torch.get_rng_state()
    set_generators(loader, resume.rng, include_global=True)
    load_samplers(loader, resume.samplers)
    holder = epoch_holder(loader)
    if resume.distributed_epoch is not None and holder is not None:
        holder.set_epoch(resume.distributed_epoch)
    if resume.redeal:
        assert resume.sharding is not None and resume.dealt is not None
        first = shards.consumed(resume.sharding, resume.yielded.prefix)
        start = capture(loader, resume.epoch, base_seed, None)
        start.sharding, start.redealt = shards.of(loader, resume.sharding, offset=first), True
        start.skip = resume.stages
        rest = shards.rest_batches(
            loader, first, resume.dealt, resume.distributed_epoch, resume.stages, bool(resume.skip)
        )
        indices = Indices(rest)
        indices.prime()
        torch.set_rng_state(caller_rng)
        return start, indices, YieldedBatches()
    source, held = sampler_iterator(loader, index_sampler, iter(index_sampler))
    saved = next((k for k in resume.samplers if k.endswith(ITERATOR)), None)
    if saved is not None:
        if held is None or held[0] + ITERATOR != saved:
            torch.set_rng_state(caller_rng)
            raise ValueError(
                f"this loader state holds the state of the iterator of the loader's "
                f"{saved[: -len(ITERATOR)]}, and that sampler's iterator here has no "
                "load_state_dict().\nWhy: the rest of the saved epoch is that iterator's "
                "position; without it the epoch would start over.\nFix: build the loader "
                "with the sampler that saved the state."
            )
        held[1].load_state_dict(copy.deepcopy(resume.samplers[saved]))
    start = capture(loader, resume.epoch, base_seed, held)
    if resume.stages:
        start.skip = resume.stages
        how = skip_samples.batching(loader, index_sampler)
        source = skip_samples.staged(source, resume.stages, how, warn=bool(resume.skip))
    yielded = YieldedBatches(resume.yielded.prefix, set(resume.yielded.beyond))
    indices = Indices(source, skip=yielded)
    indices.prime()
    torch.set_rng_state(caller_rng)
    return start, indices, YieldedBatches(yielded.prefix, set(yielded.beyond))


def skipping(loader: tud.DataLoader[Any], index_sampler: Any, source: Any, resume: Resume) -> Any:
    """The index batches of the epoch after a state saved between epochs, without the
    samples its skips name (``source``: the epoch's own). A loader dealt to ranks has the
    order filtered, then dealt (`shards.rest_batches` from its start), so that every rank
    keeps as many batches as the others."""
    warn = bool(resume.skip)
    now = shards.describe(loader)
    if now is not None:
        holder = epoch_holder(loader)
        epoch = holder.epoch if holder is not None else None
        return shards.rest_batches(loader, 0, now, epoch, resume.stages, warn)
    how = skip_samples.batching(loader, index_sampler)
    return skip_samples.staged(source, resume.stages, how, warn=warn)
