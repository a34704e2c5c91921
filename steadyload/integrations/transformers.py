"""transformers: `SteadyloadTrainerMixin` keeps Trainer loaders on steadyload and resumes exactly.

``class MyTrainer(SteadyloadTrainerMixin, Trainer)`` (or ``SFTTrainer`` and TRL's other
trainers; `SteadyloadTrainer` is the plain one). The Trainer still builds its loaders (every
``dataloader_*`` argument, the collator and ``remove_unused_columns``, ``seed_worker``,
accelerate's sharding); the mixin adopts them (`steadyload.integrations.accelerate.adopt`),
saves each rank's loader ``state_dict()`` with every checkpoint, and on
``train(resume_from_checkpoint=...)`` restores it instead of letting the Trainer skip batches
through accelerate, which would rebuild the loader as torch's. See
docs/design/integrations.md#transformers-trainer-and-trl.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..options import check_option_names, ledger_from_env
from ..report import LoaderReport
from .accelerate import adopt, rank_state, skip_first_batches, steadyload_base

# transformers ships type information for all of itself: imported by name, mypy would
# analyse the whole library on every cold run of `mypy steadyload` (~30 s here), so the
# names come through importlib and are Any to mypy.
_transformers: Any = importlib.import_module("transformers")
_trainer_module: Any = importlib.import_module("transformers.trainer")
_trainer_utils: Any = importlib.import_module("transformers.trainer_utils")

TESTED = "5.24"  # the transformers release this module was written and tested against
STATE_FILE = "steadyload_loader_rank{rank}.pt"  # in each checkpoint-<step> folder
_LEDGER_OPTIONS = ("ledger", "ledger_key")  # the training loader's only


def _check_transformers() -> None:
    """Fail loudly if the Trainer no longer has what the mixin relies on."""
    missing = [
        f"{label}.{name}"
        for label, owner, name in (
            ("transformers.trainer", _trainer_module, "skip_first_batches"),
            ("Trainer", _transformers.Trainer, "get_train_dataloader"),
            ("Trainer", _transformers.Trainer, "get_eval_dataloader"),
            ("Trainer", _transformers.Trainer, "get_test_dataloader"),
            ("TrainerCallback", _transformers.TrainerCallback, "on_save"),
            ("TrainerCallback", _transformers.TrainerCallback, "on_train_begin"),
            ("TrainerCallback", _transformers.TrainerCallback, "on_train_end"),
            ("transformers.trainer_utils", _trainer_utils, "PREFIX_CHECKPOINT_DIR"),
        )
        if not hasattr(owner, name)
    ]
    if missing:
        raise RuntimeError(
            f"steadyload.integrations.transformers: transformers {_transformers.__version__} "
            f"has no {', '.join(missing)}. SteadyloadTrainerMixin (written for transformers "
            f"{TESTED}) resumes the loader from its own state by replacing "
            "transformers.trainer.skip_first_batches, the function the Trainer calls to skip "
            "the batches of an interrupted epoch, while train() runs; without it a resumed "
            "epoch could be skipped twice or run on torch's workers.\nFix: install "
            f"transformers=={TESTED}.* or a steadyload release that supports transformers "
            f"{_transformers.__version__}."
        )


def _skip_or_resume(original: Callable[..., Any], dataloader: Any, num_batches: int = 0) -> Any:
    """transformers.trainer.skip_first_batches while a mixin Trainer trains: steadyload's
    loaders are resumed in place (from the loaded state, or by index); others as before."""
    if steadyload_base(dataloader) is None:
        return original(dataloader, num_batches)
    return skip_first_batches(dataloader, num_batches)


@contextlib.contextmanager
def _resume_patch() -> Iterator[None]:
    """Replace transformers.trainer.skip_first_batches for the duration (exceptions too)."""
    original = _trainer_module.skip_first_batches
    if getattr(original, "_steadyload", False):  # a nested train(): already in place
        yield
        return
    patched = functools.partial(_skip_or_resume, original)
    patched._steadyload = True  # type: ignore[attr-defined]  # partial objects take attributes
    _trainer_module.skip_first_batches = patched
    try:
        yield
    finally:
        _trainer_module.skip_first_batches = original


class _LoaderState(_transformers.TrainerCallback):
    """Saves the training loader's state with each checkpoint; restores it on resume."""

    def __init__(self) -> None:
        self.resume_from: str | None = None  # the checkpoint train() resumes from
        # The latest train()'s training loader, held weakly: a trainer kept after training
        # must not keep its (persistent) workers alive. Its last report outlives it.
        self._loader: Callable[[], Any] = lambda: None
        self._final: LoaderReport | None = None
        self._warned = False

    def report(self) -> LoaderReport | None:
        """The training loader's report over every epoch of the latest train(): live while
        the loader exists, else its last one."""
        base = steadyload_base(self._loader())
        return base.report(all_epochs=True) if base is not None else self._final

    def _warn_once(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"steadyload: {text}", UserWarning, stacklevel=4)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader: Any = kwargs.get("train_dataloader")
        self._loader = weakref.ref(loader) if loader is not None else (lambda: None)
        self._final = None
        if self.resume_from is None or steadyload_base(loader) is None or args.ignore_data_skip:
            return  # (ignore_data_skip: the Trainer restarts the epoch; so does the loader)
        path = rank_state(self.resume_from, STATE_FILE, args.process_index)
        if path is not None:  # (on more ranks than saved it: the lowest rank's serves)
            loader.load_state_dict(torch.load(path, weights_only=True))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._final = self.report()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader: Any = kwargs.get("train_dataloader")
        if steadyload_base(loader) is None:
            return
        folder = os.path.join(
            args.output_dir, f"{_trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        if not os.path.isdir(folder):
            self._warn_once(
                f"the checkpoint folder {folder} does not exist (a hyperparameter search "
                "saves elsewhere), so the loader's position is not saved: a resume skips the "
                "interrupted epoch's batches by index, and workers' random draws may differ."
            )
            return
        try:
            loader_state = loader.state_dict()
        except ValueError as exc:
            what, _, why_and_fix = str(exc).partition("\n")
            self._warn_once(
                f"checkpoints do not include the loader's position ({what}); a resume "
                f"skips the interrupted epoch's batches by index instead.\n{why_and_fix}"
            )
            return
        torch.save(loader_state, os.path.join(folder, STATE_FILE.format(rank=args.process_index)))


# To mypy the mixin's base is Any (it is always mixed into a Trainer); at run time, object.
_MixinBase: Any = object


class SteadyloadTrainerMixin(_MixinBase):
    """Keeps a transformers ``Trainer``'s loaders on steadyload's workers, resuming exactly.

    Put it first: ``class MyTrainer(SteadyloadTrainerMixin, Trainer)`` (or ``SFTTrainer``).
    steadyload's options come as ``steadyload_options={"on_error": "skip", ...}`` to the
    constructor, or as a class attribute of that name (the keyword wins, key by key); torch's
    arguments stay the ``dataloader_*`` fields of ``TrainingArguments``. A
    ``dataloader_multiprocessing_context`` is an explicit context, so it wins over
    ``start_method``. ``steadyload_options={"ledger": DIR}`` (or ``STEADYLOAD_LEDGER=DIR``
    in the environment) records the training loader's ledger, resumed with its checkpoints.

    - ``get_train_dataloader``, ``get_eval_dataloader`` and ``get_test_dataloader`` return
      the Trainer's own loaders (collator, ``remove_unused_columns``, ``seed_worker``,
      sampler, accelerate's sharding and device placement, persistent eval loaders)
      iterating a steadyload loader; ``trainer.get_train_dataloader().report()`` works.
    - Each checkpoint gets ``steadyload_loader_rank<r>.pt``, the training loader's
      ``state_dict()`` for rank r (a few kB).
    - ``train(resume_from_checkpoint=...)`` loads it into the training loader before the
      first batch, so the resumed epoch continues with exactly the batches (and, with
      ``sample_seeds=True``, the random draws) of the interrupted run, and no skipped batch
      is loaded: the time to the first batch does not grow with the number skipped. Without
      that file (or for a loader the mixin did not build, such as a steadyload loader
      returned by your own ``get_train_dataloader``, which is resumed the same way), the
      skipped batches' indices are drawn and no sample is loaded.

    While ``train()`` runs, ``transformers.trainer.skip_first_batches`` (the Trainer's resume
    path) is replaced and put back afterwards, exceptions included; loaders that are not
    steadyload's still go to the original.

    Raises:
        RuntimeError: at construction or ``train()``, transformers lacks a name this relies on.
        TypeError: an unknown key in ``steadyload_options``.
    """

    steadyload_options: dict[str, Any] = {}  # class-level defaults: read, never mutated

    def __init__(
        self, *args: Any, steadyload_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        _check_transformers()
        options = {**type(self).steadyload_options, **(steadyload_options or {})}
        self.steadyload_options = check_option_names(options, "steadyload_options")
        super().__init__(*args, **kwargs)
        self._steadyload_state = _LoaderState()
        self.add_callback(self._steadyload_state)

    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, iterating a steadyload loader (the one that records
        the ledger: ``steadyload_options["ledger"]``, else ``STEADYLOAD_LEDGER``, unless your
        own loader has a ``ledger=``)."""
        loader = super().get_train_dataloader()
        options = self.steadyload_options
        folder = ledger_from_env()
        base = steadyload_base(loader)
        if "ledger" not in options and folder is not None and (base is None or not base.ledger):
            options = {**options, "ledger": folder}
        return adopt(loader, **options)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The Trainer's evaluation loader, iterating a steadyload loader (no ledger)."""
        return adopt(super().get_eval_dataloader(eval_dataset), **self._not_training())

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The Trainer's prediction loader, iterating a steadyload loader (no ledger)."""
        return adopt(super().get_test_dataloader(test_dataset), **self._not_training())

    def _not_training(self) -> dict[str, Any]:
        # The ledger records training: evaluation's steps in its folder would mix with them.
        return {k: v for k, v in self.steadyload_options.items() if k not in _LEDGER_OPTIONS}

    def steadyload_report(self) -> LoaderReport | None:
        """The latest ``train()``'s training loader over every epoch of it
        (``report(all_epochs=True)``: restarts and skipped samples with their epochs,
        per-worker speed and memory, data-stall share), whatever
        ``dataloader_persistent_workers`` is; None before training, or when that loader is
        not steadyload's. Cheap; safe during and after training."""
        return self._steadyload_state.report()

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``, resuming steadyload loaders from their saved state.

        Raises:
            RuntimeError: transformers lacks a name this relies on.
        """
        _check_transformers()
        resume = resume_from_checkpoint
        if resume is True:
            resume = _trainer_utils.get_last_checkpoint(self.args.output_dir)
        self._steadyload_state.resume_from = resume if isinstance(resume, str) else None
        try:
            with _resume_patch():
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._steadyload_state.resume_from = None


class SteadyloadTrainer(SteadyloadTrainerMixin, _transformers.Trainer):
    """transformers' ``Trainer`` with `SteadyloadTrainerMixin`: a drop-in for ``Trainer``
    that also takes ``steadyload_options``."""
