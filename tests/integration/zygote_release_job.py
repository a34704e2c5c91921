"""Who keeps the zygote (start/zygote.py), in a process of its own: run by
test_zygote_release.py with a mode, prints one JSON line of what it saw.

auto's choice is forced to threads at its first look (the hand-over is what is tested;
the rule has its own tests). An exit hook registered before steadyload is imported runs
after steadyload's own: it records whether the zygote had been reaped by then.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys

_seen: dict[str, object] = {}


def _gone(pid: int) -> bool:
    """Whether ``pid`` (a child of this process) has exited and been reaped already."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reaps it if it has exited: that is not "already"
    except ChildProcessError:
        return True
    return False


def _at_exit() -> None:
    from steadyload.start import zygote

    pid = _seen["exit_zygote"]
    reaped = isinstance(pid, int) and _gone(pid)  # by steadyload's exit hook, run first
    print(json.dumps({**_seen, "reaped_before_teardown": reaped, "after": zygote.pid()}))


atexit.register(_at_exit)  # before steadyload's: runs after it

import torch  # noqa: E402

import steadyload as sl  # noqa: E402
from steadyload.engine.choice import handover, worker_kind  # noqa: E402
from steadyload.start import zygote  # noqa: E402
from tests.datasets import MapDS  # noqa: E402


def _epoch(loader: sl.DataLoader) -> int:
    return sum(len(batch) for batch in loader)


def main(mode: str) -> None:
    handover.live_choice = lambda measured, workers, probe, on="": worker_kind.chose(
        "thread", "forced by the test")  # fmt: skip
    dataset = MapDS(64)
    if mode == "released":
        other = sl.DataLoader(dataset, batch_size=4, num_workers=2)  # processes: a claim
        auto = sl.DataLoader(dataset, batch_size=4, num_workers=2, worker_type="auto")
        first = zygote.pid()
        _seen["auto_epoch"] = _epoch(auto)
        _seen["kept_for_the_other"] = zygote.pid() == first and first is not None
        _seen["other_epoch"] = _epoch(other)  # its workers still come from that zygote
        _seen["other_start"] = other.report().start_method
        del other
        gc.collect()
        auto2 = sl.DataLoader(dataset, batch_size=4, num_workers=2, worker_type="auto")
        _seen["auto2_epoch"] = _epoch(auto2)
        _seen["auto2_kind"] = auto2.report().worker_kind
        _seen["released"] = zygote.pid() is None and first is not None and _gone(first)
        later = sl.DataLoader(dataset, batch_size=4, num_workers=2)  # forks a new one
        _seen["later_epoch"] = _epoch(later)
        _seen["later_start"] = later.report().start_method
        _seen["exit_zygote"] = zygote.pid()
    elif mode == "asked":
        auto = sl.DataLoader(
            dataset, batch_size=4, num_workers=2, worker_type="auto", start_method="zygote"
        )
        first = zygote.pid()
        _seen["auto_epoch"] = _epoch(auto)
        _seen["kept"] = zygote.pid() == first and first is not None
        _seen["exit_zygote"] = zygote.pid()
    torch.set_num_threads(1)  # a use of torch after the loaders: nothing to do with them


if __name__ == "__main__":
    main(sys.argv[1])
