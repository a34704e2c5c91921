"""What steadyload says when the fork-safe recipe is broken, one mistake at a time.

Run: python examples/error_gallery.py
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch

import steadyload as sl

ROOT = Path(__file__).resolve().parents[1]


class WithConnection(torch.utils.data.Dataset[Any]):
    """Mistake 1: a database connection opened in __init__ travels with the dataset."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:")

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


class Corrupt(torch.utils.data.Dataset[Any]):
    """Mistake 2 (not ours, the data's): sample 5 is broken."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise ValueError("truncated JPEG in shard-0003/000005.jpg")
        return i


def show(title: str, exc: BaseException) -> None:
    print(f"--- {title}: {type(exc).__name__}")
    print(textwrap.indent(str(exc).rstrip(), "    "))
    for note in getattr(exc, "__notes__", []):
        print(f"    note: {note}")
    print()


def main() -> None:
    try:
        list(sl.DataLoader(WithConnection(), num_workers=2))
    except sl.NotPicklableError as exc:
        show("a connection inside the dataset", exc)
    try:
        list(sl.DataLoader(Corrupt(), batch_size=2, num_workers=2))
    except ValueError as exc:
        show("an exception in __getitem__ (its own type, with the sample index)", exc)
    unguarded = textwrap.dedent(
        """
        import steadyload as sl
        from examples.error_gallery import Corrupt

        for batch in sl.DataLoader(Corrupt(), num_workers=2):
            pass
        """
    )
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(unguarded)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    last = out.stderr[out.stderr.index("steadyload.MainGuardError"):]
    print("--- training code at the top level of train.py, without the main guard")
    print(textwrap.indent(last.rstrip(), "    "))
    print()
    original = torch.cuda.is_initialized
    torch.cuda.is_initialized = lambda: True  # pretend a GPU is in use (this machine may have none)
    try:
        iter(sl.DataLoader(Corrupt(), num_workers=2, start_method="fork"))
    except sl.UnsafeForkError as exc:
        show("fork after the GPU was initialised (simulated)", exc)
    finally:
        torch.cuda.is_initialized = original


if __name__ == "__main__":
    main()
