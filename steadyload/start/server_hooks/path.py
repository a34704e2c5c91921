"""Imported first by the fork server: restores the parent's ``sys.path`` there.

CPython 3.11 to 3.13.7 pass the parent's ``sys.path`` to the fork server but never apply it
(forkserver.main ignores its ``sys_path`` argument), so local modules, such as the one that
defines the dataset, cannot be preloaded. steadyload hands the path over in the
environment of the server process (set only while it is being started) and applies it
here, before the other preloads.
"""

from __future__ import annotations

import json
import os
import sys

ENV = "_STEADYLOAD_FORKSERVER_SYS_PATH"

_path = os.environ.pop(ENV, None)
if _path is not None:
    for _entry in reversed(json.loads(_path)):
        if _entry not in sys.path:
            sys.path.insert(0, _entry)
