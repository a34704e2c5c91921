"""engine/remote/sources.py: a stack of code cloudpickle rebuilt (``<dynamic-code>``) names
the user's file, line and source again, matched against this process's code."""

from __future__ import annotations

import sys
import threading
import traceback

import pytest

from steadyload.engine.remote.sources import located
from tests import remote_datasets


def test_a_frame_of_code_pickled_by_value_is_named_by_its_file_and_line() -> None:
    cloudpickle = pytest.importorskip("cloudpickle")
    cloudpickle.register_pickle_by_value(remote_datasets)
    try:
        rebuilt = cloudpickle.loads(cloudpickle.dumps(remote_datasets.waits_for))
    finally:
        cloudpickle.unregister_pickle_by_value(remote_datasets)
    assert rebuilt.__code__.co_filename == "<dynamic-code>"  # as on a Ray actor
    release = threading.Event()
    thread = threading.Thread(target=rebuilt, args=(release,))
    thread.start()
    try:
        for _ in range(500):  # until the thread is inside the rebuilt code (bounded)
            frame = sys._current_frames().get(thread.ident or 0)
            if frame is not None and "<dynamic-code>" in "".join(traceback.format_stack(frame)):
                break
            release.wait(0.01)
        text = "".join(traceback.format_stack(frame))
    finally:
        release.set()
        thread.join(10)
    assert 'File "<dynamic-code>", line ' in text and ", in waits_for\n" in text, text
    assert located(text) == text  # not pickled by value here (nor __main__'s): as it was
    cloudpickle.register_pickle_by_value(remote_datasets)
    try:
        named = located(text)
    finally:
        cloudpickle.unregister_pickle_by_value(remote_datasets)
    assert "<dynamic-code>" not in named, named
    assert 'remote_datasets.py", line ' in named and ", in waits_for\n" in named, named
    assert "event.wait(10)  # the line a stack of this frame shows" in named, named
