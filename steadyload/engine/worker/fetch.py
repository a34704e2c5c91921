"""Load one batch from the dataset, with torch's fetch semantics, remembering which sample.

This mirrors `torch.utils.data._utils.fetch` (map-style: ``__getitems__`` when the dataset
has it, else one ``dataset[i]`` per index; iterable: ``batch_size`` items from the replica's
iterator, StopIteration at its end) and adds one thing torch lacks: `where` says which
sample was being loaded, so an exception can name it. Used both in workers and in-process.
"""

from __future__ import annotations

import inspect
import pickle
import types
from collections.abc import Callable, Iterator
from typing import Any

from ..._seeding import StreamItem
from ...diagnosis.describe import describe_exception, format_indices
from ...report import SkippedSample, StreamCut
from ..config import WorkerConfig
from .status import COLLATING, IDLE, INIT, ITER, POSITION, STAGE, starting

MAP = 0
ITERABLE = 1  # the same values as torch.utils.data.dataloader._DatasetKind


class AllSkipped(Exception):
    """Every sample of the batch raised and was skipped (``on_error="skip"``)."""


_END = object()  # the stream ended
_BAD = object()  # the stream's item raised and was skipped
_STUCK = "its state_dict() still pointed at it, so a restart would read it again"


def stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()`` (torchdata's Stateful
    protocol: a sampler, a stream, or an iterator of either)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def stream_item_name(worker_id: int | None, number: int) -> str:
    """How a report names a stream's item: by its worker's own count (streams are per worker)."""
    if worker_id is None:
        return f"stream item {number}"
    return f"worker {worker_id}, its item {number}"


def restore_replica(kind: int, dataset: Any, saved: dict[str, Any]) -> Iterator[Any] | None:
    """Put a replica of the dataset where `Fetcher.position` said (unpickled: ``saved``), in
    torchdata's order: the dataset's state first (a stream's ``__iter__`` may build the
    iterator from it), then ``iter(dataset)`` and the iterator's state (``__iter__`` may
    reset it). Returns a stream's restored iterator (None for a map-style dataset).

    Raises:
        TypeError: the position has an iterator state, and the new iterator cannot take it.
    """
    if saved["dataset"] is not None:
        dataset.load_state_dict(saved["dataset"])
    if kind != ITERABLE:
        return None
    iterator = iter(dataset)
    if saved["iterator"] is not None:
        if not stateful(iterator):
            raise TypeError(
                "the saved stream position has an iterator state, but iter(dataset) returned "
                f"a {type(iterator).__qualname__} without load_state_dict()."
            )
        iterator.load_state_dict(saved["iterator"])
    return iterator


