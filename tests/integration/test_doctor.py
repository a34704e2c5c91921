"""`steadyload doctor`: each check on this machine, and each non-OK outcome provoked for real
where that is possible (a small tmpfs as /dev/shm, a low `ulimit -n`, files of dead pids,
harmful environment variables, a module that "initialises CUDA" at import), else through
the pure check functions with provoked inputs."""

from __future__ import annotations

import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from steadyload.cli import _doctor_checks as checks
from steadyload.cli import _doctor_env as env_checks
from steadyload.cli.__main__ import main
from steadyload.cli.doctor import CHECKS, collect, find_leftovers, format_text, to_json
from steadyload.host.system import CgroupMemory, Space

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"name", "status", "detail", "why", "fix", "data"}


def only(*names: str) -> list[str]:
    """``skip`` for `collect` that leaves only ``names``."""
    return [c for c in CHECKS if c not in names]


def by_name(results: list[Any]) -> dict[str, Any]:
    return {c.name: c for c in results}


def doctor_cli(*args: str, preexec: Any = None, wrap: list[str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
    """Run the command in a child (exit status, limits, mounts), with a deadline."""
    cmd = [*(wrap or []), sys.executable, "-m", "steadyload", "doctor", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=50,
                          preexec_fn=preexec)


def dead_pid() -> int:
    """A pid that belonged to a process which has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    return proc.pid


# -- this machine, end to end ---------------------------------------------------------------


def test_doctor_json_on_this_machine_starts_a_real_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 1 and set(doc["summary"]) == {"ok", "warn", "fail", "exit_code"}
    assert all(set(c) == FIELDS for c in doc["checks"])
    names = [c["name"] for c in doc["checks"]]
    assert names[:3] == ["python", "torch", "start_method"]  # CPU build: no gpu line
    assert {"forkserver", "cpus", "memory", "shm", "open_files", "sharing_strategy",
            "shm_leftovers", "env"} <= set(names)
    checks_ = {c["name"]: c for c in doc["checks"]}
    assert checks_["torch"]["data"]["build"] == "CPU" and checks_["torch"]["status"] == "OK"
    worker = checks_["forkserver"]
    assert worker["status"] == "OK", worker
    assert worker["data"]["worker_start_s"] > 0 and "torch" in worker["data"]["preload_requested"]
    assert worker["data"]["preload_missing"] == [], "the fork server imported every preload"
    assert doc["summary"]["fail"] == 0 and doc["summary"]["exit_code"] == 0


def test_python_m_steadyload_doctor_starts_its_worker_and_exits_0() -> None:
    # Through `python -m steadyload`: its worker imports no command line again.
    out = doctor_cli("--json", "--skip", "shm_leftovers")
    assert out.returncode == 0, out.stdout + out.stderr
    (worker,) = [c for c in json.loads(out.stdout)["checks"] if c["name"] == "forkserver"]
    assert worker["status"] == "OK" and worker["data"]["preload_missing"] == [], worker


def test_doctor_text_one_line_per_check_then_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-v", "doctor", "--skip", "forkserver"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = [ln for ln in lines if not ln.startswith((" ", "summary:", "tip:"))]
    assert body and all(
        ln.startswith(("OK    ", "WARN  ", "FAIL  ")) and ": " in ln for ln in body
    ), body
    assert not any(ln.split()[1] == "forkserver:" for ln in body)
    assert any(ln.startswith("summary: ") and ln.endswith(" 0 FAIL") for ln in lines)
    assert lines[-1].startswith("tip: add --module train.py")


def test_cli_without_subcommand_prints_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "doctor" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("steadyload ")
    with pytest.raises(SystemExit):
        main(["doctor", "--skip", "nonsense"])
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err


def test_format_text_indents_why_and_fix_of_non_ok_lines() -> None:
    text = format_text([
        checks.Check("a", "OK", "fine", why="unused", fix="unused"),
        checks.Check("b", "FAIL", "broken", why="because " * 20, fix="do this:\n    code()"),
    ])
    assert text.splitlines()[0] == "OK    a: fine"
    assert text.splitlines()[1] == "FAIL  b: broken"
    assert text.splitlines()[2].startswith("      why: because")
    assert "               code()" in text.splitlines()  # code kept as written, indented
    assert text.splitlines()[-1] == "summary: 1 OK, 0 WARN, 1 FAIL"
    assert to_json([checks.Check("b", "FAIL", "x")])["summary"]["exit_code"] == 1


# -- /dev/shm ------------------------------------------------------------------------------


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                           capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs a private mount namespace (root)")
def test_small_shm_fails_with_exit_status_1(tmp_path: Path) -> None:
    # A real 64 MiB tmpfs, as Docker's default /dev/shm, mounted only in the child's namespace.
    shm = tmp_path / "shm"
    shm.mkdir()
    mount = f"mount -t tmpfs -o size=64m tmpfs {shm} && exec \"$@\""
    out = doctor_cli("--json", "--shm-dir", str(shm), "--skip", "forkserver",
                     wrap=["unshare", "-m", "sh", "-c", mount, "sh"])
    assert out.returncode == 1, out.stderr
    result = by_name([checks.Check(**c) for c in json.loads(out.stdout)["checks"]])["shm"]
    assert result.status == "FAIL"
    assert result.detail == f"{shm}: 64 MiB free of 64 MiB"
    assert "SIGBUS" in result.why and "--shm-size" in result.fix


def test_missing_shm_dir_fails(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-shm")
    (result,) = collect(shm_dir=missing, skip=only("shm"))
    assert (result.status, result.detail) == ("FAIL", f"{missing} does not exist")


def test_shm_thresholds() -> None:
    assert checks.check_shm(Space("/dev/shm", 8 << 30, 8 << 30), "/dev/shm").status == "OK"
    low = checks.check_shm(Space("/dev/shm", 8 << 30, 900 << 20), "/dev/shm")
    assert low.status == "FAIL" and low.detail == "/dev/shm: 900 MiB free of 8.0 GiB"


# -- ulimit -n -----------------------------------------------------------------------------


def test_low_open_file_limit_fails_in_a_child() -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    out = doctor_cli("--skip", "forkserver", preexec=low_limit)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  open_files: soft 200, hard 200\n" in out.stdout
    assert "fix: raise it before starting Python: `ulimit -n 65536`" in out.stdout


@pytest.mark.parametrize(("soft", "hard", "strategy", "status"), [
    (256, 256, "file_descriptor", "FAIL"),
    (1024, 1024, "file_descriptor", "WARN"),
    (1024, 65536, "file_descriptor", "OK"),  # steadyload raises soft to hard at start
    (1024, 65536, "file_system", "WARN"),  # ... only under file_descriptor
    (65536, -1, "file_descriptor", "OK"),
])
def test_open_file_thresholds(soft: int, hard: int, strategy: str, status: str) -> None:
    assert checks.check_open_files(soft, hard, strategy).status == status


# -- leftover shared-memory files ----------------------------------------------------------


def test_leftovers_of_dead_pids_are_reported_and_cleaned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    dead = dead_pid()
    for name in (f"torch_{dead}_123_0", f"sl-{dead}-0", f"torch_{os.getpid()}_1_0",
                 f"torch_{dead}_7_1", "psm_abc", "unrelated"):
        (tmp_path / name).write_bytes(b"x" * 8192)
    mapped = tmp_path / f"torch_{dead}_7_1"  # the creator died, a live process maps it
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 0):
        found = find_leftovers(str(tmp_path))
        assert main(["doctor", "--clean", "--shm-dir", str(tmp_path), "--json",
                     *(f"--skip={c}" for c in only("shm_leftovers"))]) == 0
    assert sorted(os.path.basename(f.path) for f in found) == [f"sl-{dead}-0", f"torch_{dead}_123_0"]
    assert {f.pid for f in found} == {dead} and all(f.nbytes >= 8192 for f in found)
    report = checks.check_leftovers(str(tmp_path), found, None)
    assert report.status == "WARN" and report.detail.startswith("2 file(s) of dead processes take")
    assert report.fix.startswith("steadyload doctor --clean")

    (doc,) = json.loads(capsys.readouterr().out)["checks"]
    assert doc["status"] == "OK"
    assert doc["detail"] == f"removed 2 file(s) of dead processes (16 KiB) from {tmp_path}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"torch_{os.getpid()}_1_0", f"torch_{dead}_7_1", "psm_abc", "unrelated"])


# -- the user's module -----------------------------------------------------------------------


def write(path: Path, source: str) -> str:
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_module_that_initialises_cuda_at_import_fails(tmp_path: Path) -> None:
    # The provoked condition: no GPU here, so the module plays one that called .cuda() at
    # import by making torch.cuda.is_initialized() report True.
    marker = tmp_path / "main-ran"
    module = write(tmp_path / "train.py", f"""
        import torch
        torch.cuda.is_initialized = lambda: True

        class Data(torch.utils.data.Dataset):
            pass

        if __name__ == "__main__":
            open({str(marker)!r}, "w").close()
    """)
    results = by_name(collect(module, skip=only("module_import", "main_guard")))
    gpu = results["module_import"]
    assert gpu.status == "FAIL" and gpu.detail == f"importing {module} initialises CUDA"
    assert "deadlock" in gpu.why and "if __name__" in gpu.fix
    assert results["main_guard"].status == "OK"
    assert not marker.exists(), "the module's __main__ block must not run"


def test_module_with_threads_and_file_system_sharing_warns(tmp_path: Path) -> None:
    module = write(tmp_path / "data_mod.py", """
        import threading
        import torch.multiprocessing

        torch.multiprocessing.set_sharing_strategy("file_system")
        threading.Thread(target=threading.Event().wait, args=(30,), name="prefetcher",
                         daemon=True).start()
        for i in range(3):  # top-level work that every worker would redo
            pass
    """)
    results = by_name(collect(module, skip=only("module_import", "main_guard",
                                                 "sharing_strategy")))
    assert results["module_import"].status == "WARN"
    assert results["module_import"].detail.endswith("it starts threads: prefetcher")
    assert results["sharing_strategy"].status == "WARN"
    assert results["sharing_strategy"].detail == f"file_system (set by {module} at import)"
    guard = results["main_guard"]
    assert guard.status == "WARN" and guard.detail == f"{module} runs work at top level (line 8)"


def test_module_import_is_bounded_and_failures_are_reported(tmp_path: Path) -> None:
    hangs = write(tmp_path / "slow.py", "import time\ntime.sleep(60)\n")
    (result,) = collect(hangs, skip=only("module_import"), timeout_s=2)
    assert result.status == "FAIL" and result.detail.endswith("did not finish within 2 s")
    broken = write(tmp_path / "broken.py", "import no_such_module_here\n")
    (result,) = collect(broken, skip=only("module_import"))
    assert result.status == "FAIL"
    assert result.detail.endswith("ModuleNotFoundError: No module named 'no_such_module_here'")


def test_main_guard_from_the_syntax_tree() -> None:
    guarded = "import torch\nclass D: pass\nif __name__ == '__main__':\n    for x in D(): pass\n"
    assert checks.check_main_guard("t.py", guarded).status == "OK"
    unguarded = "import torch\nx = 1\nloader = sl.DataLoader(D())\ntrain(loader)\n"
    result = checks.check_main_guard("t.py", unguarded)
    assert result.status == "WARN" and result.data["unguarded_lines"] == [3, 4]
    assert checks.check_main_guard("t.py", "def (:\n").status == "FAIL"


# -- environment variables -------------------------------------------------------------------


def test_harmful_environment_variables_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_TUNABLEOP_ENABLED", "1")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "12.0.1")
    results = by_name(collect(skip=only("env")))
    assert results["env.PYTORCH_TUNABLEOP_ENABLED"].status == "WARN"
    assert "minutes of tuning" in results["env.PYTORCH_TUNABLEOP_ENABLED"].why
    assert results["env.CUDA_LAUNCH_BLOCKING"].status == "WARN"
    hsa = results["env.HSA_OVERRIDE_GFX_VERSION"]  # this torch is a CPU build
    assert (hsa.status, hsa.detail) == ("OK", "set to 12.0.1, ignored (not a ROCm build of torch)")
    monkeypatch.setenv("PYTORCH_TUNABLEOP_TUNING", "0")  # replaying tuned results: fine
    assert "env.PYTORCH_TUNABLEOP_ENABLED" not in by_name(collect(skip=only("env")))


def test_clean_environment_is_one_ok_line() -> None:
    (result,) = env_checks.check_env({"STEADYLOAD_DEBUG": "1", "PATH": "/bin"})
    assert (result.name, result.status) == ("env", "OK")
    assert result.detail.endswith("steadyload switches: STEADYLOAD_DEBUG")


@pytest.mark.parametrize(("devices", "arch_list", "status"), [
    (["gfx1201"], ["gfx1100", "gfx1201"], "FAIL"),  # RDNA4, supported natively: crashes
    (["gfx90a:sramecc+:xnack-"], ["gfx90a", "gfx942"], "WARN"),  # native, override useless
    (["gfx1103"], ["gfx1100"], "OK"),  # not built for: what the override is for
    ([], None, "WARN"),  # cannot tell
])
def test_hsa_override_against_native_support(
    devices: list[str], arch_list: list[str] | None, status: str,
) -> None:
    result = env_checks.check_hsa_override("11.0.0", "7.2.0", devices, arch_list)
    assert result.status == status, result
    if status != "OK":
        assert "unset HSA_OVERRIDE_GFX_VERSION" in result.fix
    assert env_checks.gfx_from_override("9.0.10") == "gfx90a"
    assert env_checks.gfx_from_override("11.0.0") == "gfx1100"


# -- the other checks, provoked ----------------------------------------------------------------


def test_torch_build_and_version() -> None:
    assert checks.check_torch("2.13.0", None, "7.2.0").detail == "2.13.0, ROCm/HIP 7.2.0 build"
    assert checks.check_torch("2.8.0", "12.8", None).detail == "2.8.0, CUDA 12.8 build"
    old = checks.check_torch("2.4.1", "12.1", None)
    assert old.status == "WARN" and "torch>=2.6" in old.fix


def test_gpu_probe_outcomes() -> None:
    assert checks.check_gpu("CUDA 12.8", None, "did not finish within 60 s").status == "WARN"
    none = checks.check_gpu("CUDA 12.8", {"available": False, "devices": []}, "")
    assert none.status == "WARN" and none.detail == "torch (CUDA 12.8 build) sees no usable GPU"
    one = checks.check_gpu("CUDA 12.8", {"available": True, "devices": [
        {"name": "NVIDIA H200", "arch": "sm_90", "memory_bytes": 1}]}, "")
    assert (one.status, one.detail) == ("OK", "1 GPU(s): NVIDIA H200 (sm_90)")


def test_cpu_and_memory_checks() -> None:
    assert checks.check_cpus(16, 16, None).status == "OK"
    quota = checks.check_cpus(16, 16, 4.0)
    assert quota.status == "WARN" and "num_workers <= 3" in quota.fix
    assert checks.check_cpus(8, 1, None).status == "WARN"
    assert checks.check_memory(CgroupMemory(8 << 30, 0), 6 << 30, 16 << 30).status == "OK"
    oom = checks.check_memory(CgroupMemory(8 << 30, 2), 6 << 30, 16 << 30)
    assert oom.status == "WARN" and "already killed 2 process(es)" in oom.detail
    assert checks.check_memory(CgroupMemory(None, None), 1 << 30, 16 << 30).status == "WARN"


def test_forkserver_failure_splits_why_and_fix() -> None:
    error = ("WorkerStartError: worker 0 (pid 7) died while starting.\n"
             "Likely cause: the fork server could not import x.\nFix: pip install x.")
    result = checks.check_forkserver(None, None, error, was_running=True)
    assert result.status == "FAIL"
    assert result.detail == "could not run one worker: WorkerStartError: worker 0 (pid 7) died while starting."
    assert (result.why, result.fix) == ("the fork server could not import x.", "pip install x.")


def test_forkserver_missing_preloads_warn() -> None:
    from steadyload.report import LoaderReport, WorkerReport

    report = LoaderReport("forkserver", ("torch", "mylib"), ("mylib",),
                          (WorkerReport(0, 123, 0.05),))
    result = checks.check_forkserver(report, 0.2, "", was_running=True)
    assert result.status == "WARN" and result.detail.endswith("the fork server did not import mylib")
    assert "import mylib" in result.fix
