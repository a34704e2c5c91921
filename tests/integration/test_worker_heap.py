"""A process worker's heap keeps a big batch's samples for the next batch (host/heap.py),
even where glibc's thresholds sit at one sample's size: real workers, page faults counted
by the worker itself."""

from __future__ import annotations

import platform
import statistics

import pytest

import steadyload as sl
from steadyload.host.heap import FIT_FROM
from tests.datasets import CountsFaults, heap_thresholds_of_one_sample

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
        reason="the fit is glibc's (mallopt); other C libraries keep their own rule",
    ),
]

BATCH = 16  # of 600 KB samples: 9.6 MB batches
PAGES = BATCH * 3 * 224 * 224 * 4 // 4096


def test_a_process_worker_stops_faulting_in_each_batchs_samples_again() -> None:
    loader = sl.DataLoader(
        CountsFaults(BATCH * 14), batch_size=BATCH, num_workers=1, worker_type="process",
        worker_init_fn=heap_thresholds_of_one_sample,
    )
    sums, starts = [], []
    for samples, faults in loader:  # each batch dropped before the next: segments reused
        assert samples.nbytes >= FIT_FROM
        sums.append(int(samples[:, 0, 0, 0].sum()))
        starts.append(int(faults[0]))  # when loading the batch began
    del samples, faults  # a failed assertion's frame would keep the last segment mapped
    assert sums == [sum(range(k * BATCH, (k + 1) * BATCH)) for k in range(14)]
    per_batch = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # The first batches map new segments (and, before the fit, fault the samples in);
    # later ones reuse both. Without the fit each batch faults every sample page again.
    steady = statistics.median(per_batch[6:])
    assert steady < PAGES / 4, per_batch
