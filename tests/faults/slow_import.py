"""A dataset whose module takes 3 s to import anywhere but in the test job itself: in the
fork server that preloads it, a server slow to answer the first worker start."""

from __future__ import annotations

import os
import time

from tests.adversarial import Numbers

if os.environ.get("STEADYLOAD_TEST_JOB_PID") not in (None, str(os.getpid())):
    time.sleep(3.0)


class SlowToImport(Numbers):
    """`Numbers` (sample i is ``tensor(i)``), defined here so the fork server preloads this
    module."""
