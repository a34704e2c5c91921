"""start_method="zygote": workers forked from a fork of this process, each case run for real."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import steadyload as sl
from steadyload.start import context as start
from tests.compare import assert_same_batches
from tests.conftest import processes_gone, wait_until
from tests.datasets import FaultOnce, MapDS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def zygote() -> int:
    """Fork the zygote before the leak fixture's baseline: it lives as long as pytest."""
    sl.prestart((), start_method="zygote")
    pid = start.zygote_pid()
    assert pid is not None
    return pid


class SharedRecords(torch.utils.data.Dataset[Any]):
    """Reads its SharedList in the worker; says which file the records live in."""

    def __init__(self) -> None:
        self.rows = sl.SharedList([{"file": f"{i}.jpg", "label": i} for i in range(10)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        st = os.fstat(self.rows._fd)
        return {"row": self.rows[i], "inode": st.st_ino, "ppid": os.getppid()}


def _run(script: str, tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=timeout)


def test_zygote_yields_the_same_batches_as_forkserver(zygote: int) -> None:
    def batches(method: str) -> list[Any]:
        loader = sl.DataLoader(MapDS(24, "random"), batch_size=4, num_workers=2, shuffle=True,
                               generator=torch.Generator().manual_seed(3), start_method=method)
        return list(loader)

    assert_same_batches(batches("zygote"), batches("forkserver"))
    loader = sl.DataLoader(MapDS(4), batch_size=2, num_workers=2, start_method="zygote",
                           persistent_workers=True)
    assert len(list(loader)) == 2
    report = loader.report()
    assert report.start_method == "zygote"
    parents = {psutil.Process(w.pid).ppid() for w in report.workers}
    assert parents == {zygote}, "workers must be forked by the zygote, never by this process"
    del loader


def test_a_dataset_defined_after_the_loader_in_the_main_script_works(tmp_path: Path) -> None:
    out = _run(
        """
        import torch, steadyload as sl
        from tests.datasets import MapDS

        if __name__ == "__main__":
            # The zygote is forked here, before `Late` exists in this process.
            first = sl.DataLoader(MapDS(4), batch_size=2, num_workers=2, start_method="zygote")

        class Late(torch.utils.data.Dataset):
            def __len__(self):
                return 6
            def __getitem__(self, i):
                return i * 10

        if __name__ == "__main__":
            print(len(list(first)))
            late = sl.DataLoader(Late(), batch_size=3, num_workers=2, start_method="zygote")
            print([b.tolist() for b in late])
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["2", "[[0, 10, 20], [30, 40, 50]]"], out.stdout


def test_zygote_is_refused_with_a_gpu_context_but_gpu_use_after_it_is_fine(tmp_path: Path) -> None:
    out = _run(
        """
        import torch, steadyload as sl
        from tests.datasets import MapDS

        if __name__ == "__main__":
            real = torch.cuda.is_initialized
            torch.cuda.is_initialized = lambda: True  # as after model.cuda()
            try:
                sl.DataLoader(MapDS(4), num_workers=1, start_method="zygote")
            except sl.UnsafeForkError as exc:
                print(exc)
            torch.cuda.is_initialized = real
            loader = sl.DataLoader(MapDS(4), num_workers=1, start_method="zygote")
            torch.cuda.is_initialized = lambda: True  # the zygote exists: workers are safe
            print("batches:", len(list(loader)))
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        "refusing to fork the zygote for start_method='zygote': this process already holds "
        "a CUDA context.\nWhy: the zygote is a fork() of this process"
    ), out.stdout
    assert "Fix: build the first zygote loader, or call steadyload.prestart(start_method='zygote'), right after importing torch" in out.stdout
    assert out.stdout.rstrip().endswith("batches: 4"), out.stdout


def test_shared_list_is_shared_with_zygote_workers_not_copied(zygote: int) -> None:
    ds = SharedRecords()
    batches = list(sl.DataLoader(ds, batch_size=5, num_workers=2, start_method="zygote",
                                 collate_fn=list))
    samples = [s for b in batches for s in b]
    assert [s["row"] for s in samples] == [{"file": f"{i}.jpg", "label": i} for i in range(10)]
    # The same memfd (inode) as here: the workers were handed the file, not the records.
    assert {s["inode"] for s in samples} == {os.fstat(ds.rows._fd).st_ino}
    assert {s["ppid"] for s in samples} == {zygote}


def test_zygote_exits_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(
        """
        import time, steadyload as sl
        from steadyload.start import context as start
        from tests.datasets import MapDS

        if __name__ == "__main__":
            loader = sl.DataLoader(MapDS(8), batch_size=2, num_workers=2, start_method="zygote",
                                   persistent_workers=True)
            list(loader)
            pids = [w.pid for w in loader.report().workers]
            print(start.zygote_pid(), *pids, flush=True)
            time.sleep(60)
        """
    ))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip(), f"the parent printed no pids (exit code {proc.poll()})"
        pids = [int(p) for p in line.split()]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_until(lambda: processes_gone(pids), 10.0, what=f"the zygote and its workers {pids} to exit after the parent's SIGKILL")
    finally:
        proc.kill()
        proc.stdout.close() if proc.stdout else None
        proc.wait(timeout=10)


def test_a_sigkilled_zygote_worker_is_replaced_and_batches_are_identical(tmp_path: Path) -> None:
    ds = FaultOnce(24, {7}, "sigkill", str(tmp_path))
    got = [b.flatten().tolist() for b in sl.DataLoader(ds, batch_size=4, num_workers=2,
                                                       start_method="zygote")]
    want = [b.flatten().tolist() for b in torch.utils.data.DataLoader(
        FaultOnce(24, set(), "none", ""), batch_size=4)]
    assert got == want


def test_prestart_rejects_other_start_methods() -> None:
    with pytest.raises(ValueError, match=r"prestart's start_method must be 'forkserver' or 'zygote', got 'fork'"):
        sl.prestart(start_method="fork")


def test_large_python_metadata_warning_counts_what_the_zygote_keeps() -> None:
    from steadyload.memory import advice as memory
    from tests.datasets import BigMetadata

    memory._warned.clear()
    with pytest.warns(UserWarning, match=r"under zygote each of the 2 workers gets a pickled copy: \d+ MiB in total, plus up to \d+ MiB kept by the zygote, which holds this process's memory as it was when the zygote was forked\. Fix: `self\.rows = steadyload\.SharedList\(self\.rows\)`"):
        assert len(list(sl.DataLoader(BigMetadata(), batch_size=4, num_workers=2, start_method="zygote"))) == 2


def test_death_diagnosis_names_the_zygote() -> None:
    from steadyload import diagnosis

    err = diagnosis.worker_died(worker_id=0, pid=1, exitcode=255, sample_indices=[], batches_held=0, start_method="zygote")
    assert "Likely cause: exit code 255 under zygote is what is reported when the zygote (the fork server forked from this process) itself died; steadyload found it alive" in str(err)
    err = diagnosis.worker_died(worker_id=0, pid=1, exitcode=-11, sample_indices=[], batches_held=0, start_method="zygote")
    assert "rather than zygote: zygote workers are forked from a copy of this process" in str(err)


def test_the_private_cpython_apis_the_zygote_relies_on_still_exist() -> None:
    from multiprocessing import connection, forkserver, popen_forkserver, spawn, util

    from steadyload.start import zygote as _zygote

    assert _zygote.unsupported_reason() is None  # forkserver.main's parameters as in 3.10-3.13
    assert callable(spawn._fixup_main_from_path) and callable(spawn._fixup_main_from_name)
    assert callable(util.close_fds) and callable(util._flush_std_streams)
    assert callable(connection.arbitrary_address) and callable(forkserver.read_signed)
    assert "self._fds" in inspect.getsource(popen_forkserver.Popen.__init__)
    assert "connect_to_new_process" in inspect.getsource(popen_forkserver.Popen._launch)