class Fetcher:
    """Fetch batches from one dataset replica; not thread-safe (one per process)."""

    def __init__(
        self,
        kind: int,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Callable[[Any], Any],
        drop_last: bool,
        *,
        skip_errors: bool = False,
        fields: Any = None,
        seeder: Callable[[Any], None] | None = None,
        worker_id: int | None = None,
        position: bytes | None = None,
    ) -> None:
        self._kind = kind
        self._skip = skip_errors
        self._worker_id = worker_id
        self._fields = fields  # the worker's status fields (POSITION, STAGE), or None
        self._seeder = seeder  # sample_seeds=True: seeds the RNGs before each sample
        self.skipped: list[SkippedSample] = []
        """Samples skipped by the last `fetch`."""
        self.count = 0
        """Samples in the batch the last `fetch` returned."""
        self.span: tuple[int, int] | None = None
        """A stream's: the items of the stream the last `fetch` read, [first, end), counted
        from the stream's start (kept in `position`: a resumed stream goes on counting)."""
        self._dataset = dataset
        self._auto_collation = auto_collation
        self._collate_fn = collate_fn
        self._drop_last = drop_last
        self._ended = False
        self._items_read = 0
        self._yielded = 0
        self.cut: StreamCut | None = None
        """Set when the stream ended at an item that raised (``on_error="skip"``)."""
        self._raised: tuple[int, str, str] | None = None  # the last item read, if it raised
        self._stuck_state: Any = None  # the stream's own state a restart after a bad item used
        # What is being loaded now, formatted only when an error needs it (hot path).
        self._stage = "iter"
        self._current: Any = None
        self._iterator: Iterator[Any] | None = None
        self._holders: tuple[Any, Any] = (None, None)  # what saves the position (position())
        self._start(position)
        # A stream that saves its position can go on after a bad item (_go_on).
        self._restartable = skip_errors and kind == ITERABLE and self._holders != (None, None)

    def _start(self, position: bytes | None) -> None:
        """Start at ``position`` (`position`'s result) when given (`restore_replica`); a
        position saved at the end of an epoch (``next_epoch``) is restored, then a new
        iterator made: what a persistent worker does between epochs."""
        dataset = self._dataset
        saved = pickle.loads(position) if position is not None else None
        iterator = restore_replica(self._kind, dataset, saved) if saved is not None else None
        if self._kind != ITERABLE:
            self._holders = (dataset if stateful(dataset) else None, None)
            return
        if iterator is None or saved is None or saved.get("next_epoch"):
            iterator = iter(dataset)
        else:  # mid-epoch: the items read before go on counting
            self._items_read = int(saved.get("read", 0))
        self._iterator = iterator
        self._holders = (
            dataset if iterator is not dataset and stateful(dataset) else None,
            iterator if stateful(iterator) else None,
        )

    def position(self) -> bytes | None:
        """Where this replica stands, pickled: the dataset's ``state_dict()`` (a stream's,
        unless the dataset is its own iterator; a map-style dataset's too) and a stream's
        iterator's (torchdata's Stateful protocol at both levels); None when neither has one."""
        dataset, iterator = self._holders
        if dataset is None and iterator is None:
            return None
        saved = {
            "dataset": dataset.state_dict() if dataset is not None else None,
            "iterator": iterator.state_dict() if iterator is not None else None,
        }
        if self._kind == ITERABLE:
            saved["read"] = self._items_read  # the ledger's item count goes on after a resume
        return pickle.dumps(saved)

    @property
    def where(self) -> str:
        """Which sample the last `fetch` was working on, for error messages."""
        stage, current = self._stage, self._current
        if stage == "iter":
            return "while creating the dataset's iterator (iter(dataset))"
        if stage == "sample":
            return f"while loading sample {current!r}"
        if stage == "getitems":
            return f"while loading samples {format_indices(current)} (__getitems__)"
        if stage == "collate":
            return f"while collating samples {format_indices(current)} (collate_fn)"
        if stage == "convert":
            return f"while converting sample {current!r} (collate_fn)"
        if stage == "stream":
            return f"while reading item {current} of the dataset's stream"
        return "while collating a batch of the dataset's stream (collate_fn)"

    def fetch(self, index: Any) -> Any:
        """Return the collated batch for ``index``; StopIteration when a stream has ended.

        With ``skip_errors``, a sample whose loading raises is left out of its batch and
        recorded in `skipped`; `AllSkipped` when no sample of the batch is left.
        """
        self.skipped = []
        if self._iterator is not None:
            return self._fetch_iterable(self._iterator, index)
        dataset = self._dataset
        fields = self._fields
        if self._auto_collation:
            data = self._load_batch(dataset, index)
            self._stage, self._current = "collate", index
            self.count = len(data)
        else:
            self._stage, self._current = "sample", index
            if fields is not None:
                fields[POSITION] = 0
            if self._seeder is not None:
                self._seeder(index)
            try:
                data = dataset[index]
            except Exception as exc:
                if not self._skip:
                    raise
                self.skipped.append(SkippedSample(index, *describe_exception(exc)))
                raise AllSkipped from exc
            self._stage = "convert"
            self.count = 1
        if fields is not None:
            fields[STAGE] = COLLATING
        return self._collate_fn(data)

    def _load_batch(self, dataset: Any, index: Any) -> Any:
        """The samples of a batch: one ``__getitems__`` call when the dataset has it.

        With ``skip_errors``, a ``__getitems__`` call that raises is retried sample by
        sample (each seeded by its own index), so that only the failing samples are left
        out; batches that load keep the batched path.
        """
        fields = self._fields
        seeder = self._seeder
        getitems = getattr(dataset, "__getitems__", None)
        if getitems:
            self._stage, self._current = "getitems", index
            if seeder is not None:
                seeder(index[0] if len(index) else None)  # one batched call: one seed
            if not self._skip:
                return getitems(index)
            try:
                return getitems(index)
            except Exception:  # find the bad samples one by one (below)
                pass
        data = []
        self._stage = "sample"
        for position, i in enumerate(index):
            self._current = i
            if fields is not None:
                fields[POSITION] = position
            if seeder is not None:
                seeder(i)
            if not self._skip:
                data.append(dataset[i])
                continue
            try:
                data.append(dataset[i])
            except Exception as exc:
                self.skipped.append(SkippedSample(i, *describe_exception(exc)))
        if not data and self.skipped:
            raise AllSkipped
        return data

    def _fetch_iterable(self, iterator: Iterator[Any], index: Any) -> Any:
        if self._ended:
            raise StopIteration
        self._stage, self._current = "stream", self._items_read
        first = self._items_read
        try:
            return self._read_batch(index)
        finally:
            self.span = (first, self._items_read)

    def _read_batch(self, index: Any) -> Any:
        if self._auto_collation:
            data = []
            for _ in index:
                item = self._next_item()
                if item is _END:
                    self._ended = True
                    break
                if item is not _BAD:
                    data.append(item)
            if not data and self.skipped and not self._ended:
                raise AllSkipped
            if not data or (self._drop_last and len(data) < len(index)):
                raise StopIteration
        else:
            data = self._next_item()
            if data is _END:
                self._ended = True
                raise StopIteration
            if data is _BAD:
                raise AllSkipped
        self._stage = "collate-stream"
        self.count = len(data) if self._auto_collation else 1
        return self._collate_fn(data)

    def _next_item(self) -> Any:
        """The stream's next item; `_END` at its end, `_BAD` for one that raised and was
        skipped (``on_error="skip"``)."""
        number = self._items_read
        if self._seeder is not None:
            self._seeder(StreamItem(number))
        try:
            item = next(self._iterator)  # type: ignore[arg-type]  # a stream has one
        except StopIteration:
            if self._raised is not None and self.cut is None:  # it ended with the bad item
                self._cut("the stream ended right after it")
            return _END
        except Exception as exc:
            if not self._skip:
                raise
            why = self._go_on()
            if why is not _STUCK:  # (stuck: the same bad item, read again)
                self._items_read += 1
                self._current = self._items_read
                error_type, message = describe_exception(exc)
                name = stream_item_name(self._worker_id, number)
                self.skipped.append(SkippedSample(name, error_type, message))
                self._raised = (number, error_type, message)
            if why is not None:
                self._cut(why)
                self._ended = True
            return _BAD
        self._items_read += 1
        self._yielded += 1
        self._current = self._items_read
        self._raised = self._stuck_state = None
        return item

    def _go_on(self) -> str | None:
        """After an item raised: restart a stream that saves its position from the state it
        reports now (most streams count the bad item as read). None when the stream goes
        on; else why it cannot (a generator that raised is finished)."""
        if self._restartable:
            try:
                state = self.position()
                saved = pickle.loads(state) if state is not None else {}
                own = (saved.get("dataset"), saved.get("iterator"))  # (not our item count)
                if own == self._stuck_state:  # the restart got nowhere
                    return _STUCK
                self._stuck_state = own
                self._start(state)  # as on a resume
                return None
            except Exception as exc:
                return f"restarting it from its state_dict() raised {type(exc).__name__}: {exc}"
        iterator = self._iterator
        if isinstance(iterator, types.GeneratorType) and (
            inspect.getgeneratorstate(iterator) == inspect.GEN_CLOSED
        ):
            return "a Python generator that raised cannot go on"
        return None  # an iterator that may go on; a StopIteration next ends it (_next_item)

    def _cut(self, why: str) -> None:
        assert self._raised is not None
        number, error_type, message = self._raised
        self.cut = StreamCut(
            worker_id=-1 if self._worker_id is None else self._worker_id,
            item=number,
            yielded=self._yielded,
            error_type=error_type,
            message=message,
            reason=why,
        )


