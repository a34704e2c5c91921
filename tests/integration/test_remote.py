"""Remote workers (Ray actors) against real Ray: a local cluster of a head and two 1-CPU
nodes, every node on 127.0.0.1, and real faults (SIGKILL of an actor, a removed node, a
lost result object, a hang, a raising sample, a SIGKILLed driver).

One cluster per module (about 9 s to start, 2.3 GiB): the tests share it and run in one
pytest process (``conftest.ONE_PROCESS``). Each test leaves no actor behind (`no_leaks`).
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import steadyload as sl
from steadyload.resume.ledger.files import read_folder
from tests.conftest import processes_gone, wait_until
from tests.remote_datasets import (
    Augmented,
    Big,
    Counted,
    Faulty,
    Hungry,
    Sharded,
    WaitsForTheAdded,
    WithResource,
    collated_where,
    hang_once_in_init,
    held_until_stopped,
    unsendable,
)

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(240)]  # one pytest process (conftest.ONE_PROCESS)
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class Ray:
    """The module's cluster and what the tests ask of it."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.nodes = [cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
                      for _ in range(2)]  # fmt: skip

    def node_of(self, node_id: str) -> Any:
        return next(n for n in self.nodes if n.node_id == node_id)

    def remove(self, node: Any) -> None:
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def restore(self) -> None:
        """Back to two worker nodes after a test removed one."""
        while len(self.nodes) < 2:
            self.nodes.append(self.cluster.add_node(num_cpus=1, object_store_memory=80 << 20))
        self.cluster.wait_for_nodes()

    @staticmethod
    def kill_live_actors() -> None:
        """Kill what a failed test left (its iterators may live on in its traceback)."""
        from ray._private.worker import global_worker

        for a in Ray.live_actors():
            try:
                global_worker.core_worker.kill_actor(ray.ActorID.from_hex(a["ActorID"]), True)
            except Exception:  # it died meanwhile
                pass

    @staticmethod
    def all_cpus_free() -> bool:
        """Whether no actor holds a CPU (every node's CPUs are available)."""
        return ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0)

    @staticmethod
    def live_actors() -> list[dict[str, Any]]:
        from ray._private import state

        return [a for a in state.actors().values()
                if a.get("ActorClassName") == "RemoteWorker" and a.get("State") != "DEAD"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[Ray]:
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in (*LOOPBACK, "PYTHONPATH")}
    os.environ.update(LOOPBACK)  # Ray on loopback only (checked below)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved["PYTHONPATH"]]))
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 << 20})
    try:
        helper = Ray(c)
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        c.wait_for_nodes()
        # Once before the tests: Ray's own connections to every node (descriptors, threads
        # it keeps for the driver's life) are opened then, not counted as a test's leaks.
        list(sl.DataLoader(Augmented(8), batch_size=2, remote_workers=2))
        wait_until(lambda: not helper.live_actors(), 20, what="the warm-up's actors to die")
        yield helper
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ours(proc: psutil.Process) -> bool:
    """A process of this test (a local worker), not one of Ray's node (raylets, their
    workers: the actors are checked through Ray's own state and their pids instead)."""
    try:
        return "ray" not in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if _ours(p)}


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("steadyload")}


@pytest.fixture(autouse=True)
def no_leaks(cluster: Ray) -> Iterator[None]:
    """conftest's leak check, for a process that hosts a Ray driver: Ray keeps connections
    and threads of its own for the driver's life, and a restored node brings new Ray
    processes, so those are left out; what steadyload starts is checked, and every actor
    must be dead (in Ray's state, and its process gone)."""
    children, threads = _children(), _threads()
    yield
    gc.collect()
    try:
        wait_until(lambda: not cluster.live_actors(), 20, what="every remote worker's actor to die")
        from ray._private import state

        actors = state.actors().values()
        pids = [a["Pid"] for a in actors if a.get("ActorClassName") == "RemoteWorker"]
        wait_until(lambda: processes_gone(pids), 20, what="every actor's process to exit")
        wait_until(lambda: not (_threads() - threads), 10, what="steadyload's threads to end")
        wait_until(lambda: not (_children() - children), 10, what="local workers to exit")
    finally:  # a failed test's actors must not hold the CPUs the next tests need
        cluster.kill_live_actors()
        cluster.restore()
        # Ray frees a dead actor's CPU once its raylet has seen the process go: a test that
        # started before would find the cluster smaller than it is.
        wait_until(cluster.all_cpus_free, 30, what="every CPU of the cluster to be free")


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True))


def _indices(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b[0]]


