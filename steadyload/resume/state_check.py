"""The saved state's format and the checks a loaded one must pass (`Checkpoints.load`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch.utils.data as tud

from ..engine.remote.spec import all_workers
from . import shards
from .epoch_order import not_replayable
from .progress import fail, persistent

STATE_FORMAT = "steadyload.DataLoader"
STATE_VERSION = 2  # 2: JSON-able (generator states as text, stream positions as objects)

REPLAY_WHY_FIX = (  # a sampler whose order cannot be re-created
    "resuming means re-creating exactly the index order of the interrupted epoch.",
    (
        "add state_dict() and load_state_dict() to the sampler (its state at the start of an "
        "epoch must determine that epoch's order), or use one of torch's samplers."
    ),
)


def dataset_len(loader: tud.DataLoader[Any]) -> int | None:
    """The dataset's length, or None when it has none (a stream)."""
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_loadable(loader: tud.DataLoader[Any], state: Any) -> None:
    """Raise (with what, why, what to do) unless ``state`` can resume ``loader``; warn when
    it resumes the epoch but later epochs will differ."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise fail(
            "load_state_dict() expects the dict that steadyload.DataLoader.state_dict() "
            f"returned, got {type(state).__name__}"
            + (f" with keys {list(state)[:8]}" if isinstance(state, dict) else "")
            + ".",
            "only a steadyload loader state says where its epoch stood.",
            "pass loader.state_dict() as saved in your checkpoint.",
        )
    version = state.get("version")
    if version != STATE_VERSION:
        raise fail(
            f"this loader state has version {version!r}; this steadyload reads version "
            f"{STATE_VERSION}.",
            "the state was written by a different steadyload release.",
            "resume with the steadyload version that saved it, or restart the epoch.",
        )
    for key, now in (
        ("dataset_len", dataset_len(loader)),
        ("batch_size", loader.batch_size),
        ("drop_last", loader.drop_last),
    ):
        if state[key] != now:
            raise fail(
                f"the saved loader had {key}={state[key]!r}, this one has {now!r}.",
                "the remaining batches of the saved epoch would be different ones.",
                "build the loader with the same dataset and arguments as the saved one.",
            )
    if state["dataset_states"] is not None and state["num_workers"] != all_workers(loader):
        raise fail(
            f"this loader state holds the dataset's own state (state_dict()) per worker, "
            f"saved with num_workers={state['num_workers']}, and this loader has "
            f"num_workers={all_workers(loader)} (remote workers count too).",
            "each worker has its own replica of the dataset (an IterableDataset also splits "
            "its stream between them), so a worker's state only means something with the "
            "same number of workers.",
            f"resume with num_workers={state['num_workers']}.",
        )
    if state["persistent"] != persistent(loader):
        warnings.warn(
            "this loader state was saved by a loader "
            f"{'with' if state['persistent'] else 'without'} persistent workers and is loaded "
            f"into one {'with' if persistent(loader) else 'without'}: the rest of the saved "
            "epoch is the same, but later epochs will differ from the uninterrupted run, "
            "because torch draws a new base seed at each epoch only without persistent "
            "workers (and shuffling draws after it). Use the same persistent_workers "
            "setting (and num_workers > 0 with it) to continue identically.",
            UserWarning,
            stacklevel=4,  # the caller of DataLoader.load_state_dict
        )
    refused = (
        shards.refusal(state, shards.of(loader, state["sharding"])) if "sharding" in state else None
    )
    if refused is not None:  # (absent from states saved before elastic resume)
        raise fail(*refused)
    reason = not_replayable(loader, state["samplers"])
    if reason is not None and not state["finished"]:
        raise fail(
            "steadyload cannot resume this DataLoader mid-epoch: " + reason + ".",
            *REPLAY_WHY_FIX,
        )
