"""What a framework's checkpointed and resumed run recorded in its ledger, read from the files.

`timeline` follows the folder's one chain of segments (a fresh start, then each resume: its
``parent`` the token of the state it loaded, its ``cut`` where it resumed) and splits the
steps into those the resumed timeline trained on and those a resume superseded (recorded
after the checkpoint by the run that crashed or went on), and checks that
``steadyload ledger verify`` finds no hole and no repeat in it; `assert_each_sample_once`
then says more precisely what the run trained on.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from steadyload.resume.ledger.files import Segment, read_folder
from steadyload.resume.ledger.verify import verify


@dataclass
class Timeline:
    """A ledger folder's chain, root first: each link the segments of one token (one per
    rank), and the steps per epoch on the timeline and superseded by a resume."""

    chain: list[list[Segment]]
    steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    superseded: list[dict[str, Any]] = field(default_factory=list)

    def indices(self, epoch: int) -> list[int]:
        """Every sample the timeline's steps of ``epoch`` trained on, over the ranks."""
        return [i for step in self.steps.get(epoch, []) for i in step["i"]]


def timeline(folder: str | os.PathLike[str]) -> Timeline:
    """The one chain of segments in ``folder``; fails when the segments are not one chain,
    or when verify finds a hole or a repeat (an epoch left unfinished is allowed)."""
    verdict = verify(folder, allow_incomplete=True)
    assert verdict.ok, verdict.text()
    by_token: dict[str, list[Segment]] = defaultdict(list)
    for segment in read_folder(folder):
        assert not segment.torn, f"{segment.path}: its last line is torn"
        by_token[segment.header["token"]].append(segment)
    parents = {s.header["parent"] for group in by_token.values() for s in group}
    leaves = [token for token in by_token if token not in parents]
    assert len(leaves) == 1, f"{folder}: one chain of segments expected, leaves {leaves}"
    chain, token = [], leaves[0]
    while token is not None:
        group = by_token.pop(token)
        assert len({s.rank for s in group}) == len(group), f"{token}: one segment per rank"
        assert len({s.header["parent"] for s in group}) == 1
        chain.append(group)
        token = group[0].header["parent"]
    assert not by_token, f"{folder}: segments outside the chain: {sorted(by_token)}"
    chain.reverse()
    result = Timeline(chain)
    for link, group in enumerate(chain):
        cut = chain[link + 1][0].header["cut"] if link + 1 < len(chain) else None
        for segment in group:
            own = segment.header["cut"]
            for step in segment.steps:
                where = [step["e"], step["s"]]
                assert own is None or where >= own, f"{segment.path}: step {where} before its cut"
                if cut is None or where < cut:
                    result.steps.setdefault(step["e"], []).append({**step, "rank": segment.rank})
                else:
                    result.superseded.append(step)
    return result


def assert_resumed(line: Timeline, cut: list[int], ranks: int, went_on: bool = True) -> None:
    """``line`` is a fresh run's, resumed once from its state of ``cut`` ([epoch, step]) on
    ``ranks`` ranks: each rank's segment continues the fresh run's timeline from there, and
    (``went_on``: the fresh run went on past its checkpoint) supersedes what followed it."""
    first, then = line.chain
    assert all(s.header["token"] == "root" and s.header["parent"] is None for s in first)
    assert sorted((s.rank, s.header["world"]) for s in then) == [(r, ranks) for r in range(ranks)]
    assert all(s.header["parent"] == "root" and s.header["cut"] == cut for s in then)
    superseded = sorted((step["e"], step["s"]) for step in line.superseded)
    assert superseded[:1] == ([(cut[0], cut[1])] if went_on else []), superseded


def recorded(line: Timeline, rank: int) -> list[list[int]]:
    """The indices of each step ``rank`` took on ``line``, in order."""
    steps = sorted((s["e"], s["s"], s["i"]) for e in line.steps.values() for s in e
                   if s["rank"] == rank)  # fmt: skip
    return [indices for _, _, indices in steps]


def assert_each_sample_once(
    line: Timeline, n: int, complete: range, left_out: frozenset[int] = frozenset()
) -> None:
    """On ``line``, no step twice on a rank and no sample twice in an epoch; each epoch of
    ``complete`` trained on every sample of ``range(n)`` (but ``left_out``, skipped on
    error: the steps list them, the events say so)."""
    for epoch, steps in line.steps.items():
        places = Counter((s["rank"], s["s"]) for s in steps)
        assert max(places.values()) == 1, f"epoch {epoch}: a step recorded twice: {places}"
        repeats = [i for i, count in Counter(line.indices(epoch)).items() if count > 1]
        assert not repeats, f"epoch {epoch}: samples trained on twice: {repeats}"
    for epoch in complete:
        assert sorted(line.indices(epoch)) == list(range(n)), f"epoch {epoch} is not whole"
    skipped = {
        e["index"] for group in line.chain for s in group for e in s.events if e["ev"] == "skip"
    }
    assert skipped <= left_out, f"skipped on error: {sorted(skipped - left_out)}"
