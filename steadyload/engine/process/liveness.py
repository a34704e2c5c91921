"""Why a process worker is gone: its exit status or signal (`ProcessExit`), or the death of
the fork server (or zygote) it came from, which takes every worker it forked (`ServerExit`).

The pool sees both through descriptors (a worker's sentinel, a server's pidfd: pool.py,
server_watch.py); these causes word them with the evidence (diagnosis/process.py,
diagnosis/server.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ... import diagnosis
from ...errors import WorkerDiedError
from ..events import Loss, Lost
from ..pool import ServerPool


@dataclass(frozen=True, slots=True)
class ProcessExit:
    """A worker process exited: its status (negative: the signal), how it was started, and
    what its status block kept (a native crash's stack, crash-prone libraries loaded)."""

    exitcode: int | None
    start_method: str
    stacks: str = ""
    libraries: tuple[str, ...] = ()
    group: Lost = ()
    blames_sample: bool = True

    @property
    def name(self) -> str:
        """ "SIGKILL", or "exit status 3"."""
        return diagnosis.signal_name(self.exitcode) or f"exit status {self.exitcode}"

    @property
    def short(self) -> str:
        """ "killed by SIGKILL", or "exited with status 3"."""
        signal = diagnosis.signal_name(self.exitcode)
        return f"killed by {signal}" if signal else f"exited with status {self.exitcode}"

    @property
    def clean(self) -> bool:
        """Exit status 0: the worker ended itself (after `Retire`, at ``max_worker_memory``)."""
        return self.exitcode == 0

    def heal(self, pool: Any) -> tuple[str, ...]:
        """Nothing to restart but the worker."""
        return ()

    def explain(self, loss: Loss) -> WorkerDiedError:
        """torch's first line, then the signal's likely cause with its evidence and a fix."""
        evidence = dataclasses.replace(loss.evidence, stacks=self.stacks, libraries=self.libraries)
        return loss.worker_died(self.exitcode, self.start_method, evidence)


@dataclass(frozen=True, slots=True)
class ServerExit:
    """The fork server (or zygote) exited, with every worker it forked (``group``: their
    exit codes, which only the server knew, are lost). No sample is at fault."""

    method: str
    """"forkserver" or "zygote"."""
    pid: int
    exitcode: int | None
    """Its exit code (negative: the signal); None when unknown (reaped by someone else)."""
    group: Lost = ()
    blames_sample: bool = False
    clean: bool = False

    @property
    def name(self) -> str:
        """ "SIGKILL", or "exit status 1"."""
        return diagnosis.signal_name(self.exitcode) or f"exit status {self.exitcode}"

    @property
    def short(self) -> str:
        """ "the forkserver died (SIGKILL)"."""
        return f"the {self.method} died ({self.name})"

    def heal(self, pool: Any) -> tuple[str, ...]:
        """Start a new server in place of this one (its workers start from it)."""
        if not isinstance(pool, ServerPool):
            raise RuntimeError(
                f"[steadyload internal error] a fork server died under a {pool.kind} pool; "
                "please report with the output of `steadyload doctor`"
            )
        return pool.restart_server(self.method, self.pid)

    def explain(self, loss: Loss) -> WorkerDiedError:
        """What took the workers: the server's signal, its likely sender, a fix."""
        return diagnosis.server_died(
            method=self.method,
            pid=self.pid,
            exitcode=self.exitcode,
            worker_pids=[pid for _, pid, _ in self.group],
            batches_held=loss.batches_held,
            outcome=loss.outcome,
        )
