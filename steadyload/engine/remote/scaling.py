"""The stall rule of ``remote_workers=(min, max)``: grow while the training loop waits for
data and the added worker helps, shrink when batches pile up.

`StallScaler` only decides; it is fed measurements (the loop's waiting time, batches
yielded, batches ready and not yet taken, actors not yet placed), so the rule is tested with
injected figures. The iterator applies its decisions (iterators/scaling.py).
"""

from __future__ import annotations

import dataclasses

INTERVAL_S = 2.0
"""How often the rule looks at the figures (a window). [Unit: second]"""
GROW_ABOVE = 0.10
"""Grow while the training loop spends more than this share of its time waiting for data."""
SHRINK_BELOW = 0.02
"""Shrink when it waits less than this share and ready batches pile up."""
GAIN = 1.05
"""An added worker helps when the batch rate rises by this factor at least."""


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingDecision:
    """One change of the remote pool's size, with the figures behind it."""

    at_s: float
    """Seconds since the epoch began. [Unit: second]"""
    workers: int
    """Remote workers after the change."""
    change: int
    """+1 (grown) or -1 (shrunk)."""
    stall_share: float
    """The share of the window the training loop spent waiting for data."""
    batches_per_s: float
    """Batches the loop took per second in the window. [Unit: 1/second]"""
    reason: str
    epoch: int = 0


class StallScaler:
    """Decides +1, -1 or 0 once per window from the loop's figures (see module)."""

    def __init__(
        self,
        minimum: int,
        maximum: int,
        *,
        interval_s: float = INTERVAL_S,
        grow_above: float = GROW_ABOVE,
        shrink_below: float = SHRINK_BELOW,
    ) -> None:
        self.minimum, self.maximum = minimum, maximum
        self.ceiling = maximum  # lowered when an added worker did not help
        self._interval = interval_s
        self._grow_above, self._shrink_below = grow_above, shrink_below
        self._window: tuple[float, float, int] | None = None  # (time, wait_s, batches)
        self._grown_from: float | None = None  # the batch rate before the latest growth

    def joined(self) -> None:
        """An added worker started taking tasks: the next window begins now (its first
        batches, loaded while the loop waited, are not the pool's steady rate)."""
        self._window = None

    def observe(
        self,
        now: float,
        wait_s: float,
        batches: int,
        live: int,
        ready: int,
        unplaced: int,
    ) -> tuple[int, float, float, str]:
        """(change, stall share, batch rate, reason) for the figures at ``now``: the loop's
        total waiting seconds and batches so far, the live remote workers, batches ready
        and not yet taken, and actors Ray has not placed yet. Change 0: nothing to do."""
        if self._window is None or unplaced or batches < self._window[2]:
            # An added actor is not running yet (wait for it), or a new epoch began.
            self._window = (now, wait_s, batches)
            return 0, 0.0, 0.0, ""
        began, waited, taken = self._window
        span = now - began
        if span < self._interval:
            return 0, 0.0, 0.0, ""
        self._window = (now, wait_s, batches)
        stall = min(1.0, max(0.0, (wait_s - waited) / span))
        rate = (batches - taken) / span
        grown_from, self._grown_from = self._grown_from, None
        if grown_from is not None and rate < grown_from * GAIN and stall > self._grow_above:
            self.ceiling = max(self.minimum, live - 1)
            if live > self.minimum:
                return (
                    -1,
                    stall,
                    rate,
                    (
                        f"the worker added last did not help ({rate:.1f} batches/s, "
                        f"{grown_from:.1f} before): the limit is not the workers"
                    ),
                )
        if stall > self._grow_above and live < min(self.maximum, self.ceiling):
            self._grown_from = rate
            return +1, stall, rate, f"the training loop waited {stall:.0%} of the time"
        if stall < self._shrink_below and ready >= max(2, live) and live > self.minimum:
            self.ceiling = self.maximum  # the load changed: growing may help again later
            return (
                -1,
                stall,
                rate,
                (f"{ready} batches were ready and waiting; the loop waited {stall:.0%}"),
            )
        return 0, stall, rate, ""