def test_every_node_is_on_loopback(cluster: Ray) -> None:
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addresses == {"127.0.0.1"}


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_local_and_remote_workers_give_torchs_batches(cluster: Ray, tmp_path: Path) -> None:
    ds = Augmented(48)
    expected = list(torch.utils.data.DataLoader(
        ds, batch_size=4, shuffle=True, generator=_gen(), num_workers=3,
        multiprocessing_context="forkserver"))  # fmt: skip
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(), num_workers=1,
                           remote_workers=2, ledger=tmp_path)  # fmt: skip
    assert _same(list(loader), expected)  # torch's order and its workers' random draws
    steps = [s for seg in read_folder(tmp_path) for s in seg.steps]  # the ledger says who
    assert sorted(i for s in steps for i in s["i"]) == list(range(48))
    assert {(s["w"], s["k"]) for s in steps} == {(0, "process"), (1, "remote"), (2, "remote")}
    assert all(s.get("h") for s in steps if s["k"] == "remote")  # the actor's node
    assert not any(s.get("h") for s in steps if s["k"] == "process")
    report = loader.report()
    local, *remote = report.workers
    assert local.node is None and [w.worker_id for w in remote] == [1, 2]
    assert len({w.node for w in remote}) == 2  # SPREAD: one actor per node
    assert all(w.rss_bytes and w.samples == 16 and w.pid for w in remote)
    assert "is remote: Ray node" in str(report)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_stream_is_sharded_over_local_and_remote_workers_as_torch_does(cluster: Ray) -> None:
    expected = list(torch.utils.data.DataLoader(Sharded(30), batch_size=2, num_workers=3,
                                                multiprocessing_context="forkserver"))  # fmt: skip
    got = list(sl.DataLoader(Sharded(30), batch_size=2, num_workers=1, remote_workers=2))
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]


def test_remote_workers_feed_the_device_stage(cluster: Ray) -> None:
    """``device=`` over remote workers: the stage takes what the actors' results brought
    (without waiting on Ray while a batch is there to yield), in torch's order."""
    ds = Augmented(48)
    expected = list(sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(),
                                  num_workers=2, sample_seeds=True))  # fmt: skip
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(), remote_workers=2,
                           sample_seeds=True, device="cpu", device_prefetch=3)  # fmt: skip
    assert _same(list(loader), expected)
    stage = loader.report().device
    assert stage is not None and stage.batches == 12


def test_a_sigkilled_actor_is_replaced_and_its_batches_rerun_once(cluster: Ray, caplog: Any,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    ds = Augmented(48)
    expected = list(sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(),
                                  num_workers=2, sample_seeds=True))  # fmt: skip
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(),
                           remote_workers=2, sample_seeds=True, ledger=tmp_path)  # fmt: skip
    got = []
    with caplog.at_level(logging.WARNING):
        for i, batch in enumerate(it := iter(loader)):
            got.append(batch)
            if i == 2:
                os.kill(it._workers[1].pid, signal.SIGKILL)
    assert _same(got, expected)
    assert sorted(_indices(got)) == list(range(48))  # exactly once
    steps = [s for seg in read_folder(tmp_path) for s in seg.steps]
    assert sorted(i for s in steps for i in s["i"]) == list(range(48))
    rerun = [s for s in steps if s.get("ev")]  # the killed actor's batches, re-run
    assert rerun and all(s["w"] == 1 and s["ev"][0].startswith("re-run:") for s in rerun)
    (restart,) = loader.report().restarts
    assert restart.worker_id == 1 and "Ray worker process died" in restart.cause
    assert "steadyload started a replacement worker 1" in caplog.text


def test_a_lost_node_is_one_event_and_its_workers_move(cluster: Ray, caplog: Any) -> None:
    ds = Augmented(96, sleep_s=0.05)
    expected = list(sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(),
                                  num_workers=2, sample_seeds=True))  # fmt: skip
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(), sample_seeds=True,
                           remote_workers=sl.RemoteWorkers(4, num_cpus=0.25))  # fmt: skip
    got = []
    with caplog.at_level(logging.WARNING):
        for i, batch in enumerate(it := iter(loader)):
            got.append(batch)
            if i == 2:
                pool = it._pool
                lost = pool._actors[0].node_id
                on_it = sorted(w for w, a in pool._actors.items() if a.node_id == lost)
                cluster.remove(cluster.node_of(lost))
    assert _same(got, expected) and sorted(_indices(got)) == list(range(96))
    (restart,) = loader.report().restarts  # one event for the node, not one per worker
    assert restart.worker_id == -1 and f"node {lost[:12]} (127.0.0.1) lost" in restart.cause
    assert len(on_it) == 2 and f"with remote workers {on_it}" in caplog.text
    assert all(w.node is not None and not w.node.startswith(lost[:12])
               for w in loader.report().workers)  # fmt: skip


def test_a_preempted_node_is_named_and_its_worker_moves(cluster: Ray) -> None:
    """The autoscaler's preemption notice (a drain with that reason), then the node goes."""
    from ray.core.generated import autoscaler_pb2

    ds = Augmented(96, sleep_s=0.05)  # long enough for the node's processes to end
    expected = list(sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(),
                                  num_workers=2, sample_seeds=True))  # fmt: skip
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(), sample_seeds=True,
                           remote_workers=sl.RemoteWorkers(2, num_cpus=0.5))  # fmt: skip
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    got = []
    for i, batch in enumerate(it := iter(loader)):
        got.append(batch)
        if i == 2:
            node = it._pool._actors[0].node_id
            gcs = ray._raylet.GcsClient(address=cluster.cluster.address)
            deadline_ms = int(time.time() * 1000) + 1000
            assert gcs.drain_node(node, reason, "spot instance reclaimed", deadline_ms)[0]
            cluster.remove(cluster.node_of(node))
    assert _same(got, expected) and sorted(_indices(got)) == list(range(96))
    (restart,) = loader.report().restarts
    assert restart.worker_id == 0 and restart.cause == f"node {node[:12]} (127.0.0.1) preempted"


