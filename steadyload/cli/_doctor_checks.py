"""The checks of `steadyload doctor`, as functions of their inputs.

Each returns a `Check` from facts gathered elsewhere (`steadyload.cli.doctor` collects
them), so that tests can provoke every outcome.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..host.system import CgroupMemory, Space, gib

Status = Literal["OK", "WARN", "FAIL"]
CHECKS = ("python", "torch", "gpu", "start_method", "forkserver", "module_import",
          "main_guard", "cpus", "memory", "shm", "open_files", "sharing_strategy",
          "shm_leftovers", "env")
"""Check names, in output order (``--skip`` takes them); env checks are ``env.<VAR>``."""
MIN_SHM_FREE = 1 << 30
_MARK = "@@steadyload-doctor@@"  # prefixes the JSON line a child probe prints last


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report: a status, what was found, and for non-OK why and the fix."""

    name: str
    status: Status
    detail: str
    why: str = ""
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# -- pure checks ------------------------------------------------------------------------


def check_python(version: str, implementation: str, executable: str) -> Check:
    """The interpreter running the checks (the one training should use)."""
    return Check("python", "OK", f"{version} ({implementation}) at {executable}",
                 data={"version": version, "implementation": implementation})


def torch_build(cuda: str | None, hip: str | None) -> str:
    """"ROCm/HIP 7.2", "CUDA 12.8" or "CPU", from torch.version.hip / .cuda."""
    return f"ROCm/HIP {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU"


def check_torch(version: str, cuda: str | None, hip: str | None) -> Check:
    """torch's version and build; WARN below 2.6 (the oldest steadyload supports)."""
    build = torch_build(cuda, hip)
    data = {"version": version, "cuda": cuda, "hip": hip, "build": build}
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m[1]), int(m[2])) < (2, 6):
        return Check("torch", "WARN", f"{version}, {build} build", data=data,
                     why="steadyload needs torch >= 2.6 (DataLoader's in_order argument).",
                     fix="pip install -U 'torch>=2.6'")
    return Check("torch", "OK", f"{version}, {build} build", data=data)


def check_gpu(build: str, probe: dict[str, Any] | None, error: str) -> Check:
    """What a child process saw when torch initialised the GPU (GPU builds only)."""
    if probe is None:
        return Check("gpu", "WARN", f"the GPU probe failed: {error}", data={"error": error},
                     why=f"a child that only asked torch ({build}) for its GPUs did not "
                     "finish; training would hang or crash the same way.",
                     fix="check the driver (nvidia-smi / rocm-smi) and that it matches "
                     "torch's runtime version.")
    devices = probe.get("devices", [])
    if not probe.get("available") or not devices:
        return Check("gpu", "WARN", f"torch ({build} build) sees no usable GPU", data=probe,
                     why=probe.get("error") or "torch.cuda.is_available() is False.",
                     fix="check the driver, CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, and "
                     "the container's GPU access (docker --gpus all, or /dev/kfd + /dev/dri).")
    names = ", ".join(f"{d['name']} ({d['arch']})" for d in devices)
    return Check("gpu", "OK", f"{len(devices)} GPU(s): {names}", data=probe)


def check_start_method(default: str) -> Check:
    """steadyload's default start method here."""
    if default == "forkserver":
        return Check("start_method", "OK", "zygote or forkserver (steadyload's default: the "
                     "zygote where a fork of the training process is safe when its first "
                     "loader is built, else forkserver; fork is refused while a GPU context "
                     "exists)", data={"default": default})
    return Check("start_method", "OK", f"{default} (no forkserver on this platform: each "
                 "worker imports torch and your dataset's module itself)",
                 data={"default": default})


