"""`LoaderOptions`: steadyload's own settings of one loader, checked once.

Shared by the loader (which maps its keyword arguments onto them), the iterators and the
recovery policy; torch's own arguments stay on the loader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .device.target import resolve_device
from .engine.remote.spec import RemoteWorkers, remote_spec
from .host.system import parse_bytes
from .start.context import START_METHODS

ON_ERROR = ("raise", "skip")
WORKER_TYPES = ("process", "thread", "auto")
# The DataLoader keyword arguments (and attributes) that hold these options.
OPTION_NAMES = (
    "start_method",
    "max_restarts",
    "on_error",
    "hang_timeout",
    "max_worker_memory",
    "sample_seeds",
    "worker_type",
    "remote_workers",
    "ledger",
    "ledger_key",
    "device",
    "device_prefetch",
    "device_transform",
    "pinned_memory_limit",
)
LEDGER_ENV = "STEADYLOAD_LEDGER"  # the frameworks' training loaders' ledger folder


def ledger_from_env() -> str | None:
    """The ledger folder ``STEADYLOAD_LEDGER`` names, or None (unset or empty).

    Read here only, by the integrations, for the loader a framework trains on (never a
    loader built directly: ``ledger=`` is its one argument). See
    docs/guide/distributed.md#the-ledger-in-the-frameworks.
    """
    return os.environ.get(LEDGER_ENV) or None


def options_of(loader: Any) -> dict[str, Any]:
    """The steadyload options of ``loader`` (a steadyload DataLoader), as keyword arguments."""
    return {name: getattr(loader, name) for name in OPTION_NAMES}


def check_option_names(options: dict[str, Any], where: str) -> dict[str, Any]:
    """``options`` if every key is a steadyload option, as a new dict.

    Raises:
        TypeError: naming the unknown key(s), ``where`` they were given, and the options.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"{where} has unknown steadyload option(s) {', '.join(map(repr, unknown))}; the "
            f"options are {', '.join(OPTION_NAMES)} (torch's own arguments go to the loader)"
        )
    return dict(options)


@dataclass(frozen=True, slots=True)
class LoaderOptions:
    """steadyload-only settings of one loader (torch's arguments stay on the loader)."""

    start_method: str = "auto"
    """How workers start: "auto" (the zygote where a fork is safe, else forkserver, on
    Linux; else spawn: start/rule.py), "forkserver", "spawn", "fork" or "zygote". torch's
    ``multiprocessing_context``, when given,
    takes precedence."""
    max_restarts: int = 3
    """Dead or hung workers replaced per epoch before giving up (see DataLoader)."""
    on_error: str = "raise"
    """"raise": a dataset exception reaches the caller; "skip": the sample is left out."""
    hang_timeout: float | None = None
    """Seconds a task may run before the worker's stack is dumped and it is replaced."""
    max_worker_memory_bytes: int | None = None
    """USS above which a worker is replaced between tasks. [Unit: byte]"""
    sample_seeds: bool = False
    """Seed the RNGs before each sample from (base seed, epoch, index)."""
    worker_type: str = "process"
    """"process", "thread", or "auto" (chosen by measurement: engine/choice/worker_kind.py)."""
    remote: RemoteWorkers | None = None
    """Remote workers (Ray actors) beside the local ones (engine/remote/)."""
    ledger: str | None = None
    """The folder the ledger records every step into (resume/ledger/), or None."""
    ledger_key: Any = None
    """For a stream: a function of a batch giving its samples' keys, for the ledger."""
    device: Any = None
    """The `torch.device` batches are fed to (device/), or None."""
    device_prefetch: int = 2
    """Batches on their way to the device beyond the one yielded."""
    device_transform: Any = None
    """A function of a batch on the device, run by the device stage before it is yielded."""
    pinned_memory_limit_bytes: int | None = None
    """The device stage's pinned pool cap (None: device/target.py's default). [Unit: byte]"""

    def __post_init__(self) -> None:
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(map(repr, START_METHODS))}, "
                f"got {self.start_method!r}"
            )
        if (
            not isinstance(self.max_restarts, int)
            or isinstance(self.max_restarts, bool)
            or self.max_restarts < 0
        ):
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.hang_timeout is not None and (
            isinstance(self.hang_timeout, bool)
            or not isinstance(self.hang_timeout, (int, float))
            or not self.hang_timeout > 0
        ):
            raise ValueError(f"hang_timeout must be > 0 seconds or None, got {self.hang_timeout!r}")
        if self.ledger is not None and not isinstance(self.ledger, str):
            raise TypeError(f"ledger must be a folder (str or path) or None, got {self.ledger!r}")
        if self.ledger_key is not None and not callable(self.ledger_key):
            raise TypeError(f"ledger_key must be a function of a batch, got {self.ledger_key!r}")
        if self.worker_type not in WORKER_TYPES:
            raise ValueError(
                f"worker_type must be 'process', 'thread' or 'auto', got {self.worker_type!r}"
            )
        if (
            not isinstance(self.device_prefetch, int)
            or isinstance(self.device_prefetch, bool)
            or self.device_prefetch < 0
        ):
            raise ValueError(
                f"device_prefetch must be an int >= 0 (batches ahead), got {self.device_prefetch!r}"
            )
        if self.device_transform is not None and not callable(self.device_transform):
            raise TypeError(
                f"device_transform must be a function of a batch, got {self.device_transform!r}"
            )
        if self.device_transform is not None and self.device is None:
            raise ValueError(
                "device_transform runs on the device the batches are fed to, and device= is "
                "None.\nFix: pass device='cuda' (or 'cuda:N'; device='cpu' runs it in this "
                "process on the host), or apply the function in your loop."
            )
        if self.worker_type == "thread" and self.max_worker_memory_bytes is not None:
            raise ValueError(
                "max_worker_memory needs process workers, got worker_type='thread': threads "
                "share this process's memory, so none can be measured or freed on its own. "
                "Use worker_type='process' (or 'auto', which then picks processes)."
            )


def checked_options(loader: Any) -> LoaderOptions:
    """A steadyload loader's options as its public attributes hold them now, checked."""
    ledger = loader.ledger
    return LoaderOptions(
        start_method=loader.start_method,
        max_restarts=loader.max_restarts,
        on_error=loader.on_error,
        hang_timeout=loader.hang_timeout,
        max_worker_memory_bytes=parse_bytes(loader.max_worker_memory, "max_worker_memory"),
        sample_seeds=bool(loader.sample_seeds),
        worker_type=loader.worker_type,
        remote=remote_spec(loader.remote_workers),
        ledger=os.fspath(ledger) if ledger is not None else None,
        ledger_key=loader.ledger_key,
        device=resolve_device(loader.device),
        device_prefetch=loader.device_prefetch,
        device_transform=loader.device_transform,
        pinned_memory_limit_bytes=parse_bytes(loader.pinned_memory_limit, "pinned_memory_limit"),
    )
