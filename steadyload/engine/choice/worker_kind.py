"""``worker_type="auto"``: threads or processes, decided by watching the first batches.

Threads win where the work releases the GIL (image decode, numpy, tokenizers in Rust, big
tensor copies, I/O): no transport, one copy of every resource. Processes win where it holds
the GIL (Python transforms): threads would take turns. Which one a dataset is cannot be
read from its code, so "auto" measures it on the first batches, with a GIL probe
(engine/worker/gil.py): a thread that sleeps a millisecond at a time and times how late it
wakes; the share of probes that wait longer than `HELD_WAIT_S` is how often a thread that
wants the GIL finds it held. It starts on whichever kind starts faster:

- **Processes first**, where a process worker is a fork away (the zygote runs, or
  ``start_method="fork"``): from the first batch they are never much slower (GIL-free work
  loads as fast either way; GIL-bound work twice as fast), and a probe inside each worker
  measures how much of its loading holds the GIL. Held most of the time (`BUSY_SHARE`):
  processes are kept. Mostly free: the loader starts thread workers and hands the next
  batches over to them, for the same speed with one copy of every resource and no
  transport (handover.py).
- **Threads first**, where processes would start from a cold fork server (about a second
  to import torch): the first batch in milliseconds, the probe beside the threads measures
  how often they take turns at the GIL, and when that is most of the time the loader
  starts process workers and hands the next batches over to them.

Why the share of held probes and not their mean delay, used first: Python that lets go of
the GIL every half millisecond (a torch call after each sample's Python) keeps it held
nearly all the time, so threads take turns (processes loaded twice as fast), yet each
probe waits only for the current stretch to end: the mean delay of such work overlapped
that of GIL-free decode, and the choice flipped run to run. Why not the threads' CPU share
(CPU time over wall time, times the threads), tried before: it reads a machine busy with
other processes, or memory-bound copies, as waiting. A probe that waits for a CPU (every
core busy) is not waiting for the GIL either: that wait is taken out (gil.py's `GilProbe`).

Cheap samples are the exception the probe cannot see: a sample of a few microseconds (16
floats and a label) is interpreter work in short stretches, and every torch call hands
the GIL over, so the probe finds it free or held by chance while the threads still take
turns at it (two such thread workers loaded fewer samples per second than one thread
alone). So when the threads' samples cost less than `CHEAP_SAMPLE_S` each, the choice is
by the batch's cost alone: processes when a batch costs the threads at least
`MIN_PROCESS_BATCH_S` (a process worker's batch has a cost of its own to receive).

Near the line the choice waits for more probes (`NEAR_LINE`, up to `MAX_PROBES`): the
same work should get the same choice run after run. Far from it, in the direction of
processes, it does not wait: every batch the threads load while the GIL is clearly busy
is loaded at about half speed, which a short epoch (a validation pass, a first epoch)
cannot win back. So a GIL held in `CLEAR_BUSY_SHARE` of `CLEAR_PROBES` probes, or cheap
samples whose batches cost twice `MIN_PROCESS_BATCH_S`, decide after one measured batch
per thread and `EARLY_WALL_S`; and the process workers are started as soon as the first
figures lean that way (`leans_to_processes`; from the zygote that is milliseconds), so
that they are ready when the choice is made, and stopped again if it is threads.

The same GIL lines serve both: measured inside a process worker, GIL-bound work found the
GIL held as often as thread workers found it (and GIL-free work as rarely). Cheap samples
do not read the same: inside a process a tiny sample costs a fraction of what it costs
threads taking turns at the GIL, so their batch line there is its own
(`MIN_PROCESS_BATCH_ON_PROCESSES_S`); figures in docs/design/figures.md#auto. The early choices
below matter to the threads-first path; on processes nothing is lost while figures come in.

Every constant below is a line drawn between measured figures; the figures are in
docs/design/figures.md#auto, the choices measured run after run in
benchmarks/bench_auto_choice.py, and the rule is tested with injected measurements
(tests/unit/test_worker_kind.py).

Some loaders are never started on threads: a stream, or a dataset with its own
``state_dict()`` (its position lives in the replica that reads it, which cannot move to a
process), a ``worker_init_fn`` (it would run in this
process), ``max_worker_memory``, and ``on_error="skip"`` (data expected to be partly bad:
a sample that crashes native code ends the process that loads it, which with threads is
the training process).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..worker.gil import BUSY_SHARE, MIN_PROBES, NEAR_LINE, ProbeFigures
from ..worker.status import DRAWN, UNCHECKED

_LOG = logging.getLogger(__name__)

# Near the line (`NEAR_LINE`, gil.py) the choice waits for more probes, up to:
MAX_PROBES = 200
CHEAP_SAMPLE_S = 50e-6
"""A thread's cost per sample below which the probe cannot tell (see above) and the
batch's cost decides (between tiny samples and every other workload as measured)."""
MIN_PROCESS_BATCH_S = 0.5e-3
"""The cost of a batch to the threads from which cheap samples go to processes: a process
worker's batch has a cost of its own to the main process (receive, rebuild, bookkeeping),
so below this threads stay ahead."""
MIN_PROCESS_BATCH_ON_PROCESSES_S = 0.15e-3
"""The same line measured inside process workers, where a cheap sample costs a fraction
of what it costs threads taking turns at the GIL: the cost of receiving a batch itself (a
batch that loads faster than the main process receives it is not worth sending)."""
BIG_BATCH_BYTES = 8 << 20
"""Measured on processes, batches from this size on stay there, whatever the GIL does:
process workers deliver them about as fast as threads (each is written once, into shared
memory, and the worker's heap keeps its samples, host/heap.py), and a hand-over's stop
costs more than threads would save (a line between the 4.8 MB batches of JPEG decode and
19 MB ones, as measured). So one batch from each worker decides them."""
CLEAR_PROBES = 10  # enough probes when the share is past CLEAR_BUSY_SHARE
CLEAR_BUSY_SHARE = 0.8
"""A held share this far above the line decides for processes without waiting for the
full figures (pure Python 86-94%, GIL-free work at most 18%, as measured)."""
CLEAR_FREE_SHARE = 0.15
"""Inside process workers, a held share this far below the line decides for threads once
each worker loaded one measured batch (`MIN_PROBES` probes), without the full figures:
every batch more on processes is one at the slower kind (GIL-free work measured 2-10%)."""
EARLY_WALL_S = 0.05  # loading time summed over the threads before a clear choice
LEAN_PROBES = 5  # probes that may already lean to processes (their workers start then)
MIN_TASKS_PER_WORKER = 3  # batches measured per thread before deciding
MIN_WALL_S = 0.2  # and this much loading time, summed over the threads: a pause of this
# process (a busy machine, a garbage collection) must not decide it


