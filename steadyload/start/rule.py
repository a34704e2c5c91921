"""``start_method="auto"``: the zygote where forking this process is safe now, else forkserver.

A worker from the zygote (zygote.py) is a fork away: its first batch comes in about the
time torch's fork workers take, and it shares this process's pages. A worker from
CPython's fork server waits, the first time, for that server to import torch, and the
server's import is memory nobody shares. But the zygote is a fork() of this process, so
it is chosen only when a fork now is safe and cheap, and forkserver (safe at any time)
stays the choice otherwise. The rule, checked when the loader is built (the first loader
that picks the zygote forks it; later loaders use it even after the GPU is in use, since
their workers never come from this process):

- `steadyload.prestart()` did not start the fork server for the loaders (the user's ask);
- the interpreter can run a zygote (Linux, CPython 3.10-3.13);
- no GPU context here: torch's CUDA/ROCm is not initialised, and no other GPU framework
  (JAX, TensorFlow, CuPy, ...) is imported, whose context torch cannot see;
- no other Python thread runs: a lock one holds at the fork would stay held in the zygote
  and every worker (native thread pools are handled where known: OpenMP, tokenizers);
- this process's private memory is at most `MAX_PRIVATE_BYTES`: the zygote pins the
  heap as it was at the fork, and memory freed or rewritten here later stays in it.

docs/design/zygote.md explains each line and what it costs; tests/unit/test_start_rule.py
tests the rule with injected facts.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

from . import zygote

MAX_PRIVATE_BYTES = 512 << 20
"""This process's private (anonymous) memory above which the zygote is not forked: it
would pin that heap, while the fork server's own cost is fixed (its import of torch).
torch with transformers imported is about a third of it. [Unit: byte]"""
PRESTARTED = threading.Event()
"""Set by `steadyload.prestart` (start_method="forkserver"): its server is then the choice."""
GPU_MODULES = ("jax", "jaxlib", "tensorflow", "cupy", "pycuda", "numba.cuda", "mxnet", "paddle")
"""Frameworks that may hold a GPU context torch cannot see: imported, no zygote."""


@dataclass(frozen=True, slots=True)
class StartFacts:
    """What the rule looks at, gathered by `facts` (tests inject their own)."""

    zygote_running: bool
    prestarted: bool
    """`steadyload.prestart` started the fork server: the user asked for it."""
    unsupported: str | None
    """Why this interpreter cannot run a zygote, or None."""
    gpu: str | None
    """The GPU context torch holds here, described, or None."""
    gpu_modules: tuple[str, ...]
    threads: tuple[str, ...]
    """The other Python threads' names."""
    private_bytes: int | None
    """This process's anonymous resident memory (None: unknown). [Unit: byte]"""


def facts() -> StartFacts:
    """The facts about this process now."""
    from .guards import gpu_context_description

    current = threading.current_thread()
    return StartFacts(
        zygote_running=zygote.pid() is not None,
        prestarted=PRESTARTED.is_set(),
        unsupported=zygote.unsupported_reason(),
        gpu=gpu_context_description() if "torch" in sys.modules else None,
        gpu_modules=tuple(m for m in GPU_MODULES if m in sys.modules),
        threads=tuple(sorted(t.name for t in threading.enumerate() if t is not current)),
        private_bytes=private_bytes(),
    )


def private_bytes() -> int | None:
    """RssAnon of this process (Linux), or None where it cannot be read. [Unit: byte]"""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def choose(found: StartFacts) -> tuple[str, str]:
    """("zygote" or "forkserver", why), for ``start_method="auto"`` on a forkserver platform."""
    if found.zygote_running:
        return "zygote", "the zygote forked earlier in this process runs"
    if found.prestarted:
        return "forkserver", "steadyload.prestart() started the fork server for the loaders"
    reason = refusal(found)
    if reason is None:
        return "zygote", (
            "no GPU context, no other thread and a lean heap here, so the zygote (a fork of "
            "this process) starts the workers"
        )
    return "forkserver", f"not the zygote: {reason}"


def refusal(found: StartFacts) -> str | None:
    """Why forking the zygote now is unsafe or costly, or None when it is neither."""
    if found.unsupported is not None:
        return found.unsupported
    if found.gpu is not None:
        return f"this process holds {found.gpu}, which a fork would copy unusable"
    if found.gpu_modules:
        return (
            f"{', '.join(found.gpu_modules)} is imported and may hold a GPU context that "
            "a fork would copy unusable"
        )
    if found.threads:
        return (
            f"{len(found.threads)} other thread(s) run here ({', '.join(found.threads[:4])}"
            f"{', ...' if len(found.threads) > 4 else ''}), and a lock one holds at a fork "
            "would stay held in every worker"
        )
    if found.private_bytes is not None and found.private_bytes > MAX_PRIVATE_BYTES:
        return (
            f"this process holds {found.private_bytes / 2**20:.0f} MiB of private memory "
            f"(over {MAX_PRIVATE_BYTES >> 20} MiB), which a zygote would pin as it is now"
        )
    return None
