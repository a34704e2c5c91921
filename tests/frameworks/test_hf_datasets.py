"""Hugging Face datasets (Arrow): memory-mapped tables stay mapped and are not flagged; an
in-memory table about to be pickled into every worker gets a warning with the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pytest

import steadyload as sl
from steadyload.memory import advice
from tests.frameworks.samples import forkserver_pid, table_of_worker_dataset

ROWS, WIDTH = 100_000, 150  # 100,000 rows of 150 float64: 115 MiB of Arrow buffers


@pytest.fixture(scope="module")
def in_memory() -> Any:
    values = pa.array(np.zeros(ROWS * WIDTH))
    x = pa.FixedSizeListArray.from_arrays(values, WIDTH)
    ds = datasets.Dataset.from_dict({"id": np.arange(ROWS), "x": x})
    assert type(ds._data).__name__ == "InMemoryTable"
    return ds


@pytest.fixture(scope="module")
def mapped(in_memory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("hf") / "ds"
    in_memory.save_to_disk(str(path))
    ds = datasets.load_from_disk(str(path))
    assert type(ds._data).__name__ == "MemoryMappedTable"
    return ds


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(advice, "_warned", set())  # each warning is given once per process


class Holder:
    """A user dataset holding a Hugging Face dataset (the usual wrapper)."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]


def _first_batches(loader: sl.DataLoader[Any], n: int) -> list[Any]:
    return [batch for _, batch in zip(range(n), loader, strict=False)]


def test_a_memory_mapped_dataset_is_not_flagged_and_stays_mapped_in_workers(
    mapped: Any, fresh_warnings: None
) -> None:
    # Before: "self._data._batches of Dataset is a Python list ... about 115 MiB ... Fix:
    # steadyload.SharedList(...)", because pyarrow's RecordBatch.__sizeof__ counts buffers.
    assert advice.large_containers(mapped) == []
    assert advice.arrow_in_memory_bytes(mapped) == 0
    loader = sl.DataLoader(mapped, batch_size=500, sampler=range(6000), num_workers=2,
                           collate_fn=table_of_worker_dataset)  # fmt: skip
    batches = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, batch in enumerate(loader):
            batches.append(batch)
            if k == 2:  # a worker dies mid-epoch: its replacement maps the file again
                victim = loader.report().workers[0].pid
                assert victim is not None
                os.kill(victim, signal.SIGKILL)
    assert [str(w.message) for w in caught if "steadyload" in str(w.message)] == []
    assert [b["ids"] for b in batches] == [list(range(k, k + 500)) for k in range(0, 6000, 500)]
    assert {b["table"] for b in batches} == {"MemoryMappedTable"}  # the workers map the file
    assert {b["ppid"] for b in batches} == {forkserver_pid()}  # steadyload's workers
    [restart] = loader.report().restarts
    assert (restart.worker_id, restart.pid, restart.cause) == (0, victim, "killed by SIGKILL")


def test_an_in_memory_dataset_warns_with_its_size_and_the_fix(
    in_memory: Any, fresh_warnings: None
) -> None:
    loader = sl.DataLoader(in_memory, batch_size=1000, num_workers=2,
                           collate_fn=table_of_worker_dataset)  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        batches = _first_batches(loader, 1)
    messages = [str(w.message) for w in caught]
    assert messages == [(
        "steadyload: the dataset (Dataset of 100,000 rows) holds 115 MiB of Arrow data in "
        "memory, not memory-mapped; under zygote each of the 2 workers gets a pickled "
        "copy: 230 MiB in total. Fix: `ds.save_to_disk(path)` then `ds = "
        "datasets.load_from_disk(path)` (workers then map the same file: only its path is "
        "pickled), or keep it memory-mapped as load_dataset and load_from_disk return it "
        "(Dataset.from_dict, from_pandas and keep_in_memory=True build it in memory)."
    )]  # one warning: not also the SharedList advice for _data._batches
    assert batches[0]["ids"] == list(range(1000))
    assert batches[0]["table"] == "InMemoryTable"  # what the warning was about: a copy
    assert batches[0]["ppid"] == forkserver_pid()
    assert loader.report().start_method == "zygote"  # the default here (start/rule.py)


