"""The timeline: which of a ledger folder's records the model that came out actually trained on.

- **Launches.** Segments with the same token are one point of a timeline; they split into
  launches by lifetime: a segment joins a launch when it started before the launch's last
  write (``[started, mtime]`` overlap: the ranks of one job run together) and no segment of
  that launch has its rank in another process, or when a process of the launch wrote it for
  a rank the launch does not have yet (one process feeding several ranks in turn). A
  relaunch from the same checkpoint after a crash starts after the crashed one's last
  write, so it is a launch of its own.
- **The chain.** The leaf is the latest launch to start; its parent is the latest launch of
  its header's ``parent`` token that started before it, and so on back to a fresh start
  (``root``) or a parent whose files are not in the folder.
- **Cuts.** Each launch on the chain keeps its records up to the next one's cut (epoch,
  step): a resume from a state taken after N steps rolled the model back to there, so the
  earlier run's steps >= N of that epoch, and its later epochs, are superseded, on every
  rank. Every record of a launch off the chain is superseded by the chain launch that
  started after it. Superseded steps are kept, with the why (`Timeline.superseded`).
- **Ranks.** A step's rank is its epoch's dealing rank (``deal.rank``) when the dealing is
  known (a DistributedSampler, accelerate's shard), else the header's ``rank``: one process
  may feed several ranks (``DistributedSampler(num_replicas=2, rank=r)`` loaders in a world
  of 1), and the dealing is what decides a rank's samples.

Segment mtimes matter: copy a ledger folder with ``cp -p`` or ``rsync -t``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .files import Segment, read_folder

ROOT = "root"  # the token of a fresh start (record.ROOT; not imported: record needs torch)
Cut = tuple[int, int]


@dataclass(frozen=True)
class Step:
    """One step as recorded: what one batch of one rank trained on."""

    epoch: int
    step: int
    """The batch's index in the epoch on its rank, 0-based, counted across resumes."""
    rank: int
    segment: str
    """The run (segment file) that recorded it."""
    indices: list[Any]
    """The batch's dataset indices, as the sampler gave them (a sample skipped on error
    included: `Timeline.skips` says which)."""
    worker: int | None
    pid: int | None
    kind: str | None
    events: list[Any]
    """What touched it before it was yielded (a re-run after a worker died, ...)."""
    keys: list[Any] | None
    """A stream's sample keys, when recorded."""
    pos: list[int] | None = None
    """A stream's: the items of its worker's stream the batch read, [first, end)."""

    @property
    def samples(self) -> int:
        """How many samples it held (a stream's: its keys, else the items it read)."""
        if self.keys is not None:
            return len(self.keys)
        if self.pos is not None:
            return self.pos[1] - self.pos[0]
        return len(self.indices)


@dataclass(frozen=True)
class Superseded:
    """A recorded step the timeline does not count, and why."""

    step: Step
    why: str


@dataclass(frozen=True)
class Skip:
    """A sample left out on error (``on_error="skip"``)."""

    epoch: int
    index: Any
    cause: str
    rank: int
    segment: str


@dataclass(frozen=True)
class Deliberate:
    """Samples left out on purpose by ``load_state_dict(..., skip_samples=)``."""

    epoch: int
    at: int
    samples: list[Any]
    segment: str


@dataclass(frozen=True)
class EpochLine:
    """An epoch's line (base_seed, sample_seeds, plan, deal, length, ...) on the timeline."""

    part: int
    """Which part of the timeline (`Timeline.parts`) recorded it."""
    segment: str
    rank: int
    line: dict[str, Any]


@dataclass
class Launch:
    """The segments of one job (all its ranks) that started from the same point."""

    token: str
    parent: str | None
    cut: Cut | None
    segments: list[Segment]
    start: float
    end: float

    @property
    def name(self) -> str:
        """Its first segment's name (how it is cited)."""
        return self.segments[0].name


@dataclass
class Part:
    """A launch on the timeline, with the cut where the next one took over (None: none)."""

    launch: Launch
    until: Cut | None = None
    by: Launch | None = None
    """The launch that took over at ``until`` (its records from there on are superseded)."""


