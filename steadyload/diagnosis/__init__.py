"""Diagnosis: the evidence about a failed worker -> a message that says what happened, why,
and what to do; one module per way a worker fails (a process's death, a thread's, a fork
server's, a hang), and `describe` for renderings that never raise."""

from .describe import format_indices, signal_name
from .hangs import timed_out, worker_hung
from .process import Evidence, worker_died
from .server import server_died
from .thread import thread_died

__all__ = [
    "Evidence", "format_indices", "server_died", "signal_name", "thread_died", "timed_out",
    "worker_died", "worker_hung",
]
