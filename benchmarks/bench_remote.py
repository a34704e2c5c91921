"""Remote workers (Ray actors): scaling, overhead, Ray Data, and a lost node, one run.

Usage: python benchmarks/bench_remote.py [--reps N] [--quick] [--json [out.json]]
       (--json alone writes benchmarks/results/remote.json)

One local Ray cluster on loopback, started here and shut down at the end: a head with no
CPU (the driver) and two 1-CPU worker nodes, 100 MiB of object store each, every node on
127.0.0.1 (checked). Remote workers are ``RemoteWorkers(k, num_cpus=0.25)`` with
``num_workers=0`` (remote only), so 4 actors fit on the two nodes. Every epoch is a fresh
loader: each measured epoch is a run's first, starting its actors (with
``persistent_workers=True`` later epochs keep them; the steady-rate column shows those).

Sections (repetitions interleaved: rep 1 of every configuration, then rep 2, ...; medians):
  scaling   a wait-bound workload (time.sleep(20 ms) per sample, the CPU free; batch 8,
            96 samples per worker): samples/s of 1 local process worker, of 1, 2 and 4
            remote workers and of Ray Data (`from_items` of the indices, one block per
            batch, then `map_batches` with the same sleep, ``num_cpus=0.25``,
            ``compute=TaskPoolStrategy(size=k)``, then `iter_torch_batches`; its function
            sent by value, so its task workers do not import torch) at the same k, beside
            the linear ideal (k x the local worker's rate); sl/RD is steadyload's samples/s
            over Ray Data's (steady rate, and whole epoch). Per epoch:
            time to the first batch (from right after the loader's build, when Ray
            was just asked for its actors; cluster up), epoch time, the
            steady rate (samples after the first k batches over the time from the k-th to
            the last batch) and the trainer's CPU per batch (this process's process_time
            over the same batches; local workers' own CPU is not in it, Ray Data's
            executor threads and Ray's client threads are).
  gap       the first epoch of 4 remote workers (the scaling workload) 8 s after the
            loader was built (the training script's own set-up, a sleep here: the CPU is
            free, as while a model loads from disk or the network), timed from iter():
            actors prestarted when the loader was built (the default while connected to
            Ray) against ``RemoteWorkers(prestart=False)`` and Ray Data's pipeline built
            before the gap.
  jpeg      decode + resize to 224x224 of 500x375 JPEGs (PIL, made in a temp dir), batch
            16: 2 local process workers against 2 remote workers (the same 2 cores).
  overhead  2 remote workers, ``prefetch_factor=1`` (so no task waits behind another in
            an actor), both workloads: per batch, added latency = (batch handed to the
            iterator) - (task sent) - (time in the actor, `Done.load_s`), measured by
            wrapping RemotePool.send_task/_put/collect in this process; first task of each
            actor left out (it waits for the actor to start). Also at the collector thread
            (before the iterator's poll). Bytes moved per sample: pickle (protocol 5) of
            what a task's call returns, (Done, batch, ()), and of what it sends, (n, Task).
  faults    2 remote workers (batch 4, 20 ms per sample); after batch 10 the node of
            remote worker 0 is removed (``Cluster.remove_node(allow_graceful=False)``, from
            another thread while the loop keeps iterating): the stall (longest gap between
            batches from the removal on, beside the mean gap before it), samples lost
            and duplicated against the expected sequence, and whether the order held.
            Beside it: a remote actor SIGKILLed (same counts); torch's DataLoader with one
            of its 2 worker processes SIGKILLed (the epoch is lost: its error); Ray Data
            (2 tasks) with the node that made the latest batch removed mid-iteration
            (lost/duplicated rows, or its error). A node is added back between scenarios.

--quick: 1 rep, half-size epochs, Ray Data at k=4 only, no actor SIGKILL scenario (about 2-3
minutes on 2 busy cores; the default run about 6). Ray's own messages about the removed
nodes are printed as they come (the raylet's state dumps are left out).

The machine this was written on has 2 cores: the sleep workload shows the protocol's
scaling, not CPU scaling; the JPEG rows show what remote costs against local processes on
the same cores. Ray's own processes (raylets, GCS, workers) share those cores too.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import pickle
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SLEEP_S = 0.020  # the wait-bound workload: per sample
NUM_CPUS = 0.25  # per remote worker and per Ray Data task: 4 fit on the two 1-CPU nodes
GAP_S = 8.0  # the training script's set-up between building the loader and iterating it
STORE = 100 << 20  # object store per node
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


# -- datasets and Ray Data's function (importable as bench_remote by Ray's workers) ----------
class Sleepy(Dataset[Any]):
    """``sleep_s`` of waiting per sample (the CPU is free): index and 16 floats."""

    def __init__(self, n: int, sleep_s: float = SLEEP_S) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        time.sleep(self.sleep_s)
        return i, torch.full((16,), float(i))


class Jpegs(Dataset[Any]):
    """JPEG files decoded and resized to 224x224 (uint8 CHW), with the index."""

    def __init__(self, folder: str, n: int) -> None:
        self.paths = sorted(str(p) for p in Path(folder).glob("*.jpg"))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        from PIL import Image

        with Image.open(self.paths[i % len(self.paths)]) as img:  # files reused: page cache
            small = img.convert("RGB").resize((224, 224), Image.BILINEAR)
        return i, torch.from_numpy(np.array(small)).permute(2, 0, 1).contiguous()


def rd_sleepy(batch: dict[str, np.ndarray], sleep_s: float) -> dict[str, np.ndarray]:
    """Ray Data's side of `Sleepy`: the same wait per row, the same 16 floats, plus the
    node that made the rows (its id's first 12 hex digits as an int)."""
    import ray

    ids = batch["id"]
    for _ in range(len(ids)):
        time.sleep(sleep_s)
    node = int(ray.get_runtime_context().get_node_id()[:12], 16)
    return {"i": ids, "x": np.repeat(ids[:, None].astype(np.float32), 16, axis=1),
            "node": np.full(len(ids), node, np.int64)}


def make_jpegs(folder: Path, count: int = 64) -> None:
    """``count`` 500x375 JPEGs of smooth noise (decode cost like photos)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        base = rng.integers(0, 255, (47, 63, 3), dtype=np.uint8)
        Image.fromarray(base).resize((500, 375), Image.BICUBIC).save(
            folder / f"{i:04d}.jpg", quality=90)


# -- one epoch ----------------------------------------------------------------------------
def _summary(t0: float, c0: float, stamps: list[float], cpus: list[float], sizes: list[int],
             workers: int) -> dict[str, Any]:
    """Time to first batch, epoch time, steady rate and trainer CPU per batch of an epoch
    whose batches arrived at ``stamps`` (steady: after the first ``workers`` batches)."""
    w = min(workers, len(stamps) - 1)
    steady_samples = sum(sizes[w:])
    return {
        "first_s": stamps[0] - t0,
        "epoch_s": stamps[-1] - t0,
        "epoch_rate": sum(sizes) / (stamps[-1] - t0),
        "rate": steady_samples / (stamps[-1] - stamps[w - 1]) if w else None,
        "cpu_ms": 1e3 * (cpus[-1] - cpus[w - 1]) / (len(stamps) - w) if w else None,
        "epoch_cpu_ms": 1e3 * (cpus[-1] - c0) / len(stamps),
        "batches": len(stamps),
    }


def _worker_rows(loader: Any) -> list[dict[str, Any]]:
    return [{"worker": w.worker_id, "samples": w.samples, "samples_per_s": w.samples_per_s,
             "busy_share": w.busy_share, "node": w.node} for w in loader.report().workers]


def sl_epoch(ds: Any, bs: int, local: int, remote: int, prefetch: int | None = None,
             report: bool = False, gap_s: float = 0.0, prestart: bool = True) -> dict[str, Any]:
    """One epoch of a fresh steadyload loader: ``local`` process workers, ``remote`` Ray
    actors; timed from iter(), ``gap_s`` after the loader was built (the script's set-up)."""
    import steadyload as sl

    spec = sl.RemoteWorkers(remote, num_cpus=NUM_CPUS, prestart=prestart) if remote else None
    loader = sl.DataLoader(ds, batch_size=bs, num_workers=local, remote_workers=spec)
    time.sleep(gap_s)
    if prefetch is not None:  # not accepted by __init__ with num_workers=0 (torch's check)
        loader.prefetch_factor = prefetch
    stamps: list[float] = []
    cpus: list[float] = []
    sizes: list[int] = []
    seen: list[int] = []
    it = None
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        it = iter(loader)
        for batch in it:
            stamps.append(time.perf_counter())
            cpus.append(time.process_time())
            seen.extend(batch[0].tolist())
            sizes.append(len(batch[0]))
    finally:
        if it is not None:
            it._shutdown_workers()
        del it
    out = _summary(t0, c0, stamps, cpus, sizes, local + remote)
    out["same"] = seen == list(range(len(ds)))  # torch's batches, in torch's order
    if report:
        out["workers"] = _worker_rows(loader)
    return out


def rd_dataset(n: int, bs: int, k: int) -> Any:
    import ray.data

    # The function as __main__ has it: cloudpickle sends it by value, so Ray Data's task
    # workers import numpy and Ray only (importing this module would import torch there).
    fn = sys.modules["__main__"].rd_sleepy
    # The indices as blocks of one batch, in the object store: no read tasks (those of
    # ray.data.range ask 1 CPU each, so they are not fused with a 0.25-CPU map and
    # compete with it for the 2 CPUs), only the k map tasks, as steadyload has k actors.
    items = [{"id": i} for i in range(n)]
    return ray.data.from_items(items, override_num_blocks=max(1, n // bs)).map_batches(
        fn, batch_size=bs, fn_kwargs={"sleep_s": SLEEP_S}, num_cpus=NUM_CPUS,
        compute=ray.data.TaskPoolStrategy(size=k))


def rd_epoch(n: int, bs: int, k: int, gap_s: float = 0.0) -> dict[str, Any]:
    """One iteration of a fresh Ray Data pipeline over the same workload (built ``gap_s``
    before it is iterated)."""
    stamps: list[float] = []
    cpus: list[float] = []
    sizes: list[int] = []
    seen: list[int] = []
    ds = rd_dataset(n, bs, k)
    time.sleep(gap_s)
    c0, t0 = time.process_time(), time.perf_counter()
    for batch in ds.iter_torch_batches(batch_size=bs):
        stamps.append(time.perf_counter())
        cpus.append(time.process_time())
        ids = batch["i"].tolist()
        seen.extend(ids)
        sizes.append(len(ids))
    out = _summary(t0, c0, stamps, cpus, sizes, k)
    out["same"] = sorted(seen) == list(range(n))  # every row once (Ray Data's order is its own)
    out["in_order"] = seen == list(range(n))
    return out


# -- the overhead probe ---------------------------------------------------------------------
class Probe:
    """Wraps RemotePool.send_task, ._put (the collector thread) and .collect (the
    iterator's poll) in this process: when each task was sent, its batch arrived, and the
    iterator had it, with `Done.load_s`. Keeps a few outcomes to size them afterwards."""

    def __init__(self) -> None:
        self.sent: dict[int, float] = {}
        self.arrived: dict[int, float] = {}
        self.collected: dict[int, float] = {}
        self.load_s: dict[int, float] = {}
        self.kept: list[Any] = []
        self.tasks: list[tuple[int, list[int], int]] = []
        self._saved: tuple[Any, ...] = ()

    def __enter__(self) -> Probe:
        from steadyload.engine.events import Received
        from steadyload.engine.remote.pool import RemotePool

        send, put, collect = self._saved = (RemotePool.send_task, RemotePool._put,
                                            RemotePool.collect)
        probe = self

        def send_task(pool: Any, worker_id: int, task_id: int, *args: Any, **kw: Any) -> None:
            probe.sent[task_id] = time.perf_counter()
            if len(probe.tasks) < 4:
                indices = args[0] if args else kw["indices"]
                epoch = args[1] if len(args) > 1 else kw.get("epoch", 0)
                probe.tasks.append((task_id, list(indices), epoch))
            send(pool, worker_id, task_id, *args, **kw)

        def _put(pool: Any, a: Any, event: object) -> None:
            if isinstance(event, Received):
                probe.arrived[event.done.task_id] = time.perf_counter()
            put(pool, a, event)

        def collect_(pool: Any, ready: Any) -> list[tuple[int, object]]:
            out = collect(pool, ready)
            now = time.perf_counter()
            for _, event in out:
                if isinstance(event, Received):
                    probe.collected[event.done.task_id] = now
                    probe.load_s[event.done.task_id] = event.done.load_s
                    if len(probe.kept) < 4 and event.done.task_id >= 2:
                        probe.kept.append(event)
            return out

        RemotePool.send_task, RemotePool._put, RemotePool.collect = send_task, _put, collect_
        return self

    def __exit__(self, *exc: object) -> None:
        from steadyload.engine.remote.pool import RemotePool

        RemotePool.send_task, RemotePool._put, RemotePool.collect = self._saved

    def latencies(self, skip: set[int]) -> tuple[list[float], list[float]]:
        """(at the iterator, at the collector) added latency of each task not in ``skip``."""
        at_iter, at_collector = [], []
        for task_id, sent in self.sent.items():
            if task_id in skip or task_id not in self.collected:
                continue
            at_iter.append(self.collected[task_id] - sent - self.load_s[task_id])
            if task_id in self.arrived:
                at_collector.append(self.arrived[task_id] - sent - self.load_s[task_id])
        return at_iter, at_collector

    def bytes_per_sample(self) -> tuple[float, float]:
        """(returned, sent) bytes per sample, pickled as Ray's call results and arguments."""
        from steadyload.engine.protocol import Task

        back = [len(pickle.dumps((e.done, e.batch, ()), protocol=5)) / max(1, e.done.samples)
                for e in self.kept]  # fmt: skip
        out = [len(pickle.dumps((task_id, Task(task_id, idx, (), epoch)), protocol=5))
               / max(1, len(idx)) for task_id, idx, epoch in self.tasks]  # fmt: skip
        return statistics.mean(back) if back else 0.0, statistics.mean(out) if out else 0.0


def overhead_epoch(ds: Any, bs: int) -> dict[str, Any]:
    with Probe() as probe:
        out = sl_epoch(ds, bs, 0, 2, prefetch=1)
    skip = set(sorted(probe.sent)[:2])  # the first task of each actor waits for its start
    at_iter, at_collector = probe.latencies(skip)
    back, sent = probe.bytes_per_sample()
    out.update(lat_ms=[x * 1e3 for x in at_iter], lat_collector_ms=[x * 1e3 for x in at_collector],
               bytes_back=back, bytes_sent=sent)
    return out


# -- faults ---------------------------------------------------------------------------------
def guarded(fn: Callable[[], Any], deadline_s: float) -> tuple[Any, str | None]:
    """Run ``fn`` on a thread; (its result, None), or (None, what went wrong)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001  (reported, not raised)
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="bench-remote-epoch")
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        return None, f"no end after {deadline_s:.0f} s (abandoned)"
    if "error" in box:
        return None, f"{type(box['error']).__name__}: {str(box['error']).splitlines()[0][:160]}"
    return box["result"], None


class Faulted:
    """An epoch's batches (times, indices) and a fault injected after batch ``after``."""

    def __init__(self, n: int, after: int) -> None:
        self.n, self.after = n, after
        self.stamps: list[float] = []
        self.seen: list[int] = []
        self.t_fault: float | None = None
        self.t_fault_done: float | None = None
        self.fault = ""
        self.error: str | None = None

    def add(self, indices: list[int]) -> bool:
        """Record a batch; True when the fault is due now."""
        self.stamps.append(time.perf_counter())
        self.seen.extend(indices)
        return len(self.stamps) == self.after

    def in_background(self, what: str, action: Callable[[], None]) -> None:
        """Inject the fault from another thread (the loop keeps iterating)."""
        self.fault = what
        self.t_fault = time.perf_counter()

        def run() -> None:
            action()
            self.t_fault_done = time.perf_counter()

        threading.Thread(target=run, daemon=True).start()

    def result(self) -> dict[str, Any]:
        counts = Counter(self.seen)
        expected = list(range(self.n))
        out: dict[str, Any] = {
            "fault": self.fault, "error": self.error, "n": self.n, "batches": len(self.stamps),
            "delivered": len(self.seen), "lost": sum(1 for i in expected if i not in counts),
            "duplicated": sum(c - 1 for c in counts.values() if c > 1),
            "in_order": self.seen == expected,
        }
        if self.t_fault is not None:
            before = [t for t in self.stamps if t <= self.t_fault]
            after = [self.t_fault] + [t for t in self.stamps if t > self.t_fault]
            gaps = [b - a for a, b in zip(after, after[1:], strict=False)]
            out.update(
                normal_gap_s=(before[-1] - before[0]) / (len(before) - 1)
                if len(before) > 1 else None,  # the mean interval before the fault
                stall_s=max(gaps) if gaps else None,
                fault_to_next_s=gaps[0] if gaps else None,
                fault_call_s=(self.t_fault_done - self.t_fault) if self.t_fault_done else None,
                epoch_after_fault_s=(self.stamps[-1] - self.t_fault) if gaps else None,
            )
        return out


def sl_fault(n: int, kind: str, cluster: Any, deadline_s: float) -> dict[str, Any]:
    """2 remote workers; after batch 10 their node is removed (``kind="node"``) or worker
    0's actor is SIGKILLed (``kind="sigkill"``)."""
    import bench_remote

    import steadyload as sl

    rec = Faulted(n, after=10)
    loader = sl.DataLoader(bench_remote.Sleepy(n), batch_size=4,
                           remote_workers=sl.RemoteWorkers(2, num_cpus=NUM_CPUS))

    def epoch() -> None:
        it = iter(loader)
        try:
            for batch in it:
                if rec.add(batch[0].tolist()):
                    actor = it._pool.remote._actors[0]
                    if kind == "sigkill":
                        rec.in_background(f"SIGKILL of remote worker 0 (pid {actor.pid})",
                                          lambda pid=actor.pid: os.kill(pid, signal.SIGKILL))
                    else:
                        node = cluster.node_of(actor.node_id)
                        rec.in_background(f"node {actor.node_id[:12]} of remote worker 0 removed",
                                          lambda node=node: cluster.remove(node))
        finally:
            it._shutdown_workers()

    _, rec.error = guarded(epoch, deadline_s)
    out = rec.result()
    out["restarts"] = [f"worker {r.worker_id}: {r.cause} ({r.batches_rerun} batches re-run)"
                       for r in loader.report().restarts]  # fmt: skip
    out["workers"] = _worker_rows(loader)
    return out


def torch_sigkill(n: int, deadline_s: float) -> dict[str, Any]:
    """torch's DataLoader, 2 worker processes; worker 0 SIGKILLed after batch 10."""
    import bench_remote

    rec = Faulted(n, after=10)
    loader = torch.utils.data.DataLoader(bench_remote.Sleepy(n), batch_size=4, num_workers=2,
                                         multiprocessing_context="forkserver")

    def epoch() -> None:
        it = iter(loader)
        for batch in it:
            if rec.add(batch[0].tolist()):
                pid = it._workers[0].pid
                rec.in_background(f"SIGKILL of worker 0 (pid {pid})",
                                  lambda pid=pid: os.kill(pid, signal.SIGKILL))

    _, rec.error = guarded(epoch, deadline_s)
    return rec.result()


def rd_node_loss(n: int, cluster: Any, deadline_s: float) -> dict[str, Any]:
    """Ray Data, concurrency 2, batch 4; after batch 10 the node that made it is removed."""
    rec = Faulted(n, after=10)

    def epoch() -> None:
        for batch in rd_dataset(n, 4, 2).iter_torch_batches(batch_size=4):
            if rec.add(batch["i"].tolist()):
                node = cluster.node_of_prefix(int(batch["node"][-1]))
                rec.in_background(f"node {node.node_id[:12]} (made batch 10) removed",
                                  lambda node=node: cluster.remove(node))

    _, rec.error = guarded(epoch, deadline_s)
    return rec.result()


# -- the cluster ------------------------------------------------------------------------------
class LocalCluster:
    """A head with no CPU and two 1-CPU worker nodes, all on 127.0.0.1."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "object_store_memory": STORE})
        self.nodes = [self.c.add_node(num_cpus=1, object_store_memory=STORE) for _ in range(2)]

    def check_loopback(self) -> None:
        import ray

        addresses = {n["NodeManagerAddress"] for n in ray.nodes()}
        assert addresses == {"127.0.0.1"}, f"Ray is not on loopback only: {addresses}"

    def node_of(self, node_id: str) -> Any:
        return next(n for n in self.nodes if n.node_id == node_id)

    def node_of_prefix(self, prefix: int) -> Any:
        return next(n for n in self.nodes if int(n.node_id[:12], 16) == prefix)

    def remove(self, node: Any) -> None:
        self.c.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def restore(self) -> float:
        """Back to two worker nodes (waits until Ray has marked a removed one dead)."""
        t0 = time.perf_counter()
        while len(self.nodes) < 2:
            self.nodes.append(self.c.add_node(num_cpus=1, object_store_memory=STORE))
        try:
            self.c.wait_for_nodes(timeout=60)
        except TimeoutError:
            print("    (Ray still lists the removed node as alive after 60 s)", flush=True)
        self.check_loopback()
        return time.perf_counter() - t0


_RAY_MARKS = ("ray::", "raylet", "gcs_server", "default_worker.py", "ray/_private/",
              "ray/dashboard/", "ray/autoscaler/", "log_monitor", "runtime_env")


def _ray_processes() -> dict[int, str]:
    """This process's descendants that are Ray's (raylet, GCS, workers...): pid -> name."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(m in cmd for m in _RAY_MARKS) and "multiprocessing" not in cmd:
            found[pid] = cmd[:80]
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- the run ------------------------------------------------------------------------------------
def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _line(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {name:14s} failed: {r['error']}"
    return (f"  {name:14s} first {r['first_s']:6.2f} s  epoch {r['epoch_s']:6.2f} s  "
            f"steady {r['rate']:7.1f}/s  cpu {r['cpu_ms']:5.2f} ms/batch  "
            f"{'same' if r['same'] else 'DIFFERENT'}")


def _attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import bench_remote as mod  # the importable name: Ray's workers import it by that
    import ray

    quick = args.quick
    per_worker = 48 if quick else 96
    counts = [1, 2, 4]
    jpeg_n = 192 if quick else 384
    fault_n = 160 if quick else 240
    over_n = 160 if quick else 320  # the overhead section's sleep epochs (2 workers, batch 8)
    deadline = 60.0 if quick else 120.0
    results: dict[str, Any] = {"params": {
        "sleep_ms": SLEEP_S * 1e3, "batch": 8, "samples_per_worker": per_worker,
        "remote_counts": counts, "num_cpus_per_actor": NUM_CPUS, "jpeg_samples": jpeg_n,
        "jpeg_batch": 16, "fault_samples": fault_n, "reps": args.reps}}

    t0 = time.perf_counter()
    laps: dict[str, float] = {}
    results["section_s"] = laps

    def lap(name: str) -> None:
        laps[name] = time.perf_counter() - t0 - sum(laps.values())

    ray_processes: dict[int, str] = {}
    jpeg_dir = Path(tempfile.mkdtemp(prefix="bench-remote-jpegs-"))
    cluster: LocalCluster | None = None
    try:
        cluster = LocalCluster()
        ray.init(address=cluster.c.address, include_dashboard=False, log_to_driver=False)
        cluster.c.wait_for_nodes()
        cluster.check_loopback()
        results["cluster_start_s"] = time.perf_counter() - t0
        lap("cluster")
        print(f"cluster up in {results['cluster_start_s']:.1f} s: head (0 CPU) + 2 x 1-CPU "
              "nodes, all on 127.0.0.1", flush=True)
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        make_jpegs(jpeg_dir)
        # Warm-up (not measured): page cache for the actors' imports, Ray Data's own actors.
        sl_epoch(mod.Sleepy(16), 8, 0, 2)
        rd_epoch(32, 8, counts[-1])
        lap("warm-up")

        # -- scaling and Ray Data, interleaved --------------------------------------------------
        rd_counts = counts[-1:] if quick else counts  # --quick: Ray Data at 4 only
        configs = [("sl-local", 1)] + [("sl-remote", k) for k in counts] + [
            ("raydata", k) for k in rd_counts]
        runs: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.reps):
            print(f"scaling, rep {rep + 1}/{args.reps}", flush=True)
            for kind, k in configs:
                n = per_worker * k
                if kind == "raydata":
                    r = _attempt(lambda: rd_epoch(n, 8, k))  # noqa: B023
                else:
                    local, remote = (k, 0) if kind == "sl-local" else (0, k)
                    r = _attempt(lambda: sl_epoch(mod.Sleepy(n), 8, local, remote,  # noqa: B023
                                                  report=remote == 4))  # noqa: B023
                runs.setdefault(f"{kind}-{k}", []).append(r)
                print(_line(f"{kind}-{k}", r), flush=True)
                gc.collect()
        results["scaling"] = runs
        lap("scaling")

        # -- the first epoch after the script's set-up: prestarted actors or not ----------
        k, gap_runs = counts[-1], {}
        for rep in range(args.reps):
            print(f"after a {GAP_S:g} s set-up, rep {rep + 1}/{args.reps}", flush=True)
            for name, fn in (
                (f"sl-prestarted-{k}", lambda: sl_epoch(mod.Sleepy(per_worker * k), 8, 0, k,
                                                        gap_s=GAP_S)),
                (f"sl-cold-{k}", lambda: sl_epoch(mod.Sleepy(per_worker * k), 8, 0, k,
                                                  gap_s=GAP_S, prestart=False)),
                (f"raydata-{k}", lambda: rd_epoch(per_worker * k, 8, k, gap_s=GAP_S)),
            ):
                r = _attempt(fn)
                gap_runs.setdefault(name, []).append(r)
                print(_line(name, r), flush=True)
                gc.collect()
        results["gap"] = gap_runs
        results["params"]["gap_s"] = GAP_S
        lap("gap")

        # -- JPEG: local processes against remote workers ---------------------------------------
        jpeg_runs: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.reps):
            print(f"jpeg, rep {rep + 1}/{args.reps}", flush=True)
            for name, local, remote in (("sl-local-2", 2, 0), ("sl-remote-2", 0, 2)):
                r = _attempt(lambda: sl_epoch(mod.Jpegs(str(jpeg_dir), jpeg_n), 16,  # noqa: B023
                                              local, remote, report=remote > 0))  # noqa: B023
                jpeg_runs.setdefault(name, []).append(r)
                print(_line(name, r), flush=True)
                gc.collect()
        results["jpeg"] = jpeg_runs
        lap("jpeg")

        # -- overhead per batch -------------------------------------------------------------
        over: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.reps):
            print(f"overhead, rep {rep + 1}/{args.reps}", flush=True)
            for name, make, bs in (
                ("sleep", lambda: mod.Sleepy(over_n), 8),
                ("jpeg", lambda: mod.Jpegs(str(jpeg_dir), jpeg_n), 16),
            ):
                r = _attempt(lambda: overhead_epoch(make(), bs))  # noqa: B023
                over.setdefault(name, []).append(r)
                if "error" in r:
                    print(f"  {name:6s} failed: {r['error']}", flush=True)
                    continue
                print(f"  {name:6s} added latency p50 {_pct(r['lat_ms'], 50):6.2f} ms "
                      f"p99 {_pct(r['lat_ms'], 99):6.2f} ms ({len(r['lat_ms'])} batches)  "
                      f"{r['bytes_back']:8.0f} B/sample back, {r['bytes_sent']:4.0f} B/sample "
                      "sent", flush=True)
                gc.collect()
        results["overhead"] = over
        lap("overhead")

        # -- faults -------------------------------------------------------------------------
        print("faults", flush=True)
        faults: dict[str, Any] = {}
        faults["torch-sigkill"] = torch_sigkill(fault_n, deadline)
        print(f"  torch, worker SIGKILLed: {_fault_line(faults['torch-sigkill'])}", flush=True)
        if not quick:
            faults["sl-sigkill"] = sl_fault(fault_n, "sigkill", cluster, deadline)
            print(f"  steadyload, actor SIGKILLed: {_fault_line(faults['sl-sigkill'])}",
                  flush=True)
        faults["sl-node"] = sl_fault(fault_n, "node", cluster, deadline)
        print(f"  steadyload, node removed: {_fault_line(faults['sl-node'])}", flush=True)
        faults["restore_s"] = cluster.restore()
        print(f"  (node added back in {faults['restore_s']:.1f} s)", flush=True)
        faults["raydata-node"] = rd_node_loss(fault_n, cluster, deadline)
        print(f"  Ray Data, node removed: {_fault_line(faults['raydata-node'])}", flush=True)
        results["faults"] = faults
        lap("faults")
        cluster.check_loopback()  # the nodes added back too (dead ones are listed as well)
    finally:
        ray_processes = _ray_processes()
        try:
            ray.shutdown()
        finally:
            if cluster is not None:
                cluster.c.shutdown()
            for p in jpeg_dir.glob("*.jpg"):
                p.unlink()
            jpeg_dir.rmdir()
        end = time.monotonic() + 15
        while any(_alive(p) for p in ray_processes) and time.monotonic() < end:
            time.sleep(0.2)
        left = {p: c for p, c in ray_processes.items() if _alive(p)}
        print(f"Ray shut down: {len(ray_processes)} Ray processes of this run, "
              f"{len(left)} left" + (f": {left}" if left else ""), flush=True)
    results["ray_processes_left"] = len(left)
    results["total_s"] = time.perf_counter() - t0
    return results


def _fault_line(r: dict[str, Any]) -> str:
    head = (f"{r['delivered']}/{r['n']} samples "
            f"delivered, lost {r['lost']}, duplicated {r['duplicated']}, "
            f"order {'kept' if r['in_order'] else 'NOT kept'}")
    if r.get("stall_s") is not None:
        head += (f"; stall {r['stall_s']:.2f} s (mean gap before "
                 f"{1e3 * (r['normal_gap_s'] or 0):.0f} ms), fault to last batch "
                 f"{r['epoch_after_fault_s']:.1f} s")
    if r.get("error"):
        head += f"; error: {r['error']}"
    return head


# -- the tables -------------------------------------------------------------------------------
def tables(results: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    runs = results["scaling"]
    base = _median(runs["sl-local-1"], "rate")
    counts = results["params"]["remote_counts"]
    print(f"\nscaling: {SLEEP_S * 1e3:.0f} ms sleep per sample, batch 8, "
          f"{results['params']['samples_per_worker']} samples per worker, medians of "
          f"{results['params']['reps']}; ideal = k x the local worker's rate")
    print(f"  {'workers':18s} {'first batch':>11s} {'epoch':>8s} {'steady/s':>9s} "
          f"{'ideal/s':>8s} {'eff.':>5s} {'cpu/batch':>10s}  {'Ray Data/s':>10s} "
          f"{'first':>7s} {'cpu/batch':>10s}  sl/RD steady, epoch")
    rows: dict[str, Any] = {}
    for name in ["sl-local-1"] + [f"sl-remote-{k}" for k in counts]:
        k = int(name.rsplit("-", 1)[1])
        first, epoch = _median(runs[name], "first_s"), _median(runs[name], "epoch_s")
        rate, cpu = _median(runs[name], "rate"), _median(runs[name], "cpu_ms")
        ideal = base * k if base else None
        row: dict[str, Any] = {"first_s": first, "epoch_s": epoch, "rate": rate,
                               "ideal": ideal, "cpu_ms": cpu,
                               "same": all(r.get("same") for r in runs[name])}
        label = "1 local process" if name == "sl-local-1" else f"{k} remote"
        if rate is None:
            print(f"  {label:18s} failed: {runs[name][0].get('error')}")
            rows[name] = row
            continue
        line = (f"  {label:18s} {first:9.2f} s {epoch:6.2f} s {rate:9.1f} "
                f"{ideal or 0:8.1f} {rate / ideal if ideal else 0:5.2f} {cpu:7.2f} ms")
        rd = runs.get(f"raydata-{k}") if name != "sl-local-1" else None
        if rd:
            rd_rate, rd_first = _median(rd, "rate"), _median(rd, "first_s")
            rd_epoch, rd_cpu = _median(rd, "epoch_rate"), _median(rd, "cpu_ms")
            sl_epoch_rate = _median(runs[name], "epoch_rate")
            if rd_rate:
                row.update(raydata_rate=rd_rate, raydata_first_s=rd_first,
                           raydata_epoch_rate=rd_epoch, raydata_cpu_ms=rd_cpu,
                           ratio_steady=rate / rd_rate,
                           ratio_epoch=(sl_epoch_rate or 0) / rd_epoch if rd_epoch else None,
                           raydata_all_rows=all(r.get("same") for r in rd))
                line += (f"  {rd_rate:10.1f} {rd_first:5.2f} s {rd_cpu:7.2f} ms  "
                         f"{rate / rd_rate:5.2f}x, {row['ratio_epoch'] or 0:5.2f}x")
            else:
                line += f"  Ray Data failed: {rd[0].get('error')}"
        print(line)
        rows[name] = row
    summary["scaling"] = rows
    last4 = [r for r in runs.get(f"sl-remote-{counts[-1]}", []) if r.get("workers")]
    if last4:
        print(f"  report() of {counts[-1]} remote workers (last rep): " + "; ".join(
            f"w{w['worker']} {w['samples_per_s'] or 0:.1f}/s busy {w['busy_share'] or 0:.2f}"
            f" {(w['node'] or '')[:6]}" for w in last4[-1]["workers"]))

    print(f"\nthe first epoch, {GAP_S:g} s after the loader was built (a set-up that sleeps)")
    grows: dict[str, Any] = {}
    for name, rs in results["gap"].items():
        g = {key: _median(rs, key) for key in ("first_s", "epoch_s", "epoch_rate")}
        g["same"] = all(r.get("same") for r in rs)
        grows[name] = g
        if g["first_s"] is None:
            print(f"  {name:18s} failed: {rs[0].get('error')}")
            continue
        print(f"  {name:18s} first batch {g['first_s']:5.2f} s  epoch {g['epoch_s']:5.2f} s  "
              f"{g['epoch_rate']:6.1f} samples/s over the epoch")
    rd = next((g for n, g in grows.items() if n.startswith("raydata") and g["epoch_rate"]), None)
    for g in grows.values():
        g["vs_raydata"] = g["epoch_rate"] / rd["epoch_rate"] if rd and g["epoch_rate"] else None
    summary["gap"] = grows

    jpeg = results["jpeg"]
    print(f"\njpeg: decode + resize, batch 16, {results['params']['jpeg_samples']} samples")
    jrows: dict[str, Any] = {}
    for name in ("sl-local-2", "sl-remote-2"):
        r = {k: _median(jpeg[name], k) for k in ("first_s", "epoch_s", "rate", "cpu_ms")}
        jrows[name] = r
        if r["rate"] is None:
            print(f"  {name:14s} failed: {jpeg[name][0].get('error')}")
            continue
        print(f"  {name:14s} first {r['first_s']:5.2f} s  epoch {r['epoch_s']:5.2f} s  "
              f"steady {r['rate']:7.1f}/s  cpu {r['cpu_ms']:5.2f} ms/batch")
    if jrows["sl-local-2"]["rate"] and jrows["sl-remote-2"]["rate"]:
        jrows["remote_over_local"] = jrows["sl-remote-2"]["rate"] / jrows["sl-local-2"]["rate"]
        print(f"  remote / local samples/s: {jrows['remote_over_local']:.2f}x")
    summary["jpeg"] = jrows

    print("\noverhead per batch (2 remote workers, prefetch_factor=1; all reps pooled)")
    orows = {}
    for name, rs in results["overhead"].items():
        ok = [r for r in rs if "lat_ms" in r]
        if not ok:
            print(f"  {name:6s} failed: {rs[0].get('error')}")
            continue
        lat = [x for r in ok for x in r["lat_ms"]]
        col = [x for r in ok for x in r["lat_collector_ms"]]
        o = {"p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99), "n": len(lat),
             "collector_p50_ms": _pct(col, 50), "collector_p99_ms": _pct(col, 99),
             "bytes_back_per_sample": statistics.median(r["bytes_back"] for r in ok),
             "bytes_sent_per_sample": statistics.median(r["bytes_sent"] for r in ok)}
        orows[name] = o
        print(f"  {name:6s} added latency p50 {o['p50_ms']:6.2f} ms  p99 {o['p99_ms']:6.2f} ms "
              f"(n={o['n']}; at the collector p50 {o['collector_p50_ms']:.2f}, p99 "
              f"{o['collector_p99_ms']:.2f})  {o['bytes_back_per_sample']:.0f} B/sample back, "
              f"{o['bytes_sent_per_sample']:.0f} B/sample sent")
    summary["overhead"] = orows

    faults = results["faults"]
    print("\nfaults (batch 4, 20 ms per sample, 2 workers, fault after batch 10)")
    for key, label in (("sl-node", "steadyload, node removed"),
                       ("sl-sigkill", "steadyload, actor SIGKILLed"),
                       ("torch-sigkill", "torch, worker SIGKILLed"),
                       ("raydata-node", "Ray Data, node removed")):
        if key in faults:
            print(f"  {label:28s} {_fault_line(faults[key])}")
    summary["faults"] = {k: v for k, v in faults.items() if k != "restore_s"}

    print("\nsummary")
    s4 = rows.get(f"sl-remote-{counts[-1]}", {})
    print(f"  {counts[-1]} remote workers: {s4.get('rate') or 0:.1f} samples/s "
          f"({(s4.get('rate') or 0) / (s4.get('ideal') or 1):.2f} of linear); vs Ray Data: "
          f"{s4.get('ratio_steady') or 0:.2f}x steady, {s4.get('ratio_epoch') or 0:.2f}x "
          "whole epoch")
    print("  time to first batch: " + ", ".join(
        f"{n.replace('sl-', '')} {rows[n]['first_s']:.2f} s" for n in rows
        if rows[n].get("first_s") is not None)
        + (f", Ray Data-{counts[-1]} {s4['raydata_first_s']:.2f} s"
           if s4.get("raydata_first_s") else ""))
    if jrows.get("remote_over_local"):
        print(f"  jpeg: 2 remote = {jrows['remote_over_local']:.2f}x 2 local processes")
    for name, o in orows.items():
        print(f"  {name}: added latency p50 {o['p50_ms']:.2f} ms, p99 {o['p99_ms']:.2f} ms; "
              f"{o['bytes_back_per_sample']:.0f} B/sample")
    node = faults["sl-node"]
    print(f"  node loss: steadyload stalls {node.get('stall_s') or 0:.2f} s, lost "
          f"{node['lost']}, duplicated {node['duplicated']}; torch: "
          + ("epoch lost" if faults["torch-sigkill"]["error"] else "completed")
          + f"; Ray Data: lost {faults['raydata-node']['lost']}, duplicated "
          f"{faults['raydata-node']['duplicated']}"
          + (f" ({faults['raydata-node']['error']})" if faults["raydata-node"]["error"] else ""))
    print(f"  Ray processes left after shutdown: {results['ray_processes_left']}; "
          f"total {results['total_s']:.0f} s ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in results["section_s"].items()) + ")")
    return summary


class _DropRayDumps:
    """stdout without the raylet's internal state dumps that Ray prints, line by line,
    when a node dies (the message before them stays)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if "[state-dump]" in text or "(raylet) " in text:
            text = "".join(line for line in text.splitlines(keepends=True)
                           if "[state-dump]" not in line
                           and not (line.lstrip().startswith("[20") and "(raylet) " in line))
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main() -> None:
    sys.stdout = _DropRayDumps(sys.stdout)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--quick", action="store_true", help="smaller epochs, 1 rep")
    parser.add_argument("--json", type=Path, nargs="?", const=HERE / "results" / "remote.json")
    args = parser.parse_args()
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    logging.basicConfig(level=logging.WARNING, format="    [%(name)s] %(message).160s")
    results = run(args)
    summary = tables(results)
    if args.json:
        from bench_json import write_json

        write_json(args.json, {**results, "summary": summary})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    # Ray on loopback only, no usage report (before ray is imported), and this folder and
    # the repository importable by Ray's workers (the environment the cluster inherits).
    os.environ.update(LOOPBACK)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")]))
    sys.path[:0] = [str(ROOT)]
    main()
