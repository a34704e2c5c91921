"""`steadyload.DataLoader`: torch's DataLoader, with steadyload's supervised workers.

The class subclasses `torch.utils.data.DataLoader`, so argument checking, samplers,
``len()``, the persistent-iterator logic and ``isinstance`` checks in training frameworks
are torch's own; only the iterators differ (`iterators/`). steadyload's own options are
keyword-only, after torch's, and are collected in `LoaderOptions` (`options.py`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch.utils.data

from .arguments import checked_snapshot_steps, torch_arguments
from .engine.choice.plans import WorkerPlans
from .engine.remote.spec import RemoteWorkers, all_workers
from .engine.remote.warm import prestart as prestart_remote
from .iterators.in_process import InProcessIterator
from .iterators.record import History, RunRecord, not_started
from .iterators.workers import WorkerIterator
from .options import OPTION_NAMES, checked_options, options_of
from .rebuild_watch import watched_timeout
from .report import LoaderReport
from .resume.checkpoint import Checkpoints, Mark
from .worker_count import AutoChoice, resolve_num_workers

_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in `torch.utils.data.DataLoader` whose workers are supervised and fork-safe.

    Takes torch's arguments with torch's meaning and yields the same batches (for the same
    ``generator`` seed, also the same random values drawn inside workers). With
    ``num_workers > 0`` the workers are steadyload's: forked by default from a zygote (a
    fork of this process, where that is safe) or a fork server (torch, steadyload and the
    dataset's module preloaded), watched so
    that a death is reported at once as `steadyload.WorkerDiedError` naming the worker, its
    exit signal and the samples it held; batches cross over in pooled shared memory.

    ``num_workers="auto"`` times a few samples (indices 0, 1, ...) in this process, your
    RNGs restored, and picks enough workers to deliver a batch every 5 ms, at most the
    usable CPUs - 1 and what fits in half the available memory; 0 for samples under 50 µs,
    1 for an IterableDataset (not measured). The choice and its reason are logged at INFO
    (logger "steadyload.worker_count") and shown by `report()`. ``steadyload bench`` measures
    every count instead.

    Args (steadyload-only, keyword-only):
        start_method: "auto" (default), "forkserver", "spawn", "fork" or "zygote". "auto"
            takes the zygote where forking this process is safe and cheap when the loader
            is built (no GPU context, no other thread, a lean heap: start/rule.py), else
            forkserver (Linux; spawn elsewhere). fork is refused while a CUDA/ROCm context
            exists, because forked workers then deadlock. "zygote" forks a fork
            server from this process once, when the first such loader is built, and forks
            every worker from it: workers share this process's memory (torch included)
            and later GPU use here is safe; refused if a CUDA/ROCm context exists then.
            Build that first loader (or call ``steadyload.prestart(start_method=
            "zygote")``) right after importing torch; see docs/design/zygote.md. An
            explicit ``multiprocessing_context`` wins.
        max_restarts: how many dead or hung workers are replaced per epoch (default 3).
            The replacement has the same worker id and seed and re-runs every batch the
            dead worker held, so no sample is lost or repeated and the order stays. Three
            rides through rare kills (an OOM spike, a watchdog) without losing the epoch,
            while a systematic fault (every new worker dies) still stops within seconds
            with the diagnosis. 0 turns recovery off. A sample that kills a worker twice
            is never tried a third time (see ``on_error``). An IterableDataset with
            ``state_dict()``/``load_state_dict()`` is resumed by the replacement where the
            dead worker's last batch ended; any other stream cannot be replayed, and a
            death there raises.
        on_error: "raise" (default): an exception in ``__getitem__`` reaches you as its
            own type, with the sample index noted. "skip": the sample is left out of its
            batch, logged, and listed by `report()`; samples that kill a worker twice are
            skipped the same way. The number of batches never changes (ranks of a
            distributed run stay in step): a batch gets smaller, and one whose every sample
            failed is yielded empty (``collate_fn([])`` if that works, else the other
            batches' structure with zero-length tensors). A dataset with ``__getitems__``
            keeps its batched path; only a batch whose ``__getitems__`` raised is loaded
            again sample by sample, to leave out just the failing ones. On a stream, an
            item that raised inside its generator ends that generator: a stream with
            ``state_dict()`` is restarted after the item; any other loses the rest of
            that worker's share, said at WARNING and in `report()` (``streams_cut``).
        hang_timeout: seconds a batch may take in a worker (default None: no limit). On
            expiry the worker's stack (all threads) is logged, the worker is killed and the
            batch retried on a fresh worker; a second hang of the same batch raises
            `WorkerHangError` with the stack. torch's ``timeout`` keeps its meaning.
        max_worker_memory: e.g. "4GiB": a worker whose memory (USS) passes it after a
            batch is replaced between batches, losing nothing (for leaks in user code).
        sample_seeds: seed torch's, ``random``'s and numpy's global RNGs before each sample
            from (base seed, epoch, sample index), so random augmentations are the same
            whatever the number of workers, restarts or resumes (default False: torch's
            per-worker seeding). A dataset with ``__getitems__`` is seeded once per batch,
            from its first index. In-process loading restores your RNGs after each batch.
            Each worker's own generators (``get_worker_info().rng``) are seeded too;
            thread workers seed only those.
        worker_type: "process" (default), "thread" or "auto". Threads share this process:
            no start-up, no transport, one copy of the dataset, nothing forked; they run in
            parallel only where the work releases the GIL (decoding, numpy, tokenizers in
            Rust, big tensor copies) or on free-threaded Python. "auto" starts on processes
            where one is a fork away (else on threads), measures how much of the loading
            holds the GIL, and keeps or hands over to the faster kind (`report()` gives
            the figures). See docs/guide/threads.md.
        remote_workers: workers on other machines, as Ray actors (``pip install
            "steadyload[ray]"``): an int, a ``(min, max)`` range grown while the training
            loop waits for data, or `steadyload.RemoteWorkers` for placement. They serve
            beside the ``num_workers`` local ones (worker ids after theirs), with every
            promise above; see docs/guide/remote.md.
        ledger: a folder recording what every step trained on (indices, worker, re-runs,
            skips, resumes), one append-only file per rank and run, for ``steadyload
            ledger verify``, ``show`` and `steadyload.replay`. See docs/guide/ledger.md.
        ledger_key: for an IterableDataset, a function of a batch giving its samples' keys
            for the ledger (webdataset's ``__key__`` is read without it).
        device: "cuda", "cuda:N", a torch.device or "cpu": batches are yielded on it,
            copied from pinned memory on a stream of their own, ``device_prefetch`` ahead
            (default None: where the workers made them; "cuda" is ``LOCAL_RANK``'s GPU).
            A batch on its way is not consumed (``state_dict``); ``pin_memory=True`` alone
            pins off the training thread. See docs/guide/feeding-the-gpu.md.
        device_prefetch: batches on their way to the device beyond the one yielded (2).
        device_transform: a function of each batch on the device, run on the copy stream
            before it is yielded (GPU transforms, HF fast processors); ``on_error`` applies.
        pinned_memory_limit: the pinned buffers' cap (e.g. "2GiB"; default 1 GiB, <= RAM/4).

    ``snapshot_every_n_steps`` (torchdata's keyword) is accepted and changes nothing: the
    `state_dict` is exact after every batch (each batch carries its worker's position).

    Raises:
        ValueError: for the argument combinations torch rejects, with torch's messages, and
            a ``snapshot_every_n_steps`` that is not an int >= 0 (or None).
        UnsafeForkError: ``start_method="zygote"`` must fork the zygote now, and this
            process holds a CUDA/ROCm context.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: torch.utils.data.Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: torch.utils.data.Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: multiprocessing.context.BaseContext | str | None = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = 1,
        start_method: str = "auto",
        max_restarts: int = 3,
        on_error: str = "raise",
        hang_timeout: float | None = None,
        max_worker_memory: str | int | None = None,
        sample_seeds: bool = False,
        worker_type: str = "process",
        remote_workers: int | tuple[int, int] | RemoteWorkers | None = None,
        ledger: str | os.PathLike[str] | None = None,
        ledger_key: Callable[[Any], Any] | None = None,
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        device_transform: Callable[[Any], Any] | None = None,
        pinned_memory_limit: str | int | None = None,
    ) -> None:
        # "auto" becomes a count before torch validates it (tuning.py; seconds at most).
        num_workers, auto = resolve_num_workers(
            num_workers,
            dataset,
            batch_size,
            batch_sampler,
            collate_fn,
            prefetch_factor,
            persistent_workers,
        )
        self._auto: AutoChoice | None = auto
        self.snapshot_every_n_steps = checked_snapshot_steps(snapshot_every_n_steps)
        # Public attributes named like the parameters: frameworks that rebuild a loader from
        # its attributes (Lightning: type(loader)(**vars(loader))) keep the options.
        self.start_method = start_method
        self.max_restarts = max_restarts
        self.on_error = on_error
        self.hang_timeout = hang_timeout
        self.max_worker_memory = max_worker_memory
        self.sample_seeds = sample_seeds
        self.worker_type = worker_type
        self.remote_workers = remote_workers
        self.ledger = ledger
        self.ledger_key = ledger_key
        self.device, self.device_prefetch = device, device_prefetch
        self.device_transform, self.pinned_memory_limit = device_transform, pinned_memory_limit
        self._options = checked_options(self)
        remote_only = num_workers == 0 and self._options.remote is not None
        # Keywords only: Lightning records the arguments of the outermost __init__ it has
        # wrapped, which is torch's when this class was created inside a loader hook; it then
        # passes sampler= again, which positional arguments would duplicate.
        super().__init__(
            dataset=dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=None if remote_only else prefetch_factor,
            persistent_workers=False if remote_only else persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if remote_only:  # torch refuses both without local workers; remote ones use them
            self.prefetch_factor = prefetch_factor
            object.__setattr__(self, "persistent_workers", persistent_workers)  # torch's guard
        # Written again now that torch's __init__ has returned: when this class was created
        # inside a Lightning loader hook, Lightning saved torch's arguments only, and it
        # replays on the loader it rebuilds just the attribute writes made after them.
        for name in OPTION_NAMES:
            setattr(self, name, getattr(self, name))
        self._plans = WorkerPlans()  # the start context and auto's choice, once per loader
        self._last_run: RunRecord | None = None
        self._history = History()  # every epoch's report, for report(all_epochs=True)
        self._checkpoints = Checkpoints()  # epoch number and resume state (checkpoint.py)
        self._checkpoints.use_ledger(self._options.ledger, self._options.ledger_key)
        self._report_every: tuple[float, Callable[[LoaderReport], None]] | None = None
        inheriting = getattr(multiprocessing.current_process(), "_inheriting", False)
        if num_workers > 0 and not inheriting and self._plans.starts_early(self):
            # Start the fork server now, so that its imports overlap with the caller's
            # set-up (building the model), or fork the zygote while this process is still
            # GPU-free and has no thread. Not while this process is itself a worker
            # importing the main script: a loader built at top level is harmless there.
            self._plans.start_context(self)
        # Remote workers likewise, when this process is connected to Ray (warm.py).
        self._prestarted = None if inheriting else prestart_remote(self)

    timeout = watched_timeout()  # torch's plain attribute, watched (rebuild_watch.py)

    @classmethod
    def from_loader(
        cls, loader: torch.utils.data.DataLoader[Any], **options: Any
    ) -> DataLoader[Any]:
        """A steadyload loader with ``loader``'s dataset, sampling and arguments.

        For frameworks that build a torch ``DataLoader`` themselves (accelerate's
        ``prepare``, the transformers Trainer, Ray Train): the twin takes every argument
        torch keeps on the loader (``num_workers``, ``collate_fn``, ``pin_memory``,
        ``timeout``, ``worker_init_fn``, ``multiprocessing_context``, ``generator``,
        ``prefetch_factor``, ``persistent_workers``, ``pin_memory_device``, ``in_order``)
        and its batch sampler (or sampler) object itself, so sharding and seeding wrappers
        are kept. ``options`` are steadyload's keyword arguments (``on_error="skip"``, ...);
        from a steadyload loader, its options are kept unless given. Costs nothing: a
        torch loader starts no worker before it is iterated.

        Raises:
            TypeError: ``loader`` is not a torch ``DataLoader``.
        """
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise TypeError(
                f"DataLoader.from_loader needs a torch.utils.data.DataLoader, got "
                f"{type(loader).__module__}.{type(loader).__qualname__}"
            )
        kwargs = torch_arguments(loader)
        source = loader if isinstance(loader, DataLoader) else None
        if source is not None:
            kwargs.update(options_of(source))
        kwargs.update(options)
        twin = cls(**kwargs)
        if source is not None:
            twin._carry_on_from(source)
        return twin

    def check_worker_number_rationality(self) -> None:
        """torch's warning about more workers than CPUs; not for threads (they overlap I/O)."""
        if getattr(self, "worker_type", "process") != "thread" and self.num_workers > 0:
            super().check_worker_number_rationality()

    def _carry_on_from(self, other: DataLoader[Any]) -> None:
        """Go on with ``other``'s run, for a twin that replaces it: its reports and history,
        the "auto" choice, its epoch count and a loaded state not yet used (integrations)."""
        self._report_every, self._auto = other._report_every, other._auto
        self._history = other._history
        self._plans.choice = other._plans.choice
        self._checkpoints = other._checkpoints.for_twin(self)
        self._refresh_options()  # its own ledger= (STEADYLOAD_LEDGER) if other had another

    def _refresh_options(self) -> None:
        """Check the options as the attributes hold them now (a framework may set them)."""
        self._options = checked_options(self)
        self._checkpoints.use_ledger(self._options.ledger, self._options.ledger_key)

    def __iter__(self) -> Any:
        """torch's, with persistent workers kept also when all of them are remote."""
        if self.persistent_workers and self.num_workers == 0 and all_workers(self) > 0:
            if self._iterator is None:
                self._iterator = self._get_iterator()
            else:
                self._iterator._reset(self)
            return self._iterator
        return super().__iter__()

    def _get_iterator(self) -> Any:
        self._refresh_options()
        self._checkpoints.before_iterator(self)  # a resume undoes the base seed's draw
        iterator: InProcessIterator | WorkerIterator
        if self.num_workers == 0 and self._options.remote is None:
            iterator = InProcessIterator(self, self._options, self._checkpoints, self._history)
        else:
            plan = self._plans.plan(self, self._options, self._last_run, self._prestarted)
            if plan.kind == "process":  # "auto" may have chosen threads
                self.check_worker_number_rationality()
            iterator = WorkerIterator(self, self._options, plan, self._checkpoints, self._history)
        self._last_run = iterator.record
        iterator.record.periodic = self._report_every
        iterator.record.num_workers_choice = self._auto.reason if self._auto else None
        if self._plans.choice is not None and self.num_workers > 0:
            iterator.record.worker_type_choice = self._plans.choice.reason
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, to save with the model (torchdata's Stateful protocol).

        Plain Python (JSON-able when your dataset's own states are; a few kB), versioned:
        the epoch number, how many of its batches were yielded, the base seed, and the
        state of the random generators the sampler draws from as they were when the epoch
        began (between epochs: as they are). A new loader (same dataset and arguments)
        given it with `load_state_dict` yields exactly the batches this one had not yet
        yielded, in the same order, then the following epochs as an uninterrupted run
        would. A dataset, iterator, sampler or sampler iterator with ``state_dict()`` is
        saved through it (a dataset's per worker: resume with the same ``num_workers``;
        otherwise any ``num_workers`` resumes).

        Without ``generator=``, a shuffling sampler draws each epoch's order from torch's
        global generator: the state holds that too, but the epochs after a mid-epoch
        resume match only if you also restore ``torch.set_rng_state`` from your checkpoint
        (or pass ``generator=``).

        Raises:
            ValueError: the sampler is not one of torch's and has no ``state_dict`` (nor
                its iterator), or a stream that cannot say its position is mid-epoch.
        """
        return self._checkpoints.save(self)

    def _mark(self) -> Mark:
        """Where the loader stands now, in a few µs; `_state_dict_at` makes it a state
        (for frameworks that note the position at every batch but save it rarely)."""
        return self._checkpoints.mark(self)

    def _state_dict_at(self, mark: Mark) -> dict[str, Any]:
        """`state_dict` as it was at ``mark``; raises as `state_dict` does."""
        return self._checkpoints.save(self, at=mark)

    def load_state_dict(
        self, state_dict: dict[str, Any], *, skip_samples: Iterable[int] | None = None
    ) -> None:
        """Resume from `state_dict`'s result: the next ``iter(loader)`` continues that epoch.

        ``skip_samples`` (dataset indices, e.g. a loss spike's: `steadyload.ledger_samples`)
        leaves them out of the rest of the epoch (the next, for a state saved between
        epochs), batched again; later states keep it. Sharded ranks pass the same indices:
        every other sample once. See docs/guide/resume.md.

        Raises:
            ValueError: not a steadyload loader state, another version, or a loader built
                differently (dataset length, batch size, drop_last; for a state that holds
                the dataset's own state per worker, ``num_workers``), with what to do; bad
                ``skip_samples``.
        """
        self._refresh_options()  # the state's timeline goes to the ledger that will record
        self._checkpoints.load(self, state_dict, skip_samples)
        live = self._iterator  # torch keeps it only for persistent workers
        if isinstance(live, WorkerIterator):
            # Persistent workers were configured with the old base seed: start afresh.
            live._shutdown_workers()
            self._iterator = None

    def report(self, all_epochs: bool = False) -> LoaderReport:
        """What the latest epoch did: how its workers started (start method, preloads), each
        worker's samples, speed, busy share and memory, restarts, skipped samples, streams
        cut short, and the data-stall share (see `LoaderReport`). With ``all_epochs=True``,
        every epoch this loader ran (with or without persistent workers), each restart and
        skip marked with its epoch: what to look at after training.

        Cheap; safe to call at any time, also while iterating or after the run.
        """
        info = self._plans.start_info
        return self._history.report(all_epochs) or not_started(info, self._auto)


DataLoader.__module__ = "steadyload"  # public names report the package (see __init__.py)
