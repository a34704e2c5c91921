"""The device stage (``device=``, ``device_prefetch``, ``device_transform``, pinning off the
training thread) on a CPU-only machine: ``device="cpu"`` runs the same stage with nothing
to copy, and `tests.device_fakes.LazyDevice` stands in for a GPU whose copies land later,
to check the pinned pool's reuse. The GPU itself: tests/gpu/test_device_gpu.py.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import steadyload as sl
from steadyload.device import pinned, target
from tests.datasets import MapDS
from tests.device_fakes import LazyDevice

pytestmark = pytest.mark.timeout(120)

KINDS = {
    "in-process": {"num_workers": 0},
    "process": {"num_workers": 2},
    "thread": {"num_workers": 2, "worker_type": "thread"},
    "auto": {"num_workers": 2, "worker_type": "auto"},
}


def _plain(n: int, batch_size: int = 4) -> list[torch.Tensor]:
    return list(torch.utils.data.DataLoader(MapDS(n), batch_size=batch_size))


@pytest.fixture
def lazy_gpu(monkeypatch: pytest.MonkeyPatch) -> LazyDevice:
    """``device="cuda"`` is this fake device (copies that land later: device_fakes.py)."""
    device = LazyDevice()
    monkeypatch.setattr(target, "BACKEND_FOR_TESTS", lambda _: device)
    return device


@pytest.mark.parametrize("kind", KINDS)
def test_device_cpu_yields_torchs_batches_through_the_transform(kind: str) -> None:
    loader = sl.DataLoader(
        MapDS(40), batch_size=4, device="cpu", device_transform=lambda b: b * 2, **KINDS[kind]
    )
    for _ in range(2):  # the stage ends with the epoch and starts again with the next
        got = list(loader)
        assert len(got) == 10
        assert all(torch.equal(a, b * 2) for a, b in zip(got, _plain(40), strict=True))
    stage = loader.report().device
    assert stage is not None and stage.batches == 10 and stage.device == "cpu", stage
    assert "device stage (cpu, 2 ahead): 10 batches" in str(loader.report())


def test_batches_on_their_way_are_not_consumed_by_state_dict() -> None:
    """``state_dict()`` counts only what was yielded: a resume yields the batches that were
    on their way to the device when the state was taken, and nothing twice."""
    expected = _plain(64)
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": 2, "device": "cpu"}
    loader = sl.DataLoader(MapDS(64), device_prefetch=3, **kwargs)
    it = iter(loader)
    got = [next(it) for _ in range(5)]
    time.sleep(0.5)  # every worker's batches arrive: the next call takes 3 ahead
    got.append(next(it))
    assert len(it._feed._ahead) == 3  # type: ignore[attr-defined]  # on their way
    state = loader.state_dict()
    resumed = sl.DataLoader(MapDS(64), **kwargs)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b.tolist() for b in got + rest] == [b.tolist() for b in expected]
    assert [b.tolist() for b in it] == [b.tolist() for b in expected[6:]]  # and it goes on


@dataclasses.dataclass(frozen=True)
class Frame:
    pixels: torch.Tensor
    caption: str


Pair = collections.namedtuple("Pair", ["a", "b"])


class Nested(Dataset[Any]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return i


def nested_collate(indices: list[int]) -> Any:
    from transformers import BatchEncoding

    t = torch.tensor(indices, dtype=torch.float32)
    return {
        "list": [t, t + 1],
        "tuple": (t + 2, "text"),
        "pair": Pair(t + 3, 7),
        "frame": Frame(t + 4, "a caption"),
        "encoding": BatchEncoding({"input_ids": t.long(), "mask": t > 1}),
        "lengths": sl.on_host(t + 5),
        "names": [f"s{i}" for i in indices],
    }


def test_any_batch_structure_moves_and_marked_tensors_stay(lazy_gpu: LazyDevice) -> None:
    """Tensors in dicts, lists, tuples, namedtuples, dataclasses and BatchEncoding are
    copied (from pinned buffers); other leaves are left alone, and an `on_host` value is
    yielded unwrapped and not copied."""
    from transformers import BatchEncoding

    loader = sl.DataLoader(
        Nested(), batch_size=4, num_workers=2, collate_fn=nested_collate, device="cuda"
    )
    batches = list(loader)
    lazy_gpu.flush()
    for k, b in enumerate(batches):
        t = torch.arange(4 * k, 4 * k + 4, dtype=torch.float32)
        assert [x.tolist() for x in b["list"]] == [t.tolist(), (t + 1).tolist()]
        assert b["tuple"][0].tolist() == (t + 2).tolist() and b["tuple"][1] == "text"
        assert isinstance(b["pair"], Pair) and b["pair"].a.tolist() == (t + 3).tolist()
        assert isinstance(b["frame"], Frame) and b["frame"].pixels.tolist() == (t + 4).tolist()
        assert b["frame"].caption == "a caption"
        assert isinstance(b["encoding"], BatchEncoding)
        assert b["encoding"]["input_ids"].tolist() == t.long().tolist()
        assert b["encoding"]["mask"].tolist() == (t > 1).tolist()
        assert isinstance(b["lengths"], torch.Tensor) and b["lengths"].tolist() == (t + 5).tolist()
        assert b["names"] == [f"s{i}" for i in range(4 * k, 4 * k + 4)]
    # Every tensor was copied from a pinned buffer but the one kept on the host, and each
    # copy is marked used on the loop's stream.
    made = {id(t) for t in lazy_gpu.made}
    assert all(id(b["lengths"]) not in made and id(b["list"][0]) in made for b in batches)
    assert len(lazy_gpu.made) == 3 * 7 and made <= {id(t) for t, _ in lazy_gpu.kept}
    stage = loader.report().device
    assert stage is not None and stage.pinned_allocations >= 1 and stage.batches == 3


def test_copies_from_reused_pinned_buffers_land_whole(lazy_gpu: LazyDevice) -> None:
    """A pinned buffer goes back to the pool only with its copy's event, and is reused only
    once that is done: with copies that land late, every batch still arrives whole. The
    cap is 3 buffers: the stage waits for the oldest copy instead of pinning more."""
    loader = sl.DataLoader(
        MapDS(160), batch_size=4, num_workers=2, device="cuda", pinned_memory_limit="3MiB"
    )
    batches = list(loader)
    lazy_gpu.flush()
    assert [b.tolist() for b in batches] == [b.tolist() for b in _plain(160)]
    stage = loader.report().device
    assert stage is not None
    assert stage.pinned_allocations <= 3 and stage.pinned_peak_bytes <= 3 << 20, stage
    assert stage.pinned_reuses == 40 - stage.pinned_allocations, stage
    assert stage.pool_waits > 0 and lazy_gpu.synchronized > 0, stage
    assert lazy_gpu.pinned_made == [1 << 20] * stage.pinned_allocations


def test_the_reuse_check_catches_a_pool_that_reuses_early(
    lazy_gpu: LazyDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above has teeth: a pool that frees a buffer before its copy's event is done
    corrupts earlier batches, and the comparison sees it."""

    def free_at_once(self: pinned.PinnedPool) -> None:
        while self._busy:
            self._free.append(self._busy.popleft()[0])

    monkeypatch.setattr(pinned.PinnedPool, "_collect_done", free_at_once)
    loader = sl.DataLoader(
        MapDS(160), batch_size=4, num_workers=2, device="cuda", pinned_memory_limit="3MiB"
    )
    batches = list(loader)
    lazy_gpu.flush()
    assert [b.tolist() for b in batches] != [b.tolist() for b in _plain(160)]