@dataclass(frozen=True, slots=True)
class WorkerChoice:
    """What ``worker_type="auto"`` chose, and why (shown by `report()`)."""

    kind: str
    """"thread" or "process"."""
    reason: str


def chose(kind: str, why: str) -> WorkerChoice:
    """The choice of ``kind`` workers because ``why``, logged at INFO."""
    choice = WorkerChoice(kind, f"worker_type='auto' chose {kind} workers: {why}")
    _LOG.info("%s", choice.reason)
    return choice


def gil_enabled() -> bool:
    """False on a free-threaded interpreter running without the GIL (3.13t, 3.14t)."""
    check = getattr(sys, "_is_gil_enabled", None)
    return bool(check()) if check is not None else True


class ProcessFigures:
    """What process workers measured (a probe inside each, gil.py): their batches past each
    worker's first (its set-up), and the probes' counts and draws in their status blocks."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._tasks, self._samples, self._wall = 0, 0, 0.0
        self._batches, self._bytes = 0, 0  # every batch, set-up included: its size is the same
        self._set_up: set[int] = set()  # worker ids past their first task

    def note(self, worker_id: int, event: object) -> None:
        """A worker's event: a batch counts from the worker's second on."""
        done = getattr(event, "done", None)  # a `Received` batch
        if done is None:
            return
        self._batches += 1
        self._bytes += _tensor_bytes(getattr(event, "batch", None))
        if worker_id not in self._set_up:
            self._set_up.add(worker_id)
            return
        self._tasks, self._samples = self._tasks + 1, self._samples + done.samples
        self._wall += done.load_s

    def respawned(self, worker_id: int) -> None:
        """A new process for ``worker_id``: its first task is its set-up again."""
        self._set_up.discard(worker_id)

    def _progress(self, pool: Any) -> list[Any]:
        found = (pool.progress(worker_id) for worker_id in range(self._workers))
        return [progress for progress in found if progress is not None]

    def figures(self, pool: Any) -> tuple[tuple[int, int, float], ProbeFigures]:
        """``(tasks, samples, wall s)`` and the probes' figures, read from ``pool``."""
        progress = self._progress(pool)
        probes = sum(p.gil_probes for p in progress)
        held = sum(min(p.gil_held, p.gil_probes) for p in progress)
        return (self._tasks, self._samples, self._wall), ProbeFigures(probes, held, 0.0)

    def drew(self, pool: Any) -> bool | None:
        """Whether a worker's dataset drew from its process-wide random generators; None:
        not every worker has checked yet."""
        progress = self._progress(pool)
        if any(p.drew == DRAWN for p in progress):
            return True
        return None if any(p.drew == UNCHECKED for p in progress) else False

    def big_batches(self) -> WorkerChoice | None:
        """Processes, once every worker has loaded a batch and they average
        `BIG_BATCH_BYTES` or more (see the constant); else None."""
        if len(self._set_up) < self._workers:
            return None
        per_batch = self._bytes / max(self._batches, 1)
        if per_batch < BIG_BATCH_BYTES:
            return None
        return chose(
            "process",
            f"the first {self._batches} batches average {per_batch / 2**20:.0f} MiB: process "
            "workers deliver batches this big about as fast as thread workers (each is "
            "written once, into shared memory) and a hand-over's stop costs more than "
            "threads would save, so processes are kept whatever the GIL does",
        )


