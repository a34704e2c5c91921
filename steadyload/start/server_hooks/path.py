"""Imported first by the fork server: restores the parent's ``sys.path`` there.

CPython 3.11 to 3.13.7 pass the parent's ``sys.path`` to the fork server's ``main`` (as its
``sys_path`` argument) but never apply it, so local modules, such as the one that defines
the dataset, cannot be preloaded. ``main`` imports the preloads itself, so this module,
the first of them, finds that argument in ``main``'s frame and applies it before the other
preloads. Nothing crosses in the environment: the parent sets no process-wide variable
while other threads may start children, and a server that CPython restarts after a crash
gets the path the same way.
"""

from __future__ import annotations

import sys


def _main_sys_path() -> list[str] | None:
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith("forkserver.py"):
            path = frame.f_locals.get("sys_path")
            return list(path) if isinstance(path, (list, tuple)) else None
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    return None


for _entry in reversed(_main_sys_path() or ()):
    if isinstance(_entry, str) and _entry not in sys.path:
        sys.path.insert(0, _entry)
