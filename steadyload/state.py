"""Mid-epoch checkpoint and resume: `DataLoader.state_dict` / `load_state_dict`.

What decides an epoch's batches is small: the random generators the sampler draws from,
as they were when the epoch began, and how many batches were yielded since. So the state
holds those (plus the base seed and the epoch number), not lists of samples. Resuming
sets the generators back, re-creates the sampler's iterator and skips the index batches
already yielded; skipping indices costs microseconds per batch because no data is loaded.
The number of workers plays no part (dispatch never changes which batches exist), so a
run saved with 2 workers resumes with 0, 1 or 3.

Samplers: torch's own (and plain lists/ranges of indices) are replayed as above; a sampler
with ``state_dict``/``load_state_dict`` is saved through them at the start of each epoch;
any other sampler cannot be replayed faithfully and `state_dict` says so. An
IterableDataset with ``state_dict``/``load_state_dict`` is saved per worker (its stream is
split between workers by the dataset itself, so resuming needs the same ``num_workers``).
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

from .engine.fetch import ITERABLE

if TYPE_CHECKING:
    from .loader import DataLoader

STATE_FORMAT = "steadyload.DataLoader"
STATE_VERSION = 1
_GLOBAL = "torch.global"  # key of torch's default CPU generator in the saved RNG states

# torch's samplers whose order follows from their generator (or none) and their arguments.
_REPLAYABLE = (
    tud.SequentialSampler, tud.RandomSampler, tud.SubsetRandomSampler,
    tud.WeightedRandomSampler, tud.BatchSampler, DistributedSampler,
)  # fmt: skip


def _chain(loader: DataLoader[Any]) -> list[tuple[str, Any]]:
    """The sampler objects that decide the index order, outermost first, with their paths."""
    if loader._auto_collation:
        top: tuple[str, Any] = ("batch_sampler", loader.batch_sampler)
    else:
        top = ("sampler", loader.sampler)
    out = [top]
    inner = getattr(top[1], "sampler", None)
    if isinstance(top[1], tud.BatchSampler) and inner is not None:
        out.append((f"{top[0]}.sampler", inner))
    return out


def _persistent(loader: DataLoader[Any]) -> bool:
    return bool(loader.persistent_workers and loader.num_workers > 0)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _not_replayable(loader: DataLoader[Any]) -> str | None:
    """Why the loader's sampler cannot be resumed, or None when it can."""
    if loader._dataset_kind == ITERABLE:  # the sampler only counts items
        return None
    for path, obj in _chain(loader):
        if _stateful(obj):
            return None  # saved through its own state_dict (it covers what it wraps)
        if isinstance(obj, _REPLAYABLE) or isinstance(obj, (list, tuple, range)):
            continue
        return (
            f"the loader's {path} is a {type(obj).__module__}.{type(obj).__qualname__}, "
            "which is neither one of torch's samplers (whose order steadyload can replay "
            "from their random generator) nor has state_dict()/load_state_dict()"
        )
    return None


def _generators(loader: DataLoader[Any]) -> dict[str, torch.Generator]:
    """Every generator the index order can draw from, by attribute path (deduplicated)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    candidates = [("generator", loader.generator)]
    candidates += [(f"{p}.generator", getattr(o, "generator", None)) for p, o in _chain(loader)]
    for path, gen in candidates:
        if isinstance(gen, torch.Generator) and id(gen) not in seen:
            seen.add(id(gen))
            found[path] = gen
    return found


def rng_states(loader: DataLoader[Any]) -> dict[str, torch.Tensor]:
    """The states of the loader's generators and torch's global one, now."""
    states = {path: gen.get_state() for path, gen in _generators(loader).items()}
    states[_GLOBAL] = torch.get_rng_state()
    return states


@dataclass(slots=True)
class EpochStart:
    """What decided the current epoch's order, captured before the sampler drew from it."""

    epoch: int
    base_seed: int
    rng: dict[str, torch.Tensor]
    samplers: dict[str, Any]
    """A stateful sampler's ``state_dict()`` at the start of the epoch, by path."""
    distributed_epoch: int | None


@dataclass(slots=True)
class Progress:
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

    @property
    def count(self) -> int:
        """Batches yielded."""
        return self.prefix + len(self.beyond)


@dataclass(slots=True)
class Resume:
    """A loaded state waiting for the next epoch to begin (see `begin_epoch`)."""

    state: dict[str, Any]


def _fail(what: str, why: str, fix: str) -> ValueError:
    return ValueError(f"{what}\nWhy: {why}\nFix: {fix}")