@dataclass
class Timeline:
    """What a ledger folder's leaf run descends from: see the module docstring."""

    folder: str
    parts: list[Part]
    """The chain, oldest first: a fresh start (or the earliest resume found) to the leaf."""
    launches: list[Launch]
    superseded: list[Superseded]
    dataset: dict[str, Any]
    """The leaf's header ``dataset``: type, kind, len."""
    missing_parent: str | None = None
    """The token the chain's first part resumed from, when its files are not here."""
    _steps: list[Step] = field(default_factory=list)
    _lines: list[EpochLine] = field(default_factory=list)
    _skips: list[Skip] = field(default_factory=list)
    _ends: dict[tuple[str, int], int] = field(default_factory=dict)

    def ended(self, epoch: int, segment: str) -> int | None:
        """The steps ``epoch`` had on ``segment``'s rank when it ran to its end there (an
        ``end`` event), or None."""
        return self._ends.get((segment, epoch))

    def steps(self, epoch: int | None = None, rank: int | None = None) -> list[Step]:
        """The steps on the timeline, by (epoch, rank, step)."""
        return [
            s
            for s in self._steps
            if (epoch is None or s.epoch == epoch) and (rank is None or s.rank == rank)
        ]

    def epochs(self) -> list[int]:
        """The epochs the timeline has records of (an epoch line or a step)."""
        return sorted({s.epoch for s in self._steps} | {e.line["epoch"] for e in self._lines})

    def epoch_lines(self, epoch: int) -> list[EpochLine]:
        """Every line of ``epoch`` on the timeline (one per rank and part)."""
        return [e for e in self._lines if e.line["epoch"] == epoch]

    def epoch_line(
        self, epoch: int, rank: int, segment: str | None = None
    ) -> dict[str, Any] | None:
        """The line of ``epoch`` on ``rank`` (its latest part's; ``segment``'s own, if given)."""
        found = [
            e.line
            for e in self.epoch_lines(epoch)
            if e.rank == rank and (segment is None or e.segment == segment)
        ]
        return found[-1] if found else None

    def skips(self, epoch: int | None = None) -> list[Skip]:
        """Samples skipped on error on the timeline."""
        return [s for s in self._skips if epoch is None or s.epoch == epoch]

    def deliberate(self, epoch: int | None = None) -> list[Deliberate]:
        """Samples skipped on purpose (the chain's headers' ``skip``)."""
        out = []
        for part in self.parts:
            skip = part.launch.segments[0].header.get("skip")
            if skip and (epoch is None or skip["epoch"] == epoch):
                out.append(
                    Deliberate(skip["epoch"], skip["at"], list(skip["samples"]), part.launch.name)
                )
        return out

    def runs(self) -> list[str]:
        """The segments of the chain's launches, oldest part first."""
        return [s.name for p in self.parts for s in p.launch.segments]


def resolve(folder: str | os.PathLike[str]) -> Timeline:
    """Read ``folder`` and resolve its timeline (see the module docstring).

    Raises:
        FileNotFoundError: ``folder`` holds no ledger file.
    """
    segments = read_folder(folder)
    launches = _launches(segments)
    leaf = max(launches, key=lambda launch: (launch.start, launch.name))
    chain, missing = [leaf], None
    while chain[-1].parent is not None:
        child = chain[-1]
        older = [x for x in launches if x.token == child.parent and x.start < child.start]
        if not older:
            missing = child.parent
            break
        chain.append(max(older, key=lambda launch: (launch.start, launch.name)))
    chain.reverse()
    parts = [Part(launch) for launch in chain]
    for part, child in zip(parts, chain[1:], strict=False):
        part.until = child.cut if child.cut is not None else (0, 0)
        part.by = child
    timeline = Timeline(
        os.fspath(folder), parts, launches, [], dict(leaf.segments[0].header.get("dataset") or {})
    )
    timeline.missing_parent = missing
    on_chain = {id(p.launch) for p in parts}
    for number, part in enumerate(parts):
        _take(timeline, number, part)
    for launch in launches:
        if id(launch) not in on_chain:
            after = min(
                (x for x in chain if x.start > launch.start), key=lambda x: x.start, default=leaf
            )
            for segment in launch.segments:
                why = _why(after, segment)
                for step in _steps_of(segment):
                    timeline.superseded.append(Superseded(step, why))
    timeline._steps.sort(key=lambda s: (s.epoch, s.rank, s.step, s.segment))
    timeline.superseded.sort(key=lambda x: (x.step.segment, x.step.epoch, x.step.step))
    return timeline