def test_a_batch_bigger_than_the_cap_is_copied_unpinned_and_counted(lazy_gpu: LazyDevice) -> None:
    loader = sl.DataLoader(
        MapDS(8), batch_size=4, device="cuda", pinned_memory_limit=1000, device_prefetch=0
    )
    assert [b.tolist() for b in loader] == [b.tolist() for b in _plain(8)]
    stage = loader.report().device
    assert stage is not None and stage.unpinned_batches == 2 and stage.pinned_allocations == 0
    assert "2 too big: unpinned" in str(stage)


def _fails_on_batch_2(batch: torch.Tensor) -> torch.Tensor:
    if int(batch[0, 0]) == 8:
        raise ValueError("bad pixel values")
    return batch + 100


def test_a_device_transform_error_names_the_batch_and_its_samples() -> None:
    loader = sl.DataLoader(
        MapDS(16), batch_size=4, num_workers=2, device="cpu", device_transform=_fails_on_batch_2
    )
    it = iter(loader)
    assert next(it).tolist() == (_plain(16)[0] + 100).tolist()
    next(it)
    with pytest.raises(ValueError, match="bad pixel values") as raised:
        next(it)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "raised in device_transform on batch 2 (samples [8, 9, 10, 11])" in notes, notes
    assert "in the training process on cpu" in notes
    assert next(it).tolist() == (_plain(16)[3] + 100).tolist()  # the iterator goes on
    with pytest.raises(StopIteration):
        next(it)


