"""Validate: a loaded state checked whole against the loader, before anything is applied.

`check` is the one gate between a state (whatever a checkpoint file holds) and the loader:
every field's type and range (`fields.py`), then whether the state fits this loader (the
same dataset, batching and sampler kinds; the same ranks, or a sharding steadyload can deal
again to these), then the generator states decoded. It returns a `Resume` (what the next
epoch applies, decoded) or raises one ValueError that says what, why and what to do; the
loader is untouched until it returns (docs/design/resume.md, "Validate, then apply").
"""

from __future__ import annotations

import binascii
import copy
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data as tud

from ..engine.remote.spec import all_workers
from ..engine.worker.fetch import ITERABLE, stateful
from . import fields, shards, skip_samples
from .epoch_order import (
    GLOBAL,
    ITERATOR,
    YieldedBatches,
    decode_rng,
    generators,
    not_replayable,
    order_of,
    reseeded,
    stateful_samplers,
)
from .progress import fail, persistent
from .ranks import another_rank, check_world

STATE_FORMAT = fields.STATE_FORMAT
STATE_VERSION = fields.STATE_VERSION

REPLAY_WHY_FIX = (  # a sampler whose order cannot be re-created
    "resuming means re-creating exactly the index order of the interrupted epoch.",
    (
        "add state_dict() and load_state_dict() to the sampler (its state at the start of an "
        "epoch must determine that epoch's order), or use one of torch's samplers."
    ),
)


@dataclass(slots=True)
class Resume:
    """A loaded state that passed `check`: what the next epoch applies (`Checkpoints`)."""

    state: dict[str, Any]
    """The state as loaded (a copy): ``state_dict()`` gives it back until its epoch begins."""
    epoch: int
    finished: bool
    yielded: YieldedBatches
    base_seed: int | None
    """The saving run's base seed; None: this iterator draws its own (another rank's)."""
    rng: dict[str, torch.Tensor]
    """Generator states by key (`epoch_order.generators`), decoded; torch's global one is
    left out for another rank's state."""
    samplers: dict[str, Any]
    distributed_epoch: int | None
    sharding: dict[str, Any] | None
    """How the saved epoch was dealt to ranks (`shards.describe`), or None."""
    dealt: dict[str, Any] | None
    """How this loader deals it (`shards.of`)."""
    redeal: bool
    """The rest of the saved epoch is dealt again to this loader's ranks (`shards.elastic`)."""
    dataset_states: dict[str, Any] | None
    """The dataset replicas' positions; None once restored (in-process, between epochs)."""
    steps: int = 0
    """The steps of the epoch done at the state (the ledger's count: across a dealing again
    to other ranks it goes on, where ``yielded`` counts the new dealing's batches)."""
    stages: list[dict[str, Any]] = field(default_factory=list)
    """The epoch's skips (the state's ``skip``, and this load's last): `skip_samples`."""
    skip: frozenset[int] = frozenset()
    """The samples this load skips (``skip_samples``), or none."""
    skip_from: int = 0
    """This rank's batches before the skip (0: from the start of the next epoch)."""


