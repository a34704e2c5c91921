"""Ctrl-C at safe points only: SIGINT held while the parent's bookkeeping runs.

A ``KeyboardInterrupt`` is raised between any two bytecodes of the main thread. Landing
between receiving a batch and recording it, or between recording a task and sending it,
would lose or duplicate a batch; landing inside a teardown would leave workers running.
So the iterator and the teardown run under `held_interrupts`: a SIGINT that arrives is
remembered and handed to the handler that was installed (normally raising
``KeyboardInterrupt``) when the block ends. Blocking waits open a window with
`interrupts_allowed`, so Ctrl-C still interrupts a wait at once. Signal handlers can only be
changed in the main thread, and Python delivers signals only there, so elsewhere these
do nothing. Nesting is allowed; only the outermost block swaps the handler
(docs/design/shutdown.md#ctrl-c).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

_state = threading.local()  # only the main thread's is ever set


class _Held:
    """What the outermost block swapped out, and the SIGINT it is holding."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.pending: tuple[int, FrameType | None] | None = None
        self.depth = 0
        self.on_interrupt: list[Callable[[], None]] = []

    def hold(self, signum: int, frame: FrameType | None) -> None:
        self.pending = (signum, frame)
        for callback in list(self.on_interrupt):
            callback()


def _deliver(previous: Any, pending: tuple[int, FrameType | None]) -> None:
    if callable(previous):
        previous(*pending)  # default_int_handler raises KeyboardInterrupt here
    elif previous == signal.SIG_DFL:
        raise KeyboardInterrupt
    # SIG_IGN, or None (installed from C): the interrupt is dropped, as it would have been


@contextlib.contextmanager
def held_interrupts(before_delivery: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold SIGINT during the block; deliver it (once) when the outermost block ends.

    ``before_delivery`` runs (in the outermost block) right before a held SIGINT is
    delivered, after the handler was put back: the iterator takes back a batch it was about
    to return, so that the interrupt never loses one.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: _Held | None = getattr(_state, "held", None)
    if held is None:
        held = _Held(signal.getsignal(signal.SIGINT))
        signal.signal(signal.SIGINT, held.hold)
        _state.held = held
    held.depth += 1
    try:
        yield
    finally:
        held.depth -= 1
        if held.depth == 0:
            _state.held = None
            signal.signal(signal.SIGINT, held.previous)
            pending, held.pending = held.pending, None
            if pending is not None:
                if before_delivery is not None:
                    before_delivery()
                _deliver(held.previous, pending)


@contextlib.contextmanager
def interrupts_allowed() -> Iterator[None]:
    """Inside a held block: let SIGINT through during a blocking wait (it leaves no state
    half-changed); one that arrived before is delivered now."""
    held: _Held | None = getattr(_state, "held", None)
    if held is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, held.previous)
    try:
        pending, held.pending = held.pending, None
        if pending is not None:
            _deliver(held.previous, pending)
        yield
    finally:
        signal.signal(signal.SIGINT, held.hold)


@contextlib.contextmanager
def on_interrupt(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` (from the signal handler: keep it to setting a flag) when a SIGINT
    is held during the block; a teardown uses it to skip its grace periods."""
    held: _Held | None = getattr(_state, "held", None)
    if held is None:
        yield
        return
    held.on_interrupt.append(callback)
    try:
        yield
    finally:
        held.on_interrupt.remove(callback)


def interrupt_pending() -> bool:
    """Whether a SIGINT is being held (the user asked to stop)."""
    held: _Held | None = getattr(_state, "held", None)
    return held is not None and held.pending is not None