def test_on_error_skip_leaves_out_a_batch_whose_device_transform_raised() -> None:
    loader = sl.DataLoader(
        MapDS(16),
        batch_size=4,
        num_workers=2,
        device="cpu",
        device_transform=_fails_on_batch_2,
        on_error="skip",
    )
    got = list(loader)
    assert len(got) == 4 and got[2].shape == (0, 3)  # the count never changes
    assert [b.tolist() for i, b in enumerate(got) if i != 2] == [
        (b + 100).tolist() for i, b in enumerate(_plain(16)) if i != 2
    ]
    report = loader.report()
    assert [s.index for s in report.skipped] == [8, 9, 10, 11]
    assert report.skipped[0].error_type == "ValueError"
    assert "bad pixel values (in device_transform)" in report.skipped[0].message
    assert report.device is not None and report.device.skipped_batches == 1


def _hangs(batch: torch.Tensor) -> torch.Tensor:
    if int(batch[0, 0]) == 4:
        time.sleep(3)
    return batch


def test_a_hung_device_transform_is_reported_with_its_stack() -> None:
    loader = sl.DataLoader(
        MapDS(8), batch_size=4, device="cpu", device_transform=_hangs, hang_timeout=0.5
    )
    it = iter(loader)
    next(it)
    with pytest.raises(sl.WorkerHangError, match="the device stage spent over 0.5 s") as raised:
        next(it)
    message = str(raised.value)
    assert "batch 1 (samples [4, 5, 6, 7])" in message and "time.sleep(3)" in message
    assert raised.value.sample_indices == [4, 5, 6, 7]
    del it  # the stage's thread ends once the transform returns (the leak check waits)


def test_a_worker_killed_under_the_device_stage_loses_and_repeats_nothing(
    tmp_path: Any,
) -> None:
    from tests.datasets import FaultOnce

    loader = sl.DataLoader(
        FaultOnce(64, {21}, "sigkill", str(tmp_path)), batch_size=4, num_workers=2, device="cpu"
    )
    got = [int(x) for b in loader for x in b]
    assert got == list(range(64))
    assert len(loader.report().restarts) == 1


def test_persistent_workers_drop_what_was_on_its_way_when_an_epoch_is_cut() -> None:
    loader = sl.DataLoader(
        MapDS(40), batch_size=4, num_workers=2, persistent_workers=True, device="cpu"
    )
    it = iter(loader)
    next(it)
    time.sleep(0.3)
    next(it)  # batches now on their way
    assert [b.tolist() for b in loader] == [b.tolist() for b in _plain(40)]  # a new epoch
    assert [b.tolist() for b in loader] == [b.tolist() for b in _plain(40)]
    del it


