"""`verify`: each epoch of a ledger's timeline delivered exactly once, over ranks and runs.

The reference of an epoch is its plan (the epoch line's ``plan``):

- ``"full"``: every index of the dataset (the header's ``dataset.len``) once over all
  ranks and runs of the timeline. Allowed, and listed as what they are: repeats up to the
  dealing's padding (``deal.pad``; an epoch dealt again on an elastic resume sums each
  dealing's), absences up to its ``drop_last`` cuts (``deal.cut``), samples skipped on
  purpose (``load_state_dict(..., skip_samples=)``) and on error (``on_error="skip"``).
- ``"sampler"`` (or any map-style epoch with ``plan=True``): the recorded plan: each step
  0..length-1 of each rank's epoch once, its indices as recorded (a sampler that draws
  with replacement repeats indices on purpose).
- ``"stream"``: each rank's steps contiguous, no sample key twice (when recorded), and each
  worker's items read once, from its stream's start on, without a gap (``pos``).

Every epoch is also checked step by step: a step missing between two recorded ones is a
hole, a step recorded twice a repeat. Steps missing at the end of a rank's epoch make it
"incomplete: N of M steps", which fails unless ``allow_incomplete``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import defaultdict
from typing import Any

from .timeline import EpochLine, Step, Timeline, resolve
from .verdict import FAILING, FEW, EpochVerdict, Finding, Verdict, cite, few


def verify(
    folder: str | os.PathLike[str],
    epoch: int | None = None,
    plan: bool = False,
    allow_incomplete: bool = False,
) -> Verdict:
    """Check that every epoch (or ``epoch``) of the ledger in ``folder`` delivered each
    sample exactly once (see the module docstring); reads the folder once.

    Raises:
        FileNotFoundError: no ledger in ``folder``.
        ValueError: ``epoch`` has no record on the timeline.
    """
    timeline = resolve(folder)
    epochs = timeline.epochs()
    if epoch is not None:
        if epoch not in epochs:
            raise ValueError(
                f"epoch {epoch} has no record on the timeline of {timeline.folder}\n"
                f"Why: the timeline's epochs are {epochs or 'none'}.\n"
                "Fix: pick one of them, or leave --epoch out to verify them all."
            )
        epochs = [epoch]
    verdicts = [_epoch(timeline, e, plan, allow_incomplete) for e in epochs]
    return Verdict(timeline, verdicts, allow_incomplete)


def _epoch(timeline: Timeline, epoch: int, plan: bool, allow_incomplete: bool) -> EpochVerdict:
    lines = timeline.epoch_lines(epoch)
    steps = timeline.steps(epoch)
    kind = str(lines[-1].line.get("plan")) if lines else "sampler"
    n = timeline.dataset.get("len")
    by_indices = kind == "full" and not plan and isinstance(n, int)
    checked = "stream" if kind == "stream" else "indices" if by_indices else "plan"
    findings: list[Finding] = []
    done, expected, short = _check_steps(timeline, epoch, lines, steps, findings, by_indices)
    if kind == "stream":
        delivered = _check_keys(steps, findings)
        _check_positions(steps, findings)
    else:
        delivered = _check_indices(timeline, epoch, lines, steps, findings, by_indices, short)
    failed = any(f.kind in FAILING for f in findings)
    return EpochVerdict(
        epoch,
        kind,
        checked,
        "fail" if failed else "incomplete" if short else "exact",
        sum(s.samples for s in steps) if kind == "stream" else len(delivered),
        n if by_indices else None,
        done,
        expected,
        len({s.rank for s in steps} | {e.rank for e in lines}),
        len({s.segment for s in steps}),
        _digest(delivered) if kind != "stream" or delivered else "-",
        findings,
    )


def _total(line: dict[str, Any], n: int | None) -> int | None:
    """The step after the last of a rank's epoch as its line deals it (a rest dealt again
    on an elastic resume: its first step plus the rest's batches)."""
    length, deal = line.get("length"), line.get("deal") or {}
    if line.get("redealt") and length is not None:  # recorded as dealt (first step + rest)
        return int(length)
    if not deal.get("offset") or n is None or length is None:
        return None if length is None else int(length)
    batch, replicas = line.get("batch_size") or 1, int(deal["replicas"])
    if deal.get("kind") == "torch.DistributedSampler":
        share = (max(n - deal["offset"], 0) + deal["pad"] - deal["cut"]) // replicas
        rest = math.ceil(share / batch)
    else:  # accelerate deals whole batches: its offset counts batches
        batches = max(math.ceil(n / batch) - deal["offset"], 0)
        rest = math.ceil((batches + (deal["pad"] - deal["cut"]) // batch) / replicas)
    return int(line.get("first_step") or 0) + rest


def _check_steps(
    timeline: Timeline,
    epoch: int,
    lines: list[EpochLine],
    steps: list[Step],
    findings: list[Finding],
    by_indices: bool,
) -> tuple[int, int | None, bool]:
    """Each rank's steps against its parts' ranges: (steps done, expected or None, whether
    steps are missing at the end)."""
    n = timeline.dataset.get("len")
    ranges: dict[int, list[tuple[int, int, int | None, str]]] = defaultdict(list)
    last_part = max((e.part for e in lines), default=0)
    for e in lines:
        until = timeline.parts[e.part].until
        # A resume in this epoch that recorded nothing of it yet (killed at once): the
        # epoch runs to its end on this part, its steps from the cut on superseded.
        resumed = until is not None and until[0] == epoch and e.part < last_part
        end = until[1] if resumed and until is not None else _total(e.line, n)
        ended = timeline.ended(epoch, e.segment)  # its own count (a skip rebatches the rest)
        if ended is not None and not resumed:
            end = ended
        ranges[e.rank].append((e.part, int(e.line.get("first_step") or 0), end, e.segment))
    by_rank: dict[int, dict[int, list[Step]]] = defaultdict(lambda: defaultdict(list))
    for step in steps:
        by_rank[step.rank][step.step].append(step)
    done, expected, short, missing_end = 0, 0, False, 0
    unknown = False
    first = timeline.parts[0].launch.cut if timeline.parts else None
    unrecorded = first is not None and first[0] == epoch and first[1] > 0
    if first is not None and unrecorded:
        short = True
        findings.append(
            Finding(
                "incomplete",
                f"steps 0-{first[1] - 1} are not recorded here "
                "(the timeline begins with a resume from a run not in this folder)",
            )
        )
    for rank in sorted(set(ranges) | set(by_rank)):
        taken = by_rank[rank]
        spans = ranges.get(rank) or [(last_part, 0, None, "")]
        for part, lo, hi, segment in spans:
            inside = [number for number in taken if number >= lo and (hi is None or number < hi)]
            top = max(inside, default=lo - 1)
            unknown = unknown or hi is None
            expected += 0 if hi is None else hi - (0 if unrecorded and part == 0 else lo)
            done += len(inside)
            for number in range(lo, (top + 1) if hi is None else hi):
                if number in taken:
                    continue
                if number > top and part == last_part:  # not reached (yet): incomplete
                    missing_end += 1
                    continue
                findings.append(
                    Finding("hole", f"rank {rank} step {number} has no record (run {segment})")
                )
        for number, recorded in sorted(taken.items()):
            if not any(number >= lo and (hi is None or number < hi) for _, lo, hi, _ in spans):
                findings.append(
                    Finding(
                        "repeat",
                        f"rank {rank} step {number} is outside its epoch's steps: {cite(recorded)}",
                    )
                )
            elif len(recorded) > 1 and not by_indices:  # by indices: each index is named
                differ = len({json.dumps(r.indices) for r in recorded}) > 1
                findings.append(
                    Finding(
                        "repeat",
                        f"rank {rank} step {number} recorded {len(recorded)} times"
                        f"{' with different indices' if differ else ''}: {cite(recorded)}",
                    )
                )
    if missing_end:
        short = True
        findings.insert(0, Finding("incomplete", f"{done} of {expected} steps"))
    return done, None if unknown else expected, short


def _check_indices(
    timeline: Timeline,
    epoch: int,
    lines: list[EpochLine],
    steps: list[Step],
    findings: list[Finding],
    by_indices: bool,
    short: bool,
) -> list[Any]:
    """The delivered indices (samples skipped on error taken out); against the dataset for
    a "full" epoch checked ``by_indices``."""
    where_of: dict[Any, list[Step]] = defaultdict(list)
    for s in steps:
        for i in s.indices:
            where_of[_key(i)].append(s)
    skipped = set()
    for skip in timeline.skips(epoch):
        where = where_of.get(_key(skip.index), [])
        best = sorted(where, key=lambda s: (s.segment != skip.segment, s.rank != skip.rank))
        if best:
            where.remove(best[0])
        skipped.add(_key(skip.index))
        at = cite(best[:1]) if best else f"rank {skip.rank} (run {skip.segment})"
        findings.append(Finding("skipped on error", f"index {skip.index} ({skip.cause}): {at}"))
    delivered = [i for i, where in where_of.items() for _ in where]
    n = timeline.dataset.get("len")
    if not by_indices or not isinstance(n, int):
        return delivered
    # One dealing per part of the timeline that dealt the epoch (not per rank, nor per
    # resume that kept the dealing): its offset tells a rest dealt again from the first.
    dealings = {}
    for e in lines:
        deal = dict(e.line.get("deal") or {})
        deal.pop("rank", None)
        dealings[json.dumps(deal, sort_keys=True)] = deal
    pad = sum(int(d.get("pad") or 0) for d in dealings.values())
    cut = sum(int(d.get("cut") or 0) for d in dealings.values())
    on_purpose = {_key(i) for d in timeline.deliberate(epoch) for i in d.samples}
    absent = [i for i in range(n) if not where_of.get(i) and i not in skipped]
    purposely = [i for i in absent if i in on_purpose]
    if purposely:
        findings.append(
            Finding("skipped on purpose", f"{len(purposely)} sample(s): {few(purposely)}")
        )
    absent = [i for i in absent if i not in on_purpose]
    if absent and cut and not short:
        allowed, absent = absent[:cut], absent[cut:]
        findings.append(
            Finding(
                "cut",
                f"{len(allowed)} sample(s) left out by drop_last or the "
                f"dealing (up to {cut} allowed): {few(allowed)}",
            )
        )
    if absent and not short:
        findings.append(Finding("hole", f"{len(absent)} index(es) never delivered: {few(absent)}"))
    foreign = [k for k in where_of if where_of[k] and not (isinstance(k, int) and 0 <= k < n)]
    for k in foreign[: 2 * FEW]:
        findings.append(
            Finding("repeat", f"index {k} is not in the dataset (len {n}): {cite(where_of[k])}")
        )
    extra = [(k, w) for k, w in where_of.items() if len(w) > 1 and k not in foreign]
    # Padding repeats the first samples of the order at the end: prefer a rank's last step.
    last: dict[int, int] = defaultdict(int)
    for s in steps:
        last[s.rank] = max(last[s.rank], s.step)
    extra.sort(key=lambda kw: not any(s.step == last[s.rank] for s in kw[1]))
    for k, where in extra:
        if pad >= len(where) - 1:
            pad -= len(where) - 1
            findings.append(
                Finding(
                    "padding",
                    f"index {k} delivered {len(where)} times "
                    f"(the dealing's padding): {cite(where)}",
                )
            )
        elif sum(f.kind == "repeat" for f in findings) < 2 * FEW:
            findings.append(
                Finding("repeat", f"index {k} delivered {len(where)} times: {cite(where)}")
            )
        else:
            findings.append(Finding("repeat", f"index {k} delivered {len(where)} times"))
    return delivered


def _check_keys(steps: list[Step], findings: list[Finding]) -> list[Any]:
    """A stream's recorded keys: none twice."""
    where_of: dict[Any, list[Step]] = defaultdict(list)
    for s in steps:
        for k in s.keys or ():
            where_of[_key(k)].append(s)
    for k, where in where_of.items():
        if len(where) > 1:
            findings.append(
                Finding("repeat", f"key {k!r} delivered {len(where)} times: {cite(where)}")
            )
    return [k for k, where in where_of.items() for _ in where]


def _check_positions(steps: list[Step], findings: list[Finding]) -> None:
    """A stream's items by worker: each read by one step, from the stream's start, no gap."""
    by_worker: dict[tuple[int, Any], list[tuple[int, int, Step]]] = defaultdict(list)
    for s in steps:
        if s.pos is not None:
            by_worker[(s.rank, s.worker)].append((s.pos[0], s.pos[1], s))
    for (rank, worker), spans in sorted(by_worker.items(), key=lambda kv: str(kv[0])):
        spans.sort(key=lambda span: span[:2])
        at = 0
        for first, end, s in spans:
            if first > at:
                findings.append(
                    Finding(
                        "hole",
                        f"rank {rank} worker {worker}: items {at}-{first - 1} of its stream are "
                        f"in no recorded step (next: {cite([s])})",
                    )
                )
            elif first < at:
                findings.append(
                    Finding(
                        "repeat",
                        f"rank {rank} worker {worker}: items {first}-{min(at, end) - 1} of its "
                        f"stream delivered again: {cite([s])}",
                    )
                )
            at = max(at, end)


def _key(index: Any) -> Any:
    """An index as a dict key (a list or dict index: its JSON text)."""
    return index if isinstance(index, (int, str, float, type(None))) else json.dumps(index)


def _digest(delivered: list[Any]) -> str:
    ordered = sorted(delivered, key=lambda i: (0, i, "") if isinstance(i, int) else (1, 0, str(i)))
    text = json.dumps(ordered, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]
