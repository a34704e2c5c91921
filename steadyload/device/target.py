"""Which device a loader feeds (``device=``), checked when the loader is built, and the
stage an iterator gets for it (`feed_for`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..host.system import total_memory_bytes
from .backends import Backend, CudaBackend, HostBackend
from .feed import Feed, Taken

DEFAULT_PINNED_CAP = 1 << 30
"""The pinned pool's cap unless ``pinned_memory_limit`` says otherwise (and at most a
quarter of the host's memory). [Unit: byte]"""

BACKEND_FOR_TESTS: Callable[[torch.device], Backend] | None = None
"""Tests set this to give the stage a device of their own (backends.py)."""


def resolve_device(device: Any) -> torch.device | None:
    """``device=`` as a `torch.device` (``"cuda"`` gets this rank's index: ``LOCAL_RANK``
    when set, else the current device once the stage starts); None stays None.

    Raises:
        ValueError: a device that is not one, not CUDA/ROCm or CPU, or a GPU this machine
            does not have, each with what to do.
    """
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={device!r} is not a device ({exc}); use 'cuda', 'cuda:N', 'cpu', a "
            "torch.device, or None (batches stay where the workers made them)"
        ) from None
    if target.type == "cpu":
        return target
    if target.type != "cuda":
        raise ValueError(
            f"device={device!r}: steadyload's device stage feeds CUDA and ROCm GPUs "
            "('cuda', 'cuda:N'; torch.cuda is HIP on ROCm) and 'cpu'.\nFix: use one of "
            "those, or device=None and move the batches in your loop."
        )
    if BACKEND_FOR_TESTS is None and not torch.cuda.is_available():
        build = (
            "this torch is a CPU-only build (torch.version.cuda and torch.version.hip are None)"
            if torch.version.cuda is None and torch.version.hip is None
            else "no GPU is visible to this process (torch.cuda.device_count() is 0; check "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r} "
            "and the driver)"
        )
        raise ValueError(
            f"device={device!r} asks for a GPU, but {build}.\nWhy: the device stage copies "
            "every batch to that GPU, and there is none to copy to.\nFix: run where a GPU "
            "is (with a CUDA or ROCm build of torch), or pass device='cpu' (the same stage, "
            "no copy) or device=None."
        )
    if target.index is None and os.environ.get("LOCAL_RANK", "").isdigit():
        target = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # this rank's GPU
    count = torch.cuda.device_count() if BACKEND_FOR_TESTS is None else 1 << 16
    if target.index is not None and target.index >= count:
        raise ValueError(
            f"device={device!r} (cuda:{target.index}) is not among this machine's "
            f"{count} GPU(s).\nFix: use an index below {count}, or 'cuda' (LOCAL_RANK's "
            "GPU under torchrun, else the current one)."
        )
    return target


def pinned_cap(limit: int | None) -> int:
    """The pinned pool's cap: ``limit`` (``pinned_memory_limit``) or the default. [Unit: byte]"""
    if limit is not None:
        return limit
    total = total_memory_bytes()
    return min(DEFAULT_PINNED_CAP, total // 4) if total else DEFAULT_PINNED_CAP


def feed_for(
    device: torch.device | None,
    pin_memory: bool,
    take: Callable[[bool], Taken | None],
    *,
    depth: int,
    transform: Callable[[Any], Any] | None,
    cap_bytes: int,
    skip: Callable[[list[Any]], Any] | None,
    hang_timeout: float | None,
    keep_thread: bool = False,
) -> Feed | None:
    """The device stage of an iterator, or None when it needs none (no ``device=``, and no
    pinning: ``pin_memory`` is torch's, False without an accelerator)."""
    if device is None and not pin_memory:
        return None
    if device is None or device.type == "cpu":
        backend: Backend = HostBackend()
    elif BACKEND_FOR_TESTS is not None:
        backend = BACKEND_FOR_TESTS(device)
    else:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        backend = CudaBackend(device)
    return Feed(
        take,
        backend,
        depth=depth,
        transform=transform,
        pin_only=pin_memory and not backend.copies,
        cap_bytes=cap_bytes,
        skip=skip,
        hang_timeout=hang_timeout,
        keep_thread=keep_thread,
    )