def start_fetching(
    cfg: WorkerConfig,
    dataset: Any,
    worker_id: int,
    fields: Any,
    seeder: Any,
) -> tuple[Callable[[bytes | None], Fetcher], Fetcher | None, tuple[BaseException, str] | None]:
    """A worker's start (process or thread): run ``worker_init_fn``, then make the first
    fetcher (unless ``cfg.lazy_iter``: then None, made by the loop when the first message
    comes). Returns the fetcher factory (a new epoch; a replica restored at a
    `Fetcher.position`), the fetcher, and what failed and where: kept, to be reported with
    every task, as torch does for the first one (nothing can load). The status fields show
    each step (`INIT`, `ITER`), so a step that hangs is found by the hang watch like a
    task."""

    def new_fetcher(position: bytes | None) -> Fetcher:
        starting(fields, ITER)  # a stream's iter(dataset) runs here (each epoch, a resume)
        try:
            return Fetcher(
                cfg.dataset_kind,
                dataset,
                cfg.auto_collation,
                cfg.collate_fn,
                cfg.drop_last,
                skip_errors=cfg.skip_errors,
                fields=fields,
                seeder=seeder,
                worker_id=worker_id,
                position=position,
            )
        finally:
            fields[STAGE] = IDLE

    stage = "in worker_init_fn"
    try:
        if cfg.worker_init_fn is not None:
            starting(fields, INIT)
            try:
                cfg.worker_init_fn(worker_id)
            finally:
                fields[STAGE] = IDLE
        stage = "in iter(dataset)"
        return new_fetcher, None if cfg.lazy_iter else new_fetcher(None), None
    except Exception as exc:
        return new_fetcher, None, (exc, stage)
