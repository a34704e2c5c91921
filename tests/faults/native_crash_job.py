"""A sample that crashes native code (a segfault, as a corrupt file can in a C decoder).

``python native_crash_job.py thread``: thread workers; the training process dies, and
faulthandler tells its stacks. ``python native_crash_job.py auto-skip``: worker_type="auto"
with on_error="skip" picks processes, whose worker is replaced and the sample skipped; the
last line is the JSON of what the loop got.
"""

from __future__ import annotations

import json
import sys

import steadyload as sl
from tests.datasets import Fault

if __name__ == "__main__":
    if sys.argv[1] == "thread":
        loader = sl.DataLoader(Fault(16, 5, "segfault"), batch_size=2, num_workers=2,
                               worker_type="thread")  # fmt: skip
    else:
        loader = sl.DataLoader(Fault(16, 5, "segfault"), batch_size=2, num_workers=2,
                               worker_type="auto", on_error="skip")  # fmt: skip
    got = [x for batch in loader for x in batch.tolist()]
    report = loader.report()
    print(json.dumps({"got": got, "kind": report.worker_kind,
                      "skipped": [s.index for s in report.skipped]}))  # fmt: skip
