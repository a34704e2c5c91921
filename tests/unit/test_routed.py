"""`RoutedPool` on fake pools that record calls and queue events (no workers, no waiting).

What is checked here is the router alone: per-worker calls reach the pool the route names,
pool-wide calls every running pool, events of all pools come out unchanged, views join in
id order, and shutdown reaches every pool even when one raises. The hand-over's own rules
are checked with real workers in tests/faults/test_handover.py and
tests/integration/test_threads.py.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection, Iterator
from typing import Any

import pytest

from steadyload.engine.events import Died
from steadyload.engine.pool import PROCESS, REMOTE, THREAD, Kind, ServerPool, wait_any
from steadyload.engine.process.liveness import ProcessExit, ServerExit
from steadyload.engine.routed import RoutedPool, by_id
from steadyload.engine.worker.status import Progress


class FakePool:
    """A `WorkerPool` of ``count`` workers (ids from ``first``) that records each call."""

    def __init__(self, name: str, kind: Kind, first: int, count: int) -> None:
        self.name, self._kind, self.first = name, kind, first
        self.calls: list[tuple[Any, ...]] = []
        self.queued: list[tuple[int, object]] = []  # events `pending` reports
        self.socket: socket.socket | None = None  # a waitable whose readiness brings `polled`
        self.polled: list[tuple[int, object]] = []
        self.views = [f"{name}{i}" for i in range(count)]
        self.running = False
        self.raises_on_shutdown = False

    @property
    def kind(self) -> Kind:
        """As given."""
        return self._kind

    @property
    def start_method(self) -> str | None:
        """Processes' only."""
        return "forkserver" if self._kind == PROCESS else None

    @property
    def preload(self) -> tuple[str, ...]:
        """One per pool, to tell them apart."""
        return (self.name,)

    @property
    def stopped(self) -> bool:
        """Once shut down."""
        return ("shutdown",) in self.calls

    @property
    def clock(self) -> Callable[[], float]:
        """A clock of this pool's own."""
        return lambda: float(self.first)

    def _local(self, worker_id: int) -> int:
        assert worker_id >= self.first, f"{self.name} asked about worker {worker_id}"
        return worker_id

    def start(self) -> None:
        """Records."""
        self.calls.append(("start",))
        self.running = True

    def respawn(self, worker_id: int) -> None:
        """Records."""
        self.calls.append(("respawn", self._local(worker_id)))

    def shutdown(self) -> None:
        """Records; raises once asked to."""
        self.calls.append(("shutdown",))
        self.running = False
        if self.raises_on_shutdown:
            raise OSError(f"{self.name} failed to stop")

    def pid(self, worker_id: int) -> int | None:
        """The id itself, offset by pool."""
        return 1000 * (self.first + 1) + self._local(worker_id)

    def pids(self) -> dict[int, int]:
        """This pool's."""
        return {self.first: 1}

    def started_at(self, worker_id: int) -> float | None:
        """Records."""
        self.calls.append(("started_at", self._local(worker_id)))
        return 0.0

    def send_task(self, worker_id: int, task_id: int, indices: Any, epoch: int = 0) -> None:
        """Records."""
        self.calls.append(("send_task", self._local(worker_id), task_id, indices, epoch))

    def send_restore(self, worker_id: int, state: bytes) -> None:
        """Records."""
        self.calls.append(("send_restore", self._local(worker_id), state))

    def send_reset(self) -> None:
        """Records."""
        self.calls.append(("send_reset",))

    def waitables(self) -> list[Any]:
        """The socket, if any."""
        self.calls.append(("waitables",))
        return [self.socket] if self.socket is not None else []

    def pending(self) -> bool:
        """Whether events are queued."""
        return bool(self.queued)

    def collect(self, ready: Collection[Any]) -> list[tuple[int, object]]:
        """Queued events, and the polled ones if the socket was ready."""
        out, self.queued = self.queued, []
        if self.socket is not None and self.socket in ready:
            out, self.polled = out + self.polled, []
        return out

    def wait(self, timeout_s: float | None) -> list[tuple[int, object]]:
        """As every pool."""
        return wait_any((self,), timeout_s)

    def progress(self, worker_id: int) -> Progress | None:
        """Records."""
        self.calls.append(("progress", self._local(worker_id)))
        return None

    def on_its_way(self, worker_id: int) -> bool:
        """Records."""
        self.calls.append(("on_its_way", self._local(worker_id)))
        return True

    def dump_stack(self, worker_id: int, wait_s: float = 1.0) -> str:
        """Names the pool."""
        return f"stack of {self.name} {self._local(worker_id)}"

    def kill(self, worker_id: int) -> None:
        """Records."""
        self.calls.append(("kill", self._local(worker_id)))


