#!/usr/bin/env python3
"""Developer entry point: `python3 dev.py demo` or `python3 dev.py test [pytest args]`.

`python3 dev.py test` alone runs the whole suite on two pytest processes (pytest-xdist);
with pytest arguments it runs what they select, in one process unless they say `-n N`.

Creates (or reuses) ./.venv, installs the pinned requirements and steadyload itself
(editable) when they changed, then runs the demo or the test suite. Needs only python3.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".steadyload-installed"


def ensure_venv() -> None:
    """Create the virtualenv and install pinned dependencies if anything changed."""
    if not PY.exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    inputs = b"".join((ROOT / f).read_bytes() for f in ("requirements-dev.txt", "pyproject.toml"))
    digest = hashlib.sha256(inputs).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    print("installing pinned dependencies (torch==2.13.0 CPU build first)", flush=True)
    # torch first and alone, pinned, so nothing can pull an unpinned (CUDA) build.
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "-r", str(ROOT / "requirements-dev.txt")], check=True)
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)], check=True)
    STAMP.write_text(digest)


def main(argv: list[str]) -> int:
    """Dispatch ``demo`` or ``test``."""
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        return 2
    ensure_venv()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if argv[0] == "demo":
        cmd = [str(PY), str(ROOT / "examples" / "lora_vlm" / "demo.py"), *argv[1:]]
    else:
        # The whole suite on two pytest processes (pytest-xdist): most tests wait on worker
        # processes, imports and subprocess jobs, so two in parallel keep the cores busy.
        # With arguments (a file, -k, -n 0) pytest runs as asked.
        # --dist loadgroup (tests/conftest.py's scheduler): the modules in ONE_PROCESS run
        # whole in one pytest process, so one local Ray cluster serves all of
        # tests/integration/test_remote.py.
        cmd = [str(PY), "-m", "pytest", *(argv[1:] or ["-n", "2", "--dist", "loadgroup"])]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
