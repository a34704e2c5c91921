"""The bench-only environment of the peer loaders, ``.venv-peers``, and re-running in it.

The peers (torchdata 0.11, SPDL 0.8, Grain 0.2.18) are never steadyload's dependencies:
they live in ``ROOT/.venv-peers``, created on first use with the torch==2.13.0 CPU build
pinned (installed first and alone: an unpinned torch pulls a multi-GB CUDA build). A
benchmark calls `reexec_in_peers_env(__file__)` before it imports torch; its children get
``ROOT`` (steadyload) and ``benchmarks/`` on ``PYTHONPATH`` (`child_env`). This module
imports nothing outside the standard library: any python3 can run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS_VENV = ROOT / ".venv-peers"
TORCH = "torch==2.13.0"  # on every pip command line
PEERS = ["torchdata==0.11.0", "spdl==0.8.0", "grain==0.2.18"]
BASE = ["numpy==2.4.6", "psutil==7.2.2", "cloudpickle==3.1.3", "pillow==13.0.0"]


def in_peers_env() -> bool:
    """Whether this interpreter has the peers (torchdata, SPDL, Grain)."""
    try:
        import grain  # noqa: F401
        import spdl.dataloader  # noqa: F401
        import torchdata.nodes  # noqa: F401
    except ImportError:
        return False
    return True


def create_peers_env() -> Path:
    """``.venv-peers``'s python, the environment created first if it is not there."""
    py = PEERS_VENV / "bin" / "python"
    if not py.exists():
        print(f"creating the bench-only environment {PEERS_VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(PEERS_VENV)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, TORCH], check=True)  # first and alone: the CPU build
        subprocess.run([*pip, TORCH, *BASE, *PEERS], check=True)
    return py


def reexec_in_peers_env(script: str) -> None:
    """Run ``script`` with this process's arguments in ``.venv-peers`` (never returns),
    steadyload importable there: ``ROOT`` and ``benchmarks/`` put on ``PYTHONPATH``."""
    py = create_peers_env()
    os.environ["PYTHONPATH"] = child_pythonpath()
    os.execv(str(py), [str(py), script, *sys.argv[1:]])


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a benchmark's child processes: steadyload (``ROOT``), then
    ``benchmarks/`` (the shared datasets)."""
    return f"{ROOT}{os.pathsep}{HERE}"


if __name__ == "__main__":
    print(create_peers_env())
