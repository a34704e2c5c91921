"""Mid-epoch checkpoint and resume: what `DataLoader.state_dict` saves (capture, here) and
`load_state_dict` restores (the state checked whole by `validate.check`, then applied as the
next epoch begins: `apply.replay`, and the base seed here); the per-epoch bookkeeping the
iterators keep for it is `progress.py`.

What decides an epoch's batches is small (`epoch_order.py`): the random generators the
sampler draws from, as they were when the epoch began, and how many batches were yielded
since. So the state holds those (plus the base seed and the epoch number), not lists of
samples. The number of workers plays no part (dispatch never changes which batches exist),
so a run saved with 2 workers resumes with 0, 1 or 3.

Samplers: torch's own (and plain lists/ranges of indices) are replayed; a sampler with
``state_dict``/``load_state_dict`` (or whose iterator has them) is saved through them at
the start of each epoch; any other sampler cannot be replayed faithfully and
`Checkpoints.save` says so. A dataset with its own state (a stream, or its iterator; a
Stateful map-style dataset) is saved per worker (`progress.py`), so resuming it needs the
same ``num_workers``. See docs/design/resume.md.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.utils.data as tud

from ..engine.remote.spec import all_workers
from ..engine.worker.fetch import ITERABLE, restore_replica
from . import shards
from .apply import replay, skipping
from .epoch_order import (
    EpochStart,
    Indices,
    YieldedBatches,
    capture,
    encode_rng,
    load_samplers,
    not_replayable,
    order_of,
    sampler_iterator,
    set_generators,
)
from .ledger.record import Recorder, recorder_for
from .progress import EpochProgress, fail, persistent, replica_positions, saved_positions
from .skip_samples import Skip
from .validate import REPLAY_WHY_FIX, STATE_FORMAT, STATE_VERSION, Resume, check, dataset_len

_LOG = logging.getLogger(__name__)
_NONE: frozenset[int] = frozenset()


class Mark(NamedTuple):
    """Where a loader stood at one moment (`Checkpoints.mark`); `Checkpoints.save` makes it
    a state. ``start`` is what decided the epoch in progress or, between epochs, what
    decides the next (the generators and samplers now); ``pending`` is a loaded state not
    yet used; ``positions`` are the dataset replicas' (`progress.replica_positions`);
    ``unsaveable`` says why a stream's position at the mark cannot be saved."""

    epoch: int
    finished: bool
    prefix: int
    beyond: frozenset[int]
    start: EpochStart | None
    pending: Resume | None
    positions: dict[str, Any] | None
    base_seed: int | None = None
    unsaveable: str | None = None
    step_base: int = 0  # the epoch's steps before its ordinal 0 (a re-dealt rest: the state's)


