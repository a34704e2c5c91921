"""One epoch's progress (`EpochProgress`) and where each replica of the dataset stands in
it: the ``dataset_states`` part of a loader state (docs/design/resume.md). Streams and
Stateful map-style datasets keep their own position; each worker sends its replica's with
every batch (`Fetcher.position`), and a resume gives it back to the same worker id.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch.utils.data as tud

from ..engine.remote.spec import all_workers
from ..engine.worker.fetch import ITERABLE, stateful
from .epoch_order import YieldedBatches


def persistent(loader: tud.DataLoader[Any]) -> bool:
    """Whether the loader keeps its workers between epochs."""
    return bool(loader.persistent_workers and all_workers(loader) > 0)


def fail(what: str, why: str, fix: str) -> ValueError:
    """The error for a state that cannot be saved or loaded: what, why, and the fix."""
    return ValueError(f"{what}\nWhy: {why}\nFix: {fix}")


class EpochProgress:
    """One epoch's position, kept by the iterator that runs it and by `Checkpoints` until
    the next epoch begins: a state saved after a ``break`` (the iterator dropped) resumes
    the rest of the epoch; only StopIteration makes the epoch finished.

    The iterator marks each yielded batch in `yielded`, sets `finished` at the epoch's end,
    and, for a dataset that keeps its own position (a stream, a Stateful map-style
    dataset), records each worker's replica position after its last yielded batch in
    `streams` (in-process: `in_process` reads it when a state is saved).
    """

    __slots__ = (
        "epoch",
        "yielded",
        "finished",
        "streams",
        "ended",
        "last_worker",
        "resume_streams",
        "in_process",
        "step_base",
    )

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        """The loader's epoch number (0 for the first)."""
        self.yielded = YieldedBatches()
        self.finished = False
        self.streams: dict[int, bytes | None] = {}
        """worker id -> its replica's pickled position (`Fetcher.position`) after its last
        yielded batch; None when its stream cannot say (no Stateful dataset or iterator)."""
        self.ended: dict[int, bytes | None] = {}
        """worker id -> its stream's position when it ended (an epoch counter it keeps)."""
        self.last_worker: int | None = None
        """The worker whose batch was yielded last (dispatch resumes after it)."""
        self.resume_streams: dict[str, Any] | None = None
        """Loaded replica positions (``dataset_states``) for the iterator to restore, then
        clear."""
        self.step_base = 0
        """Steps of the epoch before ordinal 0: a rest dealt again to other ranks numbers
        its batches from 0, and its steps go on from the state's (the ledger's count)."""
        self.in_process: Callable[[], bytes | None] | None = None
        """``num_workers=0``: the dataset's position now (`Fetcher.position`), read when a
        state is saved (fixed at the epoch's end)."""


def replica_positions(
    loader: tud.DataLoader[Any], progress: EpochProgress, *, ended: bool
) -> dict[str, Any] | None:
    """Where each replica of the dataset stands (`Fetcher.position`, pickled as the workers
    sent them: a mark only copies them; in-process the dataset's ``state_dict()`` is called),
    for a stream or a Stateful map-style dataset.

    Mid-epoch: after each worker's last yielded batch (a worker that yielded nothing starts
    afresh). At the end of an epoch (``ended``): only where the next epoch goes on from
    them, as in the run that saved them: in-process (one dataset object) and persistent
    workers (each keeps its replica); fresh workers start from fresh copies.

    Raises:
        ValueError: mid-epoch, a batch was yielded from a stream that cannot say where it
            stands; in-process, the dataset's ``state_dict()`` raised.
    """
    iterable = loader._dataset_kind == ITERABLE
    if not iterable and not stateful(loader.dataset):
        return None  # the sampler's replay is the whole position
    workers: dict[int, bytes | None]
    if all_workers(loader) == 0:  # one dataset object, which may keep its position across
        # epochs (an IterableDataset that is its own iterator): saved even before a batch
        try:
            position = progress.in_process() if progress.in_process is not None else None
        except Exception as exc:  # the dataset's state_dict() (or pickling what it gave)
            raise fail(
                f"steadyload cannot save the position of {type(loader.dataset).__qualname__}: "
                f"its state_dict() raised {type(exc).__name__}: {exc}",
                "the dataset's own state is part of the loader's position.",
                "make state_dict() return picklable plain data (numbers, lists, dicts).",
            ) from exc
        workers = {0: position}
    elif ended:
        if not persistent(loader):
            return None
        workers = dict(progress.ended if iterable else progress.streams)
    else:
        workers = dict(progress.streams)
    if any(position is None for position in workers.values()):
        if ended or (all_workers(loader) == 0 and progress.yielded.count == 0):
            return None  # nothing to carry over, or nothing read yet: a fresh start is exact
        raise fail(
            f"steadyload cannot save the position of {type(loader.dataset).__qualname__} "
            "mid-epoch: neither the IterableDataset nor the iterator its __iter__ returns has "
            "state_dict()/load_state_dict().",
            "a stream cannot be replayed from its start without reading it again, and "
            "steadyload will not guess where it stood.",
            "give the dataset (or its iterator) state_dict()/load_state_dict() (its position "
            "in the stream), or checkpoint only at the end of an epoch.",
        )
    if not workers:
        return None  # no replica has a position yet: every one starts afresh
    last = None if ended else progress.last_worker
    return {"workers": workers, "last_worker": last, "next_epoch": ended}


def saved_positions(loader: tud.DataLoader[Any], positions: dict[str, Any]) -> dict[str, Any]:
    """A mark's positions as a state holds them: plain objects (JSON-able when the dataset's
    states are), in a list by worker id (None: a fresh start)."""
    workers: list[Any] = [None] * max(all_workers(loader), 1)
    for worker_id, blob in positions["workers"].items():
        workers[worker_id] = pickle.loads(blob)
    return {**positions, "workers": workers}


def carried(previous: EpochProgress, iterable: bool) -> dict[int, bytes]:
    """Persistent workers keep their replicas across epochs: until a worker yields in the
    new epoch, its position is where it ended ``previous`` (a stream's at its end, a
    map-style dataset's after its last batch), marked to start a new iterator there, as the
    worker does; for a state saved then, and for its replacement."""
    ended = previous.ended if iterable else previous.streams
    return {
        worker_id: pickle.dumps({**pickle.loads(blob), "next_epoch": True})
        for worker_id, blob in ended.items()
        if blob is not None
    }


def position_blobs(saved: dict[str, Any]) -> dict[int, bytes]:
    """A state's ``dataset_states`` as `Fetcher.position` blobs by worker id, for the
    iterators to restore (a position saved at an epoch's end starts the next epoch)."""
    extra = {"next_epoch": True} if saved["next_epoch"] else {}
    return {
        worker_id: pickle.dumps({**position, **extra})
        for worker_id, position in enumerate(saved["workers"])
        if position is not None
    }
