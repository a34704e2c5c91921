"""Imported last by the fork server: records which of the requested preloads it imported.

CPython's fork server swallows ImportError from its preload list (3.11 silently skips a
module it cannot import). Workers are forked from the server, so they inherit this
module as the server left it and can report what is missing.
"""

from __future__ import annotations

import sys


def _in_fork_server() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith("forkserver.py"):
            return True
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    return False


IN_FORK_SERVER = _in_fork_server()
IMPORTED = frozenset(sys.modules) if IN_FORK_SERVER else frozenset()
