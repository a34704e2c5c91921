"""An epoch of worker_type="auto" that ends while its processes are still starting from a
cold fork server (the choice forced to processes at the first look); the script then ends.
Run by test_thread_workers.py (#40 item 5: that exit must be quiet)."""

from __future__ import annotations

import torch

import steadyload as sl
from steadyload.engine.choice import handover, worker_kind
from tests.datasets import MapDS


class Tiny(MapDS):
    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


if __name__ == "__main__":
    handover.live_choice = lambda measured, workers, probe, on="": worker_kind.chose(
        "process", "forced by the test")  # fmt: skip
    loader = sl.DataLoader(Tiny(4096), batch_size=256, num_workers=2, worker_type="auto",
                           start_method="forkserver")  # threads first: a cold fork server  # fmt: skip
    assert sum(len(batch) for batch in loader) == 4096
    print("processes started:", loader.report().worker_kind == "process", flush=True)
