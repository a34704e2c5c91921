"""Fork-safety made easy: per-worker resources, picklability errors, by-value objects,
main-guard mistakes and fork hazards, each triggered for real."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import steadyload as sl
from tests.datasets import HoldsConnection, HoldsLock, MapDS, ResourceDS

ROOT = Path(__file__).resolve().parents[2]


def test_per_worker_resources_are_built_once_per_worker_and_never_pickled() -> None:
    ds = ResourceDS(24)
    clone = pickle.loads(pickle.dumps(ds))  # the dataset pickles without its resources
    assert not ResourceDS.db.built and isinstance(clone, ResourceDS)
    batches = list(sl.DataLoader(ds, batch_size=4, num_workers=2))
    builds: dict[int, set[str]] = defaultdict(set)
    for b in batches:
        for pid, build in zip(b["pid"].tolist(), b["builds"], strict=True):
            builds[pid].add(build)
    assert len(builds) == 2 and os.getpid() not in builds
    assert all(len(v) == 1 for v in builds.values()), "a factory ran more than once in a worker"
    # The batches are right: sqlite answered, the file was read, the tokenizer encoded.
    assert [i for b in batches for i in b["i"].tolist()] == list(range(24))
    assert batches[0]["ids"].tolist()[:2] == [[1, 2, 3, 4], [1, 2, 3, 5]]
    assert batches[0]["first_line"][0] == '"""Datasets used by tests, at module level so that forkserver workers can import them."""'
    assert not ResourceDS.db.built, "the main process never used the resource, so never built it"


def test_per_worker_as_a_pickled_wrapper_and_after_fork() -> None:
    calls: list[int] = []
    wrapped = sl.per_worker(lambda: calls.append(os.getpid()) or len(calls))
    assert wrapped.get() == 1 and wrapped.get() == 1 and calls == [os.getpid()]
    copy = pickle.loads(pickle.dumps(wrapped))  # a lambda factory travels by value
    assert not copy.built
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the inherited value is not reused
        os.write(w, str(wrapped.get()).encode())
        os._exit(0)
    os.close(w)
    assert os.read(r, 16) == b"2"  # built again in the child (its calls list had 1 entry)
    os.close(r)
    os.waitpid(pid, 0)
    with pytest.raises(TypeError, match=r"per_worker needs a callable .* got 3"):
        sl.per_worker(3)  # type: ignore[arg-type]


def test_unpicklable_attribute_is_named_with_its_path_and_the_fix() -> None:
    with pytest.raises(sl.NotPicklableError, match=r"^dataset\.index\.conn: cannot pickle 'sqlite3\.Connection' object\nWhy: DataLoader workers started with forkserver or spawn receive the dataset, collate_fn and worker_init_fn by pickling.*\nFix: make it a per-worker resource.*steadyload\.per_worker") as info:
        list(sl.DataLoader(HoldsConnection(), num_workers=2))
    assert info.value.path == "dataset.index.conn" and isinstance(info.value, TypeError)
    with pytest.raises(sl.NotPicklableError, match=r"^dataset\.lock: cannot pickle '_thread\.lock' object"):
        list(sl.DataLoader(HoldsLock(), num_workers=1))


def test_unpicklable_object_captured_by_a_collate_lambda() -> None:
    import sqlite3

    conn = sqlite3.connect(":memory:")
    with pytest.raises(sl.NotPicklableError, match=r"^collate_fn\.<closure conn>: cannot pickle 'sqlite3\.Connection' object"):
        list(sl.DataLoader(MapDS(4), num_workers=1, collate_fn=lambda b: (conn, b)))
    conn.close()


def test_lambdas_and_local_classes_are_sent_by_value() -> None:
    class LocalDS(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> Any:
            return i * 10

    got = list(sl.DataLoader(LocalDS(), batch_size=3, num_workers=2, collate_fn=lambda b: sum(b)))
    assert got == [30, 120]


def _run(code: str, tmp_path: Path, *, stdin: bool = False, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if stdin:
        return subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=timeout)
    script = tmp_path / "train.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=timeout)


# examples/notebook_style.py: a dataset class and a lambda in a script read from stdin.
NOTEBOOK = (ROOT / "examples" / "notebook_style.py").read_text()


def test_dataset_defined_in_a_script_read_from_stdin(tmp_path: Path) -> None:
    out = _run(NOTEBOOK, tmp_path, stdin=True)
    assert out.returncode == 0, out.stderr
    assert "sums of squares per batch: [14, 126]" in out.stdout


def test_torch_fails_on_the_same_stdin_script(tmp_path: Path) -> None:
    # The reason the by-value path exists (keeps us honest about the problem).
    code = NOTEBOOK.replace("sl.DataLoader(", "torch.utils.data.DataLoader(multiprocessing_context='forkserver', dataset=").replace("(Squares(), ", "Squares(), ")
    out = _run(code, tmp_path, stdin=True)
    assert out.returncode != 0
    assert "Can't get attribute 'Squares'" in out.stderr or "Can't pickle" in out.stderr


UNGUARDED = textwrap.dedent(
    """
    import torch, steadyload as sl
    from tests.datasets import MapDS

    loader = sl.DataLoader(MapDS(8), batch_size=4, num_workers=2)
    for batch in loader:
        print(batch.shape)
    """
)


def test_missing_main_guard_is_refused_with_the_fix(tmp_path: Path) -> None:
    out = _run(UNGUARDED, tmp_path)
    assert out.returncode == 1
    assert "steadyload.MainGuardError: DataLoader workers started from the top level of " in out.stderr
    assert "train.py, line 6, outside `if __name__ == \"__main__\":`" in out.stderr
    assert "Fix: move the training code under the guard" in out.stderr
    assert out.stderr.count("steadyload.MainGuardError:") == 1, "no worker may have run the script again"


def test_guarded_script_with_a_top_level_loader_works(tmp_path: Path) -> None:
    code = UNGUARDED.replace("for batch in loader:", 'if __name__ == "__main__":\n  for batch in loader:')
    code = code.replace("        print(batch.shape)", "    print(batch.shape)")
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("torch.Size([4, 3])") == 2


def test_fork_with_other_threads_running_warns_once_naming_them() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="sl-test-thread")
    thread.start()
    try:
        with pytest.warns(RuntimeWarning, match=r"forking DataLoader workers while 1 other thread\(s\) run in this process: sl-test-thread\. fork copies only the calling thread"):
            assert len(list(sl.DataLoader(MapDS(4), num_workers=1, start_method="fork"))) == 4
    finally:
        stop.set()
        thread.join(timeout=5)


PRELOAD = textwrap.dedent(
    """
    import logging, sys
    import cloudpickle, psutil
    import torch, steadyload as sl
    sys.path.insert(0, {tmp!r})
    from refuses_fork_server import DS

    if __name__ == "__main__":
        logging.basicConfig(level=logging.WARNING)
        loader = sl.DataLoader(DS(), batch_size=2, num_workers=2, start_method="forkserver")
        print(list(loader))
        print(loader.report())
    """
)

REFUSES = textwrap.dedent(
    """
    import sys, torch

    def _in_server_preload():
        f, names = sys._getframe(), set()
        while f is not None:
            if f.f_code.co_filename.endswith("forkserver.py"):
                names.add(f.f_code.co_name)
            f = f.f_back
        return "main" in names and "_serve_one" not in names

    if _in_server_preload():
        raise ImportError("this module refuses to load in a fork server")

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return i
    """
)


def test_preloads_of_the_parents_imports_and_failed_preloads_are_reported(tmp_path: Path) -> None:
    (tmp_path / "refuses_fork_server.py").write_text(REFUSES)
    out = _run(PRELOAD.format(tmp=str(tmp_path)), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[tensor([0, 1]), tensor([2, 3])]" in out.stdout
    preload_line = next(line for line in out.stdout.splitlines() if "fork server preload:" in line)
    for module in ("torch", "cloudpickle", "psutil", "refuses_fork_server"):
        assert module in preload_line
    assert "NOT preloaded (import failed in the fork server): refuses_fork_server" in out.stdout
    assert "the fork server could not import refuses_fork_server" in out.stderr


PRESTART = textwrap.dedent(
    """
    import sys
    import steadyload as sl
    if __name__ == "__main__":
        sl.prestart(["torch", "local_helper"])   # before torch is imported here
        assert "torch" not in sys.modules, "prestart must not import torch in this process"
    import torch
    from local_helper import Numbers

    if __name__ == "__main__":
        loader = sl.DataLoader(Numbers(), batch_size=2, num_workers=2)
        print([b.tolist() for b in loader])
        print(loader.report())
    """
)


def test_prestart_starts_the_fork_server_early_with_local_modules(tmp_path: Path) -> None:
    (tmp_path / "local_helper.py").write_text(textwrap.dedent(
        """
        import torch

        class Numbers(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return i
        """
    ))
    out = _run(PRESTART, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[[0, 1], [2, 3]]" in out.stdout
    assert "fork server preload: steadyload (3 modules), torch, local_helper" in out.stdout
    assert "preload result: all imported" in out.stdout  # the parent's sys.path reached it
