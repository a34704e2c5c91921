"""The ``--json`` files of the benchmarks: their figures plus where the figures came from.

Every benchmark writes its results with `write_json`, which adds the provenance that
``render_docs.py`` prints above each table of ``docs/benchmarks.md``: ``source`` (how the
figures were obtained), ``command``, ``date``, ``commit`` and ``machine``. Commit a file
under ``benchmarks/results/`` and run ``python3 benchmarks/render_docs.py`` to publish it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def provenance() -> dict[str, Any]:
    """Where the figures of this run come from: the command, date, commit and machine."""
    torch = sys.modules.get("torch")
    torch_version = getattr(torch, "__version__", None) if torch is not None else None
    script = Path(sys.argv[0]).name
    return {
        "source": f"measured by benchmarks/{script}",
        "command": " ".join(["python3", f"benchmarks/{script}", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "machine": f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}"
        + (f", torch {torch_version}" if torch_version else ""),
    }


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` to ``path`` with the provenance keys first."""
    path.write_text(json.dumps({**provenance(), **results}, indent=1) + "\n")
