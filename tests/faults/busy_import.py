"""A dataset whose module spends 3 s of CPU importing anywhere but in the test job itself: in
the fork server that preloads it, a server slow to answer but visibly making progress."""

from __future__ import annotations

import os
import time

from tests.adversarial import Numbers

if os.environ.get("STEADYLOAD_TEST_JOB_PID") not in (None, str(os.getpid())):
    _until = time.monotonic() + 3.0
    while time.monotonic() < _until:  # an import that computes (or reads) all the while
        pass


class BusyToImport(Numbers):
    """`Numbers` (sample i is ``tensor(i)``), defined here so the fork server preloads this
    module."""
