"""Memory advice: what every worker would copy (large Python containers), and whether
batches and the dataset's tensors fit (available memory, /dev/shm, open-file limit).

A dataset that holds its metadata in a large Python list or dict pays for it once per
worker: pickled into each forkserver/spawn/zygote worker, or, under fork, copied page by
page as the workers touch the objects' reference counts (copy-on-read, pytorch issue 13246).
`check_copy_on_read` scans the dataset's attributes (and theirs, one level down), estimates
the size of large containers from a sample of their items, and warns once, with the fix.
A Hugging Face ``datasets.Dataset`` is judged by where its Arrow table lives instead: a
memory-mapped one pickles as a file path (nothing to say), an in-memory one as all its data.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from ..host.system import gib

_LOG = logging.getLogger(__name__)

LARGE_LEN = 100_000
LARGE_BYTES = 100 << 20
_SAMPLE = 64
_warned: set[tuple[str, str]] = set()


def estimate_bytes(container: Any) -> int:
    """Approximate memory of a list/tuple/set/dict and the objects in it (sampled)."""
    n = len(container)
    if n == 0:
        return sys.getsizeof(container)
    items = container.items() if isinstance(container, dict) else container
    sample = []
    for k, item in enumerate(items):
        if k >= _SAMPLE:
            break
        sample.append(item)
    per_item = sum(_deep_size(x) for x in sample) / len(sample)
    return int(sys.getsizeof(container) + per_item * n)


def _deep_size(obj: Any, depth: int = 2) -> int:
    size = sys.getsizeof(obj)
    if depth == 0:
        return size
    if isinstance(obj, dict):
        size += sum(_deep_size(k, depth - 1) + _deep_size(v, depth - 1) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(_deep_size(x, depth - 1) for x in obj)
    return size


def _large(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict, set)) and (
        len(value) > LARGE_LEN or estimate_bytes(value) > LARGE_BYTES
    )


def large_containers(dataset: Any) -> list[tuple[str, Any]]:
    """(attribute path, container) for large containers on the dataset, one level down.

    The Arrow internals of a Hugging Face dataset are left out (`arrow_tables` judges
    those): pyarrow's ``RecordBatch.__sizeof__`` counts its buffers, mapped or not, so a
    memory-mapped dataset's ``_data._batches`` would look like a copy of the whole table.
    """
    found = []
    arrow = _arrow_attributes(dataset)
    for name, value in list(getattr(dataset, "__dict__", {}).items()):
        if name in arrow:
            continue
        if _large(value):
            found.append((f"self.{name}", value))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            found.extend(
                (f"self.{name}.{inner}", v)
                for inner, v in list(vars(value).items())
                if _large(v)
            )
    return found


# -- Hugging Face datasets (Arrow) ---------------------------------------------------------
#
# `datasets.Dataset._data` is a `datasets.table.Table`: `MemoryMappedTable` pickles as its
# file path and replays (load_from_disk, load_dataset), `InMemoryTable` as all its data
# (Dataset.from_dict, from_pandas, keep_in_memory=True), `ConcatenationTable` as its blocks.
# `_indices` (after select, shuffle) is a Table too. Nothing here imports datasets: a
# Dataset of theirs means `datasets.table` is already imported.

_ARROW_ATTRIBUTES = frozenset({"_data", "_indices"})


def _arrow_tables_module(obj: Any) -> Any:
    """`datasets.table` when ``obj`` is a Hugging Face map-style dataset, else None."""
    tables = sys.modules.get("datasets.table")
    if tables is None or not type(obj).__module__.startswith("datasets."):
        return None
    return tables if isinstance(getattr(obj, "_data", None), tables.Table) else None


def _arrow_attributes(obj: Any) -> frozenset[str]:
    return _ARROW_ATTRIBUTES if _arrow_tables_module(obj) is not None else frozenset()


def _in_memory_bytes(table: Any, tables: Any) -> int:
    """Bytes of ``table`` (a datasets.table.Table) that pickling copies."""
    if isinstance(table, tables.MemoryMappedTable):
        return 0
    if isinstance(table, tables.ConcatenationTable):
        return sum(_in_memory_bytes(block, tables) for row in table.blocks for block in row)
    return int(table.nbytes)  # InMemoryTable, or a kind this code does not know: a copy


def arrow_in_memory_bytes(obj: Any) -> int | None:
    """How many bytes of a Hugging Face dataset's Arrow data pickling would copy.

    0 for a dataset whose table (and indices mapping, if any) is memory-mapped: it pickles
    as file paths and every process maps the same pages. None when ``obj`` is not a
    ``datasets.Dataset``; never imports ``datasets``.
    """
    tables = _arrow_tables_module(obj)
    if tables is None:
        return None
    total = _in_memory_bytes(obj._data, tables)
    indices = getattr(obj, "_indices", None)
    if isinstance(indices, tables.Table):
        total += _in_memory_bytes(indices, tables)
    return total


def arrow_tables(dataset: Any) -> list[tuple[str, Any, int]]:
    """(path, HF dataset, in-memory bytes) for the dataset itself and its attributes."""
    found = []
    own = arrow_in_memory_bytes(dataset)
    if own is not None:
        found.append(("the dataset", dataset, own))
    for name, value in list(getattr(dataset, "__dict__", {}).items()):
        nbytes = arrow_in_memory_bytes(value)
        if nbytes is not None:
            found.append((f"self.{name}", value, nbytes))
    return found


def _check_arrow(dataset: Any, num_workers: int, method: str) -> None:
    """Warn once when an in-memory Arrow table is about to be pickled into every worker."""
    if method == "fork":
        return  # forked workers share the parent's Arrow buffers: no refcounts in them
    for path, hf, nbytes in arrow_tables(dataset):
        key = (type(dataset).__qualname__, f"arrow:{path}")
        if nbytes <= LARGE_BYTES or key in _warned:
            continue
        _warned.add(key)
        target = "ds" if path == "the dataset" else path
        warnings.warn(
            f"steadyload: {path} ({type(hf).__name__} of {len(hf):,} rows) holds "
            f"{gib(nbytes)} of Arrow data in memory, not memory-mapped; under {method} "
            f"each of the {num_workers} workers gets a pickled copy: "
            f"{gib(nbytes * num_workers)} in total. Fix: `{target}.save_to_disk(path)` "
            f"then `{target} = datasets.load_from_disk(path)` (workers then map the same "
            "file: only its path is pickled), or keep it memory-mapped as load_dataset "
            "and load_from_disk return it (Dataset.from_dict, from_pandas and "
            "keep_in_memory=True build it in memory).",
            UserWarning,
            stacklevel=5,
        )


def check_copy_on_read(dataset: Any, num_workers: int, method: str) -> None:
    """Warn once per attribute about large Python containers every worker would copy, and
    about in-memory Arrow tables (Hugging Face datasets) pickled into every worker."""
    _check_arrow(dataset, num_workers, method)
    for path, value in large_containers(dataset):
        key = (type(dataset).__qualname__, path)
        if key in _warned:
            continue
        _warned.add(key)
        nbytes = estimate_bytes(value)
        if method == "fork":
            cost = (
                f"under fork each of the {num_workers} workers copies the pages it reads "
                f"(reading writes reference counts): up to {gib(nbytes * num_workers)} more "
                "by the end of an epoch"
            )
        else:
            cost = (
                f"under {method} each of the {num_workers} workers gets a pickled copy: "
                f"{gib(nbytes * num_workers)} in total"
            )
        if method == "zygote":
            # The zygote was forked at the first zygote loader's construction, so usually
            # with the dataset already built: its pages stay in the zygote, shared only
            # until this process's reference counts and collections touch the objects.
            cost += (
                f", plus up to {gib(nbytes)} kept by the zygote, which holds this process's "
                "memory as it was when the zygote was forked"
            )
        shared = "SharedDict" if isinstance(value, dict) else "SharedList"
        warnings.warn(
            f"steadyload: {path} of {type(dataset).__name__} is a Python "
            f"{type(value).__name__} of {len(value):,} items, about {gib(nbytes)}; {cost}. "
            f"Fix: `{path} = steadyload.{shared}({path})` in __init__ (one copy in shared "
            "memory for all workers).",
            UserWarning,
            stacklevel=4,
        )


# -- shared-memory hygiene ------------------------------------------------------------------
#
# Where the bytes go, and so what is checked: steadyload's batches travel in memfd segments,
# which count against the process's memory (cgroup), not against /dev/shm; so the expected
# in-flight batch bytes are compared with available memory. torch's sharing strategy
# ("file_descriptor" by default) still applies to tensors held by the dataset, which are
# moved to /dev/shm when the dataset is sent to forkserver/spawn workers; those bytes are
# compared with free /dev/shm (Docker's default is 64 MB). The "file_descriptor" strategy
# keeps one descriptor per shared storage, and each batch segment holds one: the soft
# `ulimit -n` is raised to the hard limit up front.

_shm_warned: set[str] = set()


def tensor_bytes(obj: Any, depth: int = 3) -> int:
    """Bytes of the CPU tensors in ``obj`` (a batch, or a dataset's attributes)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if obj.device.type == "cpu" else 0
    if depth == 0:
        return 0
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, depth - 1) for v in obj[:1000])
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict) and depth >= 2:
        return sum(tensor_bytes(v, 1) for v in state.values())
    return 0