def _launches(segments: list[Segment]) -> list[Launch]:
    """Segments grouped by token, then split into launches by lifetime (module docstring)."""
    by_token: dict[str, list[Segment]] = {}
    for segment in sorted(segments, key=lambda s: (s.started, s.name)):
        by_token.setdefault(str(segment.header["token"]), []).append(segment)
    launches = []
    for token, group in by_token.items():
        current: Launch | None = None
        for segment in group:
            if current is not None and _joins(current, segment):
                current.segments.append(segment)
                current.end = max(current.end, segment.last)
                continue
            header = segment.header
            cut = header.get("cut")
            current = Launch(
                token,
                header.get("parent"),
                (int(cut[0]), int(cut[1])) if cut is not None else None,
                [segment],
                segment.started,
                segment.last,
            )
            launches.append(current)
    return launches


def _joins(launch: Launch, segment: Segment) -> bool:
    here = _process(segment)
    if segment.started <= launch.end:  # alive together: one job, unless a rank is claimed twice
        return not any(s.rank == segment.rank and _process(s) != here for s in launch.segments)
    # One process feeding several ranks in turn (DistributedSampler(num_replicas, rank) in a
    # world of 1) is one job too; the same rank again is a relaunch.
    rank = _first_rank(segment)
    return any(_process(s) == here for s in launch.segments) and all(
        _first_rank(s) != rank for s in launch.segments
    )


def _process(segment: Segment) -> tuple[Any, Any]:
    return segment.header.get("host"), segment.header.get("pid")


def _first_rank(segment: Segment) -> int:
    return _rank(segment, segment.epochs[0] if segment.epochs else None)


def _why(by: Launch, superseded: Segment) -> str:
    """Why ``superseded``'s records (from ``by``'s cut on) do not count: ``by``'s segment of
    the same rank is cited."""
    rank = _first_rank(superseded)
    segment = next((s.name for s in by.segments if _first_rank(s) == rank), by.name)
    if by.cut is None:
        return f"superseded by the fresh start (segment {segment})"
    return f"superseded by the resume at epoch {by.cut[0]} step {by.cut[1]} (segment {segment})"


def _rank(segment: Segment, line: dict[str, Any] | None) -> int:
    deal = line.get("deal") if line is not None else None
    if isinstance(deal, dict) and deal.get("kind") is not None:
        return int(deal["rank"])
    return segment.rank


def _lines_of(segment: Segment) -> dict[int, dict[str, Any]]:
    """Each epoch's line; an epoch begun twice in one segment (a re-dealt rest that the next
    iterator delivers: `Checkpoints.begin_epoch`) runs from its first line's first step."""
    lines: dict[int, dict[str, Any]] = {}
    for line in segment.epochs:
        epoch = int(line["epoch"])
        first = lines[epoch]["first_step"] if epoch in lines else line.get("first_step")
        lines[epoch] = {**line, "first_step": first}
    return lines


def _steps_of(segment: Segment) -> list[Step]:
    lines = _lines_of(segment)
    out = []
    for r in segment.steps:
        epoch = int(r["e"])
        out.append(
            Step(
                epoch,
                int(r["s"]),
                _rank(segment, lines.get(epoch)),
                segment.name,
                list(r.get("i") or []),
                r.get("w"),
                r.get("p"),
                r.get("k"),
                list(r.get("ev") or []),
                r.get("keys"),
                r.get("pos"),
            )
        )
    return out


def _before(at: Cut, until: Cut | None) -> bool:
    return until is None or at < until


def _take(timeline: Timeline, number: int, part: Part) -> None:
    """Part ``number``'s records: those before its ``until`` on the timeline, the rest
    superseded."""
    for segment in part.launch.segments:
        why = _why(part.by, segment) if part.by is not None else ""
        lines = _lines_of(segment)
        for epoch, line in lines.items():
            if _before((epoch, int(line.get("first_step") or 0)), part.until):
                rank = _rank(segment, line)
                timeline._lines.append(EpochLine(number, segment.name, rank, line))
        for step in _steps_of(segment):
            if _before((step.epoch, step.step), part.until):
                timeline._steps.append(step)
            else:
                timeline.superseded.append(Superseded(step, why))
        for event in segment.events:
            if event.get("ev") == "end":  # the epoch ran to its end on this rank
                epoch, steps = int(event["e"]), int(event["steps"])
                if _before((epoch, max(steps - 1, 0)), part.until):
                    timeline._ends[(segment.name, epoch)] = steps
                continue
            if event.get("ev") != "skip":
                continue
            epoch = int(event["e"])
            # No step on the line: a skip counts unless its whole epoch is past the cut.
            if _before((epoch, 0), part.until):
                rank = _rank(segment, lines.get(epoch))
                timeline._skips.append(
                    Skip(epoch, event["index"], str(event.get("cause", "")), rank, segment.name)
                )