def _tensor_bytes(batch: Any) -> int:
    """The bytes of the tensors in ``batch`` (dicts, lists and tuples walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(_tensor_bytes(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_tensor_bytes(value) for value in batch)
    return 0


def static_choice(loader: Any, max_worker_memory: int | None) -> WorkerChoice | None:
    """The choice when it needs no measurement, else None (start on threads and watch)."""
    from torch.utils.data import IterableDataset

    from ..worker.fetch import stateful

    if max_worker_memory is not None:
        return chose("process", "max_worker_memory needs workers with memory of their own")
    if getattr(loader, "on_error", "raise") == "skip":
        return chose(
            "process",
            "on_error='skip' expects bad samples, and one that crashes "
            "native code (a corrupt file in a C decoder) would end this "
            "process under thread workers; a process worker is replaced "
            "and the sample skipped",
        )
    if not gil_enabled():
        return chose("thread", "this interpreter runs without the GIL")
    if isinstance(loader.dataset, IterableDataset):
        return chose(
            "process",
            "an IterableDataset's stream cannot move from a thread "
            "to a process, so it is not tried on threads",
        )
    if stateful(loader.dataset):
        return chose(
            "process",
            "the dataset keeps its own state (state_dict()) in each "
            "worker's replica, which cannot move from a thread to a "
            "process, so it is not tried on threads",
        )
    if loader.worker_init_fn is not None:
        return chose(
            "process",
            "a worker_init_fn would run in this process on threads "
            "(it may seed this process's random generators)",
        )
    return None


def leans_to_processes(measured: tuple[int, int, float], probe: ProbeFigures) -> bool:
    """Whether the first figures, too few to decide, already point to processes: then the
    process workers are started (from a cold fork server that takes its import of torch),
    so that they are ready when the choice is made; GIL-free work never pays for them."""
    tasks, samples, wall = measured
    if tasks > 0 and wall / max(samples, 1) < CHEAP_SAMPLE_S:
        return wall / tasks >= MIN_PROCESS_BATCH_S
    return probe.probes >= LEAN_PROBES and probe.held_share >= BUSY_SHARE


def live_choice(
    measured: tuple[int, int, float], workers: int, probe: ProbeFigures, on: str = "thread"
) -> WorkerChoice | None:
    """Decide from the workers' ``(tasks, samples, wall s)`` and the probe's figures, taken
    ``on`` "thread" workers (the probe beside them) or "process" workers (a probe inside
    each); None: not enough yet. On processes a choice to keep them needs no guard against
    a pause (they are kept while undecided anyway): it is made on the first figures that
    point there."""
    tasks, samples, wall = measured
    kept = on == "process"  # choosing processes changes nothing
    if tasks < workers or (wall < EARLY_WALL_S and not kept):
        return None
    full = tasks >= MIN_TASKS_PER_WORKER * workers and wall >= MIN_WALL_S
    per_sample, per_batch = wall / max(samples, 1), wall / tasks
    if per_sample < CHEAP_SAMPLE_S:
        line = MIN_PROCESS_BATCH_ON_PROCESSES_S if kept else MIN_PROCESS_BATCH_S
        clearly = (1 if kept else 2) * line
        if not full and per_batch < clearly:
            return None  # not clearly worth sending yet: wait for the full figures
        loaded = (
            f"while {workers} {on} workers loaded {tasks} batches, a sample took "
            f"{per_sample * 1e6:.0f} us"
        )
        if per_batch >= line:
            return chose(
                "process",
                f"{loaded}: samples this cheap are mostly interpreter "
                "work, which threads take turns at (they hand the GIL "
                "over at every torch call), and a batch "
                f"({per_batch * 1e3:.1f} ms) is worth sending, so "
                "processes load faster",
            )
        return chose(
            "thread",
            f"{loaded}, but a batch only {per_batch * 1e6:.0f} us, less "
            "than a process worker's batch costs to receive, so threads "
            "stay ahead",
        )
    share = probe.held_share
    clear = probe.probes >= CLEAR_PROBES and share >= CLEAR_BUSY_SHARE
    clear |= kept and probe.probes >= MIN_PROBES and share <= CLEAR_FREE_SHARE
    near = abs(share - BUSY_SHARE) < NEAR_LINE
    if not clear and (
        not full or probe.probes < MIN_PROBES or (near and probe.probes < MAX_PROBES)
    ):
        return None
    wait = probe.waited_s / max(probe.probes, 1)
    figures = (
        f"while {workers} thread workers loaded {tasks} batches, a thread wanting the GIL "
        f"found it held by another in {share:.0%} of {probe.probes} probes (it waited "
        f"{wait * 1e3:.2f} ms on average)"
        if on == "thread"
        else f"while {workers} process workers loaded {tasks} batches, a probe inside each "
        f"found its GIL held in {share:.0%} of {probe.probes} probes"
    )
    if share >= BUSY_SHARE:
        return chose(
            "process", f"{figures}: the GIL was busy, so threads take turns (the work holds it)"
        )
    return chose(
        "thread",
        f"{figures}: the GIL was mostly free, so threads load in parallel "
        "(the work releases it or waits)",
    )