def test_an_actor_killed_by_rays_memory_monitor_is_named_and_replaced(
    cluster: Ray, tmp_path: Path,
) -> None:  # fmt: skip
    """A node whose memory monitor acts 3 GiB above what the machine uses now; a sample
    takes 6 GiB there (once)."""
    vm = psutil.virtual_memory()
    threshold = (vm.total - vm.available + (3 << 30)) / vm.total
    tight = {"RAY_memory_usage_threshold": f"{threshold:.4f}",
             "RAY_memory_monitor_refresh_ms": "100"}  # fmt: skip
    os.environ.update(tight)  # read by the node's raylet when it starts
    try:
        node = cluster.cluster.add_node(num_cpus=1, resources={"tight": 1},
                                        object_store_memory=80 << 20)  # fmt: skip
    finally:
        for k in tight:
            os.environ.pop(k)
    try:
        cluster.cluster.wait_for_nodes()
        marker = tmp_path / "ate"
        ds = Hungry(16, at=5, gib=6, marker=str(marker))
        marker.touch()  # torch's batches, without the 6 GiB
        expected = list(sl.DataLoader(ds, batch_size=2, generator=_gen(), num_workers=1,
                                      sample_seeds=True))  # fmt: skip
        marker.unlink()
        loader = sl.DataLoader(ds, batch_size=2, generator=_gen(), sample_seeds=True,
                               remote_workers=sl.RemoteWorkers(1, resources={"tight": 1}))  # fmt: skip
        got = list(loader)
        assert marker.exists() and _same(got, expected)
        (restart,) = loader.report().restarts
        assert restart.worker_id == 0 and restart.cause == "killed by Ray's memory monitor"
    finally:
        cluster.cluster.remove_node(node, allow_graceful=False)


def test_a_lost_result_object_is_rerun(cluster: Ray, monkeypatch: Any) -> None:
    """A batch is done and sits in its node's object store; the node goes before this
    process fetched it. (The fetch is held back to reach that moment; the loss is real.)"""
    from steadyload.engine.remote import pool as remote_pool

    armed = threading.Event()
    lost: list[Any] = []

    class HeldFetch:
        """Ray, with worker 1's next fetch held until its node is gone."""

        def __getattr__(self, name: str) -> Any:
            return getattr(ray, name)

        def get(self, ref: Any, *args: Any, **kwargs: Any) -> Any:
            if armed.is_set() and not lost and (
                    threading.current_thread().name == "steadyload-remote-1"):
                lost.append(ref)
                assert ray.wait([ref], fetch_local=False, timeout=60)[0]  # done, not fetched
                cluster.remove(cluster.node_of(node[0]))
            return ray.get(ref, *args, **kwargs)

    node: list[str] = []
    monkeypatch.setattr(remote_pool, "import_ray", lambda: HeldFetch())
    loader = sl.DataLoader(Big(24, sleep_s=0.05), batch_size=2,
                           remote_workers=sl.RemoteWorkers(2, num_cpus=0.25))  # fmt: skip
    got = []
    for i, batch in enumerate(it := iter(loader)):
        got.append(batch)
        if i == 1:
            node.append(it._pool._actors[1].node_id)
            armed.set()
    assert _indices(got) == list(range(24)) and lost
    assert all(torch.equal(b[1][k], torch.full((512, 512), float(b[0][k])))
               for b in got for k in range(len(b[0])))  # fmt: skip
    (restart,) = loader.report().restarts
    assert restart.worker_id == 1 and restart.cause == "its result object was lost"


def test_a_hung_remote_sample_is_killed_with_its_stack_and_rerun(cluster: Ray, tmp_path: Path,
                                                                 caplog: Any) -> None:  # fmt: skip
    marker = tmp_path / "hung"
    ds = Faulty(16, hang=5, marker=str(marker))
    loader = sl.DataLoader(ds, batch_size=2, remote_workers=2, hang_timeout=4.0)
    with caplog.at_level(logging.INFO, logger="steadyload"):
        got = list(loader)
    assert _indices(got) == list(range(16)) and marker.exists()
    (restart,) = loader.report().restarts
    assert "hang_timeout=4.0" in restart.cause
    assert "Remote worker 0 (Ray actor" in caplog.text
    assert "remote_datasets.py" in caplog.text and "time.sleep(600)" in caplog.text


