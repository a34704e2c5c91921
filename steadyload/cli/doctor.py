"""`steadyload doctor`: check this machine for what makes DataLoader workers fail or hang.

One line per check (OK / WARN / FAIL), with the why and the fix for every non-OK line;
``--json`` for machines; exit status 1 when a check fails. The checks are pure functions
in `_doctor_checks`; this module gathers their inputs. Nothing here initialises CUDA/HIP in
this process: what might (asking torch for GPUs, importing the user's module) runs in a
child process with a deadline, started first so that it overlaps with the other checks.
torch is imported on dispatch, not at module level (quick ``steadyload --help``).
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import platform
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from . import _doctor_checks as checks
from ._doctor_checks import CHECKS, Check
from ._doctor_env import check_env

_MARK = "@@steadyload-doctor@@"  # prefixes the JSON line a child probe writes last

# Imports the module as forkserver/spawn workers do (a script under the name __mp_main__,
# so its `if __name__ == "__main__":` block is skipped), then reports what the import did.
_IMPORT_PROBE = r"""
import importlib, importlib.util, json, os, sys, threading, time
mark, target = sys.argv[1], sys.argv[2]
out = {"ok": False}
before = {t.ident for t in threading.enumerate()}
start = time.perf_counter()
try:
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(target)
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location("__mp_main__", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = module
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(target)
    out.update(ok=True, file=getattr(module, "__file__", None))
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["seconds"] = time.perf_counter() - start
out["threads"] = sorted(t.name for t in threading.enumerate() if t.ident not in before)
out["cuda_initialized"] = False
torch = sys.modules.get("torch")
if torch is not None:
    out["hip"] = getattr(torch.version, "hip", None)
    try:
        out["cuda_initialized"] = bool(torch.cuda.is_initialized())
        out["sharing_strategy"] = torch.multiprocessing.get_sharing_strategy()
    except Exception:
        pass
os.write(1, ("\n" + mark + json.dumps(out) + "\n").encode())
os._exit(0)  # skip the module's atexit hooks and non-daemon threads
"""

_GPU_PROBE = r"""
import json, os, sys, torch
out = {"available": False, "devices": []}
try:
    out["available"] = torch.cuda.is_available()
    for i in range(torch.cuda.device_count() if out["available"] else 0):
        p = torch.cuda.get_device_properties(i)
        arch = getattr(p, "gcnArchName", "") or f"sm_{p.major}{p.minor}"
        out["devices"].append({"name": p.name, "arch": arch, "memory_bytes": p.total_memory})
    out["arch_list"] = torch.cuda.get_arch_list()
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
os.write(1, ("\n" + sys.argv[1] + json.dumps(out) + "\n").encode())
"""


def _spawn(code: str, *args: str) -> tuple[subprocess.Popen[str], float]:
    # A session of its own, so that a timeout kills whatever the user's module started too.
    proc = subprocess.Popen(
        [sys.executable, "-c", code, _MARK, *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    return proc, time.monotonic()


def _finish(child: tuple[subprocess.Popen[str], float], timeout_s: float,
            ) -> tuple[dict[str, Any] | None, str]:
    """The probe's JSON result, or (None, what went wrong); never waits past the deadline."""
    proc, started = child
    try:
        out, err = proc.communicate(timeout=max(0.1, started + timeout_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild left its own session, pipes open
            pass
        return None, f"did not finish within {timeout_s:g} s"
    for line in reversed(out.splitlines()):
        if line.startswith(_MARK):
            result: dict[str, Any] = json.loads(line[len(_MARK):])
            return result, ""
    code = proc.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    tail = err.strip().splitlines()[-1:] or [""]
    return None, f"the child process {how} {tail[0]}".strip()


def _kfd_archs() -> list[str]:
    """The GPUs' own gfx names from the ROCm driver (sysfs), unaffected by any override."""
    archs = []
    for path in sorted(glob.glob("/sys/class/kfd/kfd/topology/nodes/*/properties")):
        try:
            with open(path) as f:
                props = dict(line.split(None, 1) for line in f if " " in line)
            v = int(props.get("gfx_target_version", "0"))
        except (OSError, ValueError):
            continue
        if v:  # 0: a CPU node
            archs.append(f"gfx{v // 10000}{(v // 100) % 100:x}{v % 100:x}")
    return archs


# torch: /torch_<pid>_<random>_<counter> (at::NewProcessWideShmHandle, file_system strategy);
# steadyload's own segments are memfds, but older runs and tools named them sl-<pid>-<n>.
_SHM_NAME = re.compile(r"^(?:torch_(\d+)_|sl-(\d+)-|steadyload[-_]?(\d+)?)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _paths_in_use() -> set[str]:
    """Files open or mapped by any process we can see (/proc/*/fd and /proc/*/maps)."""
    used: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                used.add(os.readlink(f"/proc/{entry}/fd/{fd}").removesuffix(" (deleted)"))
            with open(f"/proc/{entry}/maps") as f:
                used.update(line.split(None, 5)[5].strip() for line in f if line.count(" ") > 5)
        except OSError:  # the process exited, or is not ours to read
            continue
    return used


def find_leftovers(shm_dir: str) -> list[checks.Leftover]:
    """torch_*/sl-*/steadyload* files in ``shm_dir`` whose pid is dead and nobody maps."""
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    candidates = []
    for name in names:
        m = _SHM_NAME.match(name)
        if not m:
            continue
        pid = next((int(g) for g in m.groups() if g), None)
        if pid is not None and _pid_alive(pid):
            continue
        path = os.path.join(shm_dir, name)
        try:
            candidates.append(checks.Leftover(path, pid, os.stat(path).st_blocks * 512))
        except OSError:
            continue
    if not candidates:
        return []
    used = _paths_in_use()
    return [c for c in candidates if os.path.realpath(c.path) not in used]


def clean_leftovers(leftovers: list[checks.Leftover]) -> tuple[list[checks.Leftover], list[str]]:
    """Delete the files; returns (removed, error messages)."""
    removed, errors = [], []
    for item in leftovers:
        try:
            os.unlink(item.path)
            removed.append(item)
        except FileNotFoundError:
            removed.append(item)
        except OSError as exc:
            errors.append(f"{item.path}: {exc.strerror}")
    return removed, errors


def _one_worker(timeout_s: float) -> Check:
    """Start one real forkserver worker through a tiny steadyload.DataLoader."""
    import torch

    from ..loader import DataLoader
    from ..start.preload import forkserver_running

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return Check("forkserver", "OK", "not available on this platform (workers use spawn)")
    was_running = forkserver_running()
    began = time.perf_counter()
    try:
        loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=2,
                            num_workers=1, start_method="forkserver", timeout=timeout_s)
        got = [batch[0].tolist() for batch in loader]
        if got != [[0, 1], [2, 3]]:
            raise RuntimeError(f"[steadyload internal error] one worker returned {got}, "
                               "expected [[0, 1], [2, 3]]; please report it with this output")
    except Exception as exc:
        return checks.check_forkserver(None, None, f"{type(exc).__name__}: {exc}", was_running)
    return checks.check_forkserver(loader.report(), time.perf_counter() - began, "",
                                   was_running)


def collect(module: str | None = None, *, clean: bool = False, shm_dir: str = "/dev/shm",
            skip: Sequence[str] = (), timeout_s: float = 60.0,
            env: Mapping[str, str] | None = None) -> list[Check]:
    """Run every check not in ``skip`` on this machine, in `CHECKS` order.

    Takes a few seconds, mostly the fork server importing torch. ``module`` (a path or a
    dotted name) is imported in a child; ``clean`` deletes leftover shared-memory files of
    dead processes from ``shm_dir``; ``timeout_s`` bounds the worker and each child.
    """
    import torch
    import torch.multiprocessing as tmp

    from ..host import system
    from ..start.context import default_method

    env = os.environ if env is None else env
    want = set(CHECKS) - set(skip)
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    gpu_build = bool(cuda or hip)
    mod_child = _spawn(_IMPORT_PROBE, module) if module and want & {
        "module_import", "main_guard", "sharing_strategy"} else None
    gpu_child = _spawn(_GPU_PROBE) if gpu_build and want & {"gpu", "env"} else None
    soft, hard = system.fd_limits()  # before a worker starts: that raises the soft limit
    out: list[Check] = []
    if "python" in want:
        out.append(checks.check_python(platform.python_version(),
                                       platform.python_implementation(), sys.executable))
    if "torch" in want:
        out.append(checks.check_torch(torch.__version__, cuda, hip))
    gpu, gpu_error = _finish(gpu_child, timeout_s) if gpu_child else (None, "")
    if gpu_build and "gpu" in want:
        out.append(checks.check_gpu(checks.torch_build(cuda, hip), gpu, gpu_error))
    if "start_method" in want:
        out.append(checks.check_start_method(default_method()))
    if "forkserver" in want:
        out.append(_one_worker(timeout_s))
    imported, import_error = _finish(mod_child, timeout_s) if mod_child else (None, "")
    if module and "module_import" in want:
        out.append(checks.check_module_import(module, imported, import_error))
    path = (imported or {}).get("file") or (module if module and module.endswith(".py")
                                            else None)
    if path and "main_guard" in want:
        try:
            with open(path, encoding="utf-8") as f:
                out.append(checks.check_main_guard(path, f.read()))
        except OSError as exc:
            out.append(Check("main_guard", "WARN", f"cannot read {path}: {exc.strerror}"))
    if "cpus" in want:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        out.append(checks.check_cpus(os.cpu_count(), affinity, system.cpu_quota()))
    if "memory" in want:
        out.append(checks.check_memory(system.cgroup_memory(), system.available_memory_bytes(),
                                       system.total_memory_bytes()))
    if "shm" in want:
        out.append(checks.check_shm(system.shm_space(shm_dir), shm_dir))
    strategy, source = tmp.get_sharing_strategy(), "torch's default"
    if imported and imported.get("sharing_strategy", strategy) != strategy:
        strategy, source = imported["sharing_strategy"], f"set by {module} at import"
    if "open_files" in want:
        out.append(checks.check_open_files(soft, hard, strategy))
    if "sharing_strategy" in want:
        out.append(checks.check_sharing_strategy(strategy, source))
    if "shm_leftovers" in want:
        found = find_leftovers(shm_dir)
        removed, errors = clean_leftovers(found) if clean else (None, [])
        out.append(checks.check_leftovers(shm_dir, found, removed, errors))
    if "env" in want:
        archs = _kfd_archs() if hip else []
        if not archs and gpu and "HSA_OVERRIDE_GFX_VERSION" not in env:
            archs = [d["arch"] for d in gpu.get("devices", [])]
        out.extend(check_env(env, hip, archs, (gpu or {}).get("arch_list")))
    return out


def summarize(results: Sequence[Check]) -> dict[str, int]:
    """Counts per status and the exit code (1 when any check failed)."""
    counts = {s: sum(c.status == s for c in results) for s in ("OK", "WARN", "FAIL")}
    return {"ok": counts["OK"], "warn": counts["WARN"], "fail": counts["FAIL"],
            "exit_code": 1 if counts["FAIL"] else 0}


def format_text(results: Sequence[Check]) -> str:
    """One line per check; for non-OK, indented ``why:`` and ``fix:`` lines; a summary."""
    lines = []
    for c in results:
        lines.append(f"{c.status:<6}{c.name}: {c.detail}")
        for label, text in (("why", c.why), ("fix", c.fix)):
            if not text or c.status == "OK":
                continue
            prefix = f"      {label}: "
            for line in filter(str.strip, text.splitlines()):
                if line.startswith(" "):  # code in a fix: keep it as written
                    lines.append(" " * 11 + line)
                else:
                    lines.append(textwrap.fill(line, 100, initial_indent=prefix,
                                               subsequent_indent=" " * 11,
                                               break_long_words=False, break_on_hyphens=False))
                prefix = " " * 11
    s = summarize(results)
    lines.append(f"summary: {s['ok']} OK, {s['warn']} WARN, {s['fail']} FAIL")
    return "\n".join(lines)


def to_json(results: Sequence[Check]) -> dict[str, Any]:
    """The ``--json`` document: ``{"version": 1, "checks": [...], "summary": {...}}``."""
    return {"version": 1, "checks": [asdict(c) for c in results],
            "summary": summarize(results)}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``steadyload doctor`` and its options."""
    p = subparsers.add_parser(
        "doctor", help="check this machine for what breaks DataLoader workers",
        description="Check this machine for what makes DataLoader workers fail or hang: "
        "one line per check, with the why and the fix. Exit status 1 when a check fails.")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--module", metavar="PATH_OR_NAME",
                   help="import your training script or dataset module (train.py or "
                   "pkg.data) in a child, as workers do, and report whether that creates "
                   "a CUDA/HIP context or threads; its __main__ block is not run")
    p.add_argument("--clean", action="store_true", help="delete leftover shared-memory files "
                   "of dead processes (only those no process has open)")
    p.add_argument("--shm-dir", default="/dev/shm", metavar="DIR",
                   help="shared-memory directory to check (default: /dev/shm)")
    p.add_argument("--skip", action="append", default=[], choices=CHECKS, metavar="CHECK",
                   help=f"leave out a check (repeatable): {', '.join(CHECKS)}")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="limit for the test worker and for each child probe (default 60)")


def run(args: argparse.Namespace) -> int:
    """Run the checks, print them, and return the exit status (1 when any failed)."""
    if not args.timeout > 0:
        raise SystemExit(f"steadyload doctor: --timeout must be > 0 seconds, "
                         f"got {args.timeout!r}")
    results = collect(args.module, clean=args.clean, shm_dir=args.shm_dir, skip=args.skip,
                      timeout_s=args.timeout)
    if args.json:
        print(json.dumps(to_json(results), indent=2))
    else:
        print(format_text(results))
        if not args.module:
            print("tip: add --module train.py to check what importing your script does in "
                  "a worker")
    return summarize(results)["exit_code"]
