"""The public surface: exactly the documented names, all reporting module `steadyload`."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

import steadyload

DOCUMENTED = [
    "DataLoader",
    "DeviceReport",
    "LoaderReport",
    "MainGuardError",
    "NotPicklableError",
    "RemoteWorkers",
    "SharedDict",
    "SharedList",
    "SharedMemoryError",
    "SkipLimitError",
    "SteadyloadError",
    "UnsafeForkError",
    "WorkerDiedError",
    "WorkerHangError",
    "WorkerReport",
    "WorkerStartError",
    "ledger_samples",
    "on_host",
    "per_worker",
    "prestart",
    "replay",
    "report_every",
    "sample_rng",
]


def test_all_is_the_documented_list_sorted() -> None:
    assert steadyload.__all__ == sorted(DOCUMENTED)


def test_public_objects_report_the_public_module() -> None:
    for name in steadyload.__all__:
        assert getattr(steadyload, name).__module__ == "steadyload", name


def test_signature_is_torchs_positionally_then_keyword_only_extras() -> None:
    # torch's arguments, then torchdata's StatefulDataLoader keyword (a one-line switch),
    # then steadyload's options.
    ours = inspect.signature(steadyload.DataLoader.__init__).parameters
    theirs = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, name
        assert ours[name].default == param.default, name
    extras = list(ours)[len(theirs):]
    assert extras == [
        "snapshot_every_n_steps", "start_method", "max_restarts", "on_error", "hang_timeout", "max_worker_memory",
        "sample_seeds", "worker_type", "remote_workers", "ledger", "ledger_key", "device",
        "device_prefetch", "device_transform", "pinned_memory_limit",
    ]
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extras)


def test_error_hierarchy() -> None:
    for name in (
        "WorkerDiedError", "WorkerHangError", "WorkerStartError", "UnsafeForkError",
        "MainGuardError", "SharedMemoryError",
    ):
        cls = getattr(steadyload, name)
        assert issubclass(cls, steadyload.SteadyloadError) and issubclass(cls, RuntimeError)
    assert issubclass(steadyload.WorkerHangError, TimeoutError)
    assert issubclass(steadyload.NotPicklableError, TypeError)


def test_every_error_rebuilds_from_its_message_alone() -> None:
    # torch's ExceptionWrapper.reraise (and code written for torch's errors) calls
    # exc_type(message): an error that needs its keyword fields would raise TypeError there.
    import steadyload.errors as errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        error = cls("DataLoader worker (pid 7) exited unexpectedly")
        assert str(error) == "DataLoader worker (pid 7) exited unexpectedly"
        raised = torch.utils.data._utils.worker.ExceptionWrapper((cls, error, None), "x")
        with pytest.raises(cls, match="exited unexpectedly"):
            raised.reraise()


def test_public_functions_and_classes_are_documented() -> None:
    for name in steadyload.__all__:
        assert inspect.getdoc(getattr(steadyload, name)), name


def test_version_from_the_command_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "steadyload", "--version"], capture_output=True, text=True,
        timeout=60, check=True,
    )
    assert out.stdout.strip() == f"steadyload {steadyload.__version__}"
