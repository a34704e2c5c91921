"""Mid-epoch checkpoint and resume (state_dict/load_state_dict) and sample_seeds."""

from __future__ import annotations

import io
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, Sampler

import steadyload
from tests import resume_job
from tests.compare import assert_same_batches
from tests.datasets import MapDS, ResetsOnIter, StatefulStream

ROOT = Path(__file__).resolve().parents[2]


def _job(out: Path, *args: str) -> list[torch.Tensor]:
    subprocess.run(
        [sys.executable, "-m", "tests.resume_job", str(out), *args],
        cwd=ROOT, check=True, timeout=60, capture_output=True,
    )  # fmt: skip
    batches: list[torch.Tensor] = torch.load(out, weights_only=True)
    return batches


BATCHES_PER_EPOCH = -(-resume_job.N // resume_job.BATCH)
# "A random point of epoch 2": drawn once from a fixed seed, so a failure reproduces.
SAVE_AT = random.Random(2026).randrange(1, BATCHES_PER_EPOCH)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_resume_in_a_fresh_process_with_other_worker_counts(
    tmp_path: Path, persistent: bool
) -> None:
    flag = ["--persistent"] if persistent else []
    full = _job(tmp_path / "full.pt", "--workers", "2", *flag)
    assert len(full) == resume_job.EPOCHS * BATCHES_PER_EPOCH
    before = _job(tmp_path / "before.pt", "--workers", "2", "--save-at", "2", str(SAVE_AT), *flag)
    state_file = str(tmp_path / "before.pt.state")
    assert len(before) == 2 * BATCHES_PER_EPOCH + SAVE_AT
    # num_workers=0 cannot keep persistent workers; that case is test_persistence_mismatch.
    for workers in (1, 3) if persistent else (0, 1, 3):
        after = _job(tmp_path / f"after{workers}.pt", "--workers", str(workers),
                     "--resume", state_file, *flag)  # fmt: skip
        # Indices and the torch/random/numpy values drawn in __getitem__ all match.
        assert_same_batches(before + after, full)


def _epochs(loader: Any, n: int) -> list[Any]:
    return [b for _ in range(n) for b in loader]


def _resumed_run(make: Any, epochs: int, save_epoch: int, save_after: int) -> list[Any]:
    """Batches of a run saved after batch ``save_after`` of ``save_epoch``, then resumed."""
    loader = make()
    seen: list[Any] = []
    for _ in range(save_epoch):
        seen.extend(loader)
    it = iter(loader)
    seen.extend(next(it) for _ in range(save_after))
    state = loader.state_dict()
    del it, loader
    state = _through_torch_save(state)
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(state["epoch"], epochs):
        seen.extend(resumed)
    return seen


def _through_torch_save(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)
    return loaded


@pytest.mark.parametrize("save_after", [0, 1, 6, BATCHES_PER_EPOCH])
def test_resume_in_process_at_edges_of_an_epoch(save_after: int) -> None:
    def make() -> Any:
        return resume_job.make_loader(0)

    want = _epochs(make(), 3)
    assert_same_batches(_resumed_run(make, 3, 1, save_after), want)


def test_state_saved_after_an_epoch_ended_starts_the_next() -> None:
    full = _epochs(resume_job.make_loader(2), 3)
    loader = resume_job.make_loader(2)
    first = list(loader)  # the epoch ran to StopIteration
    state = loader.state_dict()
    assert state["finished"] and state["epoch"] == 0
    resumed = resume_job.make_loader(1)
    resumed.load_state_dict(state)
    assert_same_batches(first + _epochs(resumed, 2), full)


@pytest.mark.parametrize(
    ("workers", "persistent"), [(0, False), (2, False), (2, True)],
    ids=["in-process", "workers", "persistent"],
)
def test_break_then_state_dict_keeps_the_position(workers: int, persistent: bool) -> None:
    # The everyday loop (torchdata's StatefulDataLoader users'): break at max_steps (or in a
    # SIGTERM handler), drop the iterator, then save. Only StopIteration ends the epoch.
    def make() -> Any:
        return resume_job.make_loader(workers, persistent)

    full = _epochs(make(), 2)
    loader = make()
    got = []
    for i, batch in enumerate(loader):
        got.append(batch)
        if i == 2:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["finished"], state["batches_yielded"]) == (0, False, 3)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(got + _epochs(resumed, 2), full)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_whose_iter_resets_its_position_resumes_where_it_stood(workers: int) -> None:
    def make() -> Any:
        return steadyload.DataLoader(ResetsOnIter(30), batch_size=4, num_workers=workers)

    full = list(make())
    loader = make()
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(got + list(resumed), full)


