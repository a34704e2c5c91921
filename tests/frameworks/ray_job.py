"""Ray Train with steadyload loaders, for tests/frameworks/test_ray.py.

``python -m tests.frameworks.ray_job OUT``: a local ``ray.init(num_cpus=2)``, one
``TorchTrainer`` with 2 training workers (gloo, CPU). Each worker, in one Ray session:

1. passes a steadyload loader to Ray's own ``prepare_data_loader`` (which rebuilds it as
   torch's) and records the warning steadyload gives, without iterating it;
2. trains one epoch on ``steadyload.integrations.ray.prepare_data_loader(loader)``
   (fault-free), saving ``state_dict()`` through Ray's wrapper after the 2nd batch;
3. trains the same epoch again on a fresh loader, SIGKILLing one of its workers after the
   2nd batch.

With ``remote`` after OUT, each worker instead trains on a loader whose 2 workers are Ray
actors placed by a custom resource (`train_func_remote`).

Each worker writes OUT/rank<r>.json (batches, the pids that loaded them, the fork server's
pid, the loader's types and options, report() figures); the driver prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

N, BATCH, KILL_AFTER = 64, 4, 2
OPTIONS: dict[str, Any] = {"on_error": "skip", "max_restarts": 5, "hang_timeout": 60.0}


def _loader() -> Any:
    import steadyload as sl
    from tests.frameworks.samples import PidSquares

    # 50 ms per sample: when the kill comes (after 2 steps), worker 0 still holds batches.
    return sl.DataLoader(PidSquares(N, delay_s=0.05), batch_size=BATCH, shuffle=True,
                         num_workers=2, prefetch_factor=3, **OPTIONS)  # fmt: skip


def _epoch(prepared: Any, kill: bool) -> dict[str, Any]:
    import torch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches, ppids, out = [], set(), {}
    for step, batch in enumerate(prepared, 1):
        batches.append(batch["i"].tolist())
        ppids.update(batch["ppid"].tolist())
        loss = model(batch["x"]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == KILL_AFTER:
            out["state_batches_yielded"] = prepared.state_dict()["batches_yielded"]
            if kill:
                victim = prepared.report().workers[0].pid
                os.kill(victim, signal.SIGKILL)
                out["killed"] = victim
    report = prepared.report()
    out.update(
        batches=batches, ppids=sorted(ppids),
        restarts=[[r.worker_id, r.cause, r.batches_rerun] for r in report.restarts],
        start_method=report.start_method,
    )  # fmt: skip
    return out


def train_func(config: dict[str, Any]) -> None:
    """One Ray Train worker: the three runs of the module docstring."""
    import multiprocessing.forkserver

    import ray.train
    import ray.train.torch

    from steadyload.integrations.ray import prepare_data_loader

    rank = ray.train.get_context().get_world_rank()
    info: dict[str, Any] = {"rank": rank, "actor_pid": os.getpid()}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rebuilt = ray.train.torch.prepare_data_loader(_loader())
        info["ray_own_inner"] = type(getattr(rebuilt, "_dataloader", rebuilt)).__module__
        info["ray_own_warnings"] = [str(w.message) for w in caught if "steadyload" in str(w.message)]
        del rebuilt

        for name, kill in (("clean", False), ("killed", True)):
            t = time.monotonic()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                prepared = prepare_data_loader(_loader())
            inner = prepared._dataloader
            info[name] = _epoch(prepared, kill)
            info[name].update(
                warnings=[str(w.message) for w in caught if "steadyload" in str(w.message)],
                seconds=round(time.monotonic() - t, 2),
                wrapper=f"{type(prepared).__module__}.{type(prepared).__qualname__}",
                inner=f"{type(inner).__module__}.{type(inner).__qualname__}",
                sampler=type(inner.sampler).__qualname__,
                prefetch_factor=inner.prefetch_factor,
                options={k: getattr(inner, k) for k in OPTIONS},
            )  # fmt: skip
        info["forkserver_pid"] = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    except Exception as e:  # reported to the test, which fails with it
        import traceback

        info["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(info))
    ray.train.report({"rank": rank})


def train_func_remote(config: dict[str, Any]) -> None:
    """One Ray Train worker whose loader's workers are Ray actors placed on the "CPU
    nodes" (a custom resource stands for them): prepare_data_loader keeps them."""
    import ray.train

    import steadyload as sl
    from steadyload.integrations.ray import prepare_data_loader
    from tests.frameworks.samples import PidSquares

    rank = ray.train.get_context().get_world_rank()
    info: dict[str, Any] = {"rank": rank, "actor_pid": os.getpid()}
    try:
        spec = sl.RemoteWorkers(2, num_cpus=0.25, resources={"cpu_pool": 1})
        loader = sl.DataLoader(PidSquares(N, delay_s=0.01), batch_size=BATCH, shuffle=True,
                               remote_workers=spec, on_error="skip")  # fmt: skip
        prepared = prepare_data_loader(loader)
        inner = prepared._dataloader
        info["batches"] = [batch["i"].tolist() for batch in prepared]
        report = inner.report()
        info.update(
            remote_workers=repr(inner.remote_workers), sampler=type(inner.sampler).__qualname__,
            nodes=[w.node for w in report.workers], pids=[w.pid for w in report.workers],
        )  # fmt: skip
    except Exception as e:  # reported to the test, which fails with it
        import traceback

        info["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(info))
    ray.train.report({"rank": rank})


def main() -> None:
    """Start Ray, train, print the outcome as one JSON line, stop Ray."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[2])
    t = time.monotonic()
    remote = sys.argv[2:] == ["remote"]  # the loaders' workers as Ray actors
    # address="local": a new instance of its own, never a cluster another test started on
    # this machine (Ray would join the latest one it finds).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             resources={"cpu_pool": 4} if remote else None,
             runtime_env={"env_vars": {"PYTHONPATH": root}})  # fmt: skip
    try:
        init_s = time.monotonic() - t
        # Where Ray's node lives: loopback only on these machines (set by __main__ below).
        addresses = sorted({node["NodeManagerAddress"] for node in ray.nodes()})
        trainer = TorchTrainer(
            train_func_remote if remote else train_func, train_loop_config={"out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                         resources_per_worker={"CPU": 0.5 if remote else 1}),
            run_config=RunConfig(storage_path=str(out / "ray"), name="steadyload"),
        )  # fmt: skip
        t = time.monotonic()
        result = trainer.fit()
        print(json.dumps({"init_s": round(init_s, 2), "fit_s": round(time.monotonic() - t, 2),
                          "error": repr(result.error) if result.error else None,
                          "node_addresses": addresses}))  # fmt: skip
    finally:
        ray.shutdown()


if __name__ == "__main__":
    # Ray on Linux binds every node to the machine's routable address unless told: this
    # makes it use 127.0.0.1 throughout (these machines must stay on loopback).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main()
