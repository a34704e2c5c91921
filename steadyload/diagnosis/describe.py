"""Safe, short renderings of what user code and workers hand over: exception texts,
tracebacks, index lists, signal names. None of them raises, whatever the object does.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Sequence

_MAX_INDICES_SHOWN = 16


def signal_name(exitcode: int | None) -> str | None:
    """``-9 -> "SIGKILL"``; None for a normal exit status or an unknown signal number."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return None


def describe_exception(exc: BaseException) -> tuple[str, str]:
    """(qualified type name, text) of an exception, never raising: user code's ``__str__``
    may raise, and the worker that reports the error must not die of it."""
    cls = type(exc)
    name = f"{cls.__module__}.{cls.__qualname__}"
    try:
        text = str(exc)
    except Exception as inner:
        text = f"<str() of the exception raised {type(inner).__name__}: {inner!r}>"
    return name, text


def format_traceback(exc: BaseException) -> str:
    """The exception's traceback as text, never raising (see `describe_exception`)."""
    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception as inner:  # a broken __str__ or __notes__, say
        return f"(the traceback could not be formatted: {type(inner).__name__})"


def format_indices(indices: Sequence[object]) -> str:
    """A short, readable rendering of a list of sample indices."""
    shown = ", ".join(repr(i) for i in indices[:_MAX_INDICES_SHOWN])
    more = len(indices) - _MAX_INDICES_SHOWN
    return f"[{shown}, ... {more} more]" if more > 0 else f"[{shown}]"


def tail(text: str, lines: int = 25) -> str:
    """The last ``lines`` lines of ``text``, indented (a stack in a message)."""
    # faulthandler ends with the list of loaded extension modules: not worth the space.
    body = [line for line in text.strip().splitlines() if not line.startswith("Extension modules")]
    kept = body[-lines:]
    return "\n".join("    " + line for line in kept)