class FakeServerPool(FakePool):
    """A fake pool whose workers come from a fork server."""

    def restart_server(self, method: str, pid: int) -> tuple[str, ...]:
        """Records."""
        self.calls.append(("restart_server", (method, pid)))
        return ("torch",)


@pytest.fixture
def pools() -> tuple[FakeServerPool, FakePool]:
    """Two local process workers (ids 0, 1) and three remote ones (2 .. 4)."""
    return FakeServerPool("local", PROCESS, 0, 2), FakePool("remote", REMOTE, 2, 3)


@pytest.fixture
def routed(pools: tuple[FakeServerPool, FakePool]) -> Iterator[RoutedPool]:
    """The two started as one pool, by id."""
    pool = by_id(*pools, split=2)
    pool.start()
    yield pool
    pool.shutdown()


def _only(pool: FakePool, name: str) -> list[tuple[Any, ...]]:
    return [c for c in pool.calls if c[0] == name]


def test_per_worker_calls_go_to_the_pool_the_route_names(
    pools: tuple[FakeServerPool, FakePool], routed: RoutedPool
) -> None:
    local, remote = pools
    routed.send_task(1, 7, [3, 4], epoch=2)
    routed.send_task(3, 8, [5], epoch=2)
    routed.send_restore(4, b"at 9")
    routed.respawn(0)
    routed.kill(2)
    routed.progress(1)
    routed.started_at(4)
    assert routed.on_its_way(3)
    assert (routed.pid(0), routed.pid(3)) == (1000, 3003)
    assert routed.dump_stack(4) == "stack of remote 4"
    assert [c for c in local.calls if c[0] not in ("start", "waitables")] == [
        ("send_task", 1, 7, [3, 4], 2), ("respawn", 0), ("progress", 1),
    ]  # fmt: skip
    assert [c for c in remote.calls if c[0] not in ("start", "waitables")] == [
        ("send_task", 3, 8, [5], 2), ("send_restore", 4, b"at 9"), ("kill", 2),
        ("started_at", 4), ("on_its_way", 3),
    ]  # fmt: skip


def test_the_route_is_asked_at_each_call() -> None:
    threads, procs = FakePool("threads", THREAD, 0, 2), FakePool("procs", PROCESS, 0, 2)
    phase = [threads]
    pool = RoutedPool((threads, procs), lambda worker_id: phase[0])
    pool.send_task(0, 1, [0])
    phase[0] = procs
    pool.send_task(0, 2, [1])
    assert _only(threads, "send_task") == [("send_task", 0, 1, [0], 0)]
    assert _only(procs, "send_task") == [("send_task", 0, 2, [1], 0)]


def test_pool_wide_calls_reach_every_running_pool(
    pools: tuple[FakeServerPool, FakePool], routed: RoutedPool
) -> None:
    local, remote = pools
    assert routed.running and _only(local, "start") == _only(remote, "start") == [("start",)]
    assert remote.calls[0] == ("start",) and local.calls[0] == ("start",)
    routed.send_reset()
    assert _only(local, "send_reset") == _only(remote, "send_reset") == [("send_reset",)]
    local.shutdown()  # stopped early (as auto's threads are): no longer asked
    routed.send_reset()
    assert len(_only(local, "send_reset")) == 1 and len(_only(remote, "send_reset")) == 2


def test_remote_pool_starts_first_and_local_stops_first(
    pools: tuple[FakeServerPool, FakePool],
) -> None:
    order: list[str] = []
    local, remote = pools
    for p in pools:
        p.start = lambda p=p: order.append(f"start {p.name}")  # type: ignore[method-assign]  # spy
        p.shutdown = lambda p=p: order.append(f"stop {p.name}")  # type: ignore[method-assign]  # spy
    routed = by_id(local, remote, split=2)
    routed.start()
    routed.shutdown()
    assert order == ["start remote", "start local", "stop local", "stop remote"]


