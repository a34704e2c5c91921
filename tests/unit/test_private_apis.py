"""steadyload leans on a few private APIs of CPython and torch; fail loudly if they move.

Every torch hook lives in steadyload/engine/worker/torch_hooks.py; each has a check here.
"""

from __future__ import annotations

import inspect
from multiprocessing import forkserver

import torch
from torch.utils.data import dataloader
from torch.utils.data._utils import worker as torch_worker


def test_forkserver_singleton_state() -> None:
    server = forkserver._forkserver
    assert hasattr(server, "_forkserver_pid") and hasattr(server, "_preload_modules")
    assert callable(server.set_forkserver_preload) and callable(server.ensure_running)


def test_torch_iterator_base_and_its_hooks() -> None:
    base = dataloader._BaseDataLoaderIter
    for name in ("_reset", "_next_index", "_next_data", "__next__"):
        assert hasattr(base, name), name
    assert "first_iter" in inspect.signature(base._reset).parameters


def test_torch_worker_seeding_and_info() -> None:
    assert callable(torch_worker._generate_state)
    assert hasattr(torch_worker, "_worker_info")
    fields = set(torch_worker.WorkerInfo.__dataclass_fields__)
    assert {"id", "num_workers", "seed", "dataset"} <= fields


def test_collate_allocates_through_new_shared() -> None:
    # default_collate's worker path allocates with _new_shared; the arena hooks it.
    assert callable(torch.UntypedStorage._new_shared)
    src = inspect.getsource(torch.utils.data._utils.collate.collate_tensor_fn)
    assert "_new_shared" in src and "get_worker_info" in src


def test_forkserver_popen_launch_as_start_launch_redoes_it() -> None:
    # start/launch.py redoes popen_forkserver.Popen._launch with bounded waits.
    from multiprocessing import popen_forkserver

    src = inspect.getsource(popen_forkserver.Popen._launch)
    for step in ("get_preparation_data", "connect_to_new_process", "os.dup(w)", "read_signed"):
        assert step in src, step
    assert callable(forkserver.read_signed)
    assert "fds" in inspect.signature(forkserver.ForkServer.connect_to_new_process).parameters


def test_the_c_getsignal_answers_as_signal_getsignal_does() -> None:
    # engine/interrupts.py checks its handler per batch with _signal.getsignal (no enum).
    import _signal
    import signal

    assert _signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGINT)
    assert _signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGTERM)


def test_get_worker_info_is_the_global_read_install_per_thread_swaps() -> None:
    # torch_hooks.install_per_thread swaps its code object for a thread-local read first.
    from steadyload.engine.worker import torch_hooks

    code = torch_worker.get_worker_info.__code__
    if code is not torch_hooks._per_thread_get_worker_info.__code__:  # not swapped yet
        assert not code.co_freevars and "_worker_info" in code.co_names


def test_worker_info_can_carry_thread_generators() -> None:
    # torch_hooks.make_info fills torch's own container for thread workers when it exists.
    rng = getattr(torch_worker, "_RNG", None)
    if rng is not None:
        assert {"rng", "worker_method"} <= set(torch_worker.WorkerInfo.__dataclass_fields__)


def test_the_profiler_flag_that_next_consults() -> None:
    # torch_hooks.profiler_enabled: iterators use torch's __next__ only while it is set.
    assert isinstance(torch.autograd.profiler._is_profiler_enabled, bool)


def test_pin_memory_helper() -> None:
    # iterators/ pin batches with torch's own helper, as its iterators do.
    from torch.utils.data._utils.pin_memory import pin_memory

    assert "device" in inspect.signature(pin_memory).parameters


def test_threading_runs_exit_hooks_before_freezing_daemon_threads() -> None:
    # engine/thread/pool.py stops thread workers at exit with threading._register_atexit.
    import threading

    assert callable(threading._register_atexit)  # type: ignore[attr-defined]
    assert "_threading_atexits" in inspect.getsource(threading._shutdown)  # type: ignore[attr-defined]
