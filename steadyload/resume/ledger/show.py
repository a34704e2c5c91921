"""What given steps of a ledger's timeline trained on: `show` and `ledger_samples`."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .timeline import Step, Timeline, resolve


def show(
    folder: str | os.PathLike[str], epoch: int, step: int, rank: int | None = None
) -> list[dict[str, Any]]:
    """Step ``step`` of ``epoch`` on the timeline, one object per rank (or ``rank``'s):
    ``{epoch, step, rank, run, indices, seeds, workers, events}`` (JSON-able).

    ``seeds``: each sample's seed when the epoch ran with ``sample_seeds=True``, else None;
    ``workers``: ``[{"id", "pid", "kind"}]``; ``events``: what touched the batch (a re-run,
    a sample skipped on error).

    Raises:
        FileNotFoundError: no ledger in ``folder``.
        LookupError: the timeline has no such step.
    """
    timeline = resolve(folder)
    found = [s for s in timeline.steps(epoch, rank) if s.step == step]
    if not found:
        where = f"epoch {epoch} step {step}" + (f" on rank {rank}" if rank is not None else "")
        ranks = sorted({s.rank for s in timeline.steps(epoch)})
        raise LookupError(
            f"the ledger in {timeline.folder} has no {where} on its timeline\n"
            f"Why: its epochs are {timeline.epochs()}; epoch {epoch} has ranks {ranks} and "
            f"{len(timeline.steps(epoch, rank))} step(s) there.\n"
            "Fix: pick a recorded step (`steadyload ledger verify` lists the epochs)."
        )
    return [describe(timeline, s) for s in found]


def describe(timeline: Timeline, step: Step) -> dict[str, Any]:
    """One step as `show` gives it."""
    line = timeline.epoch_line(step.epoch, step.rank, step.segment) or {}
    seeds = None
    if line.get("sample_seeds") and line.get("plan") != "stream":
        from ..._seeding import sample_seed  # imports torch: only when asked for seeds

        seeds = [sample_seed(int(line["base_seed"]), step.epoch, i) for i in step.indices]
    events = list(step.events)
    launch = next(
        p.launch for p in timeline.parts if step.segment in {s.name for s in p.launch.segments}
    )
    if launch.cut is not None and tuple(launch.cut) == (step.epoch, step.step):
        events.append(f"resumed here (epoch {step.epoch} step {step.step}) from {launch.parent}")
        deal = line.get("deal") or {}
        if line.get("redealt"):
            events.append(f"the epoch's rest dealt again to {deal.get('replicas')} ranks")
    for skip in timeline.skips(step.epoch):
        if skip.rank == step.rank and skip.index in step.indices:
            events.append(f"skipped on error: sample {skip.index} ({skip.cause})")
    worker: dict[str, Any] = {"id": step.worker, "pid": step.pid, "kind": step.kind}
    if step.pos is not None or step.keys is not None:  # a stream's: what of it the batch read
        worker.update(items=step.pos, keys=step.keys)
    return {
        "epoch": step.epoch,
        "step": step.step,
        "rank": step.rank,
        "run": step.segment,
        "indices": step.indices,
        "seeds": seeds,
        "workers": [worker],
        "events": events,
    }


def text(shown: list[dict[str, Any]]) -> str:
    """`show`'s objects for people."""
    out = []
    for s in shown:
        out.append(
            f"epoch {s['epoch']} step {s['step']} rank {s['rank']} (run {s['run']}): "
            f"{_samples(s)} sample(s)"
        )
        if s["indices"]:
            out.append(f"  indices: {', '.join(map(str, s['indices']))}")
        if s["seeds"] is not None:
            out.append(f"  seeds:   {', '.join(map(str, s['seeds']))}")
        for w in s["workers"]:
            out.append(f"  worker {w['id']} (pid {w['pid']}, {w['kind']})")
            if w.get("items") is not None:
                first, end = w["items"]
                out.append(f"  its stream's items {first}-{end - 1}")
            if w.get("keys") is not None:
                out.append(f"  keys: {', '.join(map(str, w['keys']))}")
        out += [f"  event: {e}" for e in s["events"]]
    return "\n".join(out)


def _samples(shown: dict[str, Any]) -> int:
    """How many samples a shown step held (a stream's: its keys, or the items it read)."""
    for w in shown["workers"]:
        if w.get("keys") is not None:
            return len(w["keys"])
        if w.get("items") is not None:
            return int(w["items"][1] - w["items"][0])
    return len(shown["indices"])


def ledger_samples(
    folder: str | os.PathLike[str],
    epoch: int,
    steps: int | Iterable[int],
    rank: int | None = None,
) -> list[Any]:
    """The dataset indices that steps ``steps`` of ``epoch`` trained on, sorted.

    Reads the ledger in ``folder`` (written by ``DataLoader(..., ledger=folder)``) and
    resolves its timeline, so steps a resume superseded do not count. Every rank's samples
    unless ``rank`` is given. A sample skipped on error in one of those steps is included
    (it was in the batch). For example, the samples around a loss spike, to leave out on
    resume: ``ledger_samples("ledger/", epoch=3, steps=range(330, 341))``.

    Args:
        folder: the ledger folder.
        epoch: the epoch number (0-based, as the loader counts).
        steps: a step (the batch's 0-based index in the epoch on its rank) or several.
        rank: one rank's samples, or None for every rank's.

    Returns:
        The indices, sorted (one entry per delivery: a padded sample may appear twice).

    Raises:
        FileNotFoundError: no ledger files in ``folder``.
    """
    wanted = {steps} if isinstance(steps, int) else set(steps)
    timeline = resolve(folder)
    found = [i for s in timeline.steps(epoch, rank) if s.step in wanted for i in s.indices]
    return sorted(found, key=lambda i: (0, i, "") if isinstance(i, int) else (1, 0, str(i)))


ledger_samples.__module__ = "steadyload"  # its public name (see steadyload/__init__.py)
