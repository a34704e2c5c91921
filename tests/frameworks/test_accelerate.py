"""accelerate keeps steadyload's loader: `prepare`, `adopt`, `skip_first_batches`, save/load state.

One process here (real Accelerator on CPU), two under torchrun (gloo) in accelerate_job.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import steadyload as sl
from tests.frameworks import accelerate_job
from tests.frameworks.hf_common import (
    Indexed,
    Stream,
    Tokens,
    forkserver_pid,
    kill_worker,
    read_loads,
)
from tests.frameworks.ledger_check import (
    assert_each_sample_once,
    assert_resumed,
    recorded,
    timeline,
)

accelerate = pytest.importorskip("accelerate")
from steadyload.integrations.accelerate import (  # noqa: E402
    adopt,
    prepare,
    skip_first_batches,
    steadyload_base,
)

ROOT = Path(__file__).resolve().parents[2]


def _loader(dataset: Any, seed: int = 0, **kw: Any) -> sl.DataLoader[Any]:
    return sl.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2,
                         generator=torch.Generator().manual_seed(seed), **kw)


def _batches(loader: Any, kill_after: int | None = None) -> list[list[tuple[int, int]]]:
    out, parents = [], set()
    for step, batch in enumerate(loader):
        out.append(list(zip(batch["index"].tolist(), batch["noise"].tolist(), strict=True)))
        parents |= set(batch["ppid"].tolist())
        if step == kill_after:
            kill_worker(loader)
    assert parents == {forkserver_pid()}, "batches were not loaded by steadyload's workers"
    return out


def test_prepare_keeps_sharding_signals_on_steadyload_workers_and_heals_a_killed_worker() -> None:
    runs = []
    for kill_after in (None, 1):
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=3)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = _loader(Indexed(38, delay_s=0.005), on_error="skip", max_restarts=2,
                         sample_seeds=True)
        model, opt, dl = prepare(acc, model, opt, loader)
        assert type(dl).__name__ == "DataLoaderShard" and acc._dataloaders[-1] is dl
        assert isinstance(dl, sl.DataLoader)  # accelerate reports the class it iterates
        base = steadyload_base(dl)
        assert base is not None and (base.on_error, base.max_restarts) == ("skip", 2)
        seen, ends, syncs = [], [], []
        for step, batch in enumerate(dl):
            with acc.accumulate(model):
                seen.append(list(zip(batch["index"].tolist(), batch["noise"].tolist(),
                                     strict=True)))
                assert set(batch["ppid"].tolist()) == {forkserver_pid()}
                acc.backward(model(batch["x"]).pow(2).mean())
                opt.step()
                opt.zero_grad()
            ends.append(acc.gradient_state.end_of_dataloader)
            syncs.append(acc.sync_gradients)
            if step == kill_after:
                kill_worker(dl)
        # GradientState: the last batch is flagged and syncs, whatever the accumulation count.
        assert ends == [False] * 9 + [True]
        assert syncs == [False, False, True] * 3 + [True]
        assert dl.remainder == 38 % 4
        runs.append((seen, [r.cause for r in dl.report().restarts]))
    (clean, no_restarts), (healed, restarts) = runs
    assert healed == clean and no_restarts == [] and restarts == ["killed by SIGKILL"]


def test_save_state_and_load_state_resume_mid_epoch_exactly(tmp_path: Path) -> None:
    acc = accelerate.Accelerator(cpu=True)
    dl = prepare(acc, _loader(Indexed(80, delay_s=0.002), sample_seeds=True))
    it = iter(dl)
    before = [next(it)["index"].tolist() for _ in range(4)]
    acc.save_state(str(tmp_path))
    rest = [b["index"].tolist() for b in it]  # the epoch as the uninterrupted run goes on
    next_epoch = _batches(dl)
    assert "steadyload_loader_0_rank0.pt" in os.listdir(tmp_path)

    acc2 = accelerate.Accelerator(cpu=True)  # a fresh run, its loader from another seed
    dl2 = prepare(acc2, _loader(Indexed(80, delay_s=0.002), seed=7, sample_seeds=True))
    acc2.load_state(str(tmp_path))
    resumed = _batches(dl2, kill_after=0)  # 15 batches left to dispatch: the death shows
    assert [[i for i, _ in b] for b in resumed] == rest and len(before + rest) == 20
    assert [r.cause for r in dl2.report().restarts] == ["killed by SIGKILL"]
    assert dl2.iteration == 1  # the epoch counter came back with the state, then advanced
    # With generator=, the next epoch too: same samples, same worker-side draws.
    assert _batches(dl2) == next_epoch


BAD = frozenset({5, 17, 30, 41})  # of Flawed(48): on_error="skip" leaves them out


def test_accelerates_resume_recipe_load_state_then_skip_first_batches_is_exact(
    tmp_path: Path,
) -> None:
    """accelerate's documented resume: ``load_state(dir)``, then the epoch from
    ``accelerator.skip_first_batches(loader, k)`` and the next ones from the loader."""
    done = 5  # of the 12 batches of epoch 0, when the checkpoint is taken

    def run(seed: int) -> tuple[Any, Any]:
        acc = accelerate.Accelerator(cpu=True)
        dataset = accelerate_job.Flawed(48, bad=BAD, delay_s=0.002)
        return acc, prepare(acc, _loader(dataset, seed=seed, on_error="skip", max_restarts=2,
                                         sample_seeds=True))

    acc, dl = run(0)  # the uninterrupted run
    it = iter(dl)
    first = _batches(next(it) for _ in range(done))
    acc.save_state(str(tmp_path))
    rest = _batches(it)
    following = _batches(dl)

    acc2, dl2 = run(7)  # a fresh run, its loader from another seed
    acc2.load_state(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped = acc2.skip_first_batches(dl2, done)
        resumed = _batches(skipped, kill_after=0)  # 6 batches still to come: a restart
        resumed_report = dl2.report()
        next_epoch = _batches(dl2)
    assert [str(w.message) for w in caught if "steadyload" in str(w.message)] == []
    assert skipped is dl2  # accelerate's shard, kept: steadyload's workers, the saved epoch
    # The rest of the interrupted epoch and the whole next one, as the uninterrupted run had
    # them: the same samples in the same batches, the same worker-side draws (sample_seeds).
    assert resumed == rest and len(first + rest) == 12
    assert next_epoch == following and len(following) == 12
    assert [r.cause for r in resumed_report.restarts] == ["killed by SIGKILL"]
    # Each bad sample shortens its batch by one: those of the resumed part were skipped
    # there, on steadyload's workers (torch's would have raised), and all of them next epoch.
    resumed_skips = [s.index for s in resumed_report.skipped]
    assert resumed_skips and set(resumed_skips) <= BAD, "pick BAD indices in the resumed part"
    assert sum(4 - len(b) for b in rest) == len(resumed_skips)
    assert sorted(s.index for s in dl2.report().skipped) == sorted(BAD)


def test_accelerates_module_skip_first_batches_refuses_a_loader_holding_a_loaded_state(
    tmp_path: Path,
) -> None:
    """``from accelerate import skip_first_batches`` is out of steadyload's reach: it would
    run the resumed epoch on torch's workers and leave the state to the next epoch."""
    acc = accelerate.Accelerator(cpu=True)
    dl = prepare(acc, _loader(Indexed(40)))
    it = iter(dl)
    first = [next(it)["index"].tolist() for _ in range(3)]
    acc.save_state(str(tmp_path))
    rest = [b["index"].tolist() for b in it]
    acc2 = accelerate.Accelerator(cpu=True)
    dl2 = prepare(acc2, _loader(Indexed(40), seed=7))
    acc2.load_state(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)accelerate's skip_first_batches was given a "
                       r"steadyload\.DataLoader holding a loaded state.*Why: torch's loader "
                       r"cannot continue that state.*Fix: use `steadyload\.integrations\."
                       r"accelerate\.skip_first_batches\(loader, n\)`"):
        accelerate.skip_first_batches(dl2, len(first))
    # Refused before anything changed: the accelerator's method resumes it exactly.
    assert acc2.skip_first_batches(dl2, len(first)) is dl2
    assert [b["index"].tolist() for b in _batches_plain(dl2)] == rest


