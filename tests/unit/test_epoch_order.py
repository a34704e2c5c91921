"""YieldedBatches: which batches of an epoch were yielded, and taking the last one back."""

from __future__ import annotations

import random

from steadyload.resume.epoch_order import YieldedBatches


def test_unmark_undoes_the_last_mark_in_any_order_of_arrival() -> None:
    rng = random.Random(0)
    for _ in range(200):
        order = list(range(12))
        # in_order=False: each batch at most a few places from its turn (the window).
        order.sort(key=lambda i: i + rng.uniform(0, 4))
        yielded = YieldedBatches()
        for ordinal in order:
            before = (yielded.prefix, set(yielded.beyond))
            yielded.mark(ordinal)
            yielded.unmark(ordinal)  # a Ctrl-C took it back ...
            assert (yielded.prefix, yielded.beyond) == before, (order, ordinal)
            yielded.mark(ordinal)  # ... and the next call yields it
        assert (yielded.prefix, yielded.beyond, yielded.count) == (12, set(), 12)
