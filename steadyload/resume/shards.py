"""Elastic resume: the rest of an epoch sharded over N ranks, dealt again to M ranks.

torch's ``DistributedSampler`` gives rank r the positions r, r+N, r+2N, ... of one order of
the dataset (the same on every rank: it follows from ``seed + epoch``), padded or cut to a
multiple of N; accelerate's ``BatchSamplerShard`` gives rank r the batches r, r+N, ... of
one order of batches (or, with ``split_batches``, the r-th slice of each). The ranks of a
data-parallel run take their batches in lockstep, so after k batches on every rank they
have together consumed exactly the first ``N*k*u`` units of that order (u: samples per
batch for DistributedSampler, 1 batch for BatchSamplerShard, k batches in all with
``split_batches``), whichever rank saved the state. The rest of the epoch is that order
from there on: dealt to M ranks the way the sampler deals (padded or cut to a multiple of M
as its ``drop_last`` says), every sample of the epoch is seen once over all ranks, in the
order's order (docs/design/resume.md, "Elastic resume").

A loader state records the sharding of its epoch (`describe`): the kind, N, the sampler's
arguments that decide the order, and the ``offset`` where the epoch's dealing began (0,
or where an elastic resume re-dealt it). `consumed` turns a state into the units consumed;
`rest_batches` makes a rank's index batches for the rest.
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Iterator
from typing import Any

import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

from . import skip_samples

DISTRIBUTED = "torch.DistributedSampler"
ACCELERATE = "accelerate.BatchSamplerShard"
_SHARD = "accelerate.data_loader.BatchSamplerShard"


def qualname(obj: Any) -> str:
    """``module.Class`` of ``obj``'s type (how samplers are recognised by name)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _distributed(loader: tud.DataLoader[Any]) -> Any:
    """The loader's DistributedSampler where steadyload can deal its order again: the
    sampler itself, or the one torch's BatchSampler batches (None: none there)."""
    index: Any = loader.batch_sampler if loader._auto_collation else loader.sampler
    if type(index) is tud.BatchSampler:
        index = index.sampler
    return index if isinstance(index, DistributedSampler) else None


def world() -> dict[str, int]:
    """This process's place in torch.distributed's default group (size 1, rank 0 without
    one): a state records it, so that one loaded on another rank is noticed (`validate`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"size": dist.get_world_size(), "rank": dist.get_rank()}
    return {"size": 1, "rank": 0}


def epoch_batches(sharding: dict[str, Any], n: int | None, drop_last: bool) -> int | None:
    """The batches each rank had in an epoch dealt as ``sharding`` over ``n`` samples (a
    DistributedSampler's; None when unknown): the bound of a state's batch count."""
    per_batch = sharding["per_batch"]
    if sharding["kind"] != DISTRIBUTED or n is None or per_batch is None:
        return None
    rest, replicas = max(n - sharding["offset"], 0), sharding["replicas"]
    share = rest // replicas if sharding["order"]["drop_last"] else math.ceil(rest / replicas)
    return share // per_batch if drop_last else math.ceil(share / per_batch)


def deal_plan(loader: tud.DataLoader[Any], sharding: dict[str, Any] | None) -> dict[str, Any]:
    """How an epoch (or the rest a resume dealt again) goes to ranks, for the ledger: the
    kind, N, this rank, where the dealing began, and the samples it repeats (``pad``) and
    leaves out (``cut``) over all ranks, by the sampler's rules (padding to a multiple of N,
    ``drop_last``); accelerate's figures count whole batches of ``batch_size``."""
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        n = None
    batch = loader.batch_size or 1
    if sharding is None or n is None:
        cut = n % batch if n is not None and loader.drop_last and loader._auto_collation else 0
        return {"kind": None, "replicas": 1, "rank": 0, "offset": 0, "pad": 0, "cut": cut}
    replicas, offset, order = sharding["replicas"], sharding["offset"], sharding["order"]
    plan = {"kind": sharding["kind"], "replicas": replicas, "rank": sharding["rank"]}
    if sharding["kind"] == DISTRIBUTED:
        rest = max(n - offset, 0)
        pad = 0 if order["drop_last"] else -rest % replicas
        cut = rest % replicas if order["drop_last"] else 0
        share = (rest + pad - cut) // replicas
        if loader.drop_last and sharding["per_batch"]:
            cut += share % sharding["per_batch"] * replicas
        return {**plan, "offset": offset, "pad": pad, "cut": cut}
    batches = max(math.ceil(n / batch) - offset, 0)  # accelerate: units are batches
    spread = 1 if order["split_batches"] else replicas
    pad = -batches % spread if order["even_batches"] and not order["drop_last"] else 0
    cut = batches % spread if order["drop_last"] else 0
    return {**plan, "offset": offset, "pad": pad * batch, "cut": cut * batch}