def test_a_wrapped_dataset_is_judged_by_its_table(
    in_memory: Any, mapped: Any, fresh_warnings: None
) -> None:
    # No workers needed: the check runs in the parent, before any worker starts.
    with pytest.warns(UserWarning, match=r"^steadyload: self\.ds \(Dataset of 100,000 rows\) holds 115 MiB .* Fix: `self\.ds\.save_to_disk\(path\)` then `self\.ds = datasets\.load_from_disk\(path\)`"):
        advice.check_copy_on_read(Holder(in_memory), 2, "spawn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        advice.check_copy_on_read(Holder(mapped), 2, "spawn")
        advice.check_copy_on_read(Holder(in_memory), 2, "spawn")  # said once
        advice.check_copy_on_read(in_memory, 2, "fork")  # fork shares Arrow buffers


def test_only_the_in_memory_parts_count(in_memory: Any, mapped: Any) -> None:
    tables = datasets.table
    both = datasets.concatenate_datasets([mapped.select(range(10)), in_memory])
    assert isinstance(both._data, tables.ConcatenationTable)
    assert advice.arrow_in_memory_bytes(both) == in_memory._data.nbytes
    picked = mapped.select(range(0, ROWS, 2))  # mapped table, in-memory indices mapping
    assert 0 < advice.arrow_in_memory_bytes(picked) < advice.LARGE_BYTES
    assert advice.arrow_in_memory_bytes(Holder(mapped)) is None  # not a datasets.Dataset
    assert [(p, n) for p, _, n in advice.arrow_tables(Holder(mapped))] == [("self.ds", 0)]


def test_nothing_imports_datasets_for_other_datasets(tmp_path: Path) -> None:
    code = (
        "import sys, torch\n"
        "from steadyload.memory import advice\n"
        "class D(torch.utils.data.Dataset):\n"
        "    def __init__(self): self.rows = list(range(10))\n"
        "advice.check_copy_on_read(D(), 2, 'forkserver')\n"
        "assert advice.arrow_in_memory_bytes(D()) is None\n"
        "print('datasets' in sys.modules, 'pyarrow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


# -- on_error="skip" on an HF stream (issue #22: nothing lost silently) ----------------------
STREAM_ROWS, BAD_ROW = 48, 9


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    if row["id"] == BAD_ROW:
        raise ValueError(f"row {BAD_ROW} does not decode")
    return row


def _rows_of_generator() -> Any:
    for i in range(STREAM_ROWS):
        yield _decode({"id": i})


def _stream(mapped_fn: Any = None) -> Any:
    ds = datasets.Dataset.from_dict({"id": list(range(STREAM_ROWS))}).to_iterable_dataset(
        num_shards=4
    )
    return ds.map(mapped_fn) if mapped_fn is not None else ds


def _ids(loader: sl.DataLoader[Any]) -> list[int]:
    return [int(i) for batch in loader for i in batch["id"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_row_in_a_mapped_stream_is_skipped_and_the_stream_goes_on(workers: int) -> None:
    # HF's IterableDataset saves its position and counts the row its map raised on as read:
    # steadyload restarts the stream from there, so only the bad row is missing.
    clean = _ids(sl.DataLoader(_stream(), batch_size=5, num_workers=workers))
    loader = sl.DataLoader(_stream(_decode), batch_size=5, num_workers=workers, on_error="skip")
    assert _ids(loader) == [i for i in clean if i != BAD_ROW]
    report = loader.report()
    assert len(report.skipped) == 1 and "does not decode" in report.skipped[0].message
    assert report.streams_cut == ()


def test_a_bad_row_inside_an_hf_generator_is_reported_as_a_cut_stream() -> None:
    # A generator that raised cannot go on, and HF's state still points at the bad row.
    ds = datasets.IterableDataset.from_generator(_rows_of_generator)
    loader = sl.DataLoader(ds, batch_size=5, num_workers=2, on_error="skip")
    got = _ids(loader)
    report = loader.report()
    (cut,) = report.streams_cut
    assert cut.yielded == len(got) == BAD_ROW  # one shard: worker 0 reads it all
    assert cut.worker_id == 0 and cut.item == BAD_ROW
    assert report.rows_lost is None  # an HF stream has no len(): the report says unknown
    assert "stream cut: worker 0's stream ended at its item 9" in str(report)
