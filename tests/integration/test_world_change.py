"""Issue #36 in real multi-process runs (torchrun, gloo, CPU; tests/world_job.py): a loader
state saved on N ranks and loaded on M (2 -> 3, 4 -> 2; every rank loads rank 1's state,
as the README's recipe has every rank load one rank's state). What steadyload cannot deal
again to other ranks, or what another sampler would continue, is refused by
``load_state_dict`` itself, before any batch, with what/Why:/Fix:; torch's
DistributedSampler still resumes with every sample of the epoch once, in its order.

One save run and one load run per pair of world sizes, each building one loader per
scenario (`world_job.SCENARIOS`), so that the pair costs two torchrun launches; the
outcomes of every scenario are checked before the test fails, and a failure says what
each one did."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import world_job
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
FROM_RANK = 1  # the state every loading rank loads (the issue's: rank 1 of the saving run)
SHAPE = re.compile(r"\S.*\nWhy: \S.*\nFix: \S.*", re.DOTALL)  # steadyload's errors


def _torchrun(out: Path, ranks: int, *flags: str) -> None:
    torchrun("tests.world_job", out, ranks, *flags)


def _saved(out: Path, name: str, world: int) -> list[list[list[int]]]:
    """Each saving rank's batches of scenario ``name``."""
    runs = [json.loads((out / f"{name}_r{r}.json").read_text()) for r in range(world)]
    assert all(run["world"] == world for run in runs)
    return [run["batches"] for run in runs]


def _loaded(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    """Each loading rank's outcome of scenario ``name`` (`world_job.load`)."""
    return [json.loads((out / f"load_w{world}_r{r}.json").read_text())[name] for r in range(world)]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def _lost_and_repeated(items: list[int]) -> str:
    seen = Counter(items)
    lost = sorted(set(range(world_job.N)) - set(seen))
    repeated = sorted(i for i, k in seen.items() if k > 1)
    return f"lost {len(lost)} {lost}, repeated {len(repeated)} {repeated}"


def _in_lockstep(ranks: list[list[list[int]]]) -> list[int]:
    """The samples as the ranks took them together: step by step, and within a batch
    position by position, rank by rank (a DistributedSampler deals one sample a rank)."""
    out: list[int] = []
    for step in range(max(len(batches) for batches in ranks)):
        for j in range(world_job.BATCH):
            out += [b[step][j] for b in ranks if step < len(b) and j < len(b[step])]
    return out


def _refused(
    out: Path, name: str, saved_world: int, world: int, names: tuple[str, ...]
) -> list[str]:
    """What is wrong with scenario ``name``'s outcome, where every loading rank's
    ``load_state_dict`` must raise a ValueError whose message names each of ``names`` and
    is shaped what/Why:/Fix:, before any batch ([]: nothing wrong)."""
    saved, problems = _saved(out, name, saved_world), []
    for rank, got in enumerate(_loaded(out, name, world)):
        where = f"{name} {saved_world} -> {world} ranks, rank {rank}"
        if got["error"] is None:
            if name.startswith("shuffle"):  # every rank walks the whole dataset
                items = _flat(saved[FROM_RANK]) + _flat(got["batches"])
                whose = f"rank {FROM_RANK}'s saved batches and this rank's rest"
            else:  # the ranks share the dataset: over all ranks of both runs
                items = [i for r in saved for i in _flat(r)]
                items += [i for g in _loaded(out, name, world) for i in _flat(g["batches"])]
                whose = "all ranks of both runs"
            problems.append(
                f"{where}: accepted silently, {len(got['batches'])} batches; over {whose}: "
                + _lost_and_repeated(items)
            )
            continue
        message = got["message"] or ""
        if got["error"] != "load":
            problems.append(
                f"{where}: raised from iteration after {len(got['batches'])} batches, not "
                f"from load_state_dict: {got['type']}: {message}"
            )
            continue
        assert got["batches"] == []
        missing = [w for w in names if w not in message]
        if got["type"] != "ValueError" or missing or not SHAPE.fullmatch(message):
            problems.append(
                f"{where}: load_state_dict raised {got['type']} (want ValueError naming "
                f"{list(names)}, missing {missing}, shaped what/Why:/Fix:): {message}"
            )
    return problems


def _redealt(out: Path, saved_world: int, world: int) -> list[str]:
    """What is wrong with the DistributedSampler scenario: it must load on every rank and
    deliver over all ranks of both runs every sample of the epoch once, in the order of its
    permutation (no padding: 60 - 3 batches of 2 on N ranks divides by M)."""
    where = f"distributed {saved_world} -> {world} ranks"
    loaded = _loaded(out, "distributed", world)
    errors = [
        f"{where}, rank {r}: {g['error']}: {g['type']}: {g['message']}"
        for r, g in enumerate(loaded)
        if g["error"] is not None
    ]
    if errors:
        return errors
    taken = _in_lockstep(_saved(out, "distributed", saved_world))
    taken += _in_lockstep([g["batches"] for g in loaded])
    order = torch.randperm(world_job.N, generator=torch.Generator().manual_seed(0)).tolist()
    if taken != order:
        return [
            f"{where}: not each sample once in the sampler's order: {_lost_and_repeated(taken)}"
        ]
    return []


@pytest.mark.parametrize(("saved_world", "world"), [(2, 3), (4, 2)])
def test_another_number_of_ranks_refuses_what_it_cannot_deal_again(
    tmp_path: Path, saved_world: int, world: int
) -> None:
    _torchrun(tmp_path, saved_world, "save")
    _torchrun(tmp_path, world, "load", "--from-rank", str(FROM_RANK))
    problems = [
        *_refused(tmp_path, "stream", saved_world, world, ("RankStream", "ranks")),
        *_refused(tmp_path, "sampler", saved_world, world, ("RankShardSampler", "ranks")),
        *_refused(tmp_path, "shuffle_on_to_off", saved_world, world,
                  ("RandomSampler", "SequentialSampler")),
        *_refused(tmp_path, "shuffle_off_to_on", saved_world, world,
                  ("RandomSampler", "SequentialSampler")),
        *_redealt(tmp_path, saved_world, world),
    ]  # fmt: skip
    assert not problems, "\n".join(problems)