def describe(loader: tud.DataLoader[Any], offset: int = 0) -> dict[str, Any] | None:
    """How the loader's epoch is sharded over ranks (JSON-able), or None when it is not."""
    sampler, batches = _distributed(loader), loader.batch_sampler
    if sampler is not None:
        batch = getattr(batches, "batch_size", 1) if loader._auto_collation else 1
        return {
            "kind": DISTRIBUTED,
            "replicas": sampler.num_replicas,
            "rank": sampler.rank,
            "offset": offset,
            "per_batch": batch,
            "exact": type(sampler) is DistributedSampler,
            "order": {
                "seed": sampler.seed,
                "shuffle": sampler.shuffle,
                "drop_last": sampler.drop_last,
            },
        }
    shard: Any = batches if loader._auto_collation else None
    if shard is not None and qualname(shard) == _SHARD:
        return {
            "kind": ACCELERATE,
            "replicas": shard.num_processes,
            "rank": shard.process_index,
            "offset": offset,
            "per_batch": 1,
            "exact": True,
            "order": {
                "split_batches": shard.split_batches,
                "even_batches": shard.even_batches,
                "drop_last": shard.drop_last,
            },
        }
    buried = _buried(shard if shard is not None else loader.sampler)
    if buried is not None:  # inside a custom batch sampler: recorded, never dealt again
        return {
            "kind": DISTRIBUTED,
            "replicas": buried.num_replicas,
            "rank": buried.rank,
            "offset": offset,
            "per_batch": None,
            "exact": False,
            "order": {
                "seed": buried.seed,
                "shuffle": buried.shuffle,
                "drop_last": buried.drop_last,
            },
        }
    return None


def _buried(obj: Any, depth: int = 4) -> Any:
    """A DistributedSampler held by a custom batch sampler (or None): under any attribute
    (``.sampler``, ``.batch_sampler``, ``._inner``, ...), of an attribute, ``depth`` deep;
    lists and other containers are not searched (an index list may be long), nor modules."""
    if depth == 0:
        return None
    try:
        held = list(vars(obj).values())
    except TypeError:  # no __dict__ (slots, a builtin): nothing held that way
        return None
    for value in held:
        if isinstance(value, DistributedSampler):
            return value
    for value in held:
        if hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType)):
            found = _buried(value, depth - 1)
            if found is not None:
                return found
    return None


def of(
    loader: tud.DataLoader[Any], saved: dict[str, Any] | None = None, offset: int = 0
) -> dict[str, Any] | None:
    """`describe`, or for a loader without a sharding sampler (one process, as frameworks
    build it) given a state saved with one: one rank of the saved kind, so that the rest of
    a run from N ranks goes on in one process (torch's BatchSampler batches it)."""
    now = describe(loader, offset)
    index = loader.batch_sampler if loader._auto_collation else loader.sampler
    one = (
        saved is not None
        and now is None
        and (
            saved["kind"] == ACCELERATE
            or not loader._auto_collation
            or type(index) is tud.BatchSampler
        )
    )
    if one:
        assert saved is not None
        return {**saved, "replicas": 1, "rank": 0, "offset": offset}
    return now


