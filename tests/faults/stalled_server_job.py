"""A loader whose fork server does not answer a worker start; prints what it saw as JSON.

Run by tests/faults/test_stalled_server.py in a process of its own (the fork server is
process-wide): ``python stalled_server_job.py stopped|slow|busy forkserver|zygote``.
stopped: the warm server gets SIGSTOP before the next loader starts its workers.
slow: the server's preload (the dataset's module) sleeps 3 s in its import, and the job
allows a server 1 s without progress (STEADYLOAD_START_STALL_S; 120 s by default).
busy: the same, but the import computes for 3 s: progress, so the start is waited for.
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
from tests.faults.busy_import import BusyToImport
from tests.faults.slow_import import SlowToImport

if __name__ == "__main__":
    how, method = sys.argv[1], sys.argv[2]
    os.environ["STEADYLOAD_TEST_JOB_PID"] = str(os.getpid())  # not slow to import here

    def loader() -> sl.DataLoader:
        dataset = BusyToImport(8) if how == "busy" else SlowToImport(8)
        return sl.DataLoader(dataset, batch_size=2, num_workers=2, start_method=method)

    def server_pid() -> int | None:
        return zygote_pid() if method == "zygote" else forkserver._forkserver._forkserver_pid

    seen: dict[str, object] = {}
    if how == "stopped":
        seen["first"] = [b.tolist() for b in loader()]
        pid = server_pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
    else:
        os.environ[launch.STALL_ENV] = "1"
    began = time.monotonic()
    try:
        seen["first"] = [b.tolist() for b in loader()]
    except sl.WorkerStartError as exc:
        seen["error"], seen["type"] = str(exc), type(exc).__name__
    seen["waited_s"] = time.monotonic() - began
    if how == "stopped":
        os.kill(server_pid() or 0, signal.SIGCONT)
    else:
        del os.environ[launch.STALL_ENV]
    seen["after"] = [b.tolist() for b in loader()]  # the server answers again: all is well
    print(json.dumps(seen))
