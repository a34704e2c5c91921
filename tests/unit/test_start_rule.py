"""start/rule.py: when ``start_method="auto"`` takes the zygote, tested with injected facts;
and that a loader built in a clean process forks it while one with threads does not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from steadyload.start import rule
from steadyload.start.context import auto_method

ROOT = Path(__file__).resolve().parents[2]
CLEAN = rule.StartFacts(
    zygote_running=False, prestarted=False, unsupported=None, gpu=None, gpu_modules=(), threads=(),
    private_bytes=200 << 20,
)  # fmt: skip


def test_a_clean_lean_process_takes_the_zygote() -> None:
    method, why = rule.choose(CLEAN)
    assert method == "zygote" and "no GPU context, no other thread and a lean heap" in why
    assert auto_method(CLEAN)[0] == "zygote"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"gpu": "a CUDA context"}, "this process holds a CUDA context"),
        ({"gpu": "a ROCm/HIP GPU context (HIP 6.2)"}, "a ROCm/HIP GPU context"),
        ({"gpu_modules": ("jax",)}, "jax is imported and may hold a GPU context"),
        ({"threads": ("Thread-1 (loader)",)}, "1 other thread(s) run here (Thread-1 (loader))"),
        ({"private_bytes": rule.MAX_PRIVATE_BYTES + (1 << 20)}, "MiB of private memory"),
        ({"unsupported": "it needs Linux"}, "it needs Linux"),
    ],
)
def test_each_unsafe_or_costly_fact_keeps_forkserver(change: dict[str, object], said: str) -> None:
    method, why = rule.choose(replace(CLEAN, **change))  # type: ignore[arg-type]
    assert method == "forkserver" and why.startswith("not the zygote: ") and said in why, why


def test_a_prestarted_fork_server_is_the_users_choice() -> None:
    method, why = rule.choose(replace(CLEAN, prestarted=True))
    assert method == "forkserver" and "steadyload.prestart() started the fork server" in why


def test_a_zygote_already_running_is_used_whatever_holds_now() -> None:
    """Its workers never come from this process, so a GPU context or threads made since
    its fork are safe."""
    later = replace(CLEAN, zygote_running=True, gpu="a CUDA context", threads=("t",))
    assert rule.choose(later)[0] == "zygote"


def test_the_facts_are_read_from_this_process() -> None:
    found = rule.facts()
    assert found.private_bytes is not None and found.private_bytes > 10 << 20  # torch alone
    assert found.gpu is None  # the CPU build


_JOB = textwrap.dedent(
    """
    import json, sys, threading
    import torch
    import steadyload as sl
    from steadyload.start.context import zygote_pid
    from tests.datasets import MapDS

    if __name__ == "__main__":
        stop = threading.Event()
        if sys.argv[1] == "thread":
            threading.Thread(target=stop.wait, name="user-thread").start()
        loader = sl.DataLoader(MapDS(8), batch_size=2, num_workers=2)
        forked_at_build = zygote_pid() is not None
        got = [b[:, 0].tolist() for b in loader]
        stop.set()
        print(json.dumps({"forked_at_build": forked_at_build, "got": got,
                          "method": loader.report().start_method}))
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["clean", "thread"])
def test_the_default_forks_the_zygote_only_in_a_process_without_threads(
    case: str, tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    out = subprocess.run(
        [sys.executable, str(script), case], capture_output=True, text=True, timeout=100,
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["got"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    if case == "clean":
        assert seen["forked_at_build"] and seen["method"] == "zygote", seen
    else:
        assert not seen["forked_at_build"] and seen["method"] == "forkserver", seen