def test_a_remote_worker_hung_in_its_set_up_is_killed_with_its_stack_and_restarted(
    cluster: Ray, tmp_path: Path, caplog: Any,
) -> None:  # fmt: skip
    """hang_timeout counts from when the actor's set-up begins (its imports and Ray's
    placement never count); the restarted worker is seeded as the first was."""
    init = functools.partial(hang_once_in_init, str(tmp_path / "hung"))
    loader = sl.DataLoader(Augmented(8), batch_size=2, generator=_gen(), remote_workers=2,
                           worker_init_fn=init, hang_timeout=4.0)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="steadyload"):
        got = list(loader)
    assert (tmp_path / "hung").exists()
    # torch's batches, from steadyload's local workers (torch's, forked beside the Ray
    # driver's threads, can deadlock)
    expected = list(sl.DataLoader(Augmented(8), batch_size=2, generator=_gen(), num_workers=2,
                                  worker_init_fn=init))  # fmt: skip
    assert _same(got, expected)
    (restart,) = loader.report().restarts
    assert restart.worker_id == 0
    assert "hung in worker_init_fn for more than hang_timeout=4.0 s" in restart.cause
    assert "hang_once_in_init" in caplog.text and "time.sleep(600)" in caplog.text


def _break_connections_to(pid: int) -> int:
    """Shut down this process's TCP connections to ``pid``'s servers (a broken network
    path; the descriptors stay Ray's). Returns how many."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
             if c.status == psutil.CONN_LISTEN}  # fmt: skip
    broken = 0
    for c in psutil.Process().net_connections("tcp"):
        if c.raddr and c.raddr.port in ports and c.fd >= 0:
            with socket.socket(fileno=os.dup(c.fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            broken += 1
    return broken


def test_a_broken_connection_to_a_live_actor_replaces_it_not_its_node(cluster: Ray) -> None:
    ds = Augmented(40, sleep_s=0.05)
    expected = list(sl.DataLoader(ds, batch_size=2, generator=_gen(), num_workers=2,
                                  sample_seeds=True))  # fmt: skip
    loader = sl.DataLoader(ds, batch_size=2, generator=_gen(), remote_workers=2,
                           sample_seeds=True)  # fmt: skip
    got = []
    for i, batch in enumerate(it := iter(loader)):
        got.append(batch)
        if i == 2:
            broken = _break_connections_to(it._workers[0].pid)
            pool, node = it._pool, it._pool._actors[0].node_id
    assert broken and _same(got, expected)
    (restart,) = loader.report().restarts  # one worker, not its node
    assert restart.worker_id == 0 and restart.cause == "its connection broke"
    assert node not in pool._lost_nodes


def test_skip_names_the_remote_sample_and_its_exception(cluster: Ray) -> None:
    loader = sl.DataLoader(Faulty(20, bad=(5, 17)), batch_size=4, remote_workers=2,
                           on_error="skip")  # fmt: skip
    got = list(loader)
    assert _indices(got) == [i for i in range(20) if i not in (5, 17)]
    skipped = sorted((s.index, s.error_type, s.message) for s in loader.report().skipped)
    assert skipped == [(5, "builtins.ValueError", "corrupt sample 5"),
                       (17, "builtins.ValueError", "corrupt sample 17")]  # fmt: skip


def test_a_batch_ray_cannot_send_is_the_batchs_error_not_a_death(cluster: Ray) -> None:
    loader = sl.DataLoader(Augmented(8), batch_size=2, remote_workers=1, collate_fn=unsendable)
    it = iter(loader)
    with pytest.raises(TypeError, match="pickle") as caught:  # as from a local worker
        next(it)
    died = isinstance(caught.value, sl.WorkerDiedError)
    del it, caught  # (the traceback holds the iterator, and the iterator its actor)
    assert not died
    assert not loader.report().restarts  # the actor was fine: not replaced


def test_the_dataset_is_shipped_once_not_once_per_task(cluster: Ray) -> None:
    Counted.pickled = 0
    got = list(sl.DataLoader(Counted(40), batch_size=2, remote_workers=2))  # 20 tasks
    assert len(got) == 20 and Counted.pickled == 1


def test_an_actor_collates_into_plain_memory_not_dev_shm(cluster: Ray) -> None:
    """Ray pickles the batch: a /dev/shm segment per batch (torch's default in a worker)
    would only cost, and an actor killed while torch names one would leave it behind."""
    small = list(sl.DataLoader(Augmented(8), batch_size=4, remote_workers=1,
                               collate_fn=collated_where))  # fmt: skip
    big = list(sl.DataLoader(Big(8), batch_size=8, remote_workers=1,  # 8 MiB: numpy's memory
                             collate_fn=collated_where))  # fmt: skip
    flags = [flag for _, shared in small + big for flag in shared.tolist()]
    assert len(flags) == 3 * 2 and not any(flags)
    assert torch.equal(big[0][0][1][3], torch.full((512, 512), 3.0))


def test_per_worker_resources_are_built_once_per_actor(cluster: Ray) -> None:
    got = list(sl.DataLoader(WithResource(24), batch_size=3, remote_workers=2))
    built: dict[int, set[int]] = {}
    for batch in got:
        for pid, at in batch[1].tolist():
            built.setdefault(pid, set()).add(at)
    assert len(built) == 2 and all(len(times) == 1 for times in built.values())


@pytest.mark.parametrize("resumed", [{"num_workers": 1, "remote_workers": 1}, {"num_workers": 0}],
                         ids=["other-placement", "in-process"])  # fmt: skip
def test_a_remote_state_resumes_elsewhere(cluster: Ray, resumed: dict[str, Any]) -> None:
    ds = Augmented(40)
    args = dict(batch_size=4, shuffle=True, sample_seeds=True)
    whole = list(sl.DataLoader(ds, generator=_gen(), num_workers=2, **args))
    loader = sl.DataLoader(ds, generator=_gen(), remote_workers=2, **args)
    first = []
    for batch in loader:
        first.append(batch)
        if len(first) == 4:
            break
    state = loader.state_dict()
    again = sl.DataLoader(ds, generator=_gen(), **resumed, **args)
    again.load_state_dict(state)
    assert _same(first + list(again), whole)


@pytest.mark.parametrize("how", ["end", "del", "error"])
def test_actors_end_with_the_loader(cluster: Ray, how: str) -> None:
    loader = sl.DataLoader(Faulty(16, bad=(9,) if how == "error" else ()), batch_size=2,
                           remote_workers=2)  # fmt: skip
    it = iter(loader)
    next(it)
    assert len(cluster.live_actors()) == 2
    if how == "end":
        list(it)
    elif how == "error":
        with pytest.raises(ValueError, match="corrupt sample 9"):
            list(it)
    del it  # the test's fixture waits for every actor to be dead


def test_a_loader_built_while_connected_prestarts_its_actors_for_its_first_iterator(
    cluster: Ray,
) -> None:  # fmt: skip
    """Built while connected: its actors start then (placed, torch imported); the first
    iterator takes them and tells each which worker it is: torch's batches exactly."""
    loader = sl.DataLoader(Augmented(16), batch_size=2, generator=_gen(), remote_workers=2)
    wait_until(lambda: len([a for a in cluster.live_actors() if a.get("Pid")]) == 2, 60,
               what="the prestarted actors to start")  # fmt: skip
    prestarted = {h._actor_id.hex() for h in loader._prestarted._handles}
    it = iter(loader)
    got = [next(it)]
    used = {a.handle._actor_id.hex() for a in it._pool._actors.values()}
    got += list(it)
    assert used == prestarted and len(used) == 2
    expected = list(sl.DataLoader(Augmented(16), batch_size=2, generator=_gen(), num_workers=2))
    assert _same(got, expected)
    assert not loader._prestarted._handles  # the next epoch's start as before


def test_prestarted_actors_die_with_a_loader_never_iterated_or_sent_elsewhere(
    cluster: Ray,
) -> None:  # fmt: skip
    cold = sl.DataLoader(Augmented(8), remote_workers=sl.RemoteWorkers(2, prestart=False))
    assert cold._prestarted is None and not cluster.live_actors()
    loader = sl.DataLoader(Augmented(8), remote_workers=2)
    wait_until(lambda: len(cluster.live_actors()) == 2, 60, what="the prestarted actors")
    del loader
    gc.collect()
    wait_until(lambda: not cluster.live_actors(), 30, what="the prestarted actors to die")
    # Pickled (the loader sent to a spawned process, which starts its own): given back here.
    loader = sl.DataLoader(Augmented(8), remote_workers=2)
    wait_until(lambda: len(cluster.live_actors()) == 2, 60, what="the prestarted actors")
    copy = pickle.loads(pickle.dumps(loader))
    assert copy._prestarted is not None and not copy._prestarted._handles
    wait_until(lambda: not cluster.live_actors(), 30, what="the prestarted actors to go")


def test_an_idle_iterator_gives_its_actors_to_a_loader_ray_could_not_place(
    cluster: Ray, caplog: Any,
) -> None:  # fmt: skip
    args: dict[str, Any] = dict(batch_size=4, shuffle=True, sample_seeds=True)
    expected = list(sl.DataLoader(Augmented(32), generator=_gen(), num_workers=2, **args))
    left = iter(sl.DataLoader(Augmented(32), generator=_gen(), remote_workers=2, **args))
    first = [next(left) for _ in range(2)]  # its 2 actors hold both CPUs of the cluster
    other = sl.DataLoader(Augmented(16), batch_size=4, remote_workers=2, sample_seeds=True)
    with caplog.at_level(logging.INFO, logger="steadyload"):
        assert _indices(list(other)) == list(range(16))  # without the give-back: waits for ever
        assert "gave back their Ray resources" in caplog.text
        rest = list(left)  # used again: it asks Ray for its workers again
    assert "start again: their iterator is in use again" in caplog.text
    assert _same(first + rest, expected)  # nothing lost or loaded twice, torch's order


class _Blocker:
    """Holds a CPU of the cluster for as long as it lives."""

    def ping(self) -> int:
        return 1


@pytest.mark.parametrize("placed", [1, 0])
def test_an_idle_iterator_with_an_unplaced_actor_gives_back_and_resumes(
    cluster: Ray, caplog: Any, placed: int,
) -> None:  # fmt: skip
    """Blockers hold the CPUs the iterator's actors do not get. ``placed`` 1: its placed
    actor's CPU must go to the other loader although its other actor holds tasks. 0: no
    actor of it started, so its window is full of their tasks: used again, it only waits,
    and that wait must ask for its actors."""
    blockers = [ray.remote(num_cpus=1)(_Blocker).remote() for _ in range(2 - placed)]
    ray.get([b.ping.remote() for b in blockers], timeout=60)
    args: dict[str, Any] = dict(batch_size=4, shuffle=True, sample_seeds=True)
    expected = list(sl.DataLoader(Augmented(32), generator=_gen(), num_workers=2, **args))
    left = iter(sl.DataLoader(Augmented(32), generator=_gen(), remote_workers=2, **args))
    wait_until(lambda: len(cluster.live_actors()) == 2 and [
        a["State"] for a in cluster.live_actors()].count("ALIVE") == placed, 60,
        what=f"{placed} actor(s) of the iterator placed")  # fmt: skip
    other = sl.DataLoader(Augmented(16), batch_size=4, remote_workers=1, sample_seeds=True)
    got: list[Any] = []
    with caplog.at_level(logging.INFO, logger="steadyload"):
        thread = threading.Thread(target=lambda: got.extend(other), daemon=True)
        thread.start()
        if placed:
            thread.join(90)  # without the give-back: for as long as the blocker lives
            loaded_beside = not thread.is_alive()
        else:  # no CPU for it until a blocker goes; the iterator's requests go first
            wait_until(lambda: "gave back their Ray resources" in caplog.text, 60,
                       what="the idle iterator's give-back")  # fmt: skip
            loaded_beside = True
        for blocker in blockers:
            ray.kill(blocker)
        thread.join(60)
        assert loaded_beside, "the other loader waited for the blocker's CPU"
        assert "gave back their Ray resources" in caplog.text
        assert _indices(got) == list(range(16))
        rest = list(left)  # its tasks go to the actors that replace the given-back ones
    assert _same(rest, expected)  # nothing lost or loaded twice, torch's order


def test_an_idle_stream_keeps_its_actors(cluster: Ray) -> None:
    it = iter(sl.DataLoader(Sharded(16), batch_size=2, remote_workers=1))
    next(it)
    pool = it._pool
    wait_until(lambda: not any(a.held for a in pool._actors.values()), 30, what="tasks done")
    time.sleep(1.2)  # idle for longer than sharing.IDLE_S
    assert pool.give_back() == []  # the actor holds the stream's position
    assert len(list(it)) == 7
    del it


def test_ctrl_c_while_waiting_for_remote_workers_loses_no_batch(cluster: Ray) -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        it = iter(sl.DataLoader(Augmented(24, sleep_s=0.1), batch_size=2, remote_workers=2))
        got = [next(it)]
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            while True:
                got.append(next(it))  # the SIGINT lands while next() waits for an actor
        timer.join()
        got += list(it)  # the loop goes on, as after Ctrl-C with torch's workers
        assert _indices(got) == list(range(24))
        del it
    finally:
        signal.signal(signal.SIGINT, previous)


def test_actors_die_with_a_sigkilled_driver(cluster: Ray, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import sys, ray, steadyload as sl
        from tests.remote_datasets import Augmented
        if __name__ == "__main__":
            ray.init(address={cluster.cluster.address!r}, log_to_driver=False)
            it = iter(sl.DataLoader(Augmented(400, sleep_s=0.05), remote_workers=2))
            next(it)
            print("ready", flush=True)
            for _ in it:
                pass
    """))
    env = {**os.environ, **LOOPBACK, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
        assert len(cluster.live_actors()) == 2
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        driver.stdout.close()  # type: ignore[union-attr]


def test_without_ray_steadyload_imports_and_says_how_to_get_it() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["ray"] = None  # as if it were not installed
        import steadyload as sl
        try:
            list(sl.DataLoader(list(range(4)), remote_workers=1))
        except ImportError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # fmt: skip
    assert 'pip install "steadyload[ray]"' in out.stdout, out.stderr


def test_a_loader_built_before_ray_init_connects_nothing() -> None:
    code = textwrap.dedent("""
        import steadyload as sl
        loader = sl.DataLoader(list(range(4)), remote_workers=1)
        import ray
        print(loader._prestarted is None, ray.is_initialized())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # fmt: skip
    assert out.stdout.split() == ["True", "False"], out.stderr


def test_from_loader_keeps_remote_workers() -> None:
    loader = sl.DataLoader(list(range(8)), remote_workers=sl.RemoteWorkers((1, 3), num_cpus=0.5))
    twin = sl.DataLoader.from_loader(loader)
    assert twin.remote_workers == loader.remote_workers


@pytest.mark.parametrize("bad", [0.5, -1, (3, 1), "x", True])
def test_remote_workers_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="remote_workers"):
        sl.DataLoader(list(range(8)), remote_workers=bad)


class Scripted:
    """A stall rule that decides by script, not by measurement: +1 at its first look, -1 at
    its 4th look after the added worker joined, then nothing."""

    def __init__(self, minimum: int, maximum: int, **_: Any) -> None:
        self.grown = False
        self.looks_since_join: int | None = None

    def joined(self) -> None:
        self.looks_since_join = 0

    def observe(self, now: float, wait_s: float, batches: int, live: int, ready: int,
                unplaced: int) -> tuple[int, float, float, str]:  # fmt: skip
        if not self.grown:
            self.grown = True
            return 1, 0.5, 1.0, "scripted growth"
        if self.looks_since_join is not None and not unplaced:
            self.looks_since_join += 1
            if self.looks_since_join == 4:
                return -1, 0.0, 1.0, "scripted shrink"
        return 0, 0.0, 0.0, ""


def test_a_range_grows_and_shrinks_on_the_rules_decisions_and_keeps_torchs_order(
    cluster: Ray, monkeypatch: Any, tmp_path: Path,
) -> None:  # fmt: skip
    """What the pool does on a decision, against real Ray: start an actor for a parked id,
    let it join dispatch once ready, park the highest id and stop its actor once drained.
    When to decide is the rule's, unit-tested on an injected clock with injected figures
    (tests/unit/test_remote_scaling.py); here the rule is scripted and its clock ticks a
    whole window per batch, so no decision depends on this machine's speed. The added
    actor says `Ready` only once worker 0 has stopped, holding the batch the loop waits for
    until the added actor loads one (`WaitsForTheAdded`): it must join when it is ready,
    not when a batch is taken."""
    from steadyload.engine.remote import scaling as rule
    from steadyload.iterators import scaling, workers

    ticks = itertools.count(step=rule.INTERVAL_S)
    monkeypatch.setattr(rule, "StallScaler", Scripted)
    monkeypatch.setattr(workers, "RemoteScaling", functools.partial(
        scaling.RemoteScaling, clock=lambda: float(next(ticks))))  # fmt: skip
    ds = WaitsForTheAdded(200, str(tmp_path), alone=40, sleep_s=0.1)
    want = [b for b in torch.utils.data.DataLoader(range(200), batch_size=2, shuffle=True,
                                                   generator=_gen())]  # fmt: skip
    init = functools.partial(held_until_stopped, str(tmp_path))
    loader = sl.DataLoader(ds, batch_size=2, shuffle=True, generator=_gen(),
                           remote_workers=(1, 2), worker_init_fn=init)  # fmt: skip
    got = list(loader)
    assert [b[0].tolist() for b in got] == [b.tolist() for b in want]  # torch's order, each once
    assert (tmp_path / "stopped").exists() and not (tmp_path / "gave_up").exists()
    report = loader.report()
    assert [(d.change, d.workers, d.reason) for d in report.scaling] == [
        (1, 2, "scripted growth"), (-1, 1, "scripted shrink")], report.scaling
    added = next(w for w in report.workers if w.worker_id == 1)
    assert added.samples > 0 and added.node is not None  # the added actor loaded batches
    assert "remote pool: grew to 2" in str(report)


def test_a_range_needs_a_map_style_dataset() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

    with pytest.raises(ValueError, match="needs a map-style dataset"):
        iter(sl.DataLoader(Stream(), remote_workers=(1, 2)))

    class Positioned(Augmented):  # its own state, kept per worker
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(ValueError, match="without state_dict"):
        iter(sl.DataLoader(Positioned(8), remote_workers=(1, 2)))


def test_accelerate_keeps_remote_workers_and_resumes_with_another_placement(
    cluster: Ray, tmp_path: Path,
) -> None:  # fmt: skip
    accelerate = pytest.importorskip("accelerate")
    from steadyload.integrations.accelerate import prepare, steadyload_base

    ds = Augmented(32)
    expected = list(sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(),
                                  num_workers=2, sample_seeds=True))  # fmt: skip
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, generator=_gen(), sample_seeds=True,
                           remote_workers=2)  # fmt: skip
    acc = accelerate.Accelerator(cpu=True)
    prepared = prepare(acc, loader)
    it = iter(prepared)
    before = [next(it) for _ in range(3)]
    acc.save_state(str(tmp_path))  # with the loader's state_dict()
    rest = list(it)
    assert _same(before + rest, expected)
    report = steadyload_base(prepared).report()
    assert [w.node is not None for w in report.workers] == [True, True]
    del it, prepared
    acc2 = accelerate.Accelerator(cpu=True)  # a fresh run: another seed, another placement
    again = prepare(acc2, sl.DataLoader(
        ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7),
        sample_seeds=True, num_workers=1, remote_workers=1))
    acc2.load_state(str(tmp_path))
    assert _same(list(again), rest)