def test_skip_first_batches_stays_on_steadyload_and_loads_no_skipped_sample(
    tmp_path: Path,
) -> None:
    acc = accelerate.Accelerator(cpu=True)
    full = [b["input_ids"][:, 0].tolist() for b in prepare(acc, _loader(Tokens(20)))]
    dl = prepare(acc, _loader(Tokens(20, log_dir=str(tmp_path))))
    assert skip_first_batches(dl, 3) is dl  # in place: the next epoch starts at batch 3
    got = [b["input_ids"][:, 0].tolist() for b in dl]
    assert got == full[3:]
    loads = read_loads(tmp_path)
    assert {i for i, _, _ in loads}.isdisjoint(i for b in full[:3] for i in b)
    assert {ppid for _, _, ppid in loads} == {forkserver_pid()}
    assert dl.state_dict()["finished"] and dl.report().batches == 2
    # The accelerator steadyload prepared sends its loaders to steadyload's, in place.
    again = prepare(acc, _loader(Tokens(20)))
    assert acc.skip_first_batches(again, 3) is again
    assert [b["input_ids"][:, 0].tolist() for b in again] == full[3:]
    # accelerate's module function rebuilds the loader as torch's: it says so.
    with pytest.warns(UserWarning, match=r"(?s)accelerate's skip_first_batches is rebuilding "
                      r"this steadyload.DataLoader as torch's.*Fix: use `steadyload\."
                      r"integrations\.accelerate\.skip_first_batches\(loader, n\)`"):
        accelerate.skip_first_batches(prepare(acc, _loader(Tokens(20))), 3)