def dataset_len(loader: tud.DataLoader[Any]) -> int | None:
    """The dataset's length, or None when it has none (a stream)."""
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def check(loader: tud.DataLoader[Any], state: Any, skip: Iterable[Any] | None = None) -> Resume:
    """``state`` checked against ``loader``, as a `Resume`, with the samples ``skip`` names
    left out of the rest of the epoch (`skip_samples`); warns when it resumes the epoch but
    later epochs will differ.

    Raises:
        ValueError: a field is missing or out of range (named, with the value found and what
            was expected), ``skip`` is not dataset indices, or the state cannot resume this
            loader exactly (what, why, fix).
    """
    fields.check_format(state)
    fields.check_fields(state)
    saved, dealt = state["sharding"], shards.of(loader, state["sharding"])
    drop = skip_samples.requested(loader, skip, saved, dealt)
    stages = copy.deepcopy(state.get("skip", []))
    finished, yielded = state["finished"], state["batches_yielded"]
    if drop:
        at = yielded if saved is None else shards.consumed(saved, yielded)
        beyond = state["yielded_beyond"] if saved is None else []  # (sharded: refused)
        stages.append(skip_samples.stage(0 if finished else at, [] if finished else beyond, drop))
    _check_fits(loader, state)
    refused = shards.refusal(state, dealt, skip=bool(stages))
    if refused is not None:
        raise fail(*refused)
    _check_order(loader, state)  # (first: another sampler is the plainer cause)
    check_world(loader, state, dealt)
    reason = not_replayable(loader, state["samplers"])
    if reason is not None and not state["finished"]:
        raise fail(
            "steadyload cannot resume this DataLoader mid-epoch: " + reason + ".",
            *REPLAY_WHY_FIX,
        )
    redeal = bool(
        saved is not None and dealt is not None and (stages or shards.elastic(saved, dealt))
    )
    _check_count(loader, state, redeal)
    rng = _decoded_rng(loader, state)
    base_seed = state["base_seed"]
    if another_rank(state, dealt):
        # Another rank's state (a framework keeps rank 0's; a resume on more ranks): its base
        # seed and torch's global generator are that rank's, and taking them would make this
        # rank's workers and random draws repeat that rank's.
        base_seed = None
        rng.pop(GLOBAL, None)
    if state["persistent"] != persistent(loader):
        warnings.warn(
            "this loader state was saved by a loader "
            f"{'with' if state['persistent'] else 'without'} persistent workers and is loaded "
            f"into one {'with' if persistent(loader) else 'without'}: the rest of the saved "
            "epoch is the same, but later epochs will differ from the uninterrupted run, "
            "because torch draws a new base seed at each epoch only without persistent "
            "workers (and shuffling draws after it). Use the same persistent_workers "
            "setting (and num_workers > 0 with it) to continue identically.",
            UserWarning,
            stacklevel=4,  # the caller of DataLoader.load_state_dict
        )
    if state["version"] < STATE_VERSION:
        warnings.warn(
            f"this loader state has version {state['version']} (an earlier steadyload): it "
            "does not say on which ranks it was saved nor with which sampler kinds, so "
            "those are not checked. Resume on the ranks and with the sampler that saved it; "
            "states saved from now on are checked whole.",
            UserWarning,
            stacklevel=4,
        )
    if drop and saved is None and shards.world()["size"] > 1:
        skip_samples.warn_unsharded(shards.world()["size"])
    kept = copy.deepcopy(state)
    if drop:  # the state as a state_dict() taken right after this resume would be
        kept["skip"], kept["yielded_beyond"] = copy.deepcopy(stages), []
    return Resume(
        state=kept,
        epoch=state["epoch"],
        finished=state["finished"],
        yielded=YieldedBatches(yielded, set(kept["yielded_beyond"])),
        base_seed=base_seed,
        rng=rng,
        samplers=kept["samplers"],
        distributed_epoch=None if state["finished"] else state["distributed_epoch"],
        sharding=kept["sharding"],
        dealt=dealt,
        redeal=redeal,
        dataset_states=copy.deepcopy(state["dataset_states"]),
        steps=_steps(state),
        stages=stages,
        skip=drop,
        skip_from=0 if finished else yielded,
    )


def _steps(state: dict[str, Any]) -> int:
    """The steps of the epoch the state was saved after (the ledger's count, when it kept
    one: it goes on across a dealing again; else the batches yielded)."""
    ledger = state.get("ledger")
    if isinstance(ledger, dict):
        return int(ledger["steps"])
    return int(state["batches_yielded"])


def _check_fits(loader: tud.DataLoader[Any], state: dict[str, Any]) -> None:
    """The dataset, batching and per-worker states fit this loader."""
    for key, now in (
        ("dataset_len", dataset_len(loader)),
        ("batch_size", loader.batch_size),
        ("drop_last", loader.drop_last),
    ):
        if state[key] != now:
            raise fail(
                f"the saved loader had {key}={state[key]!r}, this one has {now!r}.",
                "the remaining batches of the saved epoch would be different ones.",
                "build the loader with the same dataset and arguments as the saved one.",
            )
    saved = state["dataset_states"]
    if saved is not None and state["num_workers"] != all_workers(loader):
        raise fail(
            f"this loader state holds the dataset's own state (state_dict()) per worker, "
            f"saved with num_workers={state['num_workers']}, and this loader has "
            f"num_workers={all_workers(loader)} (remote workers count too).",
            "each worker has its own replica of the dataset (an IterableDataset also splits "
            "its stream between them), so a worker's state only means something with the "
            "same number of workers.",
            f"resume with num_workers={state['num_workers']}.",
        )
    name = type(loader.dataset).__qualname__
    if saved is not None and not stateful(loader.dataset):
        if any(w is not None and w["dataset"] is not None for w in saved["workers"]):
            raise fail(
                f"this loader state holds the dataset's own state, and this loader's "
                f"dataset, a {name}, has no state_dict()/load_state_dict().",
                "the saved position is that dataset's; this one cannot take it.",
                "build the loader with the dataset that saved the state.",
            )
    iterable = loader._dataset_kind == ITERABLE
    if saved is None and iterable and not state["finished"] and state["batches_yielded"] > 0:
        raise fields.bad(
            "dataset_states",
            "is None",
            f"the stream's positions: a mid-epoch state of an IterableDataset ({name}) that "
            "had yielded batches holds them",
        )