def test_remote_only_loaders_keep_persistent_workers_and_prefetch_factor(cluster: Ray) -> None:
    loader = sl.DataLoader(Augmented(16), batch_size=4, remote_workers=2, prefetch_factor=1,
                           persistent_workers=True, sample_seeds=True)  # fmt: skip
    assert loader.prefetch_factor == 1 and loader.persistent_workers
    epochs = []
    for _ in range(2):
        epochs.append(_indices(list(loader)))
        pids = sorted(w.pid for w in loader.report().workers)
        assert len(pids) == 2
        epochs.append(pids)
    assert epochs[0] == epochs[2] == list(range(16))
    assert epochs[1] == epochs[3]  # the same actors served both epochs
    del loader


def test_the_object_store_does_not_grow_over_an_epoch(cluster: Ray) -> None:
    def free() -> float:
        return float(ray.available_resources().get("object_store_memory", 0.0))

    before = free()
    loader = sl.DataLoader(Big(64), batch_size=4, remote_workers=2)  # 4 MiB per batch
    taken = sum(len(b[0]) for b in loader)
    assert taken == 64
    wait_until(lambda: free() >= before - (1 << 20), 20,
               what=f"the object store to be as free as before the epoch ({before:.0f} bytes)")


@pytest.mark.slow
@pytest.mark.timeout(420)  # two Trainer runs; each actor imports transformers
def test_the_trainer_keeps_remote_workers_and_resumes_exactly(cluster: Ray, tmp_path: Path) -> None:
    """transformers' Trainer with the mixin, 1 local + 2 remote workers: a run with a
    checkpoint mid-epoch, then a resume from it, which sees the uninterrupted run's batches."""
    pytest.importorskip("transformers")
    import json

    env = {**os.environ, **LOOPBACK, "PYTHONPATH": str(ROOT),
           "RAY_ADDRESS": cluster.cluster.address}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.frameworks.trainer_job", str(tmp_path),
                           "R1", "R2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    whole, resumed = (json.loads((tmp_path / f"{r}-rank0.json").read_text()) for r in ("R1", "R2"))
    assert resumed["batches"] == whole["batches"][whole["save_at"]:]
    assert whole["restarts"] == resumed["restarts"] == []
    assert whole["report"].count("is remote: Ray node") == 2, whole["report"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning")
def test_lightning_keeps_remote_workers_through_predict_and_a_mid_epoch_resume(
    cluster: Ray, tmp_path: Path,
) -> None:  # fmt: skip
    lightning = pytest.importorskip("lightning")
    from tests.frameworks.samples import PidSquares
    from tests.frameworks.test_lightning import Interrupt, Recorder

    def trainer(*callbacks: Any) -> Any:
        return lightning.Trainer(
            accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False, callbacks=list(callbacks))

    def fit(model: Any, *callbacks: Any, ckpt: Path | None = None) -> None:
        trainer(*callbacks).fit(model, sl.DataLoader(
            PidSquares(24, delay_s=0.01), batch_size=4, shuffle=True, remote_workers=2,
            generator=torch.Generator().manual_seed(0), sample_seeds=True), ckpt_path=ckpt)

    full, part, rest, ckpt = Recorder(), Recorder(), Recorder(), tmp_path / "mid.ckpt"
    fit(full)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(part, Interrupt(ckpt, after=2))
    fit(rest, ckpt=ckpt)
    assert len(part.batches) == 3 and len(full.batches) == 12
    assert part.batches + rest.batches == full.batches  # Lightning's resume, exact
    model, predictor = Recorder(), trainer()
    predictor.predict(model, dataloaders=sl.DataLoader(PidSquares(16), batch_size=4,
                                                       remote_workers=2))  # fmt: skip
    rebuilt = predictor.predict_dataloaders
    assert type(rebuilt) is sl.DataLoader and rebuilt.remote_workers == 2  # re-instantiated
    assert [w.node is not None for w in rebuilt.report().workers] == [True, True]
    assert model.batches == [list(range(k, k + 4)) for k in range(0, 16, 4)]


def test_a_hung_remote_sample_of_code_pickled_by_value_names_the_users_file(
    cluster: Ray, tmp_path: Path, caplog: Any
) -> None:
    """#40 item 3: a dataset pickled by value (as a class in a script's __main__ is) has its
    code named <dynamic-code> on the actor; the hang report names the file, line and code."""
    import cloudpickle

    import tests.remote_datasets as module

    cloudpickle.register_pickle_by_value(module)
    try:
        ds = Faulty(16, hang=5, marker=str(tmp_path / "hung"))
        loader = sl.DataLoader(ds, batch_size=2, remote_workers=2, hang_timeout=4.0)
        with caplog.at_level(logging.INFO, logger="steadyload"):
            got = list(loader)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert _indices(got) == list(range(16))
    assert "<dynamic-code>" not in caplog.text, caplog.text
    assert 'remote_datasets.py", line 46, in __getitem__' in caplog.text, caplog.text
    assert "time.sleep(600)" in caplog.text
