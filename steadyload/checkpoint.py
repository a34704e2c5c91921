"""Mid-epoch checkpoint and resume: what `DataLoader.state_dict` saves and
`load_state_dict` restores, and the per-epoch bookkeeping the iterators keep for it.

What decides an epoch's batches is small (`epoch_order.py`): the random generators the
sampler draws from, as they were when the epoch began, and how many batches were yielded
since. So the state holds those (plus the base seed and the epoch number), not lists of
samples. The number of workers plays no part (dispatch never changes which batches exist),
so a run saved with 2 workers resumes with 0, 1 or 3.

Samplers: torch's own (and plain lists/ranges of indices) are replayed; a sampler with
``state_dict``/``load_state_dict`` is saved through them at the start of each epoch; any
other sampler cannot be replayed faithfully and `Checkpoints.save` says so. An
IterableDataset with ``state_dict``/``load_state_dict`` is saved per worker (its stream is
split between workers by the dataset itself, so resuming needs the same ``num_workers``).
See docs/design/resume.md.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data as tud

from .engine.fetch import ITERABLE
from .epoch_order import (
    EpochStart,
    Indices,
    YieldedBatches,
    capture,
    not_replayable,
    replay,
    rng_states,
    set_generators,
    stateful,
)

STATE_FORMAT = "steadyload.DataLoader"
STATE_VERSION = 1


class EpochProgress:
    """One epoch's position, kept by the iterator that runs it and by `Checkpoints` until
    the next epoch begins: a state saved after a ``break`` (the iterator dropped) resumes
    the rest of the epoch; only StopIteration makes the epoch finished.

    The iterator marks each yielded batch in `yielded`, sets `finished` at the epoch's end,
    and, for a stateful IterableDataset with workers, records each worker's stream state
    after its last yielded batch in `streams`.
    """

    __slots__ = ("epoch", "yielded", "finished", "streams", "last_worker", "resume_streams")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        """The loader's epoch number (0 for the first)."""
        self.yielded = YieldedBatches()
        self.finished = False
        self.streams: dict[int, bytes] = {}
        """worker id -> pickled stream state after that worker's last yielded batch."""
        self.last_worker: int | None = None
        """The worker whose batch was yielded last (dispatch resumes after it)."""
        self.resume_streams: dict[str, Any] | None = None
        """A loaded stream position for the iterator to restore, then clear."""


@dataclass(frozen=True, slots=True)
class Mark:
    """Where a loader stood at one moment (`Checkpoints.mark`); `Checkpoints.save` makes it
    a state. ``start`` is set for a mark in the middle of an epoch, ``pending`` for a loaded
    state not yet used, ``rng`` for a mark between epochs (the generators then);
    ``unsaveable`` says why a stream's position at the mark cannot be saved."""

    epoch: int
    finished: bool
    prefix: int
    beyond: frozenset[int]
    start: EpochStart | None
    pending: dict[str, Any] | None
    rng: dict[str, torch.Tensor] | None
    stream: dict[str, Any] | None
    base_seed: int | None = None
    unsaveable: str | None = None


def _persistent(loader: tud.DataLoader[Any]) -> bool:
    return bool(loader.persistent_workers and loader.num_workers > 0)


def _fail(what: str, why: str, fix: str) -> ValueError:
    return ValueError(f"{what}\nWhy: {why}\nFix: {fix}")


_REPLAY_WHY_FIX = (  # a sampler whose order cannot be re-created
    "resuming means re-creating exactly the index order of the interrupted epoch.",
    ("add state_dict() and load_state_dict() to the sampler (its state at the start of an "
     "epoch must determine that epoch's order), or use one of torch's samplers."),
)


def _dataset_len(loader: tud.DataLoader[Any]) -> int | None:
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


