"""The fork servers a pool's workers came from: one pidfd each, and their deaths.

Each worker handle remembers the server that forked it (CPython restarts a dead fork
server on its own at the next start, and steadyload's zygote too, so live workers may come
from two servers for a moment). A server's pidfd sits in the pool's one
``connection.wait``; when it fires, or when a worker of it is reported exited with status
255 (what CPython reports for every worker of a server that died), the server's exit is
confirmed here and its workers are buried together as one event (docs/design/recovery.md).
"""

from __future__ import annotations

import select
from collections.abc import Iterator

from ...host.system import close_fds, pidfd_open
from ...start import servers
from ...start.servers import ServerRef


class ServerWatch:
    """pidfds of the servers that have live workers; owned by one pool.

    ``fds`` is shared with the pool's finalizer, which closes what is left.
    """

    def __init__(self, fds: dict[ServerRef, int]) -> None:
        self.fds = fds

    def watch(self, method: str) -> ServerRef | None:
        """The server forking workers for ``method`` now, watched from here on."""
        server = servers.current(method)
        if server is not None and server not in self.fds:
            fd = pidfd_open(server.pid)
            if fd is not None:
                self.fds[server] = fd
        return server

    def waitables(self) -> Iterator[tuple[int, ServerRef]]:
        """(pidfd, server) pairs to wait on."""
        return ((fd, server) for server, fd in self.fds.items())

    def exited(self, server: ServerRef, wait_s: float = 0.0) -> tuple[bool, int | None]:
        """(whether ``server`` has exited, within ``wait_s``; its exit code or -signal).

        A worker's sentinel can close a moment before its server's exit is visible: the
        pidfd (or, without one, a short poll) bounds how long that may take. [Unit: second]
        """
        fd = self.fds.get(server)
        if fd is not None:
            readable, _, _ = select.select([fd], [], [], wait_s)
            if not readable:
                return False, None
        elif not servers.wait_exited(server, wait_s):
            return False, None
        return servers.exit_status(server)

    def forget(self, server: ServerRef) -> None:
        """Stop watching ``server`` (its workers are gone)."""
        fd = self.fds.pop(server, None)
        if fd is not None:
            close_fds([fd])

    def close(self) -> None:
        """Close every pidfd. Safe to call more than once."""
        close_fds(list(self.fds.values()))
        self.fds.clear()
