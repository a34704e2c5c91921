"""A worker's start, the same for every kind: threads, seeding, `get_worker_info()`, the loop.

A kind (process/worker.py, thread/worker.py, remote/actor.py) builds its `loop.Link` and its
status fields, then calls `serve`, which does what torch's ``_worker_loop`` does before the
first task and runs the one worker loop (loop.py). Only two things differ between kinds:

- whether the worker owns its process (``process_wide``: a process or a remote actor) or
  shares it with the training loop (a thread). An owner runs torch's ops on one thread,
  seeds the process-wide generators as torch does and sets torch's module-global worker
  info; a thread sets neither (thread/sharing.py keeps its ops to itself) and gets its info
  per thread, with generators of its own.
- the ``worker_method`` its info reports ("multiprocessing" or "thread").

Whatever escapes the loop (never the dataset's errors: they are outcomes) is the worker's
death, handed to `loop.Link.escaped`, which makes it one the way its kind can be seen to
die.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..._seeding import SampleSeeder
from ..config import WorkerConfig
from . import loop, torch_hooks
from .gil import WorkerGilProbe

_LOG = logging.getLogger(__name__)


def serve(
    cfg: WorkerConfig,
    dataset: Any,
    worker_id: int,
    link: loop.Link,
    status: loop.Status,
    *,
    process_wide: bool,
    method: str,
    began: Callable[[], object] | None = None,
) -> None:
    """Set the worker up as torch's ``_worker_loop`` does, then run the worker loop.

    Args:
        cfg: The worker's configuration.
        dataset: The dataset it loads from (a thread's may be its own replica).
        worker_id: Which worker it is.
        link: Its kind's side of the transport; also told what escapes (`loop.Link.escaped`).
        status: Its status fields, which the parent reads.
        process_wide: The worker owns its process (a process or a remote actor), so its
            thread count, the process-wide generators and torch's module-global worker
            info are its own; False for a thread worker.
        method: ``get_worker_info().worker_method``: "multiprocessing" or "thread".
        began: Called once the worker is seeded, right before its set-up
            (``worker_init_fn``, the first iterator).
    """
    try:
        if process_wide:
            torch.set_num_threads(1)
            seed = torch_hooks.seed_process(cfg.base_seed, worker_id)
        else:
            seed = cfg.base_seed + worker_id  # torch's per-worker seed; this thread's generators
        info = torch_hooks.make_info(worker_id, cfg.num_workers, seed, dataset, method)
        if process_wide:
            torch_hooks.set_process_info(info)
        else:
            torch_hooks.set_thread_info(info)
        seeder = (
            SampleSeeder(cfg.base_seed, worker_id, own=info, process_wide=process_wide)
            if cfg.sample_seeds
            else None
        )
        _LOG.debug("worker %d started (seed %d)", worker_id, seed)
        if began is not None:
            began()
        if process_wide and cfg.probe_gil:
            WorkerGilProbe(status.fields).start()  # ends once its figures suffice
            # A draw moves the generators from their seeded states; sample_seeds reseeds
            # them for every sample, so there it cannot be told (the parent knows).
            status.check_draws = not cfg.sample_seeds  # type: ignore[attr-defined]
        loop.run(cfg, dataset, worker_id, link, status, seeder)
    except BaseException as exc:
        link.escaped(exc)
    finally:
        if not process_wide:
            torch_hooks.set_thread_info(None)