def test_skip_first_batches_of_a_plain_loader_in_place_and_of_a_stream_through_accelerate() -> None:
    full = [b["input_ids"][:, 0].tolist() for b in _loader(Tokens(20))]
    plain = _loader(Tokens(20))
    assert skip_first_batches(plain, 2) is plain  # a steadyload loader nobody prepared
    assert [b["input_ids"][:, 0].tolist() for b in plain] == full[2:]
    # A stream has no index to skip by: accelerate's reads and drops the batches, on our workers.
    acc = accelerate.Accelerator(cpu=True)
    stream = lambda: sl.DataLoader(Stream(24), batch_size=4, num_workers=2, on_error="skip")  # noqa: E731
    whole = [b["index"].tolist() for b in prepare(acc, stream())]
    skipped = skip_first_batches(prepare(acc, stream()), 2)
    base = steadyload_base(skipped)
    assert base is not None and base.on_error == "skip"
    batches = list(skipped)
    assert [b["index"].tolist() for b in batches] == whole[2:]
    assert {p for b in batches for p in b["ppid"].tolist()} == {forkserver_pid()}


class OwnOrder(torch.utils.data.Sampler[int]):
    """A sampler steadyload cannot replay: not torch's, no state_dict."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def test_a_sampler_steadyload_cannot_replay_trains_on_and_the_error_waits_for_state_dict(
    tmp_path: Path,
) -> None:
    acc = accelerate.Accelerator(cpu=True)
    dl = prepare(acc, sl.DataLoader(Indexed(12), batch_size=4, sampler=OwnOrder(12),
                                    num_workers=2))
    assert [b["index"].tolist() for b in _batches_plain(dl)] == [[11, 10, 9, 8], [7, 6, 5, 4],
                                                                 [3, 2, 1, 0]]
    with pytest.raises(ValueError, match=r"cannot save this DataLoader's position: the "
                       r"loader's batch_sampler\.sampler is a .*OwnOrder"):
        dl.state_dict()
    with pytest.warns(UserWarning, match=r"save_state saved no position for loader 0"):
        acc.save_state(str(tmp_path))
    assert not any(n.startswith("steadyload_loader") for n in os.listdir(tmp_path))


def _batches_plain(loader: Any) -> list[Any]:
    out = list(loader)
    assert {p for b in out for p in b["ppid"].tolist()} == {forkserver_pid()}
    return out


def test_adopt_refuses_what_it_cannot_keep_and_names_the_accelerate_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    acc = accelerate.Accelerator(cpu=True)
    with pytest.raises(TypeError, match=r"adopt\(\) has unknown steadyload option\(s\) 'on_eror'; the options are start_method, "):
        adopt(prepare(acc, _loader(Indexed(8))), on_eror="skip")

    class Other(torch.utils.data.DataLoader):  # type: ignore[type-arg]
        pass

    shard = acc.prepare(torch.utils.data.DataLoader(Indexed(8), batch_size=4))
    shard.base_dataloader = Other(Indexed(8), batch_size=4)
    with pytest.raises(TypeError, match=r"iterates a .*Other, and steadyload replaces only "
                       r"torch's DataLoader"):
        adopt(shard)
    monkeypatch.delattr(accelerate.data_loader.DataLoaderAdapter, "_update_state_dict")
    version = accelerate.__version__.replace(".", r"\.")
    with pytest.raises(RuntimeError, match=rf"(?s)accelerate {version} has no accelerate\."
                       r"data_loader\.DataLoaderAdapter\._update_state_dict.*Fix: install "
                       r"accelerate==1\.15"):
        adopt(acc.prepare(torch.utils.data.DataLoader(Indexed(8), batch_size=4)))


# -- two processes ---------------------------------------------------------------------------

def test_steadyload_ledger_gives_each_prepared_loader_without_its_own_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEADYLOAD_LEDGER", str(tmp_path / "env"))
    acc = accelerate.Accelerator(cpu=True)
    own = _loader(Indexed(8), ledger=str(tmp_path / "own"))
    model, first, second = prepare(acc, torch.nn.Linear(4, 1), _loader(Indexed(8)), own)
    third = prepare(acc, _loader(Indexed(8)))
    # The state file's index (steadyload_loader_<i>_rank<r>.pt): a resume prepared in the
    # same order continues each loader's ledger.
    folders = [steadyload_base(dl).ledger for dl in (first, second, third)]
    env = tmp_path / "env"
    assert folders == [str(env / "loader0"), str(tmp_path / "own"), str(env / "loader2")]


@pytest.fixture(scope="module")
def two_ranks_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate-ddp")


@pytest.fixture(scope="module")
def two_ranks(two_ranks_out: Path) -> dict[int, dict[str, Any]]:
    out = two_ranks_out
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "tests.frameworks.accelerate_job", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=240,
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.timeout(300)
def test_two_processes_ledger_is_resumed_with_save_state_and_load_state(
    two_ranks: dict[int, dict[str, Any]], two_ranks_out: Path
) -> None:
    """STEADYLOAD_LEDGER for B (on past its checkpoint) and C (resumed from it)."""
    folder = two_ranks_out / "ledger" / "loader0"
    runs = {r: two_ranks[r]["runs"] for r in (0, 1)}
    assert {runs[r][k]["ledger"] for r in (0, 1) for k in "BC"} == {str(folder)}
    assert {runs[r]["A"]["ledger"] for r in (0, 1)} == {None}
    line = timeline(folder)
    assert_resumed(line, list(accelerate_job.SAVE_AT), ranks=2)
    for rank in (0, 1):  # the uninterrupted run's samples, with the bad ones (skipped)
        a = runs[rank]["A"]["epochs"]
        got = [[i for i in step if i not in accelerate_job.BAD] for step in recorded(line, rank)]
        assert got == [[i for i, _ in b] for e in sorted(a, key=int) for b in a[e]]
    assert_each_sample_once(
        line, accelerate_job.N, complete=range(accelerate_job.EPOCHS), left_out=accelerate_job.BAD
    )


@pytest.mark.timeout(300)
def test_two_processes_shard_heal_a_killed_worker_and_resume_exactly(
    two_ranks: dict[int, dict[str, Any]],
) -> None:
    """Run C resumes as accelerate's docs do: load_state, then skip_first_batches."""
    save_epoch, save_batches = accelerate_job.SAVE_AT
    for rank, result in two_ranks.items():
        a, b, c = (result["runs"][k] for k in "ABC")
        for run in (a, b, c):  # accelerate's shard, sharded, iterating steadyload's workers
            assert run["shard"] == "accelerate.data_loader.DataLoaderShard"
            assert run["reports_class"] == "DataLoader" and run["batch_sampler"] == "BatchSamplerShard"
            assert run["ppids"] == [result["forkserver"]]
            assert run["len"] == accelerate_job.N // accelerate_job.BATCH // 2
        assert b["epochs"] == a["epochs"], f"rank {rank}: the killed worker changed batches"
        for run in (b, c):
            assert run["restarts"] == (["killed by SIGKILL"] if rank == 1 else [])
        assert c["skip_gave_the_loader"]  # the prepared shard itself, not torch's rebuild
        epochs = {int(e): v for e, v in c["epochs"].items()}
        assert sorted(epochs) == list(range(save_epoch, accelerate_job.EPOCHS))
        assert epochs[save_epoch] == a["epochs"][str(save_epoch)][save_batches:]
        # Later epochs: the same samples. (Not the same worker-side draws: without
        # generator=, the resumed iterator's base-seed draw advances the global generator
        # that load_state restored; see docs/design/integrations.md#accelerate.)
        for later in range(save_epoch + 1, accelerate_job.EPOCHS):
            assert [[i for i, _ in b] for b in epochs[later]] == [
                [i for i, _ in b] for b in a["epochs"][str(later)]]
        assert f"steadyload_loader_0_rank{rank}.pt" in result["ckpt"]
    for epoch in map(str, range(accelerate_job.EPOCHS)):  # the ranks split each epoch
        shards = [[i for batch in two_ranks[r]["runs"]["A"]["epochs"][epoch] for i, _ in batch]
                  for r in (0, 1)]
        assert sorted(shards[0] + shards[1]) == sorted(
            set(range(accelerate_job.N)) - accelerate_job.BAD)
    # on_error="skip" left each bad sample out once per epoch, on whichever rank had it.
    skipped = sorted(i for r in (0, 1) for i in two_ranks[r]["runs"]["A"]["skipped"])
    assert skipped == sorted(list(accelerate_job.BAD) * accelerate_job.EPOCHS)
    # The ranks' base seeds differ (per-rank RNG seeds): one shared state file would resume
    # one of them with the other's worker seeds.
    assert two_ranks[0]["saved_base_seed"] != two_ranks[1]["saved_base_seed"]
