"""Resume without some samples: ``load_state_dict(state, skip_samples=...)`` (issue #37).

A skip is a stage of the epoch's order, kept in the state (``skip``, a list in the order the
skips were made) with what decided the epoch (`EpochStart.skip`):
``{"at": A, "beyond": [...], "samples": [...]}``. The first ``A`` items of the order pass
as they are (and the ``beyond`` ones, yielded out of order before the skip, are dropped:
they were consumed); the rest loses every occurrence of ``samples`` and is batched again
as the loader batches (`Batching`). Stages apply one after the other, so skips made at
successive resumes compose, and a state saved later in the epoch replays them all.

The order a stage applies to is this rank's sequence of index batches (``A``: a batch
ordinal), or, for an epoch that steadyload deals to ranks (`shards`), the order the ranks
share (``A``: a unit of it, samples for a DistributedSampler): the skipped samples leave
the shared order before its rest is dealt, so every rank keeps as many batches as the
others (lockstep) and every other sample is seen once. See docs/design/resume.md.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch.utils.data as tud

from ..engine.worker.fetch import ITERABLE

_SHOWN = 5  # indices named in a message


class Skip(NamedTuple):
    """The skip of the latest ``load_state_dict(..., skip_samples=)``: for the record of
    what was left out on purpose (`Checkpoints.last_skip`)."""

    epoch: int
    """The epoch it applies to (the next one, for a state saved between epochs)."""
    step: int
    """Batches of this rank's epoch before it (the state's ``batches_yielded``; 0 between
    epochs): the first batch without the samples is batch number ``step`` of the epoch."""
    samples: frozenset[int]
    """The dataset indices asked to be skipped (those already consumed are warned about
    when the epoch begins, and cannot be skipped)."""


class Batching(NamedTuple):
    """How the rest of an order is batched again once samples left it."""

    batched: bool
    """Its items are batches of indices (auto-collation); else single indices, filtered."""
    size: int | None = None
    """Batched again to this size (torch's BatchSampler); None: each batch is filtered and
    an emptied one dropped (a custom batch sampler's batches are its own)."""
    drop_last: bool = False


INDICES = Batching(batched=False)  # an order of single indices (a DistributedSampler's)


def batching(loader: tud.DataLoader[Any], index_sampler: Any) -> Batching:
    """How ``loader``'s index batches are made (``index_sampler``: torch's iterator's)."""
    if not loader._auto_collation:
        return INDICES
    if type(index_sampler) is tud.BatchSampler:
        return Batching(True, index_sampler.batch_size, index_sampler.drop_last)
    return Batching(True)


def of_batches(batches: Any) -> Batching:
    """The batching of a batch sampler whose batches form the order (accelerate's)."""
    size, drop_last = getattr(batches, "batch_size", None), getattr(batches, "drop_last", False)
    return Batching(True, size, bool(drop_last))


def _fail(what: str, why: str, fix: str) -> ValueError:
    return ValueError(f"{what}\nWhy: {why}\nFix: {fix}")


def _index(value: Any) -> int | None:
    """``value`` as a dataset index (an int, a numpy or 0-d tensor int), or None."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def requested(
    loader: tud.DataLoader[Any],
    skip: Iterable[Any] | None,
    sharding: dict[str, Any] | None,
    dealt: dict[str, Any] | None,
) -> frozenset[int]:
    """``skip_samples`` checked (``sharding``: the state's; ``dealt``: how ``loader`` deals
    it, `shards.of`), as a set of dataset indices; empty for None.

    Raises:
        ValueError: not an iterable of ints, an index outside the dataset, a stream, or an
            epoch dealt to ranks by a sampler steadyload cannot deal again.
    """
    if skip is None:
        return frozenset()
    fix = "pass skip_samples as the dataset indices to leave out, e.g. [120, 77, 301]."
    if loader._dataset_kind == ITERABLE:
        raise _fail(
            "skip_samples needs a map-style dataset; this loader's dataset, a "
            f"{type(loader.dataset).__qualname__}, is an IterableDataset.",
            "a stream has no indices: steadyload cannot tell which of its items to leave "
            "out without reading them.",
            "resume without skip_samples and filter the items in the stream itself.",
        )
    if isinstance(skip, (str, bytes)) or not isinstance(skip, Iterable):
        raise _fail(
            "skip_samples must be an iterable of dataset indices (ints), got "
            f"{skip!r:.60} ({type(skip).__name__}).",
            "each item names one sample to leave out, as dataset[i] takes it.",
            fix,
        )
    out = set()
    try:
        n: int | None = len(loader.dataset)  # type: ignore[arg-type]  # (checked: TypeError)
    except TypeError:
        n = None
    top = f"0 to {n - 1}" if n is not None else ">= 0"
    for value in skip:
        index = _index(value)
        if index is None:
            raise _fail(
                f"skip_samples holds {value!r} ({type(value).__name__}); expected dataset "
                "indices (ints, not bools).",
                "each item names one sample to leave out, as dataset[i] takes it.",
                fix,
            )
        if index < 0 or (n is not None and index >= n):
            raise _fail(
                f"skip_samples holds {index}, which is not an index of this loader's "
                f"dataset ({top}).",
                "skip_samples are positions in the dataset (what the sampler yields), "
                "not negative offsets or positions in an epoch.",
                fix,
            )
        out.add(index)
    for s in (sharding, dealt):
        if out and s is not None and not s["exact"]:
            raise _fail(
                "skip_samples cannot resume this loader: its epoch is dealt to ranks by a "
                "DistributedSampler subclass or one inside a custom batch sampler.",
                "without the skipped samples the rest of the epoch is dealt to the ranks "
                "again, so that every rank keeps as many batches as the others; steadyload "
                "deals as torch's DistributedSampler does, and cannot know how that one "
                "deals or batches.",
                "use torch's DistributedSampler with batch_size= (or accelerate's "
                "sharding), or resume without skip_samples.",
            )
    return frozenset(out)


def stage(at: int, beyond: Iterable[int], samples: Iterable[int]) -> dict[str, Any]:
    """A state's record of one skip (JSON-able)."""
    return {"at": at, "beyond": sorted(beyond), "samples": sorted(samples)}


def staged(
    source: Iterable[Any], stages: list[dict[str, Any]], how: Batching, *, warn: bool = False
) -> Iterator[Any]:
    """``source`` (an order of index batches, or of indices) with ``stages`` applied in
    turn, lazily. With ``warn``, the last stage is a new skip: the indices it names that
    were consumed before it are warned about (once its first ``at`` items went by)."""
    out: Iterator[Any] = iter(source)
    for i, record in enumerate(stages):
        out = _apply(out, record, how, warn and i == len(stages) - 1)
    return out


def _apply(
    source: Iterator[Any], record: dict[str, Any], how: Batching, warn: bool
) -> Iterator[Any]:
    at, beyond = record["at"], frozenset(record["beyond"])
    drop = frozenset(record["samples"])
    consumed: set[int] = set()
    for item in itertools.islice(source, at):
        if warn:
            consumed.update(_hits(item, drop, how))
        yield item
    kept = []
    if beyond:  # (in_order=False: yielded before the skip, a few batches past ``at``)
        for ordinal, item in enumerate(itertools.islice(source, max(beyond) + 1 - at), at):
            if ordinal in beyond:
                consumed.update(_hits(item, drop, how))
            else:
                kept.append(item)
    if warn and consumed:
        _warn_consumed(consumed, len(drop))
    yield from _rebatched(itertools.chain(kept, source), drop, how)


def _hits(item: Any, drop: frozenset[int], how: Batching) -> list[int]:
    found = (_index(i) for i in (item if how.batched else (item,)))
    return [i for i in found if i is not None and i in drop]


def _rebatched(items: Iterator[Any], drop: frozenset[int], how: Batching) -> Iterator[Any]:
    if not how.batched:
        yield from (i for i in items if _index(i) not in drop)
        return
    if how.size is None:
        for batch in items:
            kept = [i for i in batch if _index(i) not in drop]
            if kept:
                yield kept
        return
    batch = []  # torch's BatchSampler over what is left
    for i in (i for b in items for i in b if _index(i) not in drop):
        batch.append(i)
        if len(batch) == how.size:
            yield batch
            batch = []
    if batch and not how.drop_last:
        yield batch


def _warn_consumed(consumed: set[int], asked: int) -> None:
    shown = ", ".join(map(str, sorted(consumed)[:_SHOWN]))
    more = ", ..." if len(consumed) > _SHOWN else ""
    warnings.warn(
        f"steadyload: {len(consumed)} of the {asked} skip_samples had already been loaded "
        f"before the saved position ({shown}{more}), so they cannot be skipped and are "
        "ignored; the rest of the epoch is without the others. To skip them too, resume "
        "from an earlier checkpoint; to silence this, pass only indices not yet loaded.",
        UserWarning,
        stacklevel=2,
    )


def warn_unsharded(ranks: int) -> None:
    """Warn that the ranks of a run without a sharding sampler each skip on their own."""
    warnings.warn(
        f"steadyload: skip_samples on a loader without a sharding sampler in a run of {ranks} "
        "ranks: each rank leaves the samples out of its own rest, so the ranks may end the "
        "epoch after different numbers of batches (a collective such as DDP's all-reduce "
        "would then wait). Shard with torch's DistributedSampler: steadyload then deals the "
        "rest to the ranks again, as many batches each.",
        UserWarning,
        stacklevel=5,  # the caller of DataLoader.load_state_dict
    )
