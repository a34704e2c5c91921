"""What decides an epoch's index order, captured when the epoch begins and re-created on resume.

An epoch's batches follow from the random generators its sampler draws from, as they were
when the epoch began (plus a stateful sampler's own state, or that of the iterator it
returns, reached through `sampler_iterator`, and a DistributedSampler's epoch). `capture`
records those; `apply.replay` sets them back and re-creates the sampler's iterator,
skipping the index batches already yielded: microseconds per batch, because no data is
loaded. `Indices` numbers what the sampler yields, so that the iterators can say which
batches were yielded (`YieldedBatches`). Used by `checkpoint.py` (docs/design/resume.md).
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

from ..engine.worker.fetch import ITERABLE, stateful
from . import shards
from .shards import qualname

GLOBAL = "torch.global"  # key of torch's default CPU generator in the saved RNG states

# torch's samplers whose order follows from their generator (or none) and their arguments.
# Exact types only: a subclass may draw its order some other way.
_REPLAYABLE = (
    tud.SequentialSampler,
    tud.RandomSampler,
    tud.SubsetRandomSampler,
    tud.WeightedRandomSampler,
    tud.BatchSampler,
    DistributedSampler,
)
# Framework samplers whose order is a pure function of what they wrap, their arguments and
# a generator (found by `generators`) or an epoch the framework sets before iterating.
_KNOWN_WRAPPERS = frozenset(
    {
        "accelerate.data_loader.BatchSamplerShard",  # a rank's share of the wrapped batches
        "accelerate.data_loader.SkipBatchSampler",  # the wrapped batches minus the first n
        "accelerate.data_loader.SeedableRandomSampler",  # reseeds from initial_seed + epoch
    }
)
_WRAPPERS = frozenset(  # deal or skip the batches of what they wrap: no order of their own
    {"accelerate.data_loader.BatchSamplerShard", "accelerate.data_loader.SkipBatchSampler"}
)
_MAX_DEPTH = 4


def _chain(loader: tud.DataLoader[Any]) -> list[tuple[str, str, Any]]:
    """The sampler objects that decide the index order, outermost first: (attribute path,
    key, object).

    Follows wrappers down (``.batch_sampler``, then ``.sampler``): accelerate's
    BatchSamplerShard holds its batch sampler as ``.batch_sampler``, torch's BatchSampler
    its sampler as ``.sampler``. The key is the path with accelerate's dealing wrappers left
    out (the object inside one takes its place): a state keys generators and sampler states
    by it, so that a state saved on N processes (where accelerate wraps) finds them on one
    (where it does not).
    """
    if loader._auto_collation:
        path, obj = "batch_sampler", loader.batch_sampler
    else:
        path, obj = "sampler", loader.sampler
    out = [(path, path, obj)]
    for _ in range(_MAX_DEPTH):
        for name in ("batch_sampler", "sampler"):
            inner = getattr(obj, name, None)
            if inner is not None and inner is not obj and hasattr(inner, "__iter__"):
                key = out[-1][1]
                key = key if qualname(obj) in _WRAPPERS else f"{key}.{name}"
                path, obj = f"{path}.{name}", inner
                out.append((path, key, obj))
                break
        else:
            break
    return out


def order_of(loader: tud.DataLoader[Any]) -> list[str]:
    """The kinds of the samplers that decide the index order, outermost first, without
    accelerate's dealing wrappers (what a state records, so that a loader with another
    sampler (shuffle=True against False) is refused, `validate`)."""
    if loader._dataset_kind == ITERABLE:
        return []  # the sampler only counts items
    return [qualname(obj) for _, _, obj in _chain(loader) if qualname(obj) not in _WRAPPERS]


ITERATOR = ".__iter__"  # a sampler path + this: the state of that sampler's iterator


def _replayable(obj: Any) -> bool:
    return (
        stateful(obj)
        or type(obj) in _REPLAYABLE
        or qualname(obj) in _KNOWN_WRAPPERS
        or isinstance(obj, (list, tuple, range))
    )


def not_replayable(loader: tud.DataLoader[Any], samplers: dict[str, Any]) -> str | None:
    """Why the loader's sampler cannot be resumed, or None when it can. ``samplers`` are
    the saved sampler states of the epoch (a Stateful sampler iterator's among them)."""
    if loader._dataset_kind == ITERABLE:  # the sampler only counts items
        return None
    for path, key, obj in _chain(loader):
        if stateful(obj) or key + ITERATOR in samplers:
            return None  # saved through its own state_dict (it covers what it wraps)
        if _replayable(obj):
            continue
        return (
            f"the loader's {path} is a {qualname(obj)}, which is neither one of torch's "
            "samplers (whose order steadyload can replay from their random generator) nor "
            "has state_dict()/load_state_dict() (itself or the iterator it returns)"
        )
    return None


class _Given:
    """A sampler whose iterator exists already: torch's BatchSampler batches it."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator

    def __iter__(self) -> Iterator[Any]:
        return self._iterator


def sampler_iterator(
    loader: tud.DataLoader[Any], index_sampler: Any, created: Iterator[Any]
) -> tuple[Iterator[Any], tuple[str, Any] | None]:
    """The epoch's iterator over index batches, made so that the iterator of a sampler
    steadyload cannot replay is reachable when it is Stateful (torchdata's protocol one level
    down: a sampler whose ``__iter__`` returns an object with ``state_dict()``).

    ``created`` is the iterator torch made (``iter(index_sampler)``); for torch's
    BatchSampler over such a sampler it is replaced by the same batching over an iterator
    of the sampler made here. Returns the iterator and (its path, the Stateful iterator).
    """
    if loader._dataset_kind == ITERABLE:
        return created, None
    if type(index_sampler) is tud.BatchSampler:
        if _replayable(index_sampler.sampler):
            return created, None
        inner = iter(index_sampler.sampler)
        batches = tud.BatchSampler(_Given(inner), index_sampler.batch_size, index_sampler.drop_last)
        held = ("batch_sampler.sampler", inner) if stateful(inner) else None
        return iter(batches), held
    if _replayable(index_sampler):
        return created, None
    path = "batch_sampler" if loader._auto_collation else "sampler"
    return created, ((path, created) if stateful(created) else None)


def generators(loader: tud.DataLoader[Any]) -> dict[str, torch.Generator]:
    """Every generator the index order can draw from, by key (`_chain`; deduplicated)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    candidates = [("generator", loader.generator)]
    candidates += [(f"{k}.generator", getattr(o, "generator", None)) for _, k, o in _chain(loader)]
    for key, gen in candidates:
        if isinstance(gen, torch.Generator) and id(gen) not in seen:
            seen.add(id(gen))
            found[key] = gen
    return found


def rng_states(loader: tud.DataLoader[Any]) -> dict[str, torch.Tensor]:
    """The states of the loader's generators and torch's global one, now."""
    states = {key: gen.get_state() for key, gen in generators(loader).items()}
    states[GLOBAL] = torch.get_rng_state()
    return states


def encode_rng(state: torch.Tensor) -> str:
    """A generator's state as text (base64), so that a loader state is JSON-able."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    """`encode_rng`'s text as a generator state.

    Raises:
        binascii.Error: ``text`` is not base64.
    """
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def set_generators(
    loader: tud.DataLoader[Any], states: dict[str, torch.Tensor], *, include_global: bool
) -> None:
    """Put the loader's generators (and, if asked, torch's global one) back to ``states``
    (checked by `validate`: one for each of the loader's generators)."""
    for key, gen in generators(loader).items():
        if key in states:  # (`validate` checked that every one the order draws from is)
            gen.set_state(states[key])
    if include_global and GLOBAL in states:  # (absent: another rank's, see validate)
        torch.set_rng_state(states[GLOBAL])


def load_samplers(loader: tud.DataLoader[Any], samplers: dict[str, Any]) -> None:
    """Give the loader's Stateful samplers their saved states (`EpochStart.samplers`)."""
    for _, key, obj in _chain(loader):
        if key in samplers:
            obj.load_state_dict(copy.deepcopy(samplers[key]))


def reseeded(loader: tud.DataLoader[Any], key: str) -> bool:
    """Whether the generator at ``key`` belongs to a sampler that seeds it anew each epoch
    (accelerate's SeedableRandomSampler: made at its first ``__iter__``): its state decides
    nothing, so a state need not hold it."""
    owner = sampler_at(loader, key.removesuffix(".generator"))
    return owner is not None and qualname(owner) in _KNOWN_WRAPPERS


def stateful_samplers(loader: tud.DataLoader[Any]) -> dict[str, Any]:
    """The sampler whose own state a state holds (the outermost Stateful one), by key."""
    for _, key, obj in _chain(loader):
        if stateful(obj):
            return {key: obj}
    return {}


def sampler_at(loader: tud.DataLoader[Any], key: str) -> Any:
    """The sampler at ``key`` (`_chain`), or None."""
    return next((obj for _, k, obj in _chain(loader) if k == key), None)


@dataclass(slots=True)
class EpochStart:
    """What decided the current epoch's order, captured before the sampler drew from it."""

    epoch: int
    base_seed: int
    rng: dict[str, torch.Tensor]
    samplers: dict[str, Any]
    """A stateful sampler's ``state_dict()`` at the start of the epoch, by path."""
    distributed_epoch: int | None
    """The epoch of the sampler that takes one (`set_epoch`): torch's DistributedSampler,
    accelerate's SeedableRandomSampler."""
    sharding: dict[str, Any] | None = None
    """How the epoch is dealt to ranks (`shards.describe`), with where its dealing began."""
    redealt: bool = False
    """The rest of an epoch saved on another number of ranks, dealt again (`shards`)."""
    skip: list[dict[str, Any]] = field(default_factory=list)
    """The samples skipped on resume in this epoch, as a state keeps them (`skip_samples`)."""


def epoch_holder(loader: tud.DataLoader[Any]) -> Any:
    """The sampler whose order follows from an epoch the training loop sets (`set_epoch`):
    the outermost in the chain with one, or None. A resume on another number of processes
    may find it at another depth (accelerate wraps it in a BatchSamplerShard)."""
    for _, _, obj in _chain(loader):
        epoch = getattr(obj, "epoch", None)
        if callable(getattr(obj, "set_epoch", None)) and isinstance(epoch, int):
            return obj
    return None


def capture(
    loader: tud.DataLoader[Any], epoch: int, base_seed: int, held: tuple[str, Any] | None
) -> EpochStart:
    """What decides the epoch that begins now (call before its sampler draws); ``held`` is
    `sampler_iterator`'s Stateful sampler iterator, if any."""
    samplers = {
        key: copy.deepcopy(obj.state_dict()) for key, obj in stateful_samplers(loader).items()
    }
    if held is not None:
        samplers[held[0] + ITERATOR] = copy.deepcopy(held[1].state_dict())
    holder = epoch_holder(loader)
    return EpochStart(
        epoch=epoch,
        base_seed=base_seed,
        rng=rng_states(loader),
        samplers=samplers,
        distributed_epoch=holder.epoch if holder is not None else None,
        sharding=shards.describe(loader),
    )


@dataclass(slots=True)
class YieldedBatches:
    """Which batches of the epoch were yielded, by ordinal: a prefix and a few beyond it.

    With ``in_order=False`` a later batch can be yielded before an earlier one; those are
    the few (at most the prefetch window) kept in ``beyond``.
    """

    prefix: int = 0
    beyond: set[int] = field(default_factory=set)

    def mark(self, ordinal: int) -> None:
        """Batch number ``ordinal`` of the epoch was yielded."""
        if ordinal != self.prefix:
            self.beyond.add(ordinal)
            return
        self.prefix += 1
        while self.prefix in self.beyond:
            self.beyond.discard(self.prefix)
            self.prefix += 1

    def unmark(self, ordinal: int) -> None:
        """Undo the last `mark`, of batch ``ordinal`` (it was taken back)."""
        if ordinal in self.beyond:
            self.beyond.discard(ordinal)
        elif ordinal < self.prefix:  # the ordinals after it were "beyond" until it came
            self.beyond.update(range(ordinal + 1, self.prefix))
            self.prefix = ordinal

    @property
    def count(self) -> int:
        """Batches yielded."""
        return self.prefix + len(self.beyond)


class Indices:
    """The epoch's sampler output with each item's ordinal; skips the ordinals in ``skip``."""

    def __init__(self, source: Iterator[Any], skip: YieldedBatches | None = None) -> None:
        self._source = source
        self._skip = skip
        self._next = 0
        self._primed: list[Any] = []
        self.ordinal = -1
        """Ordinal (batch number in the epoch) of the item returned last."""

    def __iter__(self) -> Indices:
        return self

    def __next__(self) -> Any:
        if self._primed:
            self.ordinal, item = self._primed.pop()
            return item
        skip = self._skip
        while True:
            item = next(self._source)
            ordinal = self._next
            self._next += 1
            if skip is None or (ordinal >= skip.prefix and ordinal not in skip.beyond):
                self.ordinal = ordinal
                return item

    def prime(self) -> None:
        """Draw the first item now (RandomSampler draws its permutation then)."""
        try:
            item = next(self)
        except StopIteration:
            self._source = iter(())
            return
        self._primed.append((self.ordinal, item))