class Checkpoints:
    """A loader's epoch count and resume state; one per loader.

    Iterators call `begin_epoch` right after torch created the epoch's sampler iterator
    (and workers iterators `apply_base_seed` before configuring their workers); the loader
    calls `save` and `load`. Not thread-safe, like the loader.
    """

    def __init__(self) -> None:
        self.epoch = -1
        self._start: EpochStart | None = None
        self._pending: Resume | None = None  # loaded and checked, waiting for the next epoch
        self._frame: tuple[EpochStart, dict[str, Any], str | None] | None = None  # `_constant`
        self._skip = 0  # batches the next epoch starts after (skip_next_epoch)
        self._caller_rng: tuple[torch.Generator | None, torch.Tensor] | None = None
        self._current: EpochProgress | None = None  # the latest epoch, even once its
        # iterator is dropped (a loop that broke out): torchdata's StatefulDataLoader keeps it
        self.ledger: Recorder | None = None  # ledger=: what every step trained on
        self.consumed: Callable[[], Mark | None] | None = None
        """Where the loop consuming this loader stands, when a wrapper reads ahead of it
        (accelerate's shard takes one batch early): set by the integration that knows."""
        self.last_skip: Skip | None = None
        """The skip the latest `load` asked for (``skip_samples``), or None: what was left
        out on purpose, for a record of the run."""

    # -- called by the iterators ---------------------------------------------------------
    def begin_epoch(self, loader: tud.DataLoader[Any], it: Any) -> EpochProgress:
        """Record what decides this epoch's order, or, after `load`, make the epoch the
        saved one: generators reset, already-yielded batches skipped.

        ``it`` is torch's iterator (``_sampler_iter``, ``_base_seed``, ``_index_sampler``,
        ``_num_yielded``); its sampler iterator is wrapped to number the batches.
        """
        pending, self._pending = self._pending, None
        if pending is None and self._left_redealt():
            # A framework that counts the resumed epoch in the new world size's len() may
            # start its next epoch before the rest was delivered: the rest comes first.
            pending = check(
                loader, self.save(loader, at=self.consumed() if self.consumed else None)
            )
            _LOG.info(
                "steadyload: the re-dealt epoch %d was left with batches to go: this "
                "iterator delivers them first (a re-dealt epoch ends at its end)",
                pending.epoch,
            )
        skip, self._skip = self._skip, 0
        self._apply_base_seed(it, pending)
        if pending is not None and not pending.finished:
            progress = EpochProgress(self.epoch)
            self._start, it._sampler_iter, progress.yielded = replay(
                loader, it._index_sampler, pending, int(it._base_seed)
            )
            it._num_yielded = progress.yielded.count
            progress.resume_streams = pending.dataset_states
            if pending.redeal:  # its ordinals count the new dealing: steps go on from the state's
                progress.step_base = pending.steps
            self._current = progress
            self._record_epoch(loader, it, first_step=pending.steps)
            return progress
        self.epoch += 1
        progress = EpochProgress(self.epoch)
        if pending is not None:  # saved between epochs (its generators: before_iterator)
            progress.resume_streams = pending.dataset_states
        source, held = sampler_iterator(loader, it._index_sampler, it._sampler_iter)
        self._start = capture(loader, self.epoch, int(it._base_seed), held)
        if pending is not None and pending.stages:  # skipped samples, from the epoch's start
            source = skipping(loader, it._index_sampler, source, pending)
            self._start.skip = pending.stages
        it._sampler_iter = Indices(source, skip=YieldedBatches(skip) if skip else None)
        if skip:
            progress.yielded = YieldedBatches(skip)  # counted as yielded: later saves are exact
            it._num_yielded = skip
        # The sampler draws now, at iter(), as with workers (torch's in-process loading
        # draws at the first next()): the draws then come in the same order in a resumed
        # run, whose replay draws here too, before a saved dataset state is restored.
        it._sampler_iter.prime()
        self._current = progress
        self._record_epoch(loader, it, first_step=skip)
        return progress

    def _record_epoch(self, loader: tud.DataLoader[Any], it: Any, first_step: int) -> None:
        """Tell the ledger (if any) that the epoch begins, at step ``first_step``."""
        if self.ledger is not None and self._start is not None:
            self.ledger.begin_epoch(loader, self.epoch, int(it._base_seed), first_step, self._start)

    def use_ledger(self, folder: str | None, key: Callable[[Any], Any] | None) -> None:
        """Record into ``folder`` from now on (None: stop); the same folder goes on."""
        self.ledger = recorder_for(self.ledger, folder, key)

    def _left_redealt(self) -> bool:
        """Whether the latest epoch is an elastic resume's re-dealt rest, not run to its end."""
        current, start = self._current, self._start
        return current is not None and not current.finished and start is not None and start.redealt

    def before_iterator(self, loader: tud.DataLoader[Any]) -> None:
        """Called before torch's iterator draws its base seed (from ``generator=``, else the
        global generator).

        A state loaded from between epochs puts the generators (and a Stateful sampler) back
        as they were when it was saved, so that the base seed and the order are drawn as
        the saving run drew them; the global generator too when the loader draws from it
        (no ``generator=``): as restoring it from the checkpoint would. When a saved seed
        replaces torch's (mid-epoch; persistent workers keep theirs), the saving run had
        drawn it before the save: the new draw is undone as the seed is applied (before a
        saved dataset position, which may set the global generator itself)."""
        pending = self._pending
        if pending is not None and pending.finished:
            set_generators(loader, pending.rng, include_global=loader.generator is None)
            load_samplers(loader, pending.samplers)
            saved = pending.dataset_states
            if saved is not None and all_workers(loader) == 0:
                # The dataset object the saving run went on with, as it was at the save:
                # before the draws (its state may be a generator's; in workers it is not ours)
                restore_replica(loader._dataset_kind, loader.dataset, saved["workers"][0])
                pending.dataset_states = None
        gen = loader.generator
        self._caller_rng = None
        if self.replaces_base_seed():
            self._caller_rng = (gen, gen.get_state() if gen is not None else torch.get_rng_state())

    def apply_base_seed(self, loader: tud.DataLoader[Any], it: Any) -> None:
        """Give a resumed iterator the saved base seed (before its workers are configured)."""
        self._apply_base_seed(it, self._pending)

    def replaces_base_seed(self) -> bool:
        """Whether the next iterator's base seed will be a saved one, not its own draw."""
        return self._pending is not None and self._pending.base_seed is not None

    def _apply_base_seed(self, it: Any, saved: Resume | None) -> None:
        if saved is not None and saved.base_seed is not None:
            it._base_seed = saved.base_seed
        if self._caller_rng is not None:  # undo torch's draw (before_iterator)
            gen, state = self._caller_rng
            if gen is not None:
                gen.set_state(state)
            else:
                torch.set_rng_state(state)
            self._caller_rng = None

    def for_twin(self, loader: tud.DataLoader[Any]) -> Checkpoints:
        """The run's position for ``loader``, which replaces this one's (`DataLoader.from_loader`):
        the epoch count, a requested skip, and a loaded state not yet used, checked again
        against ``loader`` (a framework's twin may deal to ranks otherwise: its sharding
        decides how the state resumes)."""
        twin = Checkpoints()
        twin.epoch, twin._skip, twin.last_skip = self.epoch, self._skip, self.last_skip
        twin.ledger = self.ledger  # the same timeline: the twin goes on with its segment
        pending = self._pending
        if pending is not None:
            with warnings.catch_warnings():  # said when the state was loaded
                warnings.simplefilter("ignore")
                twin._pending = check(loader, pending.state)  # (its skips are in the state)
            twin._pending.skip, twin._pending.skip_from = pending.skip, pending.skip_from
            if pending.dataset_states is None:  # restored in-process already
                twin._pending.dataset_states = None
        return twin

    # -- called by the loader and the integrations ----------------------------------------
    @property
    def pending(self) -> Resume | None:
        """The state `load` checked and parked for the next epoch (not a copy), or None."""
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
            return Mark(self.epoch, True, 0, frozenset(), None, self._pending, None)
        progress = self._current
        start = self._start
        if progress is None or start is None or progress.finished:
            # The next epoch draws from the generators as they are now: keep them (and a
            # Stateful sampler's state). Its base seed: persistent workers keep theirs;
            # else it is drawn from those generators when the epoch begins.
            alive = persistent(loader) and loader._iterator is not None
            seed = start.base_seed if alive and start is not None else None
            now = capture(loader, self.epoch, 0, None)  # (its base_seed unused: ``seed``)
            ended, unsaveable = None, None
            try:
                if progress is not None:
                    ended = replica_positions(loader, progress, ended=True)
            except ValueError as exc:  # said by save(), when a state is asked for
                unsaveable = str(exc)
            return Mark(self.epoch, True, 0, frozenset(), now, None, ended, seed, unsaveable)
        yielded = progress.yielded
        positions, unsaveable = None, None
        try:
            positions = replica_positions(loader, progress, ended=False)
        except ValueError as exc:  # said by save(), when a state is asked for
            unsaveable = str(exc)
        return Mark(
            self.epoch,
            False,
            yielded.prefix,
            frozenset(yielded.beyond) if yielded.beyond else _NONE,
            start,
            None,
            positions,
            start.base_seed,
            unsaveable,
            progress.step_base,
        )

    def save(self, loader: tud.DataLoader[Any], at: Mark | None = None) -> dict[str, Any]:
        """`DataLoader.state_dict`: the loader's position (now, or at a `mark`), as plain
        Python (JSON-able when the dataset's own states are).

        What stays the same for an epoch (its generators, encoded; the sampler states; the
        loader's arguments) is built once (`_constant`), so that a state per step costs a
        copy of that and the position."""
        at = at if at is not None else self.mark(loader)
        if at.pending is not None:
            return copy.deepcopy(at.pending.state)  # loaded but not yet iterated: unchanged
        start = at.start
        assert start is not None  # (a mark without a loaded state has one)
        frame, reason = self._constant(loader, start)
        if at.finished:  # between epochs: whether the last epoch's sampler can be replayed
            known = self._start
            reason = not_replayable(loader, known.samplers if known is not None else {})
        if reason is not None:
            raise fail(
                "steadyload cannot save this DataLoader's position: " + reason + ".",
                *REPLAY_WHY_FIX,
            )
        if at.unsaveable is not None:
            raise ValueError(at.unsaveable)  # a fresh error each time: no growing traceback
        state = frame.copy()
        state["rng"] = frame["rng"].copy()  # (the values are text: immutable)
        if frame["samplers"]:
            state["samplers"] = copy.deepcopy(frame["samplers"])
        else:
            state["samplers"] = {}
        sharding = frame["sharding"]
        if sharding is not None:
            state["sharding"] = {**sharding, "order": dict(sharding["order"])}
        state["world"] = dict(frame["world"])
        state["order"] = list(frame["order"])
        state["skip"] = [
            {**s, "beyond": list(s["beyond"]), "samples": list(s["samples"])} for s in frame["skip"]
        ]
        state["epoch"] = at.epoch
        state["finished"] = at.finished
        state["batches_yielded"] = at.prefix
        state["yielded_beyond"] = sorted(at.beyond)
        state["base_seed"] = at.base_seed
        state["distributed_epoch"] = None if at.finished else start.distributed_epoch
        state["dataset_states"] = (
            saved_positions(loader, at.positions) if at.positions is not None else None
        )
        if self.ledger is not None:  # its timeline, and the records handed to the OS
            state["ledger"] = self.ledger.state(at.step_base + at.prefix)
        return state

    def _constant(
        self, loader: tud.DataLoader[Any], start: EpochStart
    ) -> tuple[dict[str, Any], str | None]:
        """The part of a state that ``start``'s epoch does not change (kept for the epoch in
        progress), and why its sampler cannot be replayed (None: it can)."""
        if self._frame is not None and self._frame[0] is start:
            return self._frame[1], self._frame[2]
        frame = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "rng": {k: encode_rng(v) for k, v in start.rng.items()},
            "samplers": copy.deepcopy(start.samplers),
            "sharding": copy.deepcopy(start.sharding),
            "dataset_len": dataset_len(loader),
            "batch_size": loader.batch_size,
            "drop_last": loader.drop_last,
            "num_workers": all_workers(loader),
            "persistent": persistent(loader),
            "world": shards.world(),
            "order": order_of(loader),
            "skip": copy.deepcopy(start.skip),
        }
        reason = not_replayable(loader, start.samplers)
        if start is self._start:
            self._frame = (start, frame, reason)
        return frame, reason

    def load(
        self, loader: tud.DataLoader[Any], state: Any, skip_samples: Iterable[Any] | None = None
    ) -> None:
        """`DataLoader.load_state_dict`: check ``state`` (and ``skip_samples``) whole
        (`validate.check`); only then is it parked for the next epoch, which applies it. A
        state that fails leaves the loader as it was."""
        resume = check(loader, state, skip=skip_samples)
        self.epoch = resume.epoch
        self._pending = resume
        if self.ledger is not None:
            epoch, step = (resume.epoch + 1, 0) if resume.finished else (resume.epoch, resume.steps)
            self.ledger.resumed(state, epoch, step, resume.skip)
        self._skip = 0  # the loaded position supersedes a requested skip
        self.last_skip = None
        if resume.skip:
            epoch = resume.epoch + 1 if resume.finished else resume.epoch
            self.last_skip = Skip(epoch, resume.skip_from, resume.skip)