def test_events_of_every_pool_come_out_of_wait_and_collect_unchanged(
    pools: tuple[FakeServerPool, FakePool], routed: RoutedPool
) -> None:
    local, remote = pools
    died = Died("process", 0, 1000, None, ProcessExit(-9, "forkserver"))
    server = Died("process", -1, 5, None, ServerExit("forkserver", 5, -9, ((0, 1000, None),)))
    local.queued = [(0, died), (-1, server)]
    remote.queued = [(3, "ready")]
    assert routed.pending()
    assert routed.collect(()) == [(0, died), (-1, server), (3, "ready")]
    assert not routed.pending() and routed.wait(0.0) == []
    remote.queued = [(2, "queued")]
    got = routed.wait(5.0)  # queued events: no blocking
    assert got == [(2, "queued")] and got[0][1] == "queued"


def test_wait_polls_a_quiet_pool_while_another_has_events_queued(
    pools: tuple[FakeServerPool, FakePool], routed: RoutedPool
) -> None:
    local, remote = pools
    mine, theirs = socket.socketpair()
    try:
        local.socket, local.polled = mine, [(1, "from the socket")]
        theirs.send(b"x")  # the local pool's waitable is readable
        remote.queued = [(4, "queued")]  # and the remote pool has events queued
        assert routed.wait(5.0) == [(1, "from the socket"), (4, "queued")]
        assert _only(local, "waitables") and _only(remote, "waitables")  # each armed
    finally:
        mine.close()
        theirs.close()


def test_views_join_in_worker_id_order(
    pools: tuple[FakeServerPool, FakePool], routed: RoutedPool
) -> None:
    local, remote = pools
    assert list(routed.views) == ["local0", "local1", "remote0", "remote1", "remote2"]
    remote.views[1] = "remote1'"  # a respawn replaces a view: seen at once
    assert len(routed.views) == 5 and routed.views[3] == "remote1'"
    with pytest.raises(IndexError):
        routed.views[5]


def test_the_whole_is_described_by_the_lead_pool(
    pools: tuple[FakeServerPool, FakePool], routed: RoutedPool
) -> None:
    local, remote = pools
    assert (routed.kind, routed.start_method, routed.preload) == (PROCESS, "forkserver", ("local",))
    assert routed.pids() == {0: 1} and routed.clock() == 0.0
    assert routed.part(REMOTE) is remote and routed.remote is remote
    assert routed.part(THREAD) is None


def test_remote_only_pools_report_no_start_method() -> None:
    from steadyload.engine.remote.pool import RemotePool

    assert RemotePool.start_method is None and RemotePool.kind == REMOTE
    # outcomes.py names a worker that could not start by `start_method or kind`
    assert (RemotePool.start_method or RemotePool.kind) == "remote"


def test_restart_server_goes_to_the_pool_with_a_fork_server(
    pools: tuple[FakeServerPool, FakePool], routed: RoutedPool
) -> None:
    local, _ = pools
    dead = ServerExit("forkserver", 5, -9, ())
    assert isinstance(routed, ServerPool)
    assert dead.heal(routed) == ("torch",)  # the cause restarts its server through the router
    assert _only(local, "restart_server") == [("restart_server", ("forkserver", 5))]
    threads = FakePool("threads", THREAD, 0, 1)
    threads_only = RoutedPool((threads,), lambda worker_id: threads)
    with pytest.raises(RuntimeError, match=r"internal error\] a fork server died under a thread"):
        threads_only.restart_server("forkserver", 5)


def test_shutdown_reaches_every_pool_even_when_one_raises(
    pools: tuple[FakeServerPool, FakePool],
) -> None:
    local, remote = pools
    routed = by_id(local, remote, split=2)
    routed.start()
    local.raises_on_shutdown = True
    with pytest.raises(OSError, match="local failed to stop"):
        routed.shutdown()
    assert remote.stopped and local.stopped and routed.stopped and not routed.running
    remote.raises_on_shutdown, local.raises_on_shutdown = True, False
    with pytest.raises(OSError, match="remote failed to stop"):
        routed.shutdown()  # idempotent: asked again, every pool is asked again
    assert len(_only(local, "shutdown")) == 2
