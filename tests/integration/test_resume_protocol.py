"""Resume as torchdata's StatefulDataLoader users expect it (issue #23): the Stateful
protocol on iterators, a stream's state at the end of an epoch, Stateful map-style
datasets, JSON-able states and torchdata's constructor keyword. Real worker processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import steadyload
from tests.compare import assert_same_batches
from tests.datasets import BadItemStream
from tests.stateful_datasets import (
    CountsIters,
    CountsPasses,
    DrawsGlobally,
    IteratorKeepsOrder,
    IteratorKeepsPosition,
    OwnGenerator,
    Stateless,
)


def _first(loader: Any, n: int) -> tuple[list[Any], dict[str, Any]]:
    """``n`` batches, then ``break`` and save: the everyday pattern."""
    got = []
    for batch in loader:
        got.append(batch)
        if len(got) == n:
            break
    return got, loader.state_dict()


def _epochs(loader: Any, n: int) -> list[Any]:
    return [batch for _ in range(n) for batch in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_whose_iterator_is_stateful_resumes(workers: int) -> None:
    def make() -> Any:
        return steadyload.DataLoader(IteratorKeepsPosition(40), batch_size=3, num_workers=workers)

    full = list(make())
    got, state = _first(make(), 5)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(got + list(resumed), full)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_replica_runs_iter_once(workers: int) -> None:
    # The position reaches each worker before its first iter(dataset): a stream that opens
    # its files (or a connection) in __iter__ does it once, as without a resume.
    def make() -> Any:
        return steadyload.DataLoader(CountsIters(40), batch_size=3, num_workers=workers)

    full = list(make())
    got, state = _first(make(), 4)
    resumed = make()
    resumed.load_state_dict(state)
    got.append(next(iter(resumed)))
    calls = [w["dataset"]["iters"] for w in resumed.state_dict()["dataset_states"]["workers"]
             if w is not None]  # fmt: skip
    assert calls and set(calls) == {1}
    assert_same_batches(got, full[: len(got)])


@pytest.mark.filterwarnings("ignore::UserWarning")  # the skipped rows are logged
def test_a_batch_whose_items_were_all_skipped_carries_its_position() -> None:
    # Worker 0's second batch (rows 4 and 6) is all bad: it is yielded empty. Saved right
    # after it, the resume goes on after those rows, not before (which would yield it again).
    def make() -> Any:
        return steadyload.DataLoader(BadItemStream(16, {4, 6}, state="past"), batch_size=2,
                                     num_workers=2, on_error="skip")  # fmt: skip

    full = list(make())
    got, state = _first(make(), 3)
    assert [len(b) for b in got] == [2, 2, 0]  # rows 0,2 | 1,3 | (4, 6 skipped)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(got + list(resumed), full)


@pytest.mark.timeout(120)
def test_a_killed_worker_resumes_its_stateful_iterator(tmp_path: Path) -> None:
    # The position comes with each batch from the iterator __iter__ returned, so a
    # replacement (same worker id) goes on after the dead worker's last batch.
    full = list(steadyload.DataLoader(IteratorKeepsPosition(60), batch_size=4, num_workers=2))
    loader = steadyload.DataLoader(
        IteratorKeepsPosition(60, kill_at=37, marker_dir=str(tmp_path)), batch_size=4,
        num_workers=2,
    )  # fmt: skip
    assert_same_batches(list(loader), full)
    assert (tmp_path / "killed").exists()
    assert len(loader.report().restarts) == 1


@pytest.mark.parametrize("batch_size", [4, None], ids=["batched", "unbatched"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_whose_iterator_is_stateful_resumes(workers: int, batch_size: int | None) -> None:
    # The order comes from Python's random when the iterator is made: only its saved state
    # (at the start of the epoch, then the yielded batches skipped) gives it back.
    def make() -> Any:
        return steadyload.DataLoader(
            DrawsGlobally(30), batch_size=batch_size, sampler=IteratorKeepsOrder(30),
            num_workers=workers, sample_seeds=True,
        )  # fmt: skip

    loader = make()
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert_same_batches(got + list(resumed), got + rest)


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True)],
                         ids=["in-process", "persistent"])  # fmt: skip
def test_a_streams_state_at_the_end_of_an_epoch_is_kept(workers: int, persistent: bool) -> None:
    # The pass counter lives on in the dataset object (in-process) or the worker's replica
    # (persistent workers): a state saved after the epoch ended carries it.
    def make() -> Any:
        return steadyload.DataLoader(CountsPasses(12), batch_size=None, num_workers=workers,
                                     persistent_workers=persistent)  # fmt: skip

    loader = make()
    first = list(loader)
    state = loader.state_dict()
    later = _epochs(loader, 2)
    assert {int(b[1]) for b in later[: len(first)]} == {1}  # the second pass
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(_epochs(resumed, 2), later)
    del loader, resumed


def test_without_persistent_workers_each_epoch_starts_from_a_fresh_copy() -> None:
    # As in the uninterrupted run: fresh workers take fresh copies of the dataset, whose
    # counter is 0 every epoch; a resume must not carry the workers' counters over.
    def make() -> Any:
        return steadyload.DataLoader(CountsPasses(12), batch_size=None, num_workers=2)

    loader = make()
    list(loader)
    state = loader.state_dict()
    later = list(loader)
    assert {int(b[1]) for b in later} == {0}
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), later)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_next_epoch_after_an_end_of_epoch_state_with_a_generator(persistent: bool) -> None:
    # torchdata's suite: 3 workers, shuffle with a generator, a dataset drawing from its own
    # Stateful generator; persistent workers carry theirs across epochs.
    gen = torch.Generator()

    def make() -> Any:
        gen.manual_seed(15)
        return steadyload.DataLoader(
            OwnGenerator(40), batch_size=4, shuffle=True, generator=gen, num_workers=3,
            persistent_workers=persistent,
        )  # fmt: skip

    loader = make()
    list(loader)
    state = loader.state_dict()
    want = _epochs(loader, 2)
    resumed = make()  # (its generator reseeded: the state puts it back)
    resumed.load_state_dict(state)
    assert_same_batches(_epochs(resumed, 2), want)
    del loader, resumed


@pytest.mark.parametrize("when", ["before-first-epoch", "between-epochs"])
@pytest.mark.parametrize("workers", [0, 2])
def test_without_a_generator_the_next_epoch_needs_no_rng_restore(when: str, workers: int) -> None:
    # Without generator=, the base seed and the shuffle come from torch's global generator:
    # a state saved between epochs (or before the first) holds it, and the resumed loader
    # draws from it, whatever the global state of the new process is.
    def make() -> Any:
        return steadyload.DataLoader(DrawsGlobally(24), batch_size=4, shuffle=True,
                                     num_workers=workers)  # fmt: skip

    torch.manual_seed(3)
    loader = make()
    if when == "between-epochs":
        list(loader)
    state = loader.state_dict()
    want = _epochs(loader, 2)
    torch.manual_seed(12345)  # another process
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(_epochs(resumed, 2), want)


@pytest.mark.parametrize(
    ("workers", "persistent", "kind"),
    [(0, False, "process"), (2, False, "process"), (2, True, "process"), (2, False, "thread")],
    ids=["in-process", "workers", "persistent", "threads"],
)
def test_a_stateful_map_style_dataset_is_saved_per_worker(
    workers: int, persistent: bool, kind: str
) -> None:
    # Each worker's replica draws from its own generator (threads too: one replica each):
    # its state after the worker's last yielded batch is saved and given back to the same
    # worker id.
    def make() -> Any:
        return steadyload.DataLoader(
            OwnGenerator(30), batch_size=3, shuffle=True, num_workers=workers,
            generator=torch.Generator().manual_seed(5), persistent_workers=persistent,
            worker_type=kind,
        )  # fmt: skip

    full = _epochs(make(), 2)
    got, state = _first(make(), 4)
    assert len(state["dataset_states"]["workers"]) == max(workers, 1)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(got + _epochs(resumed, 2), full)
    del resumed


def test_auto_starts_a_dataset_with_its_own_state_on_processes() -> None:
    loader = steadyload.DataLoader(OwnGenerator(12), batch_size=3, num_workers=2,
                                   worker_type="auto")  # fmt: skip
    list(loader)
    report = loader.report()
    assert report.worker_kind == "process"
    assert "keeps its own state" in (report.worker_type_choice or "")


def test_persistent_workers_carry_a_replicas_state_into_the_next_epoch() -> None:
    # Epoch 1 saved after one batch (worker 0's): worker 1 has not yielded in it, and its
    # replica's pass counter is 1 from the end of epoch 0; the resume must keep that.
    def make() -> Any:
        return steadyload.DataLoader(CountsPasses(12), batch_size=None, num_workers=2,
                                     persistent_workers=True)  # fmt: skip

    want = _epochs(make(), 2)[12:]
    loader = make()
    list(loader)
    got, state = _first(loader, 1)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(got + list(resumed), want)
    assert {int(b[1]) for b in want} == {1}
    del loader, resumed


def test_a_stateful_map_style_dataset_needs_the_same_num_workers() -> None:
    _, state = _first(steadyload.DataLoader(OwnGenerator(30), batch_size=3, num_workers=2), 2)
    other = steadyload.DataLoader(OwnGenerator(30), batch_size=3, num_workers=0)
    with pytest.raises(ValueError, match=r"(?s)per worker.*num_workers=2.*resume with"):
        other.load_state_dict(state)


def test_the_state_is_json_and_resumes_after_a_round_trip() -> None:
    def make() -> Any:
        return steadyload.DataLoader(CountsPasses(20), batch_size=3, num_workers=2)

    full = list(make())
    got, state = _first(make(), 3)
    text = json.dumps(state)  # generator states as text, stream positions as plain objects
    resumed = make()
    resumed.load_state_dict(json.loads(text))
    assert_same_batches(got + list(resumed), full)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateless_stream_saves_only_before_its_first_batch(workers: int) -> None:
    def make() -> Any:
        return steadyload.DataLoader(Stateless(20), batch_size=3, num_workers=workers)

    loader = make()
    it = iter(loader)
    state = loader.state_dict()  # nothing read for the caller yet: the epoch starts afresh
    want = list(it)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), want)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match=r"(?s)neither the IterableDataset nor the iterator.*Fix"):
        loader.state_dict()


def test_torchdatas_snapshot_keyword_is_accepted_and_checked() -> None:
    loader = steadyload.DataLoader(IteratorKeepsPosition(10), snapshot_every_n_steps=5)
    assert loader.snapshot_every_n_steps == 5
    twin = steadyload.DataLoader.from_loader(loader)
    assert twin.snapshot_every_n_steps == 5
    for bad in (-1, 1.5, "5", True):
        with pytest.raises(ValueError, match="snapshot_every_n_steps must be an int >= 0"):
            steadyload.DataLoader(IteratorKeepsPosition(10), snapshot_every_n_steps=bad)
