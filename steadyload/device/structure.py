"""A batch's tensors, wherever they sit: found and replaced as torch's ``pin_memory`` does.

Tensors in dicts (and other mappings, HF ``BatchEncoding`` too), lists, tuples, namedtuples
and dataclasses are visited; strings, numbers and other leaves are left alone, and so is a
value wrapped in `on_host` (with ``device=`` it is yielded unwrapped, on the host, neither
pinned nor copied).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch


class OnHost:
    """A value the device stage leaves on the host (see `on_host`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:  # crosses from a worker like any leaf
        return (OnHost, (self.value,))

    def __repr__(self) -> str:
        return f"on_host({self.value!r})"


def on_host(value: Any) -> Any:
    """Mark ``value`` (a tensor, or any part of a batch) to stay on the host.

    Wrap it in the dataset or ``collate_fn``; with ``device=`` the loader yields it
    unwrapped, neither copied to the device nor pinned, where the rest of the batch moves.
    Without ``device=`` nothing moves and the batch is yielded as collated, wrapper
    included (``pin_memory=True`` alone pins as torch's does, which leaves it alone).
    """
    return OnHost(value)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with each tensor ``t`` replaced by ``fn(t)`` and `OnHost` values unwrapped;
    the containers are rebuilt as torch's ``pin_memory`` rebuilds them (plus dataclasses)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, OnHost):
        return batch.value
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:
            if isinstance(batch, MutableMapping):
                clone = copy.copy(batch)  # keeps the type's own attributes (BatchEncoding)
                clone.update(items)
                return clone
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple):
        if hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*(map_tensors(v, fn) for v in batch))
        return type(batch)(map_tensors(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        record: Any = copy.copy(batch)
        for field in dataclasses.fields(batch):
            value = map_tensors(getattr(batch, field.name), fn)
            object.__setattr__(record, field.name, value)  # frozen ones too
        return record
    if isinstance(batch, Sequence):
        items_list = [map_tensors(v, fn) for v in batch]
        try:
            if isinstance(batch, MutableSequence):
                sequence: Any = copy.copy(batch)
                sequence[:] = items_list
                return sequence
            return type(batch)(items_list)  # type: ignore[call-arg]
        except TypeError:
            return items_list
    return batch


def tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors `map_tensors` would visit, in its order."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(batch, visit)
    return found


on_host.__module__ = "steadyload"  # the public name (steadyload/__init__.py)
