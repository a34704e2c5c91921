"""Ray Train: steadyload.integrations.ray.prepare_data_loader keeps steadyload's loader.

The 2-worker Ray Train run (tests/frameworks/ray_job.py) runs in a subprocess with a
deadline: Ray's own processes (GCS, raylet, actors) are not this test's children to clean
up. The sharding and the wrapper's position are also tested here without a cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    WeightedRandomSampler,
)

import steadyload as sl
from steadyload.integrations.ray import _expose, _sharded
from tests.frameworks import ray_job
from tests.frameworks.samples import PidSquares

ROOT = Path(__file__).resolve().parents[2]


def _init_fn(worker_id: int) -> None:
    pass


def _collate(rows: list[dict[str, Any]]) -> list[int]:
    return [int(r["i"]) for r in rows]


def _loader(**kwargs: Any) -> sl.DataLoader[Any]:
    args: dict[str, Any] = dict(
        batch_size=4, shuffle=True, num_workers=2, collate_fn=_collate, timeout=30.0,
        worker_init_fn=_init_fn, generator=torch.Generator().manual_seed(3),
        prefetch_factor=3, persistent_workers=True, in_order=False, drop_last=True,
        on_error="skip", max_restarts=7, hang_timeout=20.0, max_worker_memory="3GiB",
        sample_seeds=True, start_method="forkserver",
    )  # fmt: skip
    args.update(kwargs)
    return sl.DataLoader(PidSquares(30), **args)


def _expected_shard(n: int, rank: int, shuffle: bool, batch: int, drop_last: bool) -> list[list[int]]:
    order = list(DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=shuffle))
    return list(BatchSampler(order, batch, drop_last))


@pytest.mark.parametrize("rank", [0, 1])
def test_sharding_keeps_every_argument_and_option(rank: int) -> None:
    loader = _loader()
    sharded = _sharded(loader, rank, 2)
    assert type(sharded) is sl.DataLoader and sharded is not loader
    sampler = sharded.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed) == (2, rank, True, 0)
    for name in ("num_workers", "collate_fn", "timeout", "worker_init_fn", "generator",
                 "prefetch_factor", "persistent_workers", "in_order", "pin_memory",
                 "multiprocessing_context", "batch_size", "drop_last", "dataset",
                 "start_method", "max_restarts", "on_error", "hang_timeout",
                 "max_worker_memory", "sample_seeds"):  # fmt: skip
        assert getattr(sharded, name) == getattr(loader, name), name
    assert list(sharded.batch_sampler) == _expected_shard(30, rank, True, 4, True)


def test_an_unshuffled_loader_stays_in_order_and_a_sharded_one_is_kept() -> None:
    sharded = _sharded(_loader(shuffle=False, drop_last=False), 1, 2)
    assert list(sharded.batch_sampler) == _expected_shard(30, 1, False, 4, False)
    already = _loader(shuffle=None, sampler=DistributedSampler(range(30), 2, 0))
    assert _sharded(already, 0, 2) is already
    # A batch_sampler=BatchSampler(...) of the user's: its sampler is replaced inside.
    own = _loader(shuffle=None, batch_size=1, drop_last=False,
                  batch_sampler=BatchSampler(RandomSampler(range(30)), 5, drop_last=False))  # fmt: skip
    assert list(_sharded(own, 0, 2).batch_sampler) == _expected_shard(30, 0, True, 5, False)
    own = _loader(shuffle=None, batch_size=1, drop_last=False,
                  batch_sampler=BatchSampler(range(30), 5, drop_last=True))  # fmt: skip
    assert list(_sharded(own, 1, 2).batch_sampler) == _expected_shard(30, 1, False, 5, True)


def test_a_custom_batch_sampler_cannot_be_sharded() -> None:
    class Buckets(BatchSampler):
        pass

    loader = _loader(shuffle=None, batch_size=1, drop_last=False,
                     batch_sampler=Buckets(range(30), 5, drop_last=False))  # fmt: skip
    with pytest.raises(ValueError, match=r"cannot shard a loader whose batch_sampler is a tests\.frameworks\.test_ray\..*Buckets: .*\nFix: make the batch sampler yield only this rank's batches .* pass add_dist_sampler=False\."):
        _sharded(loader, 0, 2)


def test_a_custom_sampler_is_replaced_as_ray_does_and_said_once() -> None:
    weighted = WeightedRandomSampler([1.0] * 30, 30)
    with pytest.warns(UserWarning, match=r"replaces the loader's WeightedRandomSampler with a DistributedSampler.*Fix: .*add_dist_sampler=False"):
        sharded = _sharded(_loader(shuffle=None, sampler=weighted), 0, 2)
    assert isinstance(sharded.sampler, DistributedSampler) and sharded.sampler.shuffle
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sharded(_loader(shuffle=None, sampler=weighted), 1, 2)  # other ranks stay quiet


def test_through_rays_wrapper_report_and_state_dict_count_what_the_loop_received() -> None:
    from ray.train.torch.train_loop_utils import _WrappedDataLoader

    def prepared() -> Any:
        loader = _loader(num_workers=0, prefetch_factor=None, persistent_workers=False,
                         timeout=0)
        wrapper = _WrappedDataLoader(loader, torch.device("cpu"), False)
        _expose(wrapper, loader)
        return wrapper

    wrapper = prepared()
    full = list(wrapper)
    assert len(full) == 7 and wrapper.report().worker_kind == "in-process"
    assert wrapper.state_dict()["finished"]  # an end-of-epoch checkpoint starts the next one
    states = []
    interrupted = prepared()
    for k, _ in enumerate(interrupted, 1):
        states.append(interrupted.state_dict())
        if k == 3:
            break
    # Ray's wrapper has already fetched batch 4; the state is after the 3 the loop has.
    assert [s["batches_yielded"] for s in states] == [1, 2, 3]
    resumed = prepared()
    resumed.load_state_dict(states[-1])
    assert list(resumed) == full[3:]


def test_a_ray_wrapper_that_changed_is_said_so() -> None:
    loader = _loader(num_workers=0, prefetch_factor=None, persistent_workers=False, timeout=0)

    class Wrapper(torch.utils.data.DataLoader):  # type: ignore[type-arg]
        def __init__(self, inner: Any) -> None:
            self.__dict__.update(inner.__dict__)
            self._dataloader = inner

    newer = Wrapper(loader)
    with pytest.warns(UserWarning, match=r"wrapper has changed \(no _prefetch_next_batch or next_batch\): its state_dict\(\) may count one batch more .* Fix: for an exact state_dict\(\), pass move_to_device=False"):
        _expose(newer, loader)
    assert newer.state_dict == loader.state_dict and newer.report == loader.report  # bound
    with pytest.warns(UserWarning, match=r"did not wrap the steadyload loader but returned a .*Wrapper: this Ray version may load batches without steadyload"):
        _expose(Wrapper(_loader(num_workers=0, timeout=0, prefetch_factor=None,
                                persistent_workers=False)), loader)  # fmt: skip


def _ray_job(out: Path, *mode: str) -> dict[str, Any]:
    """Run tests/frameworks/ray_job.py (Ray on loopback only, checked by the callers) and
    return the outcome line it prints; kill whatever Ray left in its session."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.frameworks.ray_job", str(out), *mode], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever Ray left in the session
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    return json.loads(stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_train_two_workers_keep_steadyload_through_a_killed_worker(tmp_path: Path) -> None:
    outcome = _ray_job(tmp_path)
    assert outcome["error"] is None, outcome
    assert outcome["node_addresses"] == ["127.0.0.1"], outcome  # never the routable address
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    shards = []
    for rank, info in enumerate(ranks):
        assert "error" not in info, info.get("error")
        # Ray's own prepare_data_loader rebuilds as torch's: steadyload says so, with the fix.
        assert info["ray_own_inner"] == "torch.utils.data.dataloader"
        [warning] = info["ray_own_warnings"]
        assert warning.startswith("steadyload: Ray Train's with_sampler (ray.train.torch.prepare_data_loader) is rebuilding this steadyload.DataLoader as torch's DataLoader")
        assert "Fix: use `steadyload.integrations.ray.prepare_data_loader(loader)`" in warning
        clean, killed = info["clean"], info["killed"]
        for run in (clean, killed):
            assert run["wrapper"] == "ray.train.torch.train_loop_utils._WrappedDataLoader"
            assert run["inner"] == "steadyload.DataLoader"
            assert run["sampler"] == "DistributedSampler"
            assert run["prefetch_factor"] == 3  # Ray's rebuild drops it
            assert run["options"] == ray_job.OPTIONS
            assert run["ppids"] == [info["forkserver_pid"]]  # steadyload's workers, in the actor
            assert run["start_method"] == "forkserver"
            assert run["warnings"] == []  # steadyload's own path: nothing to say
            assert run["state_batches_yielded"] == ray_job.KILL_AFTER  # not one ahead
        assert clean["batches"] == _expected_shard(ray_job.N, rank, True, ray_job.BATCH, False)
        assert clean["restarts"] == []
        assert killed["batches"] == clean["batches"]  # the same batches, in the same order
        [(worker_id, cause, rerun)] = killed["restarts"]
        assert (worker_id, cause) == (0, "killed by SIGKILL") and rerun > 0
        shards.append({i for b in clean["batches"] for i in b})
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(ray_job.N))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_train_ranks_place_their_loader_workers_as_actors(tmp_path: Path) -> None:
    outcome = _ray_job(tmp_path, "remote")
    assert outcome["error"] is None and outcome["node_addresses"] == ["127.0.0.1"], outcome
    for rank in (0, 1):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in info, info.get("error")
        assert info["batches"] == _expected_shard(ray_job.N, rank, True, ray_job.BATCH, False)
        assert "resources={'cpu_pool': 1}" in info["remote_workers"]
        assert info["sampler"] == "DistributedSampler"
        assert all(info["nodes"]) and len(info["nodes"]) == 2  # both workers are actors
        assert info["actor_pid"] not in info["pids"]
