"""transformers Trainer and TRL's SFTTrainer keep steadyload's loader and resume it exactly.

The trainings run in trainer_job.py, in a fresh process (one, or two under torchrun with
gloo), and are checked here from their JSON: in a fresh process the fork server preloads
transformers once, and the frameworks' warnings stay out of this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.ledger_check import (
    Timeline,
    assert_each_sample_once,
    assert_resumed,
    recorded,
    timeline,
)

pytest.importorskip("transformers")
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
N, BATCH = 32, 4  # trainer_job's
pytestmark = pytest.mark.timeout(300)


def _job(out: Path, *runs: str, ranks: int = 1) -> dict[int, dict[str, Any]]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    proc = subprocess.run(
        [sys.executable, *(launcher if ranks > 1 else []), "-m", "tests.frameworks.trainer_job",
         str(out), *runs],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=280,
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results: dict[int, dict[str, Any]] = {}
    for rank in range(ranks):
        results[rank] = {run: json.loads((out / f"{run}-rank{rank}.json").read_text())
                         for run in runs}
        assert json.loads((out / f"leftover-rank{rank}.json").read_text()) == []
    return results


def _parents(run: dict[str, Any]) -> set[int]:
    return {ppid for _, _, ppid in run["loads"]}


def _indices(batches: list[list[list[int]]]) -> list[list[int]]:
    return [[sample[0] for sample in batch] for batch in batches]


def _skipped(reference: dict[str, Any]) -> set[int]:
    """The samples of the batches a resume from the checkpoint skips (its epoch's first)."""
    per_epoch, save_at = reference["steps_per_epoch"], reference["save_at"]
    start = save_at // per_epoch * per_epoch
    return {i for batch in _indices(reference["batches"][start:save_at]) for i in batch}


def _check_resumed_ledger(
    folder: Path, resumed: dict[int, dict[str, Any]], trained: dict[int, dict[str, Any]]
) -> Timeline:
    """The ledger of a run checkpointed mid-epoch by the Trainer (B1: it went on past the
    checkpoint) and ``resumed`` from it in a new process, on ``len(resumed)`` ranks: one
    chain from the checkpoint's token and step, what each rank ``trained`` on (the
    uninterrupted run's batches)."""
    line = timeline(folder)
    per_epoch, save_at = resumed[0]["steps_per_epoch"], resumed[0]["save_at"]
    assert_resumed(line, [save_at // per_epoch, save_at % per_epoch], len(resumed))
    for rank, run in trained.items():  # (not the batch accelerate's shard read ahead last)
        assert recorded(line, rank) == _indices(run["batches"])
    return line


@pytest.fixture(scope="module")
def one_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def one(one_out: Path) -> dict[str, Any]:
    return _job(one_out, "A", "B1", "B2", "U1", "U2", "W", "U3", "S1", "S2", "K", "E")[0]


@pytest.mark.slow
def test_mixin_trainer_runs_on_steadyload_workers_keeps_its_loader_and_heals_a_kill(
    one: dict[str, Any],
) -> None:
    a, b1 = one["A"], one["B1"]
    for run in (a, b1):
        assert run["loader_type"] == "accelerate.data_loader.DataLoaderShard"
        assert _parents(run) == {run["forkserver"]} and run["worker_ppids"] == [run["forkserver"]]
        assert run["built_with"] == {  # the Trainer's loader, arguments and all, on steadyload
            "collate_fn": "RemoveColumnsCollator", "worker_init_fn": "seed_worker",
            "batch_sampler": "BatchSampler", "prefetch_factor": 2, "persistent_workers": True,
            "options": {"sample_seeds": True, "max_restarts": 2},
            "report_start_method": "forkserver",
        }
    assert len(a["batches"]) == a["steps"] and b1["batches"] == a["batches"]
    mixin, whole, latest = a["mixin_report_batches"]  # steadyload_report() after train()
    assert mixin == whole > latest > 0  # every epoch of train(), not only the latest
    assert a["mixin_report"]["epochs"] == 2
    assert a["restarts"] == [] and b1["restarts"] == ["killed by SIGKILL"]
    assert "steadyload_loader_rank0.pt" in b1["checkpoint"]
    assert a["eval"]["steadyload"] and a["eval"]["cached"]  # persistent eval loader, adopted
    assert a["eval"]["parents"] == [a["forkserver"]]
    assert a["eval"]["start_method"] == "forkserver" and a["eval"]["loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("way", ["B", "U"], ids=["documented way", "user subclass"])
def test_resume_mid_epoch_gives_the_uninterrupted_batches_and_loads_no_skipped_sample(
    one: dict[str, Any], way: str,
) -> None:
    # B: the mixin builds the loader; U: the subclass's own get_train_dataloader returns a
    # steadyload loader, and the mixin only joins the class.
    uninterrupted, resumed = one["A" if way == "B" else "U1"], one[f"{way}2"]
    save_at = resumed["save_at"]
    assert resumed["batches"] == uninterrupted["batches"][save_at:]  # indices and worker draws
    assert _parents(resumed) == {resumed["forkserver"]} and resumed["restarts"] == []
    skipped = _skipped(uninterrupted)
    assert len(skipped) == save_at % resumed["steps_per_epoch"] * BATCH > 0
    assert skipped.isdisjoint(i for i, _, _ in resumed["loads"])
    assert resumed["warnings"] == []


@pytest.mark.slow
@pytest.mark.slow
def test_the_training_loaders_ledger_is_resumed_with_the_checkpoint(
    one: dict[str, Any], one_out: Path
) -> None:
    # steadyload_options={"ledger": ...}: the training loader records, the eval loader not.
    line = timeline(one_out / "ledger-A")
    [[segment]] = line.chain
    assert segment.header["dataset"]["len"] == N and one["A"]["eval"]["ledger"] is None
    assert_each_sample_once(line, N, complete=range(1))
    # STEADYLOAD_LEDGER, for the loader the mixin builds (B) and for the subclass's own (U).
    for way, uninterrupted in (("B", "A"), ("U", "U1")):
        line = _check_resumed_ledger(
            one_out / f"ledger-{way}", {0: one[f"{way}2"]}, {0: one[uninterrupted]}
        )
        assert_each_sample_once(line, N, complete=range(1))


def test_user_subclass_resumed_without_the_state_file_skips_by_index_on_steadyload(
    one: dict[str, Any],
) -> None:
    u3 = one["U3"]
    assert len(u3["batches"]) == u3["steps"] - u3["save_at"]
    assert _parents(u3) == {u3["forkserver"]}
    loaded = [i for i, _, _ in u3["loads"]]
    # Each sample of the resumed epoch loaded once at most, none of the skipped batches'.
    skipped = u3["save_at"] % u3["steps_per_epoch"] * BATCH
    assert len(loaded) == len(set(loaded)) <= N - skipped


@pytest.mark.slow
def test_without_the_mixin_the_resume_warns_naming_the_trainer_and_the_mixin(
    one: dict[str, Any],
) -> None:
    w = one["W"]
    (warning,) = w["warnings"]
    assert re.match(
        r"steadyload: the transformers Trainer \(resuming mid-epoch through accelerate's "
        r"skip_first_batches\) is rebuilding this steadyload\.DataLoader as torch's DataLoader",
        warning,
    ), warning
    assert "Fix: add steadyload.integrations.transformers.SteadyloadTrainerMixin" in warning
    assert _parents(w) == {w["main_pid"]}  # what it warns about: torch's forked workers


@pytest.mark.slow
def test_sft_trainer_with_the_mixin_keeps_trl_collator_on_steadyload_workers(
    one: dict[str, Any],
) -> None:
    s1, s2 = one["S1"], one["S2"]
    assert s1["mro"][2:4] == ["SteadyloadTrainerMixin", "SFTTrainer"]
    for run in (s1, s2):
        assert run["collator"] == "trl.trainer.sft_trainer.DataCollatorForLanguageModeling"
        assert run["loader_type"] == "accelerate.data_loader.DataLoaderShard"
        assert run["worker_ppids"] == [run["forkserver"]]
        assert run["report_start_method"] == "forkserver"
    assert s2["batches"] == s1["batches"] and len(s1["batches"]) == N // BATCH + 2
    assert s1["restarts"] == [] and s2["restarts"] == ["killed by SIGKILL"]


@pytest.mark.slow
@pytest.mark.slow
def test_a_restart_in_epoch_0_is_in_the_report_after_train_without_persistent_workers(
    one: dict[str, Any],
) -> None:
    k = one["K"]
    assert k["built_with"]["persistent_workers"] is False  # the Trainer's default
    assert k["mixin_report"]["epochs"] == 2
    assert k["mixin_report"]["restarts"] == [["killed by SIGKILL", 0]]
    assert k["mixin_report"]["latest_epoch_restarts"] == 0  # report(): the latest epoch only
    # Healed: the fault-free run's samples. (Epoch 1's worker draws differ from A's: without
    # persistent workers each epoch's iterator draws a new base seed, as in torch.)
    per_epoch = k["steps_per_epoch"]
    assert k["batches"][:per_epoch] == one["A"]["batches"][:per_epoch]
    assert _indices(k["batches"]) == _indices(one["A"]["batches"])


def test_mixin_fails_loudly_and_puts_the_resume_patch_back(one: dict[str, Any]) -> None:
    e = one["E"]
    assert e["unknown_option"].startswith("steadyload_options has unknown steadyload option(s) 'on_eror'; the options are start_method, max_restarts")
    assert re.match(r"steadyload\.integrations\.transformers: transformers \d+\.\d+\S* has no "
                    r"transformers\.trainer\.skip_first_batches\. ", e["missing_name"])
    assert "Fix: install transformers==5.24.*" in e["missing_name"]
    assert e["patched_during_train"] and e["raised"] == "boom"
    assert e["restored_after_exception"]


# -- two processes ---------------------------------------------------------------------------

def test_two_processes_shard_heal_a_killed_worker_and_resume_exactly(tmp_path: Path) -> None:
    ranks = _job(tmp_path, "A", "B1", "B2", "B3", ranks=2)
    for rank, runs in ranks.items():
        a, b1, b2, b3 = (runs[k] for k in ("A", "B1", "B2", "B3"))
        per_epoch, save_at = a["steps_per_epoch"], a["save_at"]
        for run in (a, b1, b2, b3):
            assert run["built_with"]["batch_sampler"] == "BatchSamplerShard"
            assert _parents(run) == {run["forkserver"]}
        assert len(a["batches"]) == a["steps"] and b1["batches"] == a["batches"]
        assert b1["restarts"] == (["killed by SIGKILL"] if rank == 1 else [])
        assert f"steadyload_loader_rank{rank}.pt" in b1["checkpoint"]
        assert b2["batches"] == a["batches"][save_at:]  # from the loader's state: exact
        # Without the state file: skipped by index, the same samples (the sampler is
        # seeded per epoch); only the worker-side draws may differ.
        assert _indices(b3["batches"]) == _indices(a["batches"][save_at:])
        skipped = _skipped(a)
        assert len(skipped) == save_at % per_epoch * BATCH > 0
        for resumed in (b2, b3):
            assert skipped.isdisjoint(i for i, _, _ in resumed["loads"])
    epoch0 = [i for r in (0, 1) for b in _indices(ranks[r]["A"]["batches"][:per_epoch])
              for i in b]
    assert sorted(epoch0) == list(range(N))  # the ranks split the epoch
    # Elastic resume: B1's checkpoint (2 processes, mid-epoch 1) in one process goes on
    # with the rest of that epoch, every sample of it once over both runs.
    one = _job(tmp_path, "B4")[0]["B4"]
    per_epoch, save_at = ranks[0]["A"]["steps_per_epoch"], ranks[0]["A"]["save_at"]
    done = [i for r in (0, 1) for b in _indices(ranks[r]["A"]["batches"][per_epoch:save_at])
            for i in b]
    rest = [i for b in _indices(one["batches"][: (N - len(done)) // BATCH]) for i in b]
    assert sorted(done + rest) == list(range(N))
    assert one["warnings"] == [] and one["restarts"] == []
    # STEADYLOAD_LEDGER: B1's ledger on 2 ranks, resumed by B2 on 2 ranks and by B4 on one
    # (each rank's segment; the rank and world size from torch.distributed).
    resumed, trained = ({r: ranks[r][run] for r in ranks} for run in ("B2", "A"))
    line = _check_resumed_ledger(tmp_path / "ledger-B", resumed, trained)
    assert_each_sample_once(line, N, complete=range(2))
    line = timeline(tmp_path / "ledger-B4")
    assert sorted((s.rank, s.header["world"]) for s in line.chain[0]) == [(0, 2), (1, 2)]
    assert_resumed(line, [1, save_at - per_epoch], ranks=1)  # B1's, then B4's
    [b4] = line.chain[1]  # what B4 trained on, its steps going on from the state's
    assert [s["i"] for s in b4.steps] == _indices(one["batches"])
    assert b4.steps[0]["s"] == save_at - per_epoch
    assert_each_sample_once(line, N, complete=range(2))
