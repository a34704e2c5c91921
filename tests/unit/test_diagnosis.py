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
    assert "worker 3 (pid 41872) was killed by SIGBUS while it held 1 batch (samples [1207])" in text
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


def test_sigkill_with_an_oom_kill_recorded_names_the_oom_killer() -> None:
    ev = diagnosis.Evidence(rss_bytes=int(7.9 * (1 << 30)), memory_limit_bytes=8 << 30,
                            oom_kills_before=0, oom_kills_after=1, stage="loading")
    text = str(diagnosis.worker_died(
        worker_id=3, pid=41872, exitcode=-signal.SIGKILL, sample_indices=[1207],
        batches_held=1, start_method="forkserver", evidence=ev, sample=1207,
        outcome="steadyload started a replacement worker (restart 1 of 3).",
    ))
    assert "worker 3 (pid 41872) was killed by SIGKILL while loading sample 1207" in text
    assert ("Likely cause: the out-of-memory killer (cgroup memory.events oom_kill went 0 -> 1; "
            "its last measured memory was 7.9 GiB of a 8.0 GiB limit).") in text
    assert "max_worker_memory" in text and text.endswith("(restart 1 of 3).")


def test_sigkill_near_the_limit_without_a_counter_is_probably_oom() -> None:
    ev = diagnosis.Evidence(rss_bytes=900 << 20, memory_limit_bytes=1 << 30)
    text = str(diagnosis.worker_died(
        worker_id=0, pid=1, exitcode=-signal.SIGKILL, sample_indices=[], batches_held=0,
        start_method="forkserver", evidence=ev,
    ))
    assert "probably the out-of-memory killer: its last measured memory was 900 MiB of a 1.0 GiB limit" in text


def test_native_crash_lists_risky_libraries_and_the_stack() -> None:
    stack = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n  File \"/data/ds.py\", line 9 in __getitem__\n\nExtension modules: numpy (total: 1)"
    ev = diagnosis.Evidence(stacks=stack, libraries=("OpenCV (cv2)",))
    text = str(diagnosis.worker_died(
        worker_id=0, pid=1, exitcode=-signal.SIGSEGV, sample_indices=[4], batches_held=1,
        start_method="forkserver", evidence=ev, sample=4,
    ))
    assert "Loaded crash-prone native libraries: OpenCV (cv2)." in text
    assert 'File "/data/ds.py", line 9 in __getitem__' in text and "Extension modules" not in text


def test_cgroup_files_are_read(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from steadyload.host import system

    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    monkeypatch.setattr(system, "_cgroup_dir", lambda pid="self", root=None: tmp_path)
    assert system.cgroup_memory() == system.CgroupMemory(1 << 30, 2)
    (tmp_path / "memory.max").write_text("max\n")
    assert system.cgroup_memory().limit_bytes is None


def test_available_memory_is_read_without_importing_psutil() -> None:
    """The loader asks on its first batch (memory/advice.py's check), which must not wait
    for psutil's import."""
    import os
    import subprocess
    import sys

    import psutil

    code = (
        "import sys; from steadyload.host.system import available_memory_bytes; "
        "print(available_memory_bytes(), 'psutil' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout.split()
    assert out[1] == "False"
    available, expected = int(out[0]), psutil.virtual_memory().available
    assert 0 < available <= 1.1 * expected  # a cgroup limit may cap it further


def test_sizes_parse() -> None:
    from steadyload.host.system import parse_bytes

    assert parse_bytes("4GiB", "x") == 4 << 30 and parse_bytes("512MB", "x") == 512 * 10**6
    assert parse_bytes("1.5g", "x") == int(1.5e9) and parse_bytes(1024, "x") == 1024
    assert parse_bytes(None, "x") is None