def _dataset_len(loader: DataLoader[Any]) -> int | None:
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def save(loader: DataLoader[Any]) -> dict[str, Any]:
    """`DataLoader.state_dict`: the loader's position, as plain Python and tensors."""
    reason = _not_replayable(loader)
    if reason is not None:
        raise _fail(
            "steadyload cannot save this DataLoader's position: " + reason + ".",
            "resuming means re-creating exactly the index order of the interrupted epoch.",
            "add state_dict() and load_state_dict() to the sampler (its state at the start "
            "of an epoch must determine that epoch's order), or use one of torch's samplers.",
        )
    pending = loader._resume
    if pending is not None:
        return copy.deepcopy(pending.state)  # loaded but not yet iterated: unchanged
    it = loader._current_iter()
    start: EpochStart | None = loader._epoch_start
    finished = it is None or start is None or it._sl_finished
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "epoch": loader._epoch,
        "finished": finished,
        "batches_yielded": 0,
        "yielded_beyond": [],
        "base_seed": start.base_seed if start is not None else None,
        "rng": rng_states(loader),
        "samplers": {},
        "distributed_epoch": None,
        "dataset_len": _dataset_len(loader),
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "num_workers": loader.num_workers,
        "persistent": _persistent(loader),
        "stream": None,
    }
    if not finished:
        assert it is not None and start is not None
        progress: Progress = it._sl_progress
        state.update(
            batches_yielded=progress.prefix,
            yielded_beyond=sorted(progress.beyond),
            rng={k: v.clone() for k, v in start.rng.items()},
            samplers=copy.deepcopy(start.samplers),
            distributed_epoch=start.distributed_epoch,
        )
    if loader._dataset_kind == ITERABLE:
        state["stream"] = _stream_state(loader, it, finished)
    return state


def _stream_state(loader: DataLoader[Any], it: Any, finished: bool) -> dict[str, Any] | None:
    dataset = loader.dataset
    if not _stateful(dataset):
        if finished:
            return None
        raise _fail(
            f"steadyload cannot save the position of {type(dataset).__qualname__} mid-epoch: "
            "it is an IterableDataset without state_dict()/load_state_dict().",
            "a stream cannot be replayed from its start without reading it again, and "
            "steadyload will not guess where it stood.",
            "give the dataset state_dict()/load_state_dict() (its position in the stream), "
            "or checkpoint only at the end of an epoch.",
        )
    if finished:
        return None
    if loader.num_workers == 0:
        return {"workers": {-1: pickle.dumps(dataset.state_dict())}}  # type: ignore[attr-defined]
    return dict(it._stream_resume_state())