def check_forkserver(report: Any, seconds: float | None, error: str, was_running: bool) -> Check:
    """The outcome of starting one real forkserver worker (`report` is its LoaderReport)."""
    if report is None:
        # steadyload's errors read "what\nWhy: ...\nFix: ..." (see diagnosis/).
        first, _, rest = error.partition("\n")
        parts = re.split(r"^(Why|Likely cause|Fix): ", rest, flags=re.M)
        why = [parts[0].strip()] + [t.strip() for k, t in zip(parts[1::2], parts[2::2],
                                                             strict=True) if k != "Fix"]
        fix = [t.rstrip() for k, t in zip(parts[1::2], parts[2::2], strict=True) if k == "Fix"]
        return Check("forkserver", "FAIL", f"could not run one worker: {first}",
                     why=" ".join(w for w in why if w) or "see the error above.",
                     fix="\n".join(fix) or "run `steadyload -v doctor` for the fork server's "
                     "log; compare with start_method='spawn' to tell a fork-server problem "
                     "from a dataset one.", data={"error": error})
    from ..report import summarize_modules

    start = report.workers[0].start_s if report.workers else None
    data = {"worker_start_s": start, "first_batch_s": seconds, "server_was_running": was_running,
            "preload_requested": list(report.preload_requested),
            "preload_missing": None if report.preload_missing is None
            else list(report.preload_missing)}
    started = f"worker started in {start:.2f} s" if start is not None else "worker started"
    server = "" if was_running else f", fork server started and first batch in {seconds:.1f} s"
    public = tuple(m for m in report.preload_requested if not m.startswith("_"))
    preloaded = summarize_modules(public, limit=4)
    if report.preload_missing:
        missing = summarize_modules(report.preload_missing)
        return Check("forkserver", "WARN", f"{started}; the fork server did not import "
                     f"{missing}", data=data,
                     why="CPython skips a preload that fails to import, silently; each worker "
                     "then imports it itself, adding that time to every worker start.",
                     fix=f"run `python -c 'import {report.preload_missing[0]}'` to see the error.")
    result = "result unknown (server started elsewhere)" if report.preload_missing is None \
        else "all imported"
    return Check("forkserver", "OK", f"{started}{server}; preloaded {preloaded}: {result}",
                 data=data)


def check_module_import(target: str, result: dict[str, Any] | None, error: str) -> Check:
    """Whether importing the user's module (as a worker would) created a GPU context."""
    data = {"module": target, **(result or {"error": error})}
    if result is None or not result.get("ok"):
        reason = error if result is None else result.get("error", "")
        return Check("module_import", "FAIL", f"importing {target} failed: {reason}", data=data,
                     why="forkserver and spawn workers import the module that defines the "
                     "dataset (the fork server preloads it); they would fail the same way.",
                     fix="make the module importable without side effects; keep the work "
                     "under `if __name__ == \"__main__\":`.")
    took = f"imported in {result.get('seconds', 0):.1f} s"
    if result.get("cuda_initialized"):
        gpu = "ROCm/HIP" if result.get("hip") else "CUDA"
        return Check("module_import", "FAIL", f"importing {target} initialises {gpu}", data=data,
                     why=f"the fork server imports the dataset's module: workers forked from a "
                     f"process holding a {gpu} context deadlock (GPU busy at 100%, no error); "
                     "imported as a main script, every worker makes its own context "
                     "(hundreds of MiB of GPU memory each).",
                     fix="move .cuda()/.to('cuda'), torch.cuda.* queries and model loading "
                     "into functions or under `if __name__ == \"__main__\":`.")
    threads = result.get("threads", [])
    if threads:
        return Check("module_import", "WARN", f"{took}; it starts threads: {', '.join(threads)}",
                     data=data,
                     why="fork copies only the calling thread: a lock held by these threads "
                     "stays locked in processes forked from one that imported the module "
                     "(the fork server does), and they hang.",
                     fix="start threads lazily (in a function, or with steadyload.per_worker).")
    return Check("module_import", "OK", f"{took}; no GPU context, no threads", data=data)


_WORK_CALLS = re.compile(r"\w*DataLoader|train|fit|main|cuda|backward")


