"""A loader whose fork server does not answer a worker start; prints what it saw as JSON.

Run by tests/faults/test_stalled_server.py in a process of its own (the fork server is
process-wide): ``python stalled_server_job.py stopped|slow forkserver|zygote``.
stopped: the warm server gets SIGSTOP before the next loader starts its workers.
slow: the server's preload (the dataset's module) takes 3 s to import, and the job allows
a start 1 s (launch.START_TIMEOUT_S; 120 s by default).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from multiprocessing import forkserver

import steadyload as sl
from steadyload.start import launch
from steadyload.start.context import zygote_pid
from tests.faults.slow_import import SlowToImport

if __name__ == "__main__":
    how, method = sys.argv[1], sys.argv[2]
    os.environ["STEADYLOAD_TEST_JOB_PID"] = str(os.getpid())  # not slow to import here

    def loader() -> sl.DataLoader:
        return sl.DataLoader(SlowToImport(8), batch_size=2, num_workers=2, start_method=method)

    def server_pid() -> int | None:
        return zygote_pid() if method == "zygote" else forkserver._forkserver._forkserver_pid

    seen: dict[str, object] = {}
    if how == "stopped":
        seen["first"] = [b.tolist() for b in loader()]
        pid = server_pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
    else:
        launch.START_TIMEOUT_S = 1.0
    began = time.monotonic()
    try:
        list(loader())
    except sl.WorkerStartError as exc:
        seen["error"], seen["type"] = str(exc), type(exc).__name__
    seen["waited_s"] = time.monotonic() - began
    if how == "stopped":
        os.kill(server_pid() or 0, signal.SIGCONT)
    else:
        launch.START_TIMEOUT_S = 120.0
    seen["after"] = [b.tolist() for b in loader()]  # the server answers again: all is well
    print(json.dumps(seen))
