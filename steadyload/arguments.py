"""torch's and torchdata's DataLoader arguments as steadyload takes them: read back from a
loader's attributes for `DataLoader.from_loader` (frameworks build torch loaders; steadyload
builds their twins), and torchdata's ``snapshot_every_n_steps`` checked."""

from __future__ import annotations

from typing import Any

import torch.utils.data

# What torch keeps on a DataLoader of its arguments besides the dataset and the sampling.
_TORCH_ATTRIBUTES = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
# torchdata's StatefulDataLoader adds this one; steadyload accepts it (see DataLoader).
_TORCHDATA_ATTRIBUTES = ("snapshot_every_n_steps",)


def torch_arguments(loader: torch.utils.data.DataLoader[Any]) -> dict[str, Any]:
    """The keyword arguments that rebuild ``loader``: the dataset, every argument torch keeps
    as an attribute, and its batch sampler (or sampler) object itself, so that sharding and
    seeding wrappers are kept; for an IterableDataset, its batch size and drop_last."""
    kwargs: dict[str, Any] = {name: getattr(loader, name) for name in _TORCH_ATTRIBUTES}
    kwargs.update(
        (name, getattr(loader, name)) for name in _TORCHDATA_ATTRIBUTES if hasattr(loader, name)
    )
    kwargs["dataset"] = loader.dataset
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_sampler is not None:
        kwargs["batch_sampler"] = loader.batch_sampler
    else:
        kwargs.update(batch_size=None, sampler=loader.sampler)
    return kwargs


def checked_snapshot_steps(steps: Any) -> int | None:
    """torchdata's ``snapshot_every_n_steps``, checked (steadyload's state does not need it).

    Raises:
        ValueError: not an int >= 0 or None.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
        raise ValueError(
            f"snapshot_every_n_steps must be an int >= 0 or None, got {steps!r} (torchdata's "
            "keyword; steadyload's state is exact after every batch whatever it is)."
        )
    return steps
