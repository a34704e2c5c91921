"""steadyload: multi-worker data loading for PyTorch that never hangs silently.

Import everything from here; other modules are private.
"""

from __future__ import annotations

from ._version import __version__ as __version__
from .errors import MainGuardError as MainGuardError
from .errors import NotPicklableError as NotPicklableError
from .errors import SteadyloadError as SteadyloadError
from .errors import UnsafeForkError as UnsafeForkError
from .errors import WorkerDiedError as WorkerDiedError
from .errors import WorkerHangError as WorkerHangError
from .errors import WorkerStartError as WorkerStartError
from .loader import DataLoader as DataLoader
from .per_worker import per_worker as per_worker
from .report import LoaderReport as LoaderReport
from .report import WorkerReport as WorkerReport

__all__ = [
    "DataLoader",
    "LoaderReport",
    "MainGuardError",
    "NotPicklableError",
    "SteadyloadError",
    "UnsafeForkError",
    "WorkerDiedError",
    "WorkerHangError",
    "WorkerReport",
    "WorkerStartError",
    "per_worker",
]


def _fixup_module_metadata() -> None:
    # Public objects report `steadyload` as their module (Trio's fixup_module_metadata), so
    # reprs, docs and pickles name the public path.
    for name in __all__:
        obj = globals()[name]
        if getattr(obj, "__module__", "").startswith("steadyload."):
            obj.__module__ = "steadyload"


_fixup_module_metadata()
del _fixup_module_metadata
