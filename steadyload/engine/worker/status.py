"""A worker's status block: what it is doing now, and its stack when asked or when it crashes.

One anonymous shared file (memfd) per worker process, created by the parent and passed to
the worker over its socket. Bytes [0, 64) are eight int64 fields the worker updates as it
works (which task, which sample of the batch, since when; for ``worker_type="auto"``,
the GIL probe's counts, gil.py, and whether the dataset drew from the process-wide random
generators) and the parent reads at any time, also after the worker died; a ninth, at
byte 64, the parent writes once auto's choice is made (`SETTLED`: measuring stops). From
byte 4096 on, the worker's faulthandler writes Python stacks: on a fatal signal (SIGSEGV,
SIGABRT, ...) and on SIGUSR1, which the parent sends to a worker that hangs. Nothing
touches the filesystem; the parent's descriptor keeps the text readable after the worker
is gone.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .rngs import drawn, process_rngs

_HEADER = 4096
_FIELDS = 9
TASK, POSITION, STAGE, STARTED_NS, FLAGS, GIL_PROBES, GIL_HELD, DREW, SETTLED = range(9)
UNCHECKED, UNDRAWN, DRAWN = 0, 1, 2  # DREW's values

IDLE, LOADING, COLLATING, SENDING, INIT, ITER = 0, 1, 2, 3, 4, 5
STAGES = {
    IDLE: "idle",
    LOADING: "loading",
    COLLATING: "collating",
    SENDING: "sending",
    INIT: "in worker_init_fn",
    ITER: "in iter(dataset)",
}
STARTING = (INIT, ITER)
"""Stages outside any task: watched for hangs like a task, blamed on no sample."""


def starting(fields: Any, stage: int) -> None:
    """The worker enters ``stage`` (`INIT` or `ITER`), outside any task, from now."""
    fields[TASK], fields[POSITION], fields[STARTED_NS] = -1, -1, time.monotonic_ns()
    fields[STAGE] = stage


# Native libraries worth naming after a crash (FLAGS bits).
RISKY_LIBRARIES = {
    1: ("libiomp5", "Intel OpenMP (libiomp5)"),
    2: ("libomp.so", "LLVM OpenMP (libomp)"),
    4: ("cv2", "OpenCV (cv2)"),
    8: ("libgomp", "GNU OpenMP (libgomp)"),
}


@dataclass(frozen=True, slots=True)
class Progress:
    """A snapshot of what a worker was doing."""

    task_id: int
    position: int
    """Index into the task's batch of the sample being loaded (-1 before the first)."""
    stage: int
    started_ns: int
    """When the task started, on the system-wide monotonic clock. [Unit: nanosecond]"""
    flags: int
    gil_probes: int = 0
    """The worker's GIL probe: probes counted so far (gil.py; 0 where none runs)."""
    gil_held: int = 0
    """Of those, the probes that found the GIL held."""
    drew: int = 0
    """Whether the dataset drew from the process-wide random generators, where checked
    (`WorkerStatus.check_draws`): `UNCHECKED`, `UNDRAWN` (so far) or `DRAWN`."""


