"""steadyload: multi-worker data loading for PyTorch that never hangs silently.

Import everything from here; other modules are private. Names are resolved on first use,
so that ``import steadyload; steadyload.prestart()`` starts the fork server before this
process spends a second importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# Bound now, not on first use: the class shares its name with its module, and importing
# the module (a worker unpickling a per_worker, thread workers) would otherwise leave
# ``steadyload.per_worker`` naming the module. The module imports nothing heavy.
from .per_worker import per_worker as per_worker  # noqa: E402

if TYPE_CHECKING:
    from ._seeding import sample_rng as sample_rng
    from .device.structure import on_host as on_host
    from .engine.remote.spec import RemoteWorkers as RemoteWorkers
    from .errors import MainGuardError as MainGuardError
    from .errors import NotPicklableError as NotPicklableError
    from .errors import SharedMemoryError as SharedMemoryError
    from .errors import SkipLimitError as SkipLimitError
    from .errors import SteadyloadError as SteadyloadError
    from .errors import UnsafeForkError as UnsafeForkError
    from .errors import WorkerDiedError as WorkerDiedError
    from .errors import WorkerHangError as WorkerHangError
    from .errors import WorkerStartError as WorkerStartError
    from .loader import DataLoader as DataLoader
    from .memory.shared_list import SharedDict as SharedDict
    from .memory.shared_list import SharedList as SharedList
    from .report import DeviceReport as DeviceReport
    from .report import LoaderReport as LoaderReport
    from .report import WorkerReport as WorkerReport
    from .report import report_every as report_every
    from .resume.ledger.replay import replay as replay
    from .resume.ledger.show import ledger_samples as ledger_samples
    from .start.context import prestart as prestart

_EXPORTS = {
    "DataLoader": ".loader",
    "DeviceReport": ".report",
    "LoaderReport": ".report",
    "MainGuardError": ".errors",
    "NotPicklableError": ".errors",
    "RemoteWorkers": ".engine.remote.spec",
    "SharedDict": ".memory.shared_list",
    "SharedMemoryError": ".errors",
    "SharedList": ".memory.shared_list",
    "SkipLimitError": ".errors",
    "SteadyloadError": ".errors",
    "UnsafeForkError": ".errors",
    "WorkerDiedError": ".errors",
    "WorkerHangError": ".errors",
    "WorkerReport": ".report",
    "WorkerStartError": ".errors",
    "ledger_samples": ".resume.ledger.show",
    "on_host": ".device.structure",
    "per_worker": ".per_worker",
    "prestart": ".start.context",
    "replay": ".resume.ledger.replay",
    "report_every": ".report",
    "sample_rng": "._seeding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'steadyload' has no attribute {name!r}")
    # Each defining module sets `__module__ = "steadyload"` on its public names (Trio's
    # fixup_module_metadata), so reprs, docs and pickles name the public path.
    obj = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