def _check_order(loader: tud.DataLoader[Any], state: dict[str, Any]) -> None:
    """The state's order comes from samplers of the same kinds, with the same generators
    and sampler states, as this loader's (not checked when this one process deals the rest
    of a DistributedSampler's epoch: the order is then the saved sampler's, `shards`)."""
    saved = state["sharding"]
    one = saved is not None and saved["kind"] == shards.DISTRIBUTED
    if one and shards.describe(loader) is None:
        return
    if "order" in state and state["order"] != order_of(loader):
        raise fail(
            "this loader state was saved by a loader whose index order came from "
            f"{_kinds(state['order'])}; this loader's comes from {_kinds(order_of(loader))}.",
            (
                "the rest of the saved epoch is a position in that sampler's order; another "
                "sampler (shuffle=True against False, another sampler class) gives another "
                "order, so samples would be repeated or skipped."
            ),
            "build the loader with the sampler (and shuffle=) the saving run had.",
        )
    keys = {k for k in generators(loader) if not reseeded(loader, k)}
    saved_keys = {k for k in state["rng"] if k != GLOBAL and not reseeded(loader, k)}
    if keys != saved_keys:
        missing, extra = sorted(keys - saved_keys), sorted(saved_keys - keys)
        raise fail(
            "this loader state does not fit this loader's random generators: "
            + "; ".join(
                [f"the state has no entry for {k!r}" for k in missing]
                + [f"the saved loader drew from {k!r}, which this loader lacks" for k in extra]
            )
            + ".",
            (
                "the saved order was drawn from the saved generators; with a generator "
                "more or less (generator= given or not) the rest of the epoch is another order."
            ),
            "build the loader with the same generator= (and sampler generators) as the saved one.",
        )
    if not state["finished"] and GLOBAL not in state["rng"]:
        raise fields.bad("rng", f"has no {GLOBAL!r} entry", "torch's global generator's state")
    wanted = set(stateful_samplers(loader))
    held = {k for k in state["samplers"] if not k.endswith(ITERATOR)}
    if wanted != held:
        raise fail(
            "this loader state does not fit this loader's samplers: the state holds the "
            f"own state of {sorted(held) or 'no sampler'}, this loader's samplers with "
            f"state_dict() are {sorted(wanted) or 'none'}.",
            "a sampler's own state decides its order; without it the order would start over.",
            "build the loader with the samplers that saved the state.",
        )


def _kinds(order: list[str]) -> str:
    return " > ".join(k.rsplit(".", 1)[-1] for k in order) or "no sampler (a stream)"


def _check_count(loader: tud.DataLoader[Any], state: dict[str, Any], redeal: bool) -> None:
    """The batches counted as yielded lie within the saved epoch."""
    if state["finished"]:
        return
    total = None
    if loader._dataset_kind != ITERABLE:
        if redeal:
            total = shards.epoch_batches(state["sharding"], state["dataset_len"], loader.drop_last)
        else:
            try:
                total = len(loader._index_sampler)
            except TypeError:  # a sampler without len()
                total = None
    yielded, beyond = state["batches_yielded"], state["yielded_beyond"]
    if total is not None and yielded > total:
        raise fields.bad(
            "batches_yielded",
            f"is {yielded}",
            f"at most {total}, the batches in an epoch of this loader",
        )
    if any(b <= yielded or (total is not None and b >= total) for b in beyond):
        top = f" and below {total}" if total is not None else ""
        raise fields.bad(
            "yielded_beyond",
            f"is {beyond!r}",
            f"batch numbers above batches_yielded ({yielded}){top}",
        )


def _decoded_rng(loader: tud.DataLoader[Any], state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state's generator states, decoded and tried on a generator like the one each is
    for (a damaged one raises here, not when the epoch begins)."""
    devices = {k: g.device for k, g in generators(loader).items()}
    out = {}
    for key, text in state["rng"].items():
        try:
            decoded = decode_rng(text)
            torch.Generator(device=devices.get(key, "cpu")).set_state(decoded)
        except (binascii.Error, ValueError, RuntimeError) as exc:
            raise fields.bad(
                f"rng[{key!r}]",
                f"is {fields.short(text)} ({type(exc).__name__}: {exc})",
                "a generator state as state_dict() wrote it (base64 text of "
                "torch.Generator.get_state())",
            ) from None
        out[key] = decoded
    return out
