"""The ledger's files: one append-only JSON-lines file per segment, and reading a folder.

A segment is what one process recorded for one rank from one starting point (a fresh start
or a loaded state): its own file, named so that two never collide, opened with
``O_APPEND|O_EXCL``. Lines (docs/design/ledger.md has the full format):

- the header (first line): ``{"ledger": 1, "segment", "token", "parent", "cut", "rank",
  "world", "host", "pid", "started", "dataset", "skip"}``;
- an epoch: ``{"epoch": E, "base_seed", "plan", "deal", "length", "sample_seeds"}``;
- a step: ``{"e": E, "s": S, "i": indices, "w": worker, "p": pid, "k": kind}`` (``"ev"``:
  what touched it; a stream's ``"keys"``);
- an event: ``{"ev": "skip", "e": E, "index": I, "cause": ...}``.

Lines are buffered and written (one ``write``) at least once a second by one flusher thread
for the whole process, and at once when a state is saved: a SIGKILL loses at most the last
second, and a torn last line is ignored by the reader, never the lines before it.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 1
SUFFIX = ".ledger.jsonl"
FLUSH_S = 1.0  # the longest a record waits before it reaches the OS
_DUMPS = json.JSONEncoder(  # indices as a sampler gave them: a tensor's become a list
    separators=(",", ":"), default=lambda o: o.tolist() if hasattr(o, "tolist") else repr(o)
).encode
STEP_KEYS = ("e", "s", "i", "w", "p", "k", "h", "ev", "pos", "keys")  # a step line's keys, in order


def _line(record: Any) -> str:
    if isinstance(record, tuple):  # a step (`Writer.step`)
        record = {k: v for k, v in zip(STEP_KEYS, record, strict=True) if v is not None or k == "i"}
    return _DUMPS(record) + "\n"


class Writer:
    """One segment's file, append-only; `write` buffers a record, `flush` encodes what is
    buffered and hands it to the OS (the flusher thread does within `FLUSH_S`): a step costs
    the training loop a tuple appended, its JSON is made off the hot path."""

    def __init__(self, folder: str | os.PathLike[str], header: dict[str, Any]) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        name = f"seg-{time.time_ns():x}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        self.path = Path(folder) / name
        self._fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644
        )
        self._records: list[Any] = []  # dicts and `step` tuples, in order
        self._lock = threading.Lock()
        self.write({"ledger": FORMAT, "segment": name.removesuffix(SUFFIX), **header})
        self.flush()
        _flusher.add(self)
        _flusher.wake()

    def write(self, record: dict[str, Any]) -> None:
        """Buffer one record (a line)."""
        with self._lock:
            self._records.append(record)
        if not _flusher.running:
            _flusher.wake()

    def step(self, fields: tuple[Any, ...]) -> None:
        """Buffer one step: the values of `STEP_KEYS`, in order (None: left out)."""
        self.write(fields)  # type: ignore[arg-type]  # (a tuple: `_line` tells them apart)

    @property
    def pending(self) -> bool:
        """Whether records wait to be flushed."""
        return bool(self._records)

    def flush(self) -> None:
        """Encode every buffered record and hand them to the OS, in one write where it fits."""
        with self._lock:
            if not self._records or self._fd is None:
                return
            records, self._records = self._records, []
            data = "".join(map(_line, records)).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        """Flush and close (idempotent)."""
        self.flush()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # at interpreter exit


class _Flusher:
    """One daemon thread for every open `Writer` of this process: flushes each at least
    every `FLUSH_S`; it ends once nothing was buffered for a whole `FLUSH_S` (a loop that
    stopped, a test that ended: no thread behind), and a new record starts it again."""

    def __init__(self) -> None:
        self._writers: weakref.WeakSet[Writer] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.running = False

    def add(self, writer: Writer) -> None:
        with self._lock:
            self._writers.add(writer)

    def wake(self) -> None:
        """Start the thread if it is not running (a record is buffered)."""
        with self._lock:
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="steadyload-ledger", daemon=True).start()

    def flush_all(self) -> None:
        """Flush every open writer (at exit: the flusher is a daemon thread, and a loader
        kept alive by a cycle is not collected, so its last second would be lost)."""
        with self._lock:
            writers = list(self._writers)
        for writer in writers:
            try:
                writer.flush()
            except OSError:
                pass  # a full disk at exit: nothing left to tell

    def _run(self) -> None:
        idle = 0
        while True:
            time.sleep(FLUSH_S / 2)
            with self._lock:
                writers = [w for w in self._writers if w.pending]
                idle = 0 if writers else idle + 1
                if idle >= 2:  # (a writer that buffers after this starts a new thread)
                    self.running = False
                    break
            for writer in writers:
                try:
                    writer.flush()
                except OSError:
                    pass  # a full disk: the next flush (or state_dict) says it
            del writers
        if any(w.pending for w in list(self._writers)):  # buffered as it was deciding to end
            self.wake()


_flusher = _Flusher()
atexit.register(_flusher.flush_all)


@dataclass
class Segment:
    """One segment file as read: its header and its records, by kind."""

    path: Path
    header: dict[str, Any]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    torn: bool = False
    """Its last line was cut short (the process was killed while writing it): ignored."""
    last: float = 0.0
    """When it was last written (the file's mtime)."""

    @property
    def name(self) -> str:
        return str(self.header["segment"])

    @property
    def rank(self) -> int:
        return int(self.header["rank"])

    @property
    def started(self) -> float:
        return float(self.header["started"])


def read_segment(path: Path) -> Segment | None:
    """The segment in ``path``, or None when it has no complete header line."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    tail = lines.pop()  # b"" after a complete last line; else a line cut short
    segment: Segment | None = None
    for raw in lines:
        try:
            record = json.loads(raw)
        except ValueError:
            # Only the last line can be cut short: the writer appends whole lines in order.
            raise ValueError(f"{path}: a damaged line inside the ledger: {raw[:80]!r}") from None
        if segment is None:
            if record.get("ledger") != FORMAT:
                raise ValueError(f"{path}: not a steadyload ledger (format {FORMAT}) file")
            segment = Segment(path, record, last=os.stat(path).st_mtime)
        elif "s" in record:
            segment.steps.append(record)
        elif "epoch" in record:
            segment.epochs.append(record)
        elif "ev" in record:
            segment.events.append(record)
    if segment is not None:
        segment.torn = bool(tail)
    return segment


def read_folder(folder: str | os.PathLike[str]) -> list[Segment]:
    """Every segment in ``folder``, oldest first.

    Raises:
        FileNotFoundError: ``folder`` does not exist or holds no ledger file.
    """
    paths = sorted(Path(folder).glob("*" + SUFFIX))
    if not paths:
        raise FileNotFoundError(f"no steadyload ledger files (*{SUFFIX}) in {folder}")
    segments = [s for s in (read_segment(p) for p in paths) if s is not None]
    return sorted(segments, key=lambda s: (s.started, s.name))
