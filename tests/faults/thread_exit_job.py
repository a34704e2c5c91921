"""A script that ends while thread workers are inside torch ops; run by test_thread_workers.py.

``python thread_exit_job.py MODE WORKER_TYPE``: MODE "break" (a max_steps break), "raise"
(the training step raises) or "module" (a module-level iterator left behind).
"""

from __future__ import annotations

import sys

import steadyload as sl
from tests.datasets import MatMuls

loader = sl.DataLoader(MatMuls(10_000), batch_size=8, num_workers=2,
                       worker_type=sys.argv[2], persistent_workers=True)  # fmt: skip
if sys.argv[1] == "module":
    it = iter(loader)
    next(it)
elif __name__ == "__main__":
    for step, _batch in enumerate(loader):
        if step == 5:
            if sys.argv[1] == "raise":
                raise RuntimeError("the training step failed")
            break
