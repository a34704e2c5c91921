"""Replay: one recorded step's batch rebuilt offline, in this process (`steadyload.replay`).

The ledger says which dataset indices a step trained on and, with ``sample_seeds=True``,
the base seed each sample's RNGs were seeded from: the same `Fetcher` the workers run
loads them again, seeded the same way, and collates them. Bit for bit with sample seeds;
without them the indices and every deterministic transform are reproduced, a random one
is not (its worker's RNG stream is not recorded): replay says so.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.utils.data as tud

from ..._seeding import KeepCallerRngs, SampleSeeder
from ...engine.worker.fetch import ITERABLE, Fetcher
from ..progress import fail
from .timeline import resolve


def find_step(folder: str | os.PathLike[str], epoch: int, step: int, rank: int | None) -> Any:
    """The step's record on the folder's timeline (`timeline.Step`).

    Raises:
        ValueError: no such step, or several ranks recorded it and ``rank`` is None.
    """
    timeline = resolve(folder)
    found = [s for s in timeline.steps(epoch=epoch, rank=rank) if s.step == step]
    if not found:
        raise fail(
            f"the ledger in {folder} has no step {step} of epoch {epoch}"
            + (f" on rank {rank}" if rank is not None else "")
            + ".",
            "replay rebuilds a step the ledger recorded on the run's timeline (steps a resume "
            "superseded are not on it).",
            f"list what it holds: steadyload ledger verify {folder}",
        )
    if len(found) > 1:
        ranks = sorted(s.rank for s in found)
        raise fail(
            f"step {step} of epoch {epoch} was recorded by ranks {ranks}.",
            "each rank trained on its own batch at that step.",
            "pass rank= (--rank) to say which one.",
        )
    return found[0]


def replay(
    loader: tud.DataLoader[Any],
    folder: str | os.PathLike[str],
    *,
    epoch: int,
    step: int,
    rank: int | None = None,
) -> Any:
    """The batch that step ``step`` of epoch ``epoch`` (on ``rank``) trained on, rebuilt from
    ``loader``'s dataset and collate function as the collate function made it, on the CPU
    (before pinning or any device).

    Bit for bit when the run had ``sample_seeds=True``; otherwise a UserWarning says that
    random transforms are not reproduced. ``loader`` is built as the run built it (its
    dataset and collate function; the number of workers plays no part).

    Raises:
        ValueError: the step is not in the ledger (or needs ``rank``), or the dataset is an
            IterableDataset (a stream has no index to load a sample by).
    """
    record = find_step(folder, epoch, step, rank)
    if loader._dataset_kind == ITERABLE:
        keys = f" (its samples' keys: {record.keys})" if record.keys else ""
        raise fail(
            f"steadyload cannot replay step {step} of a stream{keys}.",
            "an IterableDataset has no index to load a sample by; the ledger records which "
            "worker and keys it came from, not how to read it again.",
            "use the keys (webdataset's __key__, or ledger_key=) to find the samples.",
        )
    line = resolve(folder).epoch_line(epoch, record.rank, segment=record.segment) or {}
    seeder = None
    if line.get("sample_seeds"):
        seeder = SampleSeeder(int(line["base_seed"]))
        seeder.epoch = epoch
    else:
        warnings.warn(
            f"step {step} of epoch {epoch} is rebuilt from its recorded indices, but the run "
            "had sample_seeds=False: a random transform drew from its worker's RNG stream, "
            "which the ledger cannot replay, so random augmentations differ (indices and "
            "deterministic transforms are the same). Train with sample_seeds=True to replay "
            "batches bit for bit.",
            UserWarning,
            stacklevel=2,
        )
    fetcher = Fetcher(
        loader._dataset_kind,
        loader.dataset,
        loader._auto_collation,
        loader.collate_fn,
        loader.drop_last,
        skip_errors=getattr(loader, "on_error", "raise") == "skip",
        seeder=seeder,
    )
    with KeepCallerRngs():  # seeding must not change the caller's RNGs
        return fetcher.fetch(record.indices)


replay.__module__ = "steadyload"  # its public name (see steadyload/__init__.py)