class StatusBlock:
    """Parent side: create with `create`, hand `fd` to the worker, read at any time."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._mm = mmap.mmap(fd, _HEADER)
        self._fields = np.frombuffer(self._mm, np.int64, _FIELDS)

    @classmethod
    def create(cls, worker_id: int) -> StatusBlock:
        """A new, zeroed block for ``worker_id``."""
        fd = os.memfd_create(f"steadyload-status-w{worker_id}", os.MFD_CLOEXEC)
        os.ftruncate(fd, _HEADER)
        block = cls(fd)
        block._fields[TASK] = -1
        return block

    def progress(self) -> Progress:
        """What the worker is doing now (or was doing when it died)."""
        f = self._fields
        return Progress(
            int(f[TASK]),
            int(f[POSITION]),
            int(f[STAGE]),
            int(f[STARTED_NS]),
            int(f[FLAGS]),
            int(f[GIL_PROBES]),
            int(f[GIL_HELD]),
            int(f[DREW]),
        )

    def settle(self) -> None:
        """``worker_type="auto"`` chose: the worker's GIL probe and draw checks stop."""
        self._fields[SETTLED] = 1

    def stacks(self) -> str:
        """Everything faulthandler wrote: crash or on-demand stack dumps."""
        chunks = []
        offset = _HEADER
        while True:
            chunk = os.pread(self.fd, 1 << 16, offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        return without_inherited_frames(b"".join(chunks).decode("utf-8", "replace"))

    def libraries(self) -> list[str]:
        """Names of crash-prone native libraries the worker had loaded.

        OpenCV always counts; OpenMP runtimes only when two different ones are loaded
        (torch itself brings GNU OpenMP, which alone is fine).
        """
        flags = int(self._fields[FLAGS])
        loaded = [name for bit, (_, name) in RISKY_LIBRARIES.items() if flags & bit]
        openmp = [n for n in loaded if "OpenMP" in n]
        if len(openmp) < 2:
            loaded = [n for n in loaded if "OpenMP" not in n]
        return loaded

    def close(self) -> None:
        """Release the mapping and the descriptor."""
        del self._fields
        self._mm.close()
        os.close(self.fd)


class WorkerStatus:
    """Worker side: update the fields cheaply; arm faulthandler on the same file."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._mm = mmap.mmap(fd, _HEADER)
        self.fields: Any = np.frombuffer(self._mm, np.int64, _FIELDS)
        self._libraries_checked = 0.0
        self.check_draws = False
        """Whether the worker checks after its tasks (now and then) if the dataset drew from
        the process-wide generators (auto measuring on processes: threads would share them)."""
        self._rngs: tuple[Any, ...] | None = None
        self._draws_checked = 0.0
        os.lseek(fd, _HEADER, os.SEEK_SET)
        faulthandler.enable(file=fd, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True, chain=False)

    def begin(self, task_id: int) -> None:
        """A task starts (position -1: no sample yet)."""
        f = self.fields
        f[TASK] = task_id
        f[POSITION] = -1
        f[STARTED_NS] = time.monotonic_ns()
        f[STAGE] = LOADING
        if self.check_draws and self._rngs is None:  # as seeded, before the dataset's code
            self._rngs = process_rngs()

    def end(self) -> None:
        """The task's outcome was sent."""
        self.fields[STAGE] = IDLE
        now = time.monotonic()
        checked = self.fields[DREW]
        if self.fields[SETTLED]:
            self.check_draws, self._rngs = False, None  # the choice is made: no more checks
        elif (
            self._rngs is not None
            and checked != DRAWN
            and (now - self._draws_checked > 0.05 or checked == UNCHECKED)
        ):
            # A draw moves the generators for good: checked against the seeded states now
            # and then (each check copies their states), first after the first task.
            self._draws_checked = now
            self.fields[DREW] = UNDRAWN if not drawn(self._rngs) else DRAWN
        if now - self._libraries_checked > 2.0:  # cheap, but not per batch
            self._libraries_checked = now
            self.fields[FLAGS] = _loaded_library_flags()


def _loaded_library_flags() -> int:
    flags = 0
    if "cv2" in sys.modules:
        flags |= 4
    try:
        with open(f"/proc/{os.getpid()}/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return flags
    for bit, (needle, _) in RISKY_LIBRARIES.items():
        if bit != 4 and needle in maps:
            flags |= bit
    return flags


def without_inherited_frames(dump: str) -> str:
    """A zygote worker's faulthandler dump without the frames it inherited from this
    process: the zygote was forked deep inside the caller's stack (the training script,
    its framework, a test runner), and every worker's stack still ends in those frames,
    which it never runs. Each thread's frames from the zygote's `_run_zygote`
    (start/zygote.py) outward are cut."""
    out, cutting = [], False
    for line in dump.splitlines():
        frame = line.startswith("  File ")
        if cutting and frame:
            continue
        cutting = frame and line.endswith(" in _run_zygote") and "zygote.py" in line
        if not cutting:
            out.append(line)
    return "\n".join(out) + ("\n" if dump.endswith("\n") else "")