def load(loader: DataLoader[Any], state: Any) -> None:
    """`DataLoader.load_state_dict`: validate ``state``; the next ``iter()`` resumes it."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise _fail(
            "load_state_dict() expects the dict that steadyload.DataLoader.state_dict() "
            f"returned, got {type(state).__name__}"
            + (f" with keys {list(state)[:8]}" if isinstance(state, dict) else "") + ".",
            "only a steadyload loader state says where its epoch stood.",
            "pass loader.state_dict() as saved in your checkpoint.",
        )
    version = state.get("version")
    if version != STATE_VERSION:
        raise _fail(
            f"this loader state has version {version!r}; this steadyload reads version "
            f"{STATE_VERSION}.",
            "the state was written by a different steadyload release.",
            "resume with the steadyload version that saved it, or restart the epoch.",
        )
    for key, now in (
        ("dataset_len", _dataset_len(loader)), ("batch_size", loader.batch_size),
        ("drop_last", loader.drop_last),
    ):  # fmt: skip
        if state[key] != now:
            raise _fail(
                f"the saved loader had {key}={state[key]!r}, this one has {now!r}.",
                "the remaining batches of the saved epoch would be different ones.",
                "build the loader with the same dataset and arguments as the saved one.",
            )
    if state["stream"] is not None and state["num_workers"] != loader.num_workers:
        raise _fail(
            f"this IterableDataset was saved mid-epoch with num_workers="
            f"{state['num_workers']}, and this loader has num_workers={loader.num_workers}.",
            "an IterableDataset splits its stream between workers itself, so each worker's "
            "position only means something with the same number of workers.",
            f"resume with num_workers={state['num_workers']}.",
        )
    if state["persistent"] != _persistent(loader):
        warnings.warn(
            "this loader state was saved by a loader "
            f"{'with' if state['persistent'] else 'without'} persistent workers and is loaded "
            f"into one {'with' if _persistent(loader) else 'without'}: the rest of the saved "
            "epoch is the same, but later epochs will differ from the uninterrupted run, "
            "because torch draws a new base seed at each epoch only without persistent "
            "workers (and shuffling draws after it). Use the same persistent_workers "
            "setting (and num_workers > 0 with it) to continue identically.",
            UserWarning, stacklevel=3,
        )
    reason = _not_replayable(loader)
    if reason is not None and not state["finished"]:
        raise _fail(
            "steadyload cannot resume this DataLoader mid-epoch: " + reason + ".", "", ""
        )
    live = getattr(loader, "_iterator", None)
    if live is not None:
        # Persistent workers were configured with the old base seed: start afresh.
        live._shutdown_workers()
        loader._iterator = None
    loader._epoch = state["epoch"]
    loader._resume = Resume(copy.deepcopy(state))
    if state["finished"]:
        # The next epoch draws from the generators as they were when the state was saved.
        _set_generators(loader, state["rng"], include_global=False)


def _set_generators(
    loader: DataLoader[Any], states: dict[str, torch.Tensor], *, include_global: bool
) -> None:
    for path, gen in _generators(loader).items():
        if path in states:
            gen.set_state(states[path])
    if include_global:
        torch.set_rng_state(states[_GLOBAL])


class Indices:
    """The epoch's sampler output with each item's ordinal; skips the ordinals in ``skip``."""

    def __init__(self, source: Iterator[Any], skip: Progress | None = None) -> None:
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


def begin_epoch(loader: DataLoader[Any], it: Any) -> int:
    """Called by an iterator right after it created the epoch's sampler iterator.

    Records what decides this epoch's order (for `save`), or, after `load`, makes the
    epoch the saved one: generators reset, already-yielded batches skipped. Returns the
    epoch number.
    """
    pending, loader._resume = loader._resume, None
    it._sampler_iter = Indices(it._sampler_iter)
    it._sl_finished = False
    it._sl_progress = Progress()
    it._sl_stream_resume = None
    loader._set_current_iter(it)
    if pending is not None:
        state = pending.state
        apply_base_seed(loader, it, pending)
        if not state["finished"]:
            _resume_mid_epoch(loader, it, state)
            return loader._epoch
    loader._epoch += 1
    _record_start(loader, it)
    return loader._epoch


def apply_base_seed(loader: DataLoader[Any], it: Any, pending: Resume | None = None) -> None:
    """Give a resumed iterator the saved base seed (before its workers are configured)."""
    pending = pending or loader._resume
    if pending is None:
        return
    state = pending.state
    if state["base_seed"] is not None and (
        not state["finished"] or (loader.persistent_workers and loader.num_workers > 0)
    ):
        it._base_seed = state["base_seed"]  # persistent workers keep one base seed


def _record_start(loader: DataLoader[Any], it: Any) -> None:
    samplers = {}
    for path, obj in _chain(loader):
        if _stateful(obj):
            samplers[path] = copy.deepcopy(obj.state_dict())
            break
    sampler = loader.sampler
    loader._epoch_start = EpochStart(
        epoch=loader._epoch,
        base_seed=int(it._base_seed),
        rng=rng_states(loader),
        samplers=samplers,
        distributed_epoch=sampler.epoch if isinstance(sampler, DistributedSampler) else None,
    )


def _resume_mid_epoch(loader: DataLoader[Any], it: Any, state: dict[str, Any]) -> None:
    caller_rng = torch.get_rng_state()
    _set_generators(loader, state["rng"], include_global=True)
    for path, obj in _chain(loader):
        if path in state["samplers"]:
            obj.load_state_dict(copy.deepcopy(state["samplers"][path]))
    if state["distributed_epoch"] is not None and isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(state["distributed_epoch"])
    _record_start(loader, it)  # the same start, so that a later save works in this epoch
    progress = Progress(state["batches_yielded"], set(state["yielded_beyond"]))
    it._sampler_iter = Indices(iter(it._index_sampler), skip=progress)
    # Draw now (RandomSampler draws its permutation at the first next()), while the global
    # generator holds the saved state; then give the caller's state back.
    it._sampler_iter.prime()
    torch.set_rng_state(caller_rng)
    it._sl_progress = Progress(progress.prefix, set(progress.beyond))
    it._num_yielded = progress.count
    if state["stream"] is not None:
        it._sl_stream_resume = state["stream"]