def test_state_before_any_iteration_and_unchanged_after_load() -> None:
    loader = resume_job.make_loader(0)
    state = loader.state_dict()
    assert state["epoch"] == -1 and state["finished"]
    other = resume_job.make_loader(0)
    other.load_state_dict(state)
    assert other.state_dict()["epoch"] == -1  # not yet iterated: the loaded state as is
    assert_same_batches(list(other), list(resume_job.make_loader(0)))


def test_out_of_order_resume_yields_each_remaining_batch_once() -> None:
    def make() -> Any:
        return resume_job.make_loader(2, in_order=False)

    want = _epochs(make(), 2)
    got = _resumed_run(make, 2, 0, 5)

    def keys(batches: list[Any]) -> list[tuple[float, ...]]:
        return sorted(tuple(b[:, 0].tolist()) for b in batches)

    n = BATCHES_PER_EPOCH
    assert keys(got[:n]) == keys(want[:n]) and keys(got[n:]) == keys(want[n:])


def test_resume_without_a_generator_uses_the_saved_global_state() -> None:
    def make() -> Any:
        return steadyload.DataLoader(MapDS(30, "int"), batch_size=4, shuffle=True)

    torch.manual_seed(7)
    loader = make()
    it = iter(loader)
    before = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    torch.manual_seed(12345)
    caller = torch.get_rng_state()
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(before + list(resumed), before + rest)
    # The replayed shuffle drew from the saved state, and the resumed iterator's base seed
    # is the saved one: the caller's global RNG is untouched, as in the uninterrupted run
    # (which drew its base seed before the save), so the epochs after it are the same.
    assert torch.equal(torch.get_rng_state(), caller), "the caller's global RNG was changed"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_later_epochs_match_without_a_generator_once_the_caller_restores_its_rng(
    num_workers: int,
) -> None:
    def make() -> Any:
        # sample_seeds: worker-side draws follow (base seed, epoch, index), not which worker
        # loaded what before (docs/design/resume.md).
        return steadyload.DataLoader(MapDS(24, "random"), batch_size=4, shuffle=True,
                                     num_workers=num_workers, sample_seeds=True)

    torch.manual_seed(3)
    loader = make()
    it = iter(loader)
    before = [next(it) for _ in range(2)]
    # One checkpoint: the loader's state and the caller's RNGs (in-process samples draw
    # from those).
    state, rngs = loader.state_dict(), (torch.get_rng_state(), random.getstate(),
                                        np.random.get_state())
    want = list(it) + list(loader)  # the rest of the epoch, then the next epoch
    torch.set_rng_state(rngs[0])  # a fresh run restores all of it
    random.setstate(rngs[1])
    np.random.set_state(rngs[2])
    resumed = make()
    resumed.load_state_dict(state)
    got = list(resumed) + list(resumed)
    assert len(before) == 2
    assert_same_batches(got, want)


def test_state_is_small_and_plain() -> None:
    loader = steadyload.DataLoader(MapDS(1_000_000, "int"), batch_size=8, shuffle=True)
    it = iter(loader)
    for _ in range(1000):
        next(it)
    state = loader.state_dict()
    assert state["version"] == 3 and state["batches_yielded"] == 1000
    # Generator states (5 kB each) and a few numbers; no per-sample lists.
    assert len(pickle.dumps(state)) < 20_000
    assert _through_torch_save(state)["batches_yielded"] == 1000


