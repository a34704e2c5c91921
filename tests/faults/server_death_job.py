"""A training-like loop whose fork server dies mid-epoch; prints what it saw as JSON.

Run by tests/faults/test_server_death.py in a session of its own (so that a SIGTERM to
the process group reaches only this job): ``python server_death_job.py kill|term``; by
tests/faults/test_handover.py as ``handover``: worker_type="auto", forced to hand over to
processes, whose fork server is then SIGKILLed; and as ``zygote-gpu``: the default's
zygote SIGKILLed once this process "holds a GPU context" (injected), so that it cannot be
forked again and the workers come from the fork server from then on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from multiprocessing import forkserver

import psutil

import steadyload as sl
from tests.datasets import HandsOver, Slow


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    how = sys.argv[1]
    if how == "term":
        # A trainer that handles SIGTERM (to save a checkpoint) survives the group's signal.
        signal.signal(signal.SIGTERM, lambda *_: None)
    if how == "handover":
        from steadyload.engine.choice import handover, worker_kind

        handover.live_choice = lambda measured, workers, probe, on="": worker_kind.chose(
            "process", "forced by the test")
        marker_dir = tempfile.mkdtemp()
        loader = sl.DataLoader(HandsOver(48, marker_dir, 0.05, at=2), batch_size=2,
                               num_workers=4, max_restarts=3, worker_type="auto",
                               start_method="forkserver")  # fmt: skip
    elif how == "zygote-gpu":  # the default's zygote, dead once a GPU context exists
        loader = sl.DataLoader(Slow(48, 0.05), batch_size=2, num_workers=4, max_restarts=3)
    else:  # the fork server's death is what is tested (the zygote's: test_zygote.py)
        loader = sl.DataLoader(Slow(48, 0.05), batch_size=2, num_workers=4, max_restarts=3,
                               start_method="forkserver")  # fmt: skip
    it = iter(loader)
    got = next(it).tolist()
    while loader.report().worker_kind != "process":  # auto: until the processes run
        got += next(it).tolist()
    server = forkserver._forkserver._forkserver_pid
    if how == "zygote-gpu":
        from steadyload.start import guards, zygote

        server = zygote.pid()  # and from now on this process "holds a GPU context"
        guards.gpu_context_description = lambda: "a CUDA context (injected by the test)"
    workers = [w.pid for w in it._workers]
    preload_before = len(loader.report().preload_requested)
    if how in ("kill", "handover", "zygote-gpu"):
        os.kill(server, signal.SIGKILL)
    else:  # while the loop waits in next(): the race that surfaced a raw EOFError
        threading.Timer(0.2, os.killpg, (os.getpgid(0), signal.SIGTERM)).start()
    parents: set[int] = set()
    for batch in it:
        got += batch.tolist()
        if how == "zygote-gpu" and not parents and len(got) >= 36:  # the new workers run
            parents = {psutil.Process(w.pid).ppid() for w in it._workers if w is not None}
    report = loader.report()
    print(json.dumps({
        "got": got,
        "restarts": [[r.worker_id, r.cause, r.sample, r.batches_rerun] for r in report.restarts],
        "server": server,
        "kind": report.worker_kind,
        "new_server": forkserver._forkserver._forkserver_pid,
        "method": report.start_method,
        "parents": sorted(parents),
        "old_workers_alive": [p for p in workers if _alive(p)],
        "preload_before": preload_before,
        "preload_after": len(report.preload_requested),
    }))