class Checkpoints:
    """A loader's epoch count and resume state; one per loader.

    Iterators call `begin_epoch` right after torch created the epoch's sampler iterator
    (and workers iterators `apply_base_seed` before configuring their workers); the loader
    calls `save` and `load`. Not thread-safe, like the loader.
    """

    def __init__(self) -> None:
        self.epoch = -1
        self._start: EpochStart | None = None
        self._pending: dict[str, Any] | None = None  # loaded, waiting for the next epoch
        self._skip = 0  # batches the next epoch starts after (skip_next_epoch)
        self._current: EpochProgress | None = None  # the latest epoch, even once its
        # iterator is dropped (a loop that broke out): torchdata's StatefulDataLoader keeps it

    # -- called by the iterators ---------------------------------------------------------
    def begin_epoch(self, loader: tud.DataLoader[Any], it: Any) -> EpochProgress:
        """Record what decides this epoch's order, or, after `load`, make the epoch the
        saved one: generators reset, already-yielded batches skipped.

        ``it`` is torch's iterator (``_sampler_iter``, ``_base_seed``, ``_index_sampler``,
        ``_num_yielded``); its sampler iterator is wrapped to number the batches.
        """
        pending, self._pending = self._pending, None
        skip, self._skip = self._skip, 0
        it._sampler_iter = Indices(it._sampler_iter, skip=YieldedBatches(skip) if skip else None)
        if pending is not None:
            self._apply_base_seed(loader, it, pending)
            if not pending["finished"]:
                progress = EpochProgress(self.epoch)
                self._start, it._sampler_iter, progress.yielded = replay(
                    loader, it._index_sampler, pending, int(it._base_seed)
                )
                it._num_yielded = progress.yielded.count
                progress.resume_streams = pending["stream"]
                self._current = progress
                return progress
        self.epoch += 1
        progress = EpochProgress(self.epoch)
        if skip:
            progress.yielded = YieldedBatches(skip)  # counted as yielded: later saves are exact
            it._num_yielded = skip
        self._start = capture(loader, self.epoch, int(it._base_seed))
        self._current = progress
        return progress

    def apply_base_seed(self, loader: tud.DataLoader[Any], it: Any) -> None:
        """Give a resumed iterator the saved base seed (before its workers are configured)."""
        if self._pending is not None:
            self._apply_base_seed(loader, it, self._pending)

    def replaces_base_seed(self, loader: tud.DataLoader[Any]) -> bool:
        """Whether the next iterator's base seed will be the loaded state's, not its own."""
        return self._pending is not None and self._uses_saved_seed(loader, self._pending)

    @staticmethod
    def _uses_saved_seed(loader: tud.DataLoader[Any], state: dict[str, Any]) -> bool:
        # Mid-epoch, the saved epoch's seed; persistent workers keep one for their life.
        return state["base_seed"] is not None and (not state["finished"] or _persistent(loader))

    @classmethod
    def _apply_base_seed(cls, loader: tud.DataLoader[Any], it: Any, state: dict[str, Any]) -> None:
        if cls._uses_saved_seed(loader, state):
            it._base_seed = state["base_seed"]

    def for_twin(self) -> Checkpoints:
        """The run's position for a loader that replaces this one (`DataLoader.from_loader`):
        the epoch count, a loaded state not yet used, a requested skip."""
        twin = Checkpoints()
        twin.epoch, twin._skip = self.epoch, self._skip
        twin._pending = copy.deepcopy(self._pending)
        return twin

    # -- called by the loader and the integrations ----------------------------------------
    @property
    def pending(self) -> dict[str, Any] | None:
        """The state `load` parked for the next epoch (not a copy), or None."""
        return self._pending

    def skip_next_epoch(self, loader: tud.DataLoader[Any], batches: int) -> None:
        """Start the next epoch after its first ``batches`` batches, loading none of them.

        Their indices are still drawn, so the rest of the epoch is the epoch's own order (as
        accelerate's ``SkipBatchSampler`` gives), at microseconds per batch; they count as
        yielded, so a state saved later in that epoch resumes exactly. For resuming from a
        batch count without a saved state (the transformers Trainer's resume path).

        Raises:
            ValueError: ``batches`` is negative, the dataset is an IterableDataset (its
                stream cannot be skipped without reading it), or a loaded state is pending
                (it already says where the next epoch starts).
        """
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"batches to skip must be an int >= 0, got {batches!r}")
        if loader._dataset_kind == ITERABLE:
            raise ValueError(
                "steadyload cannot skip batches of an IterableDataset without reading them: "
                "its stream has no index to skip by."
            )
        if self._pending is not None:
            raise ValueError(
                "a loaded state already says where the next epoch starts; skipping batches "
                "as well would skip them twice."
            )
        self._skip = batches

    def mark(self, loader: tud.DataLoader[Any]) -> Mark:
        """Where the loader stands now, cheaply (a few µs: frameworks take one per batch);
        `save` makes it a state only when asked."""
        if self._pending is not None:
            return Mark(self.epoch, True, 0, frozenset(), None, self._pending, None, None)
        progress = self._current
        start = self._start
        if progress is None or start is None or progress.finished:
            # The next epoch draws from the generators as they are now: keep them.
            seed = start.base_seed if start is not None else None
            return Mark(
                self.epoch, True, 0, frozenset(), None, None, rng_states(loader), None, seed
            )
        yielded = progress.yielded
        stream, unsaveable = None, None
        if loader._dataset_kind == ITERABLE:
            try:
                stream = _stream_state(loader, progress, finished=False)
            except ValueError as exc:  # said by save(), when a state is asked for
                unsaveable = str(exc)
        return Mark(
            self.epoch, False, yielded.prefix, frozenset(yielded.beyond), start, None, None,
            stream, start.base_seed, unsaveable,
        )  # fmt: skip

    def save(self, loader: tud.DataLoader[Any], at: Mark | None = None) -> dict[str, Any]:
        """`DataLoader.state_dict`: the loader's position (now, or at a `mark`), as plain
        Python and tensors."""
        reason = not_replayable(loader)
        if reason is not None:
            raise _fail("steadyload cannot save this DataLoader's position: " + reason + ".",
                        *_REPLAY_WHY_FIX)
        at = at if at is not None else self.mark(loader)
        if at.unsaveable is not None:
            raise ValueError(at.unsaveable)  # a fresh error each time: no growing traceback
        if at.pending is not None:
            return copy.deepcopy(at.pending)  # loaded but not yet iterated: unchanged
        start = at.start
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": at.epoch,
            "finished": at.finished,
            "batches_yielded": at.prefix,
            "yielded_beyond": sorted(at.beyond),
            "base_seed": at.base_seed,
            "rng": {k: v.clone() for k, v in (at.rng or {}).items()},
            "samplers": {},
            "distributed_epoch": None,
            "dataset_len": _dataset_len(loader),
            "batch_size": loader.batch_size,
            "drop_last": loader.drop_last,
            "num_workers": loader.num_workers,
            "persistent": _persistent(loader),
            "stream": at.stream,
        }
        if start is not None:  # mid-epoch: what decided the epoch, as it began
            state.update(
                rng={k: v.clone() for k, v in start.rng.items()},
                samplers=copy.deepcopy(start.samplers),
                distributed_epoch=start.distributed_epoch,
            )
        return state

    def load(self, loader: tud.DataLoader[Any], state: Any) -> None:
        """`DataLoader.load_state_dict`: validate ``state``; the next epoch resumes it."""
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
        reason = not_replayable(loader)
        if reason is not None and not state["finished"]:
            raise _fail("steadyload cannot resume this DataLoader mid-epoch: " + reason + ".",
                        *_REPLAY_WHY_FIX)
        self.epoch = state["epoch"]
        self._pending = copy.deepcopy(state)
        self._skip = 0  # the loaded position supersedes a requested skip
        if state["finished"]:
            # The next epoch draws from the generators as they were when the state was saved.
            set_generators(loader, state["rng"], include_global=False)


def _stream_state(
    loader: tud.DataLoader[Any], progress: EpochProgress | None, finished: bool
) -> dict[str, Any] | None:
    dataset = loader.dataset
    if not stateful(dataset):
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
    assert progress is not None
    return {"workers": dict(progress.streams), "last_worker": progress.last_worker}