def test_pin_memory_alone_pins_on_the_stages_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pin_memory=True`` (torch's meaning: pinned host tensors) pins off the training
    thread. This machine has no accelerator to pin for, so the accelerator check and the
    pinning are stand-ins that record the thread."""
    from steadyload.device import mover

    threads: set[str] = set()

    def pin(batch: Any) -> Any:
        threads.add(threading.current_thread().name)
        return batch.clone()

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    monkeypatch.setattr(mover, "pin_memory", pin)
    loader = sl.DataLoader(MapDS(16), batch_size=4, num_workers=2, pin_memory=True)
    assert [b.tolist() for b in loader] == [b.tolist() for b in _plain(16)]
    assert threads == {"steadyload-feed"}
    stage = loader.report().device
    assert stage is not None and stage.device == "cpu (pinned host memory)"


def test_device_arguments_are_checked_when_the_loader_is_built() -> None:
    with pytest.raises(ValueError, match="device='cuda' asks for a GPU, but") as raised:
        sl.DataLoader(MapDS(4), device="cuda")
    assert "Fix: run where a GPU is" in str(raised.value)
    with pytest.raises(ValueError, match="is not a device"):
        sl.DataLoader(MapDS(4), device="gpu0")
    with pytest.raises(ValueError, match="feeds CUDA and ROCm GPUs"):
        sl.DataLoader(MapDS(4), device="meta")
    with pytest.raises(ValueError, match="device_transform runs on the device"):
        sl.DataLoader(MapDS(4), device_transform=lambda b: b)
    with pytest.raises(ValueError, match="device_prefetch must be an int >= 0"):
        sl.DataLoader(MapDS(4), device="cpu", device_prefetch=-1)
    with pytest.raises(TypeError, match="device_transform must be a function"):
        sl.DataLoader(MapDS(4), device="cpu", device_transform=3)
    with pytest.raises(ValueError, match="pinned_memory_limit"):
        sl.DataLoader(MapDS(4), device="cpu", pinned_memory_limit="lots")


def test_cuda_means_this_ranks_gpu_under_torchrun(
    lazy_gpu: LazyDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert target.resolve_device("cuda") == torch.device("cuda", 3)
    assert target.resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert target.resolve_device("cuda") == torch.device("cuda")
    assert target.resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert target.resolve_device(None) is None


def test_the_ledger_records_what_the_device_stage_yielded(tmp_path: Any) -> None:
    """The ledger's lines are the batches handed over, in order, once each; a resume
    with batches still on their way verifies exactly-once."""
    from steadyload.resume.ledger.verify import verify

    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": 2, "device": "cpu"}
    loader = sl.DataLoader(MapDS(48), ledger=str(tmp_path), device_prefetch=3, **kwargs)
    it = iter(loader)
    for _ in range(4):
        next(it)
    time.sleep(0.3)
    next(it)
    state = loader.state_dict()
    del it
    resumed = sl.DataLoader(MapDS(48), ledger=str(tmp_path), **kwargs)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 7
    del resumed
    verdict = verify(tmp_path)
    assert verdict.ok, verdict.text()


def test_a_failed_copy_is_raised_with_where_whatever_on_error_says(
    lazy_gpu: LazyDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``on_error="skip"`` is for the data's errors (the dataset's, device_transform's);
    a copy that fails (the device out of memory) is raised, naming the batch."""

    def out_of_memory(host: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(lazy_gpu, "to_device", out_of_memory)
    loader = sl.DataLoader(MapDS(8), batch_size=4, device="cuda", on_error="skip")
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        next(iter(loader))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "raised in the copy to cpu on batch 0 (samples [0, 1, 2, 3])" in notes, notes
    assert not loader.report().skipped
