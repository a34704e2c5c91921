"""Ray Train: a `prepare_data_loader` that keeps steadyload's loader, workers and options.

Ray's ``ray.train.torch.prepare_data_loader`` shards a loader across training workers by
building a new ``torch.utils.data.DataLoader`` from a fixed subset of its arguments (no
``prefetch_factor``, ``persistent_workers``, ``multiprocessing_context``, ``in_order``, and
none of steadyload's options), then wraps it in its ``_WrappedDataLoader`` for device
placement. This module puts the ``DistributedSampler`` in itself, keeping every argument,
and asks Ray only to wrap (``add_dist_sampler=False``, a public argument of both Ray Train
APIs). See docs/design/integrations.md#ray-train.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

from ..loader import DataLoader
from ..resume.checkpoint import Mark


def prepare_data_loader(
    loader: tud.DataLoader[Any],
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
) -> tud.DataLoader[Any]:
    """``ray.train.torch.prepare_data_loader`` for steadyload loaders: call it in the
    training function instead of Ray's, with the same arguments.

    With more than one training worker, the loader's sampler is replaced by
    ``DistributedSampler(dataset, shuffle=<whether the loader shuffled>)``, as Ray does,
    but in a `steadyload.DataLoader` built with every other argument and option of
    ``loader`` (``DataLoader.from_loader``); Ray then only wraps it to move batches to the
    training device. A plain ``torch.utils.data.DataLoader`` is turned into a steadyload
    one first (default options). The loader that comes back keeps steadyload's
    ``report()``, ``state_dict()`` and ``load_state_dict()``: Ray's wrapper fetches one
    batch ahead of the training loop, and its ``state_dict()`` is the position of the
    batches the loop has received, not of that prefetched one. As with Ray's, call
    ``loader.sampler.set_epoch(epoch)`` before each epoch when shuffling across ranks.

    Costs nothing before iteration: no worker starts until the first ``iter()``. Must run
    inside a Ray Train worker (``ray.train.get_context()``).

    Args:
        loader: the training function's loader, steadyload's or torch's.
        add_dist_sampler: shard by rank with a ``DistributedSampler`` when the run has more
            than one worker and the loader is not sharded already (default True).
        move_to_device: wrap the loader so that batches move to the worker's device
            (Ray's ``_WrappedDataLoader``; default True).
        auto_transfer: copy batches to a GPU on a separate CUDA stream (ignored on CPU).

    Returns:
        The loader to iterate: Ray's wrapper around a `steadyload.DataLoader`, or with
        ``move_to_device=False`` the steadyload loader itself.

    Raises:
        ValueError: ``add_dist_sampler`` with a custom ``batch_sampler``, which no sampler
            can be slipped into (shard it by rank yourself, then pass
            ``add_dist_sampler=False``).
    """
    import ray.train
    import ray.train.torch

    ours = loader if isinstance(loader, DataLoader) else DataLoader.from_loader(loader)
    context = ray.train.get_context()
    if add_dist_sampler and context.get_world_size() > 1:
        ours = _sharded(ours, context.get_world_rank(), context.get_world_size())
    prepared: tud.DataLoader[Any] = ray.train.torch.prepare_data_loader(
        ours, add_dist_sampler=False, move_to_device=move_to_device, auto_transfer=auto_transfer
    )
    if prepared is not ours:
        _expose(prepared, ours)
    return prepared


def _sharded(loader: DataLoader[Any], rank: int, world: int) -> DataLoader[Any]:
    """``loader`` with rank ``rank`` of ``world``'s DistributedSampler in place of its
    sampler, or ``loader`` itself when it is sharded already (or streams)."""
    if isinstance(loader.dataset, tud.IterableDataset):
        return loader  # no sampler to replace; the stream shards itself, as under Ray
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not tud.BatchSampler:
        raise ValueError(
            f"steadyload.integrations.ray.prepare_data_loader cannot shard a loader whose "
            f"batch_sampler is a {type(batch_sampler).__module__}."
            f"{type(batch_sampler).__qualname__}: no DistributedSampler can be put inside "
            "it (Ray's own prepare_data_loader would drop it and yield unbatched samples).\n"
            "Fix: make the batch sampler yield only this rank's batches "
            "(ray.train.get_context().get_world_rank() and get_world_size()) and pass "
            "add_dist_sampler=False."
        )
    if batch_sampler is not None:
        sampler = batch_sampler.sampler
        batch_size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
    else:  # batch_size=None: the sampler's indices are the samples
        sampler, batch_size, drop_last = loader.sampler, None, loader.drop_last
    if isinstance(sampler, DistributedSampler):
        return loader
    in_order = isinstance(sampler, (tud.SequentialSampler, range))
    if not in_order and type(sampler) is not tud.RandomSampler and rank == 0:
        warnings.warn(
            f"steadyload: Ray Train's sharding replaces the loader's "
            f"{type(sampler).__qualname__} with a DistributedSampler, as "
            "ray.train.torch.prepare_data_loader does. Fix: to keep your sampler, make it "
            "yield only this rank's indices and pass add_dist_sampler=False.",
            UserWarning,
            stacklevel=3,
        )
    return DataLoader.from_loader(
        loader,
        sampler=DistributedSampler(loader.dataset, num_replicas=world, rank=rank,
                                   shuffle=not in_order),  # Ray's rule; seed 0, as Ray's
        batch_sampler=None,
        batch_size=batch_size,
        drop_last=drop_last,
    )


class _Position:
    """The steadyload loader's position as the training loop behind Ray's wrapper sees it.

    Ray's ``_WrappedDataLoader`` takes the next batch before handing out the current one
    (``_prefetch_next_batch``), so the loader has always yielded one batch more than the
    loop received. The state is therefore taken just before each prefetch: that is the
    position after the batches the loop has; once the prefetch finds the epoch's end, the
    loader's own (finished) state is. The mark costs a few µs per batch; the state
    is built only when asked for. Holds
    the wrapper weakly: the wrapper holds this, and a cycle would keep a dropped wrapper's
    iterator, and its workers, alive until the next garbage collection.
    """

    def __init__(self, loader: DataLoader[Any], wrapper: Any) -> None:  # Ray's wrapper
        self._loader = loader
        self._wrapper = weakref.ref(wrapper)
        self._prefetch: Callable[[Any], None] = type(wrapper)._prefetch_next_batch
        self._mark: Mark | None = None

    def prefetch(self) -> None:
        self._mark = self._loader._mark()  # a state is built from it only if one is asked for
        wrapper = self._wrapper()
        if wrapper is not None:
            self._prefetch(wrapper)
            if wrapper.next_batch is None:  # the loader is exhausted: its own state says so
                self._mark = None

    def state_dict(self) -> dict[str, Any]:
        if self._mark is None:
            return self._loader.state_dict()  # not iterated since built or loaded
        return self._loader._state_dict_at(self._mark)  # raises as state_dict() does

    def load_state_dict(
        self, state_dict: dict[str, Any], *, skip_samples: Iterable[int] | None = None
    ) -> None:
        self._loader.load_state_dict(state_dict, skip_samples=skip_samples)
        self._mark = None


def _expose(prepared: tud.DataLoader[Any], loader: DataLoader[Any]) -> None:
    """Give Ray's wrapper steadyload's methods (its class has none of them)."""
    if getattr(prepared, "_dataloader", None) is not loader:
        warnings.warn(
            "steadyload: ray.train.torch.prepare_data_loader(add_dist_sampler=False) did not "
            f"wrap the steadyload loader but returned a {type(prepared).__qualname__}: this "
            "Ray version may load batches without steadyload. Fix: pass "
            "move_to_device=False and move batches to ray.train.torch.get_device() "
            "yourself, and report it to steadyload with your Ray version.",
            UserWarning,
            stacklevel=3,
        )
        return
    prepared.report = loader.report  # Ray's class has none
    known = callable(getattr(type(prepared), "_prefetch_next_batch", None))
    if known and hasattr(prepared, "next_batch"):
        position = _Position(loader, prepared)
        # Instance attributes: Ray's __iter__/__next__ call self._prefetch_next_batch().
        prepared._prefetch_next_batch = position.prefetch
        prepared.state_dict = position.state_dict
        prepared.load_state_dict = position.load_state_dict
    else:  # a Ray without the prefetch we know: the loader's own position, one batch on
        warnings.warn(
            "steadyload: Ray's data loader wrapper has changed (no _prefetch_next_batch or "
            "next_batch): "
            "its state_dict() may count one batch more than the training loop received. "
            "Fix: for an exact state_dict(), pass move_to_device=False and move batches to "
            "ray.train.torch.get_device() yourself.",
            UserWarning,
            stacklevel=3,
        )
        prepared.state_dict = loader.state_dict
        prepared.load_state_dict = loader.load_state_dict
