"""accelerate: `prepare`, `adopt`, `skip_first_batches` keep steadyload inside accelerate's loaders.

accelerate's ``Accelerator.prepare`` rebuilds every loader as a torch ``DataLoader`` inside
its own ``DataLoaderShard`` (or ``DataLoaderDispatcher``), which shards batches between
processes, moves them to the device and tells ``GradientState`` about the last batch. `adopt`
keeps all of that and swaps only the torch loader inside (``base_dataloader``, not yet
iterated, so no worker has started) for its steadyload twin (`DataLoader.from_loader`). The
adopted shard iterates steadyload, reports steadyload's class (``isinstance(shard,
steadyload.DataLoader)``), and passes unknown attributes on, so ``shard.report()`` works.
See docs/design/integrations.md#accelerate.

Checkpoints: `prepare` registers hooks that make ``accelerator.save_state`` write each
adopted loader's ``state_dict()`` per rank (``steadyload_loader_<i>_rank<r>.pt``) and
``load_state`` read it back, so a resumed run continues the interrupted epoch exactly. It also
routes that accelerator's ``skip_first_batches`` (accelerate's resume recipe: ``load_state``,
then ``accelerator.skip_first_batches(loader, k)`` for the resumed epoch) to this module's
`skip_first_batches` for its steadyload loaders: the loader itself comes back, the loaded
state starting it at batch ``k``. accelerate's module function ``skip_first_batches`` is out
of reach: it rebuilds the loader as torch's (steadyload warns, and refuses a loader holding a
loaded state, which the rebuilt one would get wrong; use this module's instead).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .. import rebuild_watch
from ..loader import DataLoader
from ..options import check_option_names, checked_options, ledger_from_env, options_of

TESTED = "1.15"  # the accelerate release this module was written and tested against
STATE_FILE = "steadyload_loader_{index}_rank{rank}.pt"

_MARK = "_steadyload_mark"  # (mark, end of dataloader, next iteration) of the last batch
_NEXT_ITERATION = "accelerate_next_iteration"  # the shard's epoch counter, in its state
_PREPARED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_WARNED_UNSAVED: weakref.WeakSet[Any] = weakref.WeakSet()


def _accelerate() -> Any:
    """``accelerate.data_loader``, checked for the names `adopt` relies on.

    Raises:
        RuntimeError: accelerate is missing one of them (it changed its loader classes).
    """
    import accelerate
    import accelerate.data_loader as adl

    needed = {
        "DataLoaderAdapter": ("_update_state_dict", "state_dict", "load_state_dict"),
        "DataLoaderShard": ("set_epoch",),
        "skip_first_batches": (),
    }
    for name, members in needed.items():
        obj = getattr(adl, name, None)
        gone = [m for m in members if obj is not None and not hasattr(obj, m)]
        if obj is None or gone:
            what = f"accelerate.data_loader.{name}" + (f".{gone[0]}" if gone else "")
            raise RuntimeError(
                f"steadyload.integrations.accelerate: accelerate {accelerate.__version__} has "
                f"no {what}, which steadyload relies on to keep its loader inside accelerate's "
                f"DataLoaderShard (written for accelerate {TESTED}: the shard iterates "
                "`base_dataloader` and snapshots its state through `_update_state_dict` "
                "before each batch).\nFix: install accelerate=="
                f"{TESTED}.* or a steadyload release that supports accelerate "
                f"{accelerate.__version__}."
            )
    return adl


def _set_options(loader: DataLoader[Any], options: dict[str, Any]) -> None:
    check_option_names(options, "adopt()")
    before = options_of(loader)
    for name, value in options.items():
        setattr(loader, name, value)
    try:
        checked_options(loader)  # a bad value raises now, not at the first batch
    except (TypeError, ValueError):
        for name, value in before.items():
            setattr(loader, name, value)
        raise


def steadyload_base(loader: Any) -> DataLoader[Any] | None:
    """The steadyload loader that ``loader`` iterates: itself, or the one inside an
    accelerate-prepared (adopted) loader; None for anything else. Cheap, imports nothing."""
    if not isinstance(loader, DataLoader):  # an adopted shard passes: it reports our class
        return None
    base = vars(loader).get("base_dataloader", loader)
    return base if isinstance(base, DataLoader) else None


def adopt(loader: Any, **options: Any) -> Any:
    """Make an accelerate-prepared loader iterate a steadyload loader; returns it.

    ``loader`` is what ``Accelerator.prepare`` (or accelerate's ``prepare_data_loader`` or
    ``skip_first_batches``) returned: its torch loader inside (not yet iterated) is replaced
    in place by `DataLoader.from_loader` with steadyload's ``options`` (``on_error="skip"``,
    ``max_restarts``, ...), keeping every torch argument, the sharding batch sampler, device
    placement, ``set_epoch`` and ``GradientState`` signalling. A plain torch ``DataLoader``
    gives its steadyload twin; a steadyload loader (or an adopted shard) gets the options set
    and is returned as is (adopting twice is harmless). No worker starts before a batch.

    The shard snapshots ``state_dict()`` before each batch (accelerate's own mechanism); when
    steadyload cannot save the position (a sampler it cannot replay), training goes on and
    ``state_dict()`` raises that ValueError when asked.

    Raises:
        TypeError: ``loader`` is neither a torch DataLoader nor an accelerate loader over
            one (torchdata's StatefulDataLoader is not replaced), or an unknown option.
        ValueError: an option has a bad value.
        RuntimeError: accelerate lacks a name this relies on (another accelerate release).
    """
    check_option_names(options, "adopt()")
    base = steadyload_base(loader)
    if base is not None:
        if options:
            _set_options(base, options)
        return loader
    adl = _accelerate()
    if isinstance(loader, adl.DataLoaderAdapter):
        inner = getattr(loader, "base_dataloader", None)
        if type(inner) is not torch.utils.data.DataLoader:
            raise TypeError(
                "steadyload.integrations.accelerate.adopt: this accelerate loader iterates a "
                f"{type(inner).__module__}.{type(inner).__qualname__}, and steadyload replaces "
                "only torch's DataLoader.\nFix: leave DataLoaderConfiguration's "
                "use_stateful_dataloader off (steadyload's loader saves its position itself)."
            )
        new = DataLoader.from_loader(inner, **options)
        loader.base_dataloader = new
        _install_state_hooks(loader)
        return loader
    if isinstance(loader, torch.utils.data.DataLoader):
        return DataLoader.from_loader(loader, **options)
    raise TypeError(
        "steadyload.integrations.accelerate.adopt needs a torch DataLoader or what "
        f"accelerate's prepare returned for one, got {type(loader).__module__}."
        f"{type(loader).__qualname__}"
    )


def _install_state_hooks(shard: Any) -> None:
    """Per-instance ``_update_state_dict``/``state_dict``/``load_state_dict`` for an adopted
    shard: the position marked at each batch, a state built (or its error raised) only when
    asked, the shard's epoch counter carried in the state."""
    ref = weakref.ref(shard)  # no cycle: a dropped shard ends its persistent workers at once

    def _update_state_dict() -> None:
        # accelerate calls this before each batch it takes: a mark costs a few µs, a state
        # (generators cloned, samplers copied) far more.
        me = ref()
        if me is None:
            return
        next_iteration = None
        if hasattr(me, "iteration"):  # the next epoch set_epoch() will be given
            ended = bool(getattr(me, "end_of_dataloader", False))
            next_iteration = me.iteration + int(ended)
        mark = me.base_dataloader._mark()
        me.__dict__[_MARK] = (mark, bool(getattr(me, "end_of_dataloader", False)), next_iteration)
        ledger = me.base_dataloader._checkpoints.ledger
        if ledger is not None:  # the batch taken last goes to the loop now: a trained step
            ledger.handed_on()

    def state_dict() -> dict[str, Any]:
        """The position after the batches this shard has yielded (see DataLoader.state_dict).

        Raises:
            ValueError: steadyload cannot save this loader's position (with the fix).
        """
        me = _alive(ref)
        mark, finished, next_iteration = me.__dict__[_MARK]
        # (accelerate's adjust_state_dict_for_prefetch changes only torchdata's keys.)
        state = me.base_dataloader._state_dict_at(mark)
        state["_iterator_finished"] = finished
        if next_iteration is not None:
            state[_NEXT_ITERATION] = next_iteration
        return state

    def load_state_dict(
        state_dict: dict[str, Any], *, skip_samples: Iterable[int] | None = None
    ) -> None:
        """Resume from `state_dict`'s result (``skip_samples``: as the DataLoader's)."""
        me = _alive(ref)
        state = dict(state_dict)
        next_iteration = state.pop(_NEXT_ITERATION, None)
        state.pop("_iterator_finished", None)
        me.base_dataloader.load_state_dict(state, skip_samples=skip_samples)
        if next_iteration is not None and hasattr(me, "iteration"):
            me.iteration = next_iteration
        _update_state_dict()

    def consumed() -> Any:
        me = ref()
        return me.__dict__[_MARK][0] if me is not None else None

    shard._update_state_dict = _update_state_dict
    shard.state_dict = state_dict
    shard.load_state_dict = load_state_dict
    shard.base_dataloader._checkpoints.consumed = consumed  # it reads one batch ahead
    _update_state_dict()


def _alive(ref: weakref.ref[Any]) -> Any:
    shard = ref()
    if shard is None:  # a method kept after its shard was dropped
        raise ReferenceError("the accelerate loader this method belonged to no longer exists")
    return shard


def prepare(accelerator: Any, *objects: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*objects)``, with every steadyload loader kept steadyload's.

    A drop-in: the same arguments and results (one object, or a tuple), models, optimizers
    and schedulers prepared by accelerate as usual. Each ``steadyload.DataLoader`` among
    ``objects`` comes back as accelerate's shard (sharded across processes, batches moved to
    the device, ``end_of_dataloader``/``remainder`` kept for gradient accumulation) iterating
    a steadyload loader with the original's options and ``report_every``. The first call on
    an accelerator registers save/load hooks (public accelerate API) so that
    ``accelerator.save_state`` writes each of those loaders' ``state_dict()`` for each rank
    (``steadyload_loader_<i>_rank<r>.pt``) and ``load_state`` restores it: the resumed epoch
    continues exactly, no batch loaded twice. It also makes ``accelerator.skip_first_batches``
    return a steadyload loader itself, through this module's `skip_first_batches` (other
    loaders still go to accelerate's). ``STEADYLOAD_LEDGER=DIR``: each of those loaders without
    a ``ledger=`` records into ``DIR/loader<i>`` (``i``: its state file's). Thread-safety: as
    ``accelerator.prepare``.

    Raises:
        RuntimeError: accelerate lacks a name this relies on (another accelerate release).
        TypeError: accelerate built a loader steadyload does not replace (see `adopt`).
    """
    _accelerate()
    with rebuild_watch.adopting():  # accelerate reads our loaders to rebuild them: on purpose
        result = accelerator.prepare(*objects, device_placement=device_placement)
    results = result if len(objects) != 1 else (result,)
    out = []
    for original, prepared in zip(objects, results, strict=True):
        if isinstance(original, DataLoader) and prepared is not original:
            options, folder = options_of(original), ledger_from_env()
            if options["ledger"] is None and folder is not None:  # (a resume prepared in the
                # same order continues it: the index is its state file's)
                options["ledger"] = os.path.join(folder, f"loader{_index(accelerator, prepared)}")
            prepared = adopt(prepared, **options)
            base = steadyload_base(prepared)
            if base is not None:  # what the options do not cover: the run goes on
                base._carry_on_from(original)
            _register(accelerator, prepared)
        out.append(prepared)
    return out[0] if len(objects) == 1 else tuple(out)


def _index(accelerator: Any, prepared: Any) -> int:
    """The index `_register` gives ``prepared`` (its state file's ``<i>``)."""
    loaders = _PREPARED.get(accelerator, [])
    return next((i for i, p in enumerate(loaders) if p is prepared), len(loaders))


def _register(accelerator: Any, prepared: Any) -> None:
    loaders = _PREPARED.get(accelerator)
    if loaders is None:
        loaders = _PREPARED[accelerator] = []
        ref = weakref.ref(accelerator)
        accelerator.register_save_state_pre_hook(lambda *a: _save_states(ref(), a[-1]))
        accelerator.register_load_state_pre_hook(lambda *a: _load_states(ref(), a[-1]))
        _route_skip_first_batches(accelerator)
    if not any(p is prepared for p in loaders):
        loaders.append(prepared)


def _route_skip_first_batches(accelerator: Any) -> None:
    """``accelerator.skip_first_batches`` (accelerate's resume recipe, after ``load_state``)
    sends steadyload's loaders to this module's `skip_first_batches`, others to accelerate's.

    accelerate's rebuilds the loader as a torch one over a ``SkipBatchSampler``: its epoch
    would run on torch's workers in an order of its own, and the state ``load_state`` gave
    the loader would then start the loader's next epoch inside the old one. An instance
    attribute, not a patch of the class or of accelerate's module function: accelerators
    steadyload did not prepare, and loaders that are not steadyload's, see no change.
    """
    ref = weakref.ref(accelerator)  # the accelerator holds this function: no cycle
    original = type(accelerator).skip_first_batches

    def routed(dataloader: Any, num_batches: int = 0) -> Any:
        """accelerate's ``Accelerator.skip_first_batches``; a steadyload loader (or adopted
        shard) goes to steadyload.integrations.accelerate.skip_first_batches instead: the
        loader itself comes back, continuing a loaded state exactly or skipping unloaded."""
        if steadyload_base(dataloader) is not None:
            return skip_first_batches(dataloader, num_batches)
        me = ref()
        if me is None:  # kept after its accelerator was dropped
            raise ReferenceError(
                "the Accelerator this skip_first_batches belonged to no longer exists"
            )
        return original(me, dataloader, num_batches=num_batches)

    accelerator.skip_first_batches = routed


def _save_states(accelerator: Any, output_dir: str) -> None:
    """Save hook: each adopted loader's state, one file per loader and rank."""
    if accelerator is None:
        return
    for index, loader in enumerate(_PREPARED.get(accelerator, ())):
        try:
            state = loader.state_dict()
        except ValueError as exc:
            if loader not in _WARNED_UNSAVED:
                _WARNED_UNSAVED.add(loader)
                what, _, why_and_fix = str(exc).partition("\n")
                warnings.warn(
                    f"steadyload: accelerator.save_state saved no position for loader {index} "
                    f"({what}); load_state will start that loader's epoch from its first "
                    f"batch.\n{why_and_fix}",
                    UserWarning,
                    stacklevel=4,
                )
            continue
        name = STATE_FILE.format(index=index, rank=accelerator.process_index)
        torch.save(state, os.path.join(output_dir, name))


def rank_state(folder: str, pattern: str, rank: int) -> str | None:
    """The state file ``rank`` saved in ``folder`` (``pattern`` with ``{rank}``) or, when it
    saved none (the run resumes on more ranks than saved it), the lowest rank's; None when
    there is none. Any rank's state serves every rank: data-parallel ranks take their
    batches in lockstep, and the state says how the epoch was dealt to ranks (shards.py)."""
    path = os.path.join(folder, pattern.format(rank=rank))
    if os.path.isfile(path):
        return path
    head, _, tail = pattern.partition("{rank}")
    ranks = [
        n[len(head) : len(n) - len(tail)]
        for n in os.listdir(folder)
        if n.startswith(head) and n.endswith(tail)
    ]
    saved = sorted(int(r) for r in ranks if r.isdigit())
    return os.path.join(folder, pattern.format(rank=saved[0])) if saved else None


def _load_states(accelerator: Any, input_dir: str) -> None:
    """Load hook: give each adopted loader the state this rank saved for it (or, on more
    ranks than saved it, the lowest rank's: `rank_state`)."""
    if accelerator is None:
        return
    for index, loader in enumerate(_PREPARED.get(accelerator, ())):
        pattern = STATE_FILE.replace("{index}", str(index))
        path = rank_state(input_dir, pattern, accelerator.process_index)
        if path is not None:
            loader.load_state_dict(torch.load(path, weights_only=True))


def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
    """accelerate's ``skip_first_batches``, without leaving steadyload or loading a skipped batch.

    For a steadyload loader or an adopted shard over a map-style dataset the loader itself is
    returned: its next epoch starts after ``num_batches`` batches, whose indices are drawn
    (so the rest is the epoch's own order, as with accelerate's ``SkipBatchSampler``) but
    whose samples are never loaded, microseconds per batch; they count as yielded, so a
    checkpoint taken in that epoch resumes exactly. Unlike accelerate's, this applies to the
    next epoch only, and ``len()`` stays the whole epoch's. If a state loaded by
    ``load_state``/``load_state_dict`` already starts the epoch at ``num_batches``, nothing
    more is skipped. An IterableDataset goes through accelerate's (which reads and drops the
    skipped batches) and stays steadyload's; any other loader is accelerate's business.
    ``accelerator.skip_first_batches`` calls this for the accelerators `prepare` prepared.

    Raises:
        ValueError: a loaded state starts the epoch somewhere other than ``num_batches``.
    """
    base = steadyload_base(loader)
    adl = _accelerate()
    if base is None:
        return adl.skip_first_batches(loader, num_batches)
    pending = base._checkpoints.pending
    if pending is not None and pending.redeal:
        return loader  # saved on another number of ranks: the caller's count is theirs
    if pending is not None:
        at = 0 if pending.finished else pending.yielded.prefix
        if at != num_batches:
            raise ValueError(
                f"the loaded steadyload state resumes epoch {pending.epoch} after {at} "
                f"batches, but {num_batches} batches are to be skipped.\nWhy: the loader "
                "state and the step count come from different checkpoints.\nFix: load the "
                "loader state saved with this checkpoint, or skip without it (build the "
                "loader afresh)."
            )
        return loader  # the loaded state already starts the epoch there
    if num_batches == 0:
        return loader
    if not isinstance(base.dataset, torch.utils.data.IterableDataset):  # by index, unloaded
        base._checkpoints.skip_next_epoch(base, num_batches)
        return loader
    with rebuild_watch.adopting():
        skipped = adl.skip_first_batches(loader, num_batches)
    return adopt(skipped, **options_of(base))
