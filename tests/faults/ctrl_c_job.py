"""A loop that catches Ctrl-C and goes on, under a SIGINT every ~40 ms; prints what it got.

``python ctrl_c_job.py WORKER_TYPE``: thread workers doing GIL-holding work (the window a
lost outcome needs), or process workers; the last line is the JSON of the samples seen.
A SIGINT raises KeyboardInterrupt only where it lands inside the loader's ``next()`` (that
is what is tested); one landing in this loop's own lines, where a plain Python loop could
drop the batch ``next()`` just returned, is counted and ignored.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from types import FrameType

import steadyload as sl
from tests.datasets import PythonWork


def _in_the_loader(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "_next_data_timed" and "steadyload" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


outside = 0


def _ctrl_c(signum: int, frame: FrameType | None) -> None:
    global outside
    if _in_the_loader(frame):
        raise KeyboardInterrupt
    outside += 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _ctrl_c)
    loader = sl.DataLoader(PythonWork(240), batch_size=2, num_workers=2,
                           worker_type=sys.argv[1])  # fmt: skip
    stop = threading.Event()

    def press() -> None:
        while not stop.wait(0.04):
            os.kill(os.getpid(), signal.SIGINT)

    got: list[int] = []
    interrupts = 0
    it = iter(loader)
    presser = threading.Thread(target=press, daemon=True)
    presser.start()
    while True:
        try:
            batch = next(it)
        except KeyboardInterrupt:
            interrupts += 1  # an interrupt-to-checkpoint handler: note it, go on
            continue
        except StopIteration:
            break
        got += batch.tolist()
    stop.set()
    presser.join(timeout=5)
    print(json.dumps({"got": got, "interrupts": interrupts, "outside": outside}))