def raise_fd_limit() -> tuple[int, int] | None:
    """Raise the soft open-file limit to the hard one (logged); (old, new) when it changed."""
    import resource

    import torch.multiprocessing as tmp

    if tmp.get_sharing_strategy() != "file_descriptor":
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None
    _LOG.info(
        "raised the soft open-file limit (ulimit -n) from %d to %d: torch's "
        "'file_descriptor' sharing strategy and steadyload's batch segments hold "
        "descriptors", soft, target,
    )
    return soft, target


def check_dataset_shm(dataset: Any, num_workers: int, method: str) -> None:
    """Warn when the dataset's tensors, shared through /dev/shm, do not fit there."""
    if method == "fork":
        return  # forked workers inherit the memory; nothing goes through /dev/shm
    from ..host.system import shm_space

    nbytes = tensor_bytes(dataset)
    space = shm_space()
    if not nbytes or space is None or nbytes <= space.free_bytes:
        return
    key = f"dataset:{type(dataset).__qualname__}"
    if key in _shm_warned:
        return
    _shm_warned.add(key)
    warnings.warn(
        f"steadyload: the dataset holds {gib(nbytes)} of tensors, which torch moves to "
        f"{space.path} when it sends the dataset to {method} workers, but {space.path} has "
        f"{gib(space.free_bytes)} free of {gib(space.total_bytes)}. The workers would die "
        "with a bus error (SIGBUS). Fix: give the container more shared memory (docker run "
        "--shm-size=8g), keep the tensors in a file (np.memmap / torch.load(mmap=True)) "
        "and open it per worker, or use start_method='fork' without a GPU.",
        UserWarning,
        stacklevel=4,
    )


def check_in_flight(batch: Any, prefetch_factor: int, num_workers: int) -> str | None:
    """A warning when batches in flight would take over half of the available memory."""
    from ..host.system import available_memory_bytes

    per_batch = tensor_bytes(batch)
    available = available_memory_bytes()
    in_flight = per_batch * prefetch_factor * num_workers
    if not per_batch or available is None or in_flight <= available // 2:
        return None
    return (
        f"batches of {gib(per_batch)} x prefetch_factor {prefetch_factor} x {num_workers} "
        f"workers keep {gib(in_flight)} in flight (in shared memory), over half of the "
        f"{gib(available)} available: lower prefetch_factor, batch_size or num_workers."
    )
