"""Say so when a framework rebuilds a steadyload loader as torch's DataLoader.

accelerate's ``prepare`` and ``skip_first_batches`` and Ray Train's ``prepare_data_loader``
read a loader's arguments and build a plain ``torch.utils.data.DataLoader`` from them: the
training then runs on torch's workers, and nothing says so. Each of them reads the
loader's ``timeout`` while doing it, and nothing else outside torch and steadyload does, so
the loader's ``timeout`` property calls `note_read`, which looks at the reading frame and
warns once per loader, naming the path and the fix (the integration to use). steadyload's
integrations rebuild on purpose and then adopt the result: they read inside `adopting`.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

_ADOPTING = contextvars.ContextVar("steadyload_adopting", default=False)
_WARNED = "_steadyload_rebuild_warned"

_ACCELERATE_FIX = (
    "build the loader as usual and prepare it with "
    "`steadyload.integrations.accelerate.prepare(accelerator, model, optimizer, loader)`, "
    "which keeps accelerate's sharding and device placement around steadyload's loader"
)
_TRAINER_FIX = (
    "add steadyload.integrations.transformers.SteadyloadTrainerMixin to your Trainer class "
    "(`class MyTrainer(SteadyloadTrainerMixin, Trainer)`): it keeps steadyload through "
    "accelerate and resumes mid-epoch from the loader's own state"
)
_RAY_FIX = (
    "use `steadyload.integrations.ray.prepare_data_loader(loader)` instead of Ray's, or "
    "build the loader with `sampler=DistributedSampler(dataset)` (Ray then only wraps it)"
)


@contextlib.contextmanager
def adopting() -> Iterator[None]:
    """Reads inside this block are steadyload's own rebuilds: no warning."""
    token = _ADOPTING.set(True)
    try:
        yield
    finally:
        _ADOPTING.reset(token)


def _on_stack(frame: FrameType | None, prefix: str) -> bool:
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith(prefix):
            return True
        frame = frame.f_back
    return False


def _function(frame: FrameType) -> str:
    """The function reading: past comprehensions (their own frames before Python 3.12) and
    attribute delegation (accelerate's ``DataLoaderAdapter.__getattr__``)."""
    name = frame.f_code.co_name
    while frame.f_back is not None and (
        name == "__getattr__" or (name.startswith("<") and name != "<module>")
    ):
        frame = frame.f_back
        name = frame.f_code.co_name
    return name


def _path_and_fix(frame: FrameType) -> tuple[str, str] | None:
    module = str(frame.f_globals.get("__name__", ""))
    function = _function(frame)
    if module.startswith("accelerate."):
        if _on_stack(frame, "transformers.trainer"):
            what = "resuming mid-epoch" if function == "skip_first_batches" else "preparing"
            return (
                f"the transformers Trainer ({what} through accelerate's {function})",
                _TRAINER_FIX,
            )
        if function == "skip_first_batches":
            fix = "use `steadyload.integrations.accelerate.skip_first_batches(loader, n)`"
            return "accelerate's skip_first_batches", fix
        return f"accelerate's {function} (Accelerator.prepare)", _ACCELERATE_FIX
    if module.startswith("ray.train"):
        return f"Ray Train's {function} (ray.train.torch.prepare_data_loader)", _RAY_FIX
    return None


def note_read(loader: Any, frame: FrameType | None) -> None:
    """``loader.timeout`` was read by ``frame``: warn once if a framework is rebuilding it.

    Raises:
        RuntimeError: accelerate's ``skip_first_batches`` is rebuilding a loader that holds a
            loaded state: both the skipped epoch and the next would get the wrong batches.
    """
    if frame is None or _ADOPTING.get():
        return
    module = str(frame.f_globals.get("__name__", ""))
    if module.startswith(("torch.", "steadyload.")):
        return  # torch's own iterators, steadyload's from_loader
    found = _path_and_fix(frame)
    if found is None:
        return
    if _function(frame) == "skip_first_batches" and _has_loaded_state(loader):
        raise RuntimeError(
            f"steadyload: {found[0]} was given a steadyload.DataLoader holding a loaded state "
            "(load_state or load_state_dict), which it would rebuild as torch's DataLoader.\n"
            "Why: torch's loader cannot continue that state: it would run the resumed epoch "
            "on torch's workers in an order of its own, and the state would then start this "
            "loader's next epoch inside the old one.\n"
            "Fix: use `steadyload.integrations.accelerate.skip_first_batches(loader, n)` "
            "(or `accelerator.skip_first_batches` of an accelerator prepared with "
            "`steadyload.integrations.accelerate.prepare`): it keeps the loader, and a loaded "
            "state that starts the epoch at n leaves nothing to skip."
        )
    if loader.__dict__.get(_WARNED):
        return
    loader.__dict__[_WARNED] = True
    path, fix = found
    warnings.warn(
        f"steadyload: {path} is rebuilding this steadyload.DataLoader as torch's "
        "DataLoader: its batches will come from torch's workers, without steadyload's "
        "supervision (no replacement of a dead worker, no on_error, hang_timeout, "
        "max_worker_memory or sample_seeds, no report()).\n"
        f"Fix: {fix}.",
        UserWarning,
        stacklevel=3,
    )


def _has_loaded_state(loader: Any) -> bool:
    """A state was loaded into ``loader`` and waits for its next epoch."""
    return getattr(getattr(loader, "_checkpoints", None), "pending", None) is not None


def caller_frame() -> FrameType | None:
    """The frame that called the function calling this (the attribute's reader)."""
    try:
        return sys._getframe(2)
    except ValueError:  # pragma: no cover - shallow stack
        return None


def watched_timeout() -> property:
    """The loader's ``timeout`` property: torch's plain attribute, whose reading is how a
    framework rebuilding the loader as torch's is noticed (`note_read`)."""

    def get(loader: Any) -> float:
        """torch's ``timeout``: seconds to wait for a batch (0: no limit).

        Reading it is also how steadyload notices a framework rebuilding this loader as
        torch's DataLoader (`rebuild_watch.py`): that warns once, with the fix.
        """
        note_read(loader, caller_frame())
        return loader.__dict__["timeout"]  # as given, like torch: its message prints it

    def set_(loader: Any, value: float) -> None:
        loader.__dict__["timeout"] = value  # in vars(): rebuilds from attributes keep it

    return property(get, set_)