class _Opaque(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(random.sample(range(self.n), self.n))

    def __len__(self) -> int:
        return self.n


class _Stateful(_Opaque):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.seed = 0

    def __iter__(self) -> Any:
        self.seed += 1
        return iter(random.Random(self.seed).sample(range(self.n), self.n))

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = state["seed"]


def test_a_sampler_without_state_dict_is_refused_with_the_fix() -> None:
    loader = steadyload.DataLoader(MapDS(10, "int"), sampler=_Opaque(10))
    next(iter(loader))
    with pytest.raises(ValueError, match=r"(?s)sampler is a .*_Opaque.*Fix: add state_dict"):
        loader.state_dict()


def test_a_sampler_with_state_dict_is_saved_through_it() -> None:
    def make() -> Any:
        return steadyload.DataLoader(MapDS(20, "int"), batch_size=3, sampler=_Stateful(20))

    assert_same_batches(_resumed_run(make, 3, 1, 4), _epochs(make(), 3))


def test_distributed_sampler_position_and_epoch() -> None:
    def make() -> Any:
        sampler = DistributedSampler(MapDS(40, "int"), num_replicas=2, rank=1, seed=5)
        sampler.set_epoch(3)
        return steadyload.DataLoader(MapDS(40, "int"), batch_size=4, sampler=sampler,
                                     num_workers=2)  # fmt: skip

    assert_same_batches(_resumed_run(make, 1, 0, 2), list(make()))


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_iterable_dataset_resumes_per_worker(tmp_path: Path, workers: int) -> None:
    def make() -> Any:
        return steadyload.DataLoader(StatefulStream(23, -1, str(tmp_path)), batch_size=3,
                                     num_workers=workers)  # fmt: skip

    assert_same_batches(_resumed_run(make, 1, 0, 3), list(make()))


def test_iterable_dataset_resume_needs_the_same_num_workers(tmp_path: Path) -> None:
    loader = steadyload.DataLoader(StatefulStream(23, -1, str(tmp_path)), batch_size=3,
                                   num_workers=2)  # fmt: skip
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    other = steadyload.DataLoader(StatefulStream(23, -1, str(tmp_path)), batch_size=3)
    with pytest.raises(ValueError, match=r"(?s)num_workers=2.*Fix: resume with num_workers=2"):
        other.load_state_dict(state)


def test_persistence_mismatch_warns_that_later_epochs_differ() -> None:
    loader = resume_job.make_loader(2, persistent=True)
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    state = loader.state_dict()
    rest = list(it)
    in_process = resume_job.make_loader(0)
    with pytest.warns(UserWarning, match="later epochs will differ"):
        in_process.load_state_dict(state)
    assert_same_batches(first + list(in_process), first + rest)  # this epoch still matches


def test_bad_states_are_refused_with_what_to_do() -> None:
    loader = resume_job.make_loader(0)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="expects the dict that steadyload.DataLoader"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="version 99"):
        loader.load_state_dict({**state, "version": 99})
    shorter = steadyload.DataLoader(MapDS(10), batch_size=resume_job.BATCH)
    with pytest.raises(ValueError, match=r"(?s)dataset_len=50, this one has 10.*same dataset"):
        shorter.load_state_dict(state)


@pytest.mark.parametrize("workers", [1, 2])
def test_sample_seeds_make_random_values_independent_of_workers(workers: int) -> None:
    def make(n: int) -> Any:
        return steadyload.DataLoader(
            resume_job.Augmented(), batch_size=4, num_workers=n, sample_seeds=True,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip

    assert_same_batches(list(make(workers)), list(make(0)))
    caller = torch.get_rng_state()
    list(make(0))
    assert torch.equal(torch.get_rng_state(), caller), "in-process loading changed the RNG"


def test_sample_seeds_differ_per_epoch_and_sample() -> None:
    loader = steadyload.DataLoader(resume_job.Augmented(8), batch_size=8, sample_seeds=True)
    first, second = next(iter(loader)), next(iter(loader))
    assert len(set(first[:, 1].tolist())) == 8  # no two samples share their draw
    assert not torch.equal(first[:, 1:], second[:, 1:])  # nor two epochs


def test_load_into_a_loader_with_live_persistent_workers() -> None:
    full = _epochs(resume_job.make_loader(2, persistent=True), 2)
    loader = resume_job.make_loader(2, persistent=True)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    list(it)
    list(loader)  # the same loader goes on to another epoch, then is rewound
    loader.load_state_dict(state)
    assert_same_batches(first + [b for _ in range(2) for b in loader], full)
