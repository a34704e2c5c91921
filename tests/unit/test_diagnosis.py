"""Messages for worker deaths and time-outs: torch's first line, then what, why, fix."""

from __future__ import annotations

import signal

from steadyload import diagnosis


def test_signal_names() -> None:
    assert diagnosis.signal_name(-signal.SIGKILL) == "SIGKILL"
    assert diagnosis.signal_name(1) is None and diagnosis.signal_name(None) is None


def test_sigbus_points_at_shared_memory() -> None:
    err = diagnosis.worker_died(
        worker_id=3, pid=41872, exitcode=-signal.SIGBUS, sample_indices=[1207],
        batches_held=1, start_method="forkserver",
    )
    text = str(err)
    assert text.splitlines()[0] == "DataLoader worker (pid 41872) is killed by signal: Bus error."
    assert "worker 3 (pid 41872) was killed by SIGBUS while loading 1 batch (samples [1207])" in text
    assert "/dev/shm" in text and "--shm-size" in text
    assert err.sample_indices == [1207] and err.signal_name == "SIGBUS"


def test_fork_server_death_and_long_index_lists() -> None:
    err = diagnosis.worker_died(
        worker_id=0, pid=7, exitcode=255, sample_indices=list(range(100)), batches_held=4,
        start_method="forkserver",
    )
    text = str(err)
    assert "exited unexpectedly with exit code 255" in text
    assert "fork server itself died" in text
    assert "... 84 more]" in text and "4 batches" in text


def test_timeout_message_keeps_torchs_words() -> None:
    err = diagnosis.timed_out(timeout_s=2.5, worker_id=1, pid=9, sample_indices=[4, 5])
    assert str(err).startswith("DataLoader timed out after 2.5 seconds\n")
    assert isinstance(err, TimeoutError)
