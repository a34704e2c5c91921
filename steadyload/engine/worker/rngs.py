"""The process-wide random generators (torch's default, `random`, numpy's global): their
states, to put back or to find a draw by.

Thread workers share them with the training loop (thread/sharing.py); a process worker
measured by ``worker_type="auto"`` checks whether its dataset draws from them
(status.py), since thread workers would then share them.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def process_rngs() -> tuple[Any, ...]:
    """The process-wide generators' states (torch's default, `random`, numpy's global)."""
    return torch.random.default_generator.get_state(), random.getstate(), np.random.get_state()


def restore_rngs(states: tuple[Any, ...]) -> None:
    """Put back what `process_rngs` took."""
    torch.random.default_generator.set_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def drawn(before: tuple[Any, ...]) -> bool:
    """Whether the process-wide generators moved since ``before`` (`process_rngs`)."""
    after = process_rngs()
    return not (
        torch.equal(before[0], after[0])
        and before[1] == after[1]
        and np.array_equal(before[2][1], after[2][1])
    )
