"""accelerate on 2 CPU processes (gloo) with steadyload loaders, for tests/frameworks/test_accelerate.py.

``torchrun --nproc_per_node=2 -m tests.frameworks.accelerate_job OUT``

Three runs in one launch, each from the same seeds (per rank: ``device_specific``, so the
ranks' RNGs differ), over a dataset whose BAD samples raise (``on_error="skip"``): A,
fault-free, EPOCHS epochs; B, the same with a worker of rank 1 SIGKILLed mid-epoch 0 and
``accelerator.save_state`` after SAVE_AT batches of epoch 1; C, a new Accelerator, model and
loader from other seeds that finish the run the way accelerate's docs resume: ``load_state``
the checkpoint, the resumed epoch from ``accelerator.skip_first_batches(loader, SAVE_AT[1])``
(a worker of rank 1 SIGKILLed after its first batch), the later ones from the loader. Each
rank writes OUT/rank<r>.json: its batches per run and epoch (sample index and a value drawn
in the worker, ``sample_seeds=True``), the parent pids of the processes that loaded them, its
restarts and skipped samples, what accelerate built, and the checkpoint's files. B and C
prepare their loader with ``STEADYLOAD_LEDGER=OUT/ledger``: it records into OUT/ledger/loader0.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import steadyload
from steadyload.integrations.accelerate import prepare, steadyload_base
from tests.frameworks.hf_common import Indexed, forkserver_pid, kill_worker

N, BATCH, EPOCHS = 80, 4, 3  # 10 batches per rank and epoch
BAD = frozenset({13, 50})  # samples that raise: left out of every epoch of every run
SAVE_AT = (1, 2)  # (epoch, batches) after which the state is saved
# Per run, the (epoch, batch of that loop) of rank 1 after which one of its workers is
# SIGKILLed: early enough that batches are still to be dispatched to it, so that its death
# needs a replacement.
KILL_AT = {"B": (0, 0), "C": (SAVE_AT[0], 0)}


class Flawed(Indexed):
    """`Indexed` whose samples in ``bad`` raise, as corrupt files would. Here, not in the test
    module: workers unpickle it by importing this module, which imports no framework."""

    def __init__(self, n: int, bad: frozenset[int], delay_s: float = 0.0) -> None:
        super().__init__(n, delay_s)
        self.bad = bad

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i in self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return super().__getitem__(i)


def run(out: Path, name: str, seed: int) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    set_seed(seed, device_specific=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = steadyload.DataLoader(Flawed(N, BAD, delay_s=0.005), batch_size=BATCH,
                                   shuffle=True, num_workers=2, sample_seeds=True,
                                   max_restarts=2, on_error="skip")
    if name in "BC":  # read by prepare
        os.environ["STEADYLOAD_LEDGER"] = str(out / "ledger")
    try:
        model, opt, loader = prepare(accelerator, model, opt, loader)
    finally:
        os.environ.pop("STEADYLOAD_LEDGER", None)
    rank = accelerator.process_index
    first_epoch = 0
    if name == "C":
        accelerator.load_state(str(out / "ckpt"))
        first_epoch = SAVE_AT[0]
    record: dict[str, Any] = {"epochs": {}, "ppids": set(), "restarts": [], "skipped": []}
    for epoch in range(first_epoch, EPOCHS):
        loader.set_epoch(epoch)
        active = loader
        if name == "C" and epoch == first_epoch:  # accelerate's recipe, as its docs write it
            active = accelerator.skip_first_batches(loader, SAVE_AT[1])
            record["skip_gave_the_loader"] = active is loader
        batches = []
        for step, batch in enumerate(active):
            batches.append(list(zip(batch["index"].tolist(), batch["noise"].tolist(),
                                    strict=True)))
            record["ppids"] |= set(batch["ppid"].tolist())
            accelerator.backward(model(batch["x"]).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if rank == 1 and (epoch, step) == KILL_AT.get(name):
                kill_worker(active)
            if name == "B" and (epoch, step + 1) == SAVE_AT:
                accelerator.save_state(str(out / "ckpt"))
        record["epochs"][epoch] = batches
        report = active.report()  # through the shard
        record["restarts"] += [r.cause for r in report.restarts]
        record["skipped"] += [s.index for s in report.skipped]
    base = steadyload_base(loader)
    assert base is not None
    record.update(
        ppids=sorted(record["ppids"]),
        shard=f"{type(loader).__module__}.{type(loader).__name__}",
        reports_class=loader.__class__.__name__,
        batch_sampler=type(base.batch_sampler).__name__,
        on_error=base.on_error,
        ledger=base.ledger,
        len=len(loader),
    )
    accelerator.wait_for_everyone()
    return record


def main() -> None:
    warnings.filterwarnings("ignore")  # the test asserts on the JSON, not on framework chatter
    out = Path(sys.argv[1])
    started = time.monotonic()
    runs = {name: run(out, name, seed) for name, seed in (("A", 0), ("B", 0), ("C", 99))}
    rank = int(os.environ["RANK"])
    saved = torch.load(out / "ckpt" / f"steadyload_loader_0_rank{rank}.pt", weights_only=True)
    result = {"rank": rank, "forkserver": forkserver_pid(), "runs": runs,
              "ckpt": sorted(os.listdir(out / "ckpt")), "saved_base_seed": saved["base_seed"],
              "wall_s": time.monotonic() - started}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
