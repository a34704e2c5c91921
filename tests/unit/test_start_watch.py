"""The fork-server watch of a worker start (start/launch.py `_Watch`), on an injected clock
and injected /proc figures: no server is stopped or slowed, nothing sleeps."""

from __future__ import annotations

import pytest

from steadyload.start import launch


class Server:
    """What /proc says of the server: its state letter and (CPU ticks, bytes read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.state, self.progress = "S", (10, 100)
        monkeypatch.setattr(launch, "process_state", lambda pid: self.state)
        monkeypatch.setattr(launch, "server_progress", lambda pid: self.progress)


def test_a_stopped_server_is_named_at_the_first_look(monkeypatch: pytest.MonkeyPatch) -> None:
    server, now = Server(monkeypatch), [0.0]
    watch = launch._Watch(42, clock=lambda: now[0])
    server.state = "T"
    with pytest.raises(launch.StartStalled, match=r"the fork server \(pid 42\) is stopped") as info:
        watch.check()  # no time has passed: stopped is known at once
    assert info.value.stopped and info.value.pid == 42


@pytest.mark.parametrize("idle_s, stalled", [(launch.STALL_S - 0.01, False), (launch.STALL_S, True)])
def test_a_server_without_progress_fails_the_start_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch, idle_s: float, stalled: bool
) -> None:
    Server(monkeypatch)
    now = [0.0]
    watch = launch._Watch(42, clock=lambda: now[0])
    now[0] = idle_s
    if not stalled:
        watch.check()
        return
    with pytest.raises(launch.StartStalled, match="made no progress .* for 120 s") as info:
        watch.check()
    assert not info.value.stopped


def test_progress_restarts_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    server, now = Server(monkeypatch), [0.0]
    watch = launch._Watch(42, clock=lambda: now[0])
    now[0] = launch.STALL_S - 1
    server.progress = (11, 100)  # it used CPU time (an import that computes)
    watch.check()
    now[0] = 2 * launch.STALL_S - 1.01  # STALL_S - 0.01 since the progress
    watch.check()
    now[0] = 2 * launch.STALL_S - 1
    with pytest.raises(launch.StartStalled):
        watch.check()


def test_the_stall_limit_is_a_documented_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch.STALL_ENV, "300")
    assert launch.stall_s() == 300.0
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(launch.STALL_ENV, bad)
        with pytest.raises(ValueError, match="STEADYLOAD_START_STALL_S=.* is not a number of seconds"):
            launch.stall_s()
    monkeypatch.delenv(launch.STALL_ENV)
    assert launch.stall_s() == launch.STALL_S
