"""What `verify` found: a `Verdict` of one `EpochVerdict` per epoch, and its text."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .timeline import Step, Timeline

FAILING = ("hole", "repeat")
FEW = 5  # places named per finding; findings of one kind listed per epoch: twice that


@dataclass(frozen=True)
class Finding:
    """One thing verify noticed: a ``hole`` or ``repeat`` (failures), an ``incomplete``
    epoch, or an allowed exception (``padding``, ``cut``, ``skipped on error``, ``skipped on
    purpose``)."""

    kind: str
    text: str


@dataclass
class EpochVerdict:
    """One epoch's result: ``status`` is "exact", "incomplete" or "fail"."""

    epoch: int
    plan: str
    checked: str
    """What it was checked against: "indices", "plan" or "stream"."""
    status: str
    samples: int
    expected_samples: int | None
    steps: int
    expected_steps: int | None
    ranks: int
    runs: int
    digest: str
    """sha256 of the sorted delivered indices (a stream's keys), first 12 hex digits."""
    findings: list[Finding] = field(default_factory=list)

    def line(self) -> str:
        """The epoch's one-line summary."""
        failures = [f"{n} {k}{'s' if n > 1 else ''}" for k, n in self._counts().items() if n]
        of = f" for {self.expected_samples} indices" if self.expected_samples is not None else ""
        samples = f"{self.samples} sample{'s' if self.samples != 1 else ''}{of}"
        steps = f" of {self.expected_steps}" if self.expected_steps is not None else ""
        lead = ", ".join(failures) + "; " if failures else ""
        return (
            f"epoch {self.epoch}  {self.status.upper() if self.status == 'fail' else self.status}"
            f"  {lead}{samples}, {self.steps}{steps} steps on {self.ranks} "
            f"rank{'s' if self.ranks != 1 else ''}, {self.runs} run{'s' if self.runs != 1 else ''}"
            f", plan {self.plan}, digest {self.digest}"
        )

    def _counts(self) -> dict[str, int]:
        return {k: sum(f.kind == k for f in self.findings) for k in FAILING}


@dataclass
class Verdict:
    """`verify`'s answer: one `EpochVerdict` per epoch, and the timeline it read."""

    timeline: Timeline
    epochs: list[EpochVerdict]
    allow_incomplete: bool = False

    @property
    def ok(self) -> bool:
        """Every epoch exact (or only incomplete, with ``allow_incomplete``)."""
        allowed = ("exact", "incomplete") if self.allow_incomplete else ("exact",)
        return all(e.status in allowed for e in self.epochs)

    def text(self) -> str:
        """The report: the timeline, one line per epoch with what it found, the verdict."""
        tl = self.timeline
        resumes = sum(p.launch.cut is not None for p in tl.parts)
        out = [
            (
                f"ledger {tl.folder}: {len(tl.runs())} run(s) on the timeline, {resumes} "
                f"resume(s), {len(tl.superseded)} step(s) superseded"
            )
        ]
        if tl.missing_parent is not None:
            out.append(
                f"  note: the timeline begins with a resume from {tl.missing_parent}, whose "
                "records are not in this folder"
            )
        for epoch in self.epochs:
            out.append(epoch.line())
            out += [f"    {f.kind}: {f.text}" for f in epoch.findings]
        out += [f"superseded: {line}" for line in _superseded_lines(tl)]
        if self.ok:
            out.append(
                "verdict: exact"
                if all(e.status == "exact" for e in self.epochs)
                else "verdict: exact so far (incomplete epochs allowed)"
            )
        else:
            bad = [f"epoch {e.epoch} {e.status}" for e in self.epochs if e.status != "exact"]
            out.append(f"verdict: FAIL ({', '.join(bad)})")
        return "\n".join(out)


def few(items: list[Any]) -> str:
    more = f", ... ({len(items) - 2 * FEW} more)" if len(items) > 2 * FEW else ""
    return ", ".join(map(str, items[: 2 * FEW])) + more


def cite(steps: list[Step]) -> str:
    text = "; ".join(f"rank {s.rank} step {s.step} (run {s.segment})" for s in steps[:FEW])
    return text + (f"; ... ({len(steps) - FEW} more)" if len(steps) > FEW else "")


def _superseded_lines(timeline: Timeline) -> list[str]:
    """Superseded steps, as ranges per run, epoch and rank."""
    groups: dict[tuple[str, int, int, str], list[int]] = defaultdict(list)
    for x in timeline.superseded:
        groups[(x.step.segment, x.step.epoch, x.step.rank, x.why)].append(x.step.step)
    out = []
    for (segment, epoch, rank, why), numbers in groups.items():
        numbers.sort()
        spans, start = [], numbers[0]
        for a, b in zip(numbers, [*numbers[1:], None], strict=True):
            if b != a + 1:
                spans.append(f"{start}" if start == a else f"{start}-{a}")
                start = b if b is not None else start
        out.append(
            f"epoch {epoch} step(s) {', '.join(spans)} on rank {rank} (run {segment}): {why}"
        )
    return out