def elastic(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> bool:
    """Whether a state saved with sharding ``saved`` resumes by dealing its rest again: on
    another number of ranks, or in an epoch that was itself re-dealt."""
    if saved is None or now is None:
        return False
    return saved["replicas"] != now["replicas"] or saved["offset"] != 0


def mismatch(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> str | None:
    """What differs between the sharding a state was saved with and the loader's, in words,
    or None when the state resumes on this loader (on any number of ranks)."""

    def name(s: dict[str, Any] | None) -> str:
        return "no sharding sampler" if s is None else f"a {s['kind']} over {s['replicas']} ranks"

    if (saved is None) != (now is None) or (saved and now and saved["kind"] != now["kind"]):
        return f"the state was saved with {name(saved)}, this loader has {name(now)}"
    if saved is None or now is None:
        return None
    differ = [
        f"{k}={saved['order'][k]!r} (now {now['order'][k]!r})"
        for k in saved["order"]
        if saved["order"][k] != now["order"].get(k)
    ]
    if differ:
        return "the sampler that saved it had " + ", ".join(differ)
    return None


def refusal(
    state: dict[str, Any], now: dict[str, Any] | None, skip: bool = False
) -> tuple[str, str, str] | None:
    """Why a loader state cannot resume on a loader sharded as ``now`` (what, why, fix), or
    None: its epoch was dealt otherwise, or its rest cannot be dealt again to ``now``'s
    ranks (``skip``: samples leave the epoch, so its rest is dealt again on any ranks)."""
    saved = state["sharding"]
    differs = mismatch(saved, now)
    if differs is not None:
        return (
            f"this loader state does not fit this loader: {differs}.",
            (
                "the rest of the saved epoch is a position in the order that sampler deals out; "
                "another sampler deals another order, so samples would be repeated or skipped."
            ),
            (
                "build the loader with the sampler (and arguments) the saving run had; the number "
                "of ranks may differ."
            ),
        )
    if state["finished"] or saved is None or now is None or not (skip or elastic(saved, now)):
        return None
    moved = f"saved on {saved['replicas']} ranks, resumed on {now['replicas']}"
    if not elastic(saved, now):
        moved = "resumed with skip_samples (its rest is dealt to the ranks again)"
    if not (now["exact"] and saved["exact"]):
        return (
            (
                f"this loader state was {moved}, and the loader's DistributedSampler is a "
                "subclass of it or sits inside a custom batch sampler."
            ),
            (
                "steadyload deals the rest of an epoch again as torch's DistributedSampler deals, "
                "batched by torch's BatchSampler; a subclass or another batch sampler may order, "
                "deal or batch the samples otherwise."
            ),
            (
                "resume on the same number of ranks, or use torch's DistributedSampler with "
                "batch_size= (or accelerate's sharding)."
            ),
        )
    if state["yielded_beyond"]:
        return (
            (
                f"this loader state was {moved}, and its rank had yielded batches out of order "
                f"(in_order=False: {state['yielded_beyond']} beyond the first "
                f"{state['batches_yielded']})."
            ),
            (
                "dealing the rest of the epoch again relies on every rank having yielded the same "
                "first batches (lockstep), which out-of-order batches do not promise."
            ),
            (
                "resume on the same number of ranks without skip_samples, or train with "
                "in_order=True."
            ),
        )
    if state["dataset_states"] is not None and saved["replicas"] != now["replicas"]:
        return (
            f"this loader state was {moved}, and it holds the dataset's own state per worker.",
            "a dataset's own position (a stream's) cannot be dealt to other ranks.",
            "resume on the same number of ranks.",
        )
    return None


def consumed(sharding: dict[str, Any], batches: int) -> int:
    """Units of the epoch's order consumed over all ranks after ``batches`` batches on each
    (lockstep): samples for DistributedSampler, batches for BatchSamplerShard."""
    per_step = sharding["per_batch"]
    if not (sharding["kind"] == ACCELERATE and sharding["order"]["split_batches"]):
        per_step *= sharding["replicas"]  # (split batches: each rank takes a slice of one)
    return sharding["offset"] + batches * per_step


def _deal(order: list[Any], start: int, replicas: int, rank: int, drop_last: bool) -> list[Any]:
    """Rank ``rank``'s share of ``order[start:]`` as DistributedSampler deals: padded from
    the start of ``order`` (or cut) to a multiple of ``replicas``, every replicas-th."""
    rest = order[start:]
    if drop_last:
        rest = rest[: len(rest) // replicas * replicas]
    elif (pad := -len(rest) % replicas) and order:
        rest += (order * math.ceil(pad / len(order)))[:pad]
    return rest[rank::replicas]


class _Batches:
    """A batch sampler over given batches (what BatchSamplerShard wraps)."""

    def __init__(self, batches: list[Any], batch_size: int | None, drop_last: bool) -> None:
        self._batches = batches
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[Any]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


def rest_batches(
    loader: tud.DataLoader[Any],
    start: int,
    now: dict[str, Any],
    epoch: int | None,
    stages: list[dict[str, Any]] | None = None,
    warn: bool = False,
) -> Iterator[Any]:
    """This rank's index batches (or indices, without batching) for the rest of the epoch
    from unit ``start`` of its order on, the loader being sharded as ``now`` (`of`); the
    order is drawn here, from the loader's samplers as they are now (the caller has set
    them to the epoch's start) or, in one process, from the saved sampler's arguments and
    the DistributedSampler's ``epoch``. ``stages``: skipped samples leave the order before
    it is dealt (`skip_samples.staged`; ``warn``: the last is a new skip)."""
    stages = stages or []
    replicas, rank = now["replicas"], now["rank"]
    if now["kind"] == DISTRIBUTED:
        sampler = _distributed(loader)
        if sampler is None:  # one process: the order the saving ranks' sampler dealt
            o = now["order"]
            sampler = DistributedSampler(
                loader.dataset, num_replicas=1, rank=0, shuffle=o["shuffle"], seed=o["seed"]
            )
            sampler.set_epoch(epoch or 0)
        whole = copy.copy(sampler)  # one replica, nothing padded: the epoch's order itself
        whole.num_replicas, whole.rank, whole.drop_last = 1, 0, False
        whole.num_samples = whole.total_size = len(sampler.dataset)
        order = list(skip_samples.staged(whole, stages, skip_samples.INDICES, warn=warn))
        share = _deal(order, start, replicas, rank, now["order"]["drop_last"])
        if not loader._auto_collation:
            return iter(share)
        batches: Any = loader.batch_sampler
        return iter(tud.BatchSampler(share, batches.batch_size, batches.drop_last))
    shard: Any = loader.batch_sampler
    if qualname(shard) != _SHARD:  # one process: its batch sampler is the batch order
        how = skip_samples.of_batches(shard)
        return iter(list(skip_samples.staged(shard, stages, how, warn=warn))[start:])
    inner = shard.batch_sampler
    how = skip_samples.of_batches(inner)
    rest = list(skip_samples.staged(inner, stages, how, warn=warn))[start:]
    again = type(shard)(
        _Batches(rest, getattr(inner, "batch_size", None), getattr(inner, "drop_last", False)),
        num_processes=replicas,
        process_index=rank,
        split_batches=shard.split_batches,
        even_batches=shard.even_batches,
    )
    return iter(again)