def check_main_guard(path: str, source: str) -> Check:
    """Top-level code of a script that workers (which import it) would run again.

    A heuristic from the syntax tree: top-level loops and ``with`` blocks, and statements
    calling ``*DataLoader``, ``train``, ``fit``, ``main``, ``.cuda`` or ``.backward``.
    """
    try:
        tree = ast.parse(source, path)
    except SyntaxError as exc:
        return Check("main_guard", "FAIL", f"{path} does not parse: {exc}",
                     why="workers could not import it.", fix="fix the syntax error.")
    from ..start.guards import is_main_test

    guarded = any(isinstance(n, ast.If) and is_main_test(n.test) for n in tree.body)
    lines = []
    for node in tree.body:
        if isinstance(node, ast.If) and is_main_test(node.test):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # definitions run nothing at import (decorators aside)
        calls = [c.func for c in ast.walk(node) if isinstance(c, ast.Call)]
        names = [f.id if isinstance(f, ast.Name) else f.attr for f in calls
                 if isinstance(f, (ast.Name, ast.Attribute))]
        loop = isinstance(node, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith))
        if loop or any(_WORK_CALLS.fullmatch(n) for n in names):
            lines.append(node.lineno)
    data = {"path": path, "guarded": guarded, "unguarded_lines": lines}
    if not lines:
        how = "keeps its work under `if __name__ == \"__main__\":`" if guarded else \
            "runs no work at top level"
        return Check("main_guard", "OK", f"{path} {how}", data=data)
    where = ", ".join(str(n) for n in lines[:5]) + (" ..." if len(lines) > 5 else "")
    return Check("main_guard", "WARN", f"{path} runs work at top level (line {where})",
                 data=data,
                 why="forkserver and spawn workers import the main script to find the dataset "
                 "class: its top-level code runs again in every worker (steadyload refuses "
                 "to start workers from there, with MainGuardError).",
                 fix="move that code under `if __name__ == \"__main__\":`, keeping the dataset "
                 "class and imports at module level.")


def check_cpus(count: int | None, affinity: int, quota: float | None) -> Check:
    """CPUs of the machine, of this process's affinity, and the cgroup CPU quota."""
    usable = min(affinity, max(1, int(quota + 0.5))) if quota else affinity
    detail = f"{count} CPUs, {affinity} in this process's affinity" + (
        f", cgroup quota {quota:g} CPUs" if quota else "") + f": {usable} usable"
    data = {"count": count, "affinity": affinity, "quota": quota, "usable": usable}
    if usable <= 1:
        return Check("cpus", "WARN", detail, data=data,
                     why="workers and the training loop share one CPU: worker processes add "
                     "overhead without parallelism.",
                     fix="use num_workers=0 or 1, or give the job more CPUs (docker --cpus).")
    if quota and usable < affinity:
        return Check("cpus", "WARN", detail, data=data,
                     why=f"torch sizes num_workers advice by affinity ({affinity}), but the "
                     f"cgroup quota throttles the job to {quota:g} CPUs: more workers only "
                     "wait for CPU time.",
                     fix=f"use num_workers <= {max(1, usable - 1)} (one CPU for the training "
                     "loop).")
    return Check("cpus", "OK", detail, data=data)


def check_memory(cgroup: CgroupMemory, available: int | None, total: int | None) -> Check:
    """The cgroup memory limit, available memory and earlier OOM kills."""
    limit = f"cgroup limit {gib(cgroup.limit_bytes)}" if cgroup.limit_bytes else \
        "no cgroup memory limit"
    detail = f"{limit}, {gib(available)} available of {gib(total)}"
    data = {"limit_bytes": cgroup.limit_bytes, "oom_kills": cgroup.oom_kills,
            "available_bytes": available, "total_bytes": total}
    fix = ("fewer workers or a smaller prefetch_factor; large Python lists/dicts in the "
           "dataset -> steadyload.SharedList; or a higher limit (docker --memory).")
    if cgroup.oom_kills:
        return Check("memory", "WARN", f"{detail}; the OOM killer already killed "
                     f"{cgroup.oom_kills} process(es) in this cgroup", data=data, fix=fix,
                     why="a worker killed for memory dies by SIGKILL mid-batch; steadyload "
                     "replaces it, but the memory pressure stays.")
    if available is not None and available < 2 << 30:
        return Check("memory", "WARN", detail, data=data, fix=fix,
                     why="each worker needs a few hundred MiB (torch alone) plus its batches "
                     "in flight.")
    return Check("memory", "OK", detail, data=data)


def check_shm(space: Space | None, path: str, min_free: int = MIN_SHM_FREE) -> Check:
    """Size and free space of /dev/shm; FAIL when missing or under ``min_free`` free."""
    fix = ("docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with medium: "
           "Memory mounted at /dev/shm.")
    if space is None:
        return Check("shm", "FAIL", f"{path} does not exist", data={"path": path}, fix=fix,
                     why="multiprocessing's locks and torch's shared tensors live there: "
                     "workers cannot start without it.")
    data = {"path": path, "total_bytes": space.total_bytes, "free_bytes": space.free_bytes}
    detail = f"{path}: {gib(space.free_bytes)} free of {gib(space.total_bytes)}"
    if space.free_bytes < min_free:
        return Check("shm", "FAIL", detail, data=data, fix=fix,
                     why=f"under {gib(min_free)} free. torch moves the dataset's tensors "
                     "there when it sends the dataset to workers, and a full /dev/shm kills "
                     "workers with SIGBUS (Docker's default is 64 MB). steadyload's own "
                     "batches use memfd, which counts as memory instead.")
    return Check("shm", "OK", detail, data=data)


