"""Ctrl-C at safe points only: SIGINT held while the parent's bookkeeping runs.

A ``KeyboardInterrupt`` is raised between any two bytecodes of the main thread. Landing
between receiving a batch and recording it, or between recording a task and sending it,
would lose or duplicate a batch; landing inside a teardown would leave workers running.
So the iterator and the teardown run under `held_interrupts`: a SIGINT that arrives is
remembered and handed to the handler that was installed (normally raising
``KeyboardInterrupt``) when the block ends. The one blocking call, the pool's wait,
opens a window with `interrupts_allowed`, so Ctrl-C still interrupts a wait at once.

Cost: while an iterator is `attach`ed (from its start to its teardown) steadyload's handler
stays installed, and it forwards a SIGINT at once to the previous handler whenever nothing
is held: holding and allowing are then a counter and a flag, no system call per batch. A
handler the user installs later is respected: a block that finds another handler swaps
for its own duration, as it does without an attached iterator. Signal handlers can only
be changed in the main thread, and Python delivers signals only there, so elsewhere these
do nothing; nor where the installed handler is C code (``getsignal`` gives None), which
steadyload could not put back (docs/design/shutdown.md#ctrl-c).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

try:  # the C function: signal.getsignal converts its answer to an enum through an exception
    # when the handler is a function (CPython 3.11), microseconds on every batch
    from _signal import getsignal as _raw_getsignal
except ImportError:  # another interpreter
    _raw_getsignal = signal.getsignal


class _Guard:
    """The process's SIGINT state (touched by the main thread and its signal handler only)."""

    def __init__(self) -> None:
        self.previous: Any = None  # the handler steadyload's replaced, while installed
        self.installed = False
        self.attached = 0  # iterators that keep the handler installed
        self.depth = 0  # nested held blocks
        self.allowing = False  # inside an interrupts_allowed window
        self.pending: tuple[int, FrameType | None] | None = None
        self.on_interrupt: list[Callable[[], None]] = []

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.depth == 0 or self.allowing:
            _deliver(self.previous, (signum, frame))
            return
        self.pending = (signum, frame)
        for callback in list(self.on_interrupt):
            callback()

    def install(self) -> bool:
        """Put steadyload's handler in place; False where it cannot be (see module doc)."""
        if self.installed and _raw_getsignal(signal.SIGINT) == self.handler:
            return True
        current = signal.getsignal(signal.SIGINT)
        if current is None:
            return False
        self.previous, self.installed = current, True
        signal.signal(signal.SIGINT, self.handler)
        return True

    def uninstall(self) -> None:
        if self.installed:
            self.installed = False
            if signal.getsignal(signal.SIGINT) == self.handler:
                signal.signal(signal.SIGINT, self.previous)


_guard = _Guard()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _deliver(previous: Any, pending: tuple[int, FrameType | None]) -> None:
    if callable(previous):
        previous(*pending)  # default_int_handler raises KeyboardInterrupt here
    elif previous == signal.SIG_DFL:
        raise KeyboardInterrupt
    # SIG_IGN: the interrupt is dropped, as it would have been


def attach() -> None:
    """An iterator starts: keep steadyload's handler installed until its `detach`."""
    if _main_thread():
        _guard.attached += 1
        _guard.install()


def detach() -> None:
    """The iterator attached before is done: restore the user's handler if it was the last."""
    if _main_thread() and _guard.attached > 0:
        _guard.attached -= 1
        if _guard.attached == 0 and _guard.depth == 0:
            _guard.uninstall()


@contextlib.contextmanager
def held_interrupts(before_delivery: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold SIGINT during the block; deliver it (once) when the outermost block ends.

    ``before_delivery`` runs (in the outermost block) right before a held SIGINT is
    delivered: the iterator takes back a batch it was about to return, so that the
    interrupt never loses one. Also when entered inside an `interrupts_allowed` window
    (a teardown run by the garbage collector during a wait): holding starts again.
    """
    if not _main_thread() or not _guard.install():
        yield
        return
    allowing, _guard.allowing = _guard.allowing, False
    _guard.depth += 1
    try:
        yield
    finally:
        _guard.depth -= 1
        _guard.allowing = allowing
        if _guard.depth == 0:
            previous, pending, _guard.pending = _guard.previous, _guard.pending, None
            if not _guard.attached:
                _guard.uninstall()
            if pending is not None:
                if before_delivery is not None:
                    before_delivery()
                _deliver(previous, pending)


@contextlib.contextmanager
def interrupts_allowed() -> Iterator[None]:
    """Inside a held block, around a blocking wait only: SIGINT goes through at once (the
    wait leaves nothing half-changed); one that arrived before is delivered now."""
    if _guard.depth == 0 or not _main_thread():
        yield
        return
    pending, _guard.pending = _guard.pending, None
    if pending is not None:
        _deliver(_guard.previous, pending)
    _guard.allowing = True
    try:
        yield
    finally:
        _guard.allowing = False


@contextlib.contextmanager
def on_interrupt(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` (from the signal handler: keep it to setting a flag) when a SIGINT
    is held during the block; a teardown uses it to skip its grace periods."""
    if _guard.depth == 0:
        yield
        return
    _guard.on_interrupt.append(callback)
    try:
        yield
    finally:
        _guard.on_interrupt.remove(callback)
