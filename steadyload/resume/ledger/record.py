"""Record: what each step of a loader trained on, into the ledger folder (`files.Writer`).

One `Recorder` per loader with ``ledger=`` (owned by its `Checkpoints`). A segment (one
file) begins at the first epoch and again after every `load_state_dict`: its header says
which timeline it continues (``token``: the state's, ``parent``) and from where (``cut``:
the epoch and step the state resumes at), so `timeline.py` can tell what a resume
superseded. The iterators call `step` as ``next()`` hands a batch over (a prefetched batch
never yielded is not recorded); `RunRecord` forwards skipped samples (`skipped`). A wrapper
that takes each batch one ahead of its loop (accelerate's shard) calls `handed_on` as it
hands the previous one on: from then on each step waits for it, and a step read ahead that
the loop never got (it stopped there) is dropped, not recorded.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.utils.data as tud

from ...engine.worker.fetch import ITERABLE
from .. import shards
from ..epoch_order import order_of
from .files import Writer

ROOT = "root"  # the token of a timeline that starts afresh (no state loaded)
# Samplers whose epoch is every index of the dataset once (over all ranks, with padding or
# drop_last cuts that the epoch line states): verify checks every index; any other
# sampler's epoch is its own plan, checked step by step.
_FULL = frozenset(
    {
        "torch.utils.data.sampler.SequentialSampler",
        "torch.utils.data.sampler.RandomSampler",
        "torch.utils.data.sampler.BatchSampler",
        "torch.utils.data.distributed.DistributedSampler",
        "accelerate.data_loader.SeedableRandomSampler",
    }
)


def recorder_for(
    current: Recorder | None, folder: str | None, key: Callable[[Any], Any] | None
) -> Recorder | None:
    """The recorder for ``folder`` (None: none): ``current`` when it records there already."""
    if folder is None:
        return None
    if current is None or current.folder != folder:
        return Recorder(folder, key)
    current.key = key
    return current


def token_after(parent: str | None, epoch: int, step: int, skip: Iterable[int] = ()) -> str:
    """The token of a timeline resumed from ``parent`` at (epoch, step): the same on every
    rank that loads a state of that point, so their segments group together."""
    text = f"{parent or 'none'}|{epoch}|{step}|{','.join(map(str, sorted(skip)))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Recorder:
    """A loader's ledger: see the module docstring. Not thread-safe, like the loader."""

    def __init__(self, folder: str, key: Callable[[Any], Any] | None = None) -> None:
        self.folder = folder
        self.key = key
        self.token = ROOT
        self._next: dict[str, Any] = {"token": ROOT, "parent": None, "cut": None, "skip": None}
        self._writer: Writer | None = None
        self._epoch = -1
        self._ahead = False  # a wrapper reads ahead: steps wait for `handed_on`
        self._held: tuple[Any, ...] | None = None  # the step read ahead, not yet handed on

    # -- the timeline ------------------------------------------------------------------------
    def resumed(
        self, state: dict[str, Any], epoch: int, step: int, skip: Iterable[int] = ()
    ) -> None:
        """A state was loaded: the next epoch begins a segment that continues the state's
        timeline from (``epoch``, ``step``), ``skip``: samples left out on purpose."""
        saved = state.get("ledger")
        parent = saved["token"] if isinstance(saved, dict) else None
        skipped = sorted(skip)
        self._close()
        self._next = {
            "token": token_after(parent, epoch, step, skipped),
            "parent": parent,
            "cut": [epoch, step],
            "skip": {"epoch": epoch, "at": step, "samples": skipped} if skipped else None,
        }

    def begin_epoch(
        self, loader: tud.DataLoader[Any], epoch: int, base_seed: int, first_step: int, start: Any
    ) -> None:
        """Epoch ``epoch`` begins at step ``first_step`` (a resumed one: the state's);
        ``start`` is what decides it (`epoch_order.EpochStart`: its sharding, and whether
        it is a rest dealt again to this rank, whose batches are then its length)."""
        sharding, rest = start.sharding, None
        if start.redealt and sharding is not None:
            rest = shards.epoch_batches(sharding, _size(loader.dataset), loader.drop_last)
        options = getattr(loader, "_options", None)
        sample_seeds = bool(getattr(options, "sample_seeds", False))
        if self._writer is None:
            self._open(loader)
        self._epoch = epoch
        self._held = None  # read ahead in an epoch the loop left: never trained on
        assert self._writer is not None
        self._writer.write(
            {
                "epoch": epoch,
                "base_seed": base_seed,
                "sample_seeds": sample_seeds,
                "first_step": first_step,
                "length": _length(loader) if rest is None else first_step + rest,
                "redealt": rest is not None,
                "plan": _plan(loader),
                "deal": shards.deal_plan(loader, sharding),
                "batch_size": loader.batch_size,
                "drop_last": loader.drop_last,
            }
        )

    def _open(self, loader: tud.DataLoader[Any]) -> None:
        world = shards.world()
        header = dict(self._next)
        self.token = header["token"]
        dataset = loader.dataset
        size = _size(dataset)
        header.update(
            rank=world["rank"],
            world=world["size"],
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.time(),
            dataset={
                "type": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
                "kind": "iterable" if loader._dataset_kind == ITERABLE else "map",
                "len": size,
            },
        )
        self._writer = Writer(self.folder, header)
        # A later segment of this process (no state loaded in between) goes on with it.
        self._next = {"token": self.token, "parent": header["parent"], "cut": header["cut"]}
        self._next["skip"] = None

    # -- what the loop took ------------------------------------------------------------------
    def step(
        self,
        step: int,
        indices: Any,
        worker: int,
        pid: int | None,
        kind: str,
        events: list[Any] | None = None,
        batch: Any = None,
        host: str | None = None,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Step ``step`` of the current epoch was handed to the loop (``batch``: a stream's,
        for its keys; ``host``: a remote worker's node; ``span``: a stream's items, the
        first and the end, in the worker's stream)."""
        writer = self._writer
        if writer is None:
            return
        keys = None
        if batch is not None:  # a stream's: no indices (torch's are None), maybe keys
            indices, keys = None, _keys(batch, self.key)
        pos = list(span) if batch is not None and span is not None else None
        record = (self._epoch, step, indices, worker, pid, kind, host, events or None, pos, keys)
        if self._ahead:  # (one held before: read ahead and dropped, the loop left)
            self._held = record
        else:
            writer.step(record)

    def handed_on(self) -> None:
        """A wrapper reading one batch ahead hands the batch it took last to its loop."""
        self._ahead = True
        held, self._held = self._held, None
        if held is not None and self._writer is not None:
            self._writer.step(held)

    def end_epoch(self, steps: int) -> None:
        """The current epoch ran to its end after ``steps`` steps (its records on disk)."""
        if self._writer is not None:
            self._writer.write({"ev": "end", "e": self._epoch, "steps": steps})
            self._writer.flush()

    def skipped(self, epoch: int, index: Any, cause: str) -> None:
        """A sample was left out on error (``on_error="skip"``) in epoch ``epoch``."""
        if self._writer is not None:
            self._writer.write({"ev": "skip", "e": epoch, "index": index, "cause": cause})

    def state(self, steps: int) -> dict[str, Any]:
        """What a state saved after ``steps`` steps of its epoch carries for the ledger (its
        timeline, the step it resumes at), after handing every record to the OS."""
        self.flush()
        return {"token": self.token, "steps": steps}

    def flush(self) -> None:
        """Hand the buffered records to the OS."""
        if self._writer is not None:
            self._writer.flush()

    def _close(self) -> None:
        self._held = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _size(dataset: Any) -> int | None:
    """``len(dataset)``, or None for a stream without one."""
    try:
        return len(dataset)
    except TypeError:
        return None


def _length(loader: tud.DataLoader[Any]) -> int | None:
    """This rank's batches in an epoch, when the index sampler has a length."""
    if loader._dataset_kind == ITERABLE:
        return None
    try:
        return len(loader._index_sampler)
    except TypeError:
        return None


def _plan(loader: tud.DataLoader[Any]) -> str:
    """ "full": the epoch is every index once over the ranks; "sampler": its own plan;
    "stream": an IterableDataset."""
    if loader._dataset_kind == ITERABLE:
        return "stream"
    sampler = loader.sampler
    if getattr(sampler, "replacement", False) or (
        getattr(sampler, "_num_samples", None) is not None
    ):
        return "sampler"  # draws with replacement, or another number of samples
    return "full" if all(kind in _FULL for kind in order_of(loader)) else "sampler"


def _keys(batch: Any, key: Callable[[Any], Any] | None) -> list[Any] | None:
    """The samples' keys: ``ledger_key(batch)``, or webdataset's ``__key__`` list."""
    if key is not None:
        return list(key(batch))
    if isinstance(batch, dict) and isinstance(batch.get("__key__"), list):
        return list(batch["__key__"])
    return None