def check_open_files(soft: int, hard: int, strategy: str) -> Check:
    """``ulimit -n``: FAIL under 512 usable descriptors, WARN under 4096."""
    infinite = -1  # resource.RLIM_INFINITY on Linux
    raised = strategy == "file_descriptor" and (hard == infinite or hard > soft)
    usable = hard if raised else soft
    usable = 1 << 30 if usable == infinite else usable
    def show(n: int) -> str:
        return "unlimited" if n == infinite else str(n)

    detail = f"soft {show(soft)}, hard {show(hard)}" + (
        " (steadyload raises the soft limit to the hard one when workers start)" if raised
        else "")
    data = {"soft": soft, "hard": hard, "usable": usable}
    why = (f"torch's {strategy!r} sharing strategy and steadyload's batch segments in flight "
           f"hold descriptors; {usable} can run out and fail with 'Too many open files'.")
    fix = ("raise it before starting Python: `ulimit -n 65536` (hard limit: "
           "/etc/security/limits.conf, or docker --ulimit nofile=65536:65536).")
    if usable < 512:
        return Check("open_files", "FAIL", detail, why=why, fix=fix, data=data)
    if usable < 4096:
        return Check("open_files", "WARN", detail, why=why, fix=fix, data=data)
    return Check("open_files", "OK", detail, data=data)


def check_sharing_strategy(strategy: str, source: str) -> Check:
    """torch's tensor sharing strategy; WARN for file_system (leaves files when killed)."""
    data = {"strategy": strategy, "source": source}
    if strategy == "file_system":
        return Check("sharing_strategy", "WARN", f"file_system ({source})", data=data,
                     why="tensors are shared as /dev/shm/torch_<pid>_* files that a process "
                     "killed by SIGKILL leaves behind, filling /dev/shm until workers die.",
                     fix="drop set_sharing_strategy('file_system') and raise `ulimit -n` "
                     "instead; remove leftovers with `steadyload doctor --clean`.")
    return Check("sharing_strategy", "OK", f"{strategy} ({source})", data=data)


@dataclass(frozen=True, slots=True)
class Leftover:
    """A shared-memory file whose owner process is gone."""

    path: str
    pid: int | None
    nbytes: int


def _size(n: int) -> str:
    return f"{n >> 10} KiB" if n < 1 << 20 else gib(n)


def check_leftovers(shm_dir: str, found: list[Leftover], removed: list[Leftover] | None,
                    errors: Sequence[str] = ()) -> Check:
    """Leftover shared-memory files of dead runs; ``removed`` is None without --clean."""
    total = sum(f.nbytes for f in found)
    data = {"dir": shm_dir, "files": [asdict(f) for f in found], "bytes": total,
            "removed": None if removed is None else len(removed), "errors": list(errors)}
    if not found:
        return Check("shm_leftovers", "OK", f"none in {shm_dir}", data=data)
    if removed is not None and not errors:
        return Check("shm_leftovers", "OK", f"removed {len(removed)} file(s) of dead processes "
                     f"({_size(total)}) from {shm_dir}", data=data)
    if errors:
        return Check("shm_leftovers", "WARN", f"could not remove {len(errors)} of {len(found)} "
                     f"leftover file(s): {errors[0]}", data=data,
                     why="they keep taking /dev/shm space.",
                     fix="remove them as their owner (or root).")
    sample = ", ".join(os.path.basename(f.path) for f in found[:3])
    return Check("shm_leftovers", "WARN", f"{len(found)} file(s) of dead processes take "
                 f"{_size(total)} in {shm_dir} ({sample}{', ...' if len(found) > 3 else ''})",
                 data=data,
                 why="a process killed before it could unlink its shared memory leaves it "
                 "there; it counts against /dev/shm until removed.",
                 fix="steadyload doctor --clean (removes only files whose process is gone "
                 "and that no process here has open or mapped; with a /dev/shm shared across "
                 "containers (--ipc=host), run it where no other job runs).")
