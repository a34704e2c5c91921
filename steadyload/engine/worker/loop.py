"""The one worker loop: take a task, fetch, collate, report, return the outcome.

Every kind of worker runs `run`, through `serve.serve` (torchdata's ``_apply_udf`` is the
model: one function, the kind's parts passed in). A kind supplies two things and nothing else:

- a `Link`: how messages reach the worker and how outcomes and batches leave it. A process
  (process/worker.py) receives on a reader thread and sends over its socket, packing each
  batch into shared memory; a thread (thread/worker.py) takes messages from a queue and
  queues the collated batch itself.
- a liveness signal, on the parent's side (its pool): a process's sentinel, a thread's
  escaping exception (queued by its `Link.escaped`) or its abandonment after a hang.

What the loop guarantees for every kind: `Ready` once, then exactly one outcome per task
(`Done` through `Link.send_batch`, or `Empty`, `Exhausted`, `Failed`), the status fields
(status.py) kept current for the parent's hang watch and blame, and dataset errors reported
as outcomes, never as the worker's death.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Protocol

from ...diagnosis.describe import describe_exception, format_traceback
from ..config import WorkerConfig
from ..protocol import Done, Empty, Exhausted, Failed, Reset, Restore, Stop, Task
from .fetch import ITERABLE, AllSkipped, Fetcher, start_fetching
from .status import SENDING, STAGE


class Link(Protocol):
    """What a kind of worker supplies to `run`: its side of the transport."""

    keeps_objects: bool
    """Outcomes reach a parent in this process: exceptions travel as objects, unpickled."""

    def receive(self) -> object:
        """The next message from the parent (blocks); `Stop` when the worker must end."""

    def ready(self) -> None:
        """The worker's set-up is done (``worker_init_fn``, the first iterator): say `Ready`."""

    def send(self, msg: object) -> None:
        """Send an outcome or a notice to the parent."""

    def release(self, freed: tuple[int, ...]) -> None:
        """Segments the parent handed back with a `Task` or `Reset` (processes only)."""

    def begin_task(self) -> None:
        """A task's loading starts (before the dataset is called)."""

    def cancel_task(self) -> None:
        """The task ended without a batch to send."""

    def pack(self, data: Any) -> Any:
        """The batch in the form that crosses (processes: a payload in shared memory;
        threads: the batch itself); raises if it cannot cross (the task's failure)."""

    def send_batch(self, done: Done, packed: Any) -> None:
        """Send the packed batch with its `Done`."""

    def after_task(self) -> bool:
        """After each outcome: True when the worker must stop now (it said why)."""

    def escaped(self, exc: BaseException) -> None:
        """``exc`` escaped the worker (never a dataset's error: those are outcomes): make it
        the worker's death as its kind's parent sees one (serve.py calls it, in the handler).
        """


class Status(Protocol):
    """The worker's status fields (status.py's layout), which the parent reads."""

    fields: Any

    def begin(self, task_id: int) -> None:
        """A task starts."""

    def end(self) -> None:
        """The task's outcome was sent."""


def failed_outcome(task_id: int, exc: BaseException, where: str, *, keep: bool = False) -> Failed:
    """The `Failed` message for ``exc``: the object itself when ``keep`` (the parent is this
    process), else pickled if it survives pickling, else its class and words."""
    type_name, text = describe_exception(exc)
    data: bytes | None = None
    kind: bytes | None = None
    if not keep:
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)  # exceptions with custom __init__ often fail only here
        except Exception:
            data = None
            try:  # an attribute did not pickle (an open file): the class alone may
                kind = pickle.dumps(type(exc))
            except Exception:
                kind = None
    return Failed(
        task_id=task_id,
        exception=data,
        type_name=type_name,
        text=text,
        traceback=format_traceback(exc),
        where=where,
        exception_type=kind,
        error=exc if keep else None,
    )


def _fail(link: Link, task_id: int, exc: BaseException, where: str) -> None:
    link.send(failed_outcome(task_id, exc, where, keep=link.keeps_objects))


def run(
    cfg: WorkerConfig,
    dataset: Any,
    worker_id: int,
    link: Link,
    status: Status,
    seeder: Any,
) -> None:
    """A worker's life after its kind's set-up: ``worker_init_fn`` and the first iterator,
    `Ready`, then one outcome per task until `Stop` (or `Link.after_task` says stop)."""
    new_fetcher, fetcher, init_error = start_fetching(
        cfg, dataset, worker_id, status.fields, seeder
    )
    link.ready()
    ended = False
    while True:
        msg = link.receive()
        match msg:
            case Stop():
                return
            case Reset() | Restore():
                if isinstance(msg, Reset):
                    link.release(msg.freed)
                ended = False
                if init_error is None:
                    position = msg.state if isinstance(msg, Restore) else None  # resume there
                    try:
                        fetcher = new_fetcher(position)
                    except Exception as exc:
                        where = (
                            "in iter(dataset)"
                            if position is None
                            else ("restoring the dataset's state (load_state_dict, iter(dataset))")
                        )
                        init_error = (exc, where)
                continue
            case Task():
                link.release(msg.freed)
            case _:
                raise RuntimeError(f"[steadyload internal error] unexpected message {msg!r}")
        if fetcher is None and init_error is None:  # cfg.lazy_iter: no Restore came first
            try:
                fetcher = new_fetcher(None)
            except Exception as exc:
                init_error = (exc, "in iter(dataset)")
        if init_error is not None:
            _fail(link, msg.task_id, *init_error)
            continue
        assert fetcher is not None
        if ended:
            link.send(Exhausted(msg.task_id))
            continue
        status.begin(msg.task_id)
        if seeder is not None:
            seeder.epoch = msg.epoch
        ended = _run_task(msg, fetcher, cfg.dataset_kind, link, status)
        status.end()
        if link.after_task():
            return


def _position(fetcher: Fetcher) -> bytes | None:
    """`Fetcher.position` where no batch goes out with it: a failing ``state_dict()`` is
    reported with the batches (`_run_task`); here the position is only not kept."""
    try:
        return fetcher.position()
    except Exception:
        return None


def _run_task(
    task: Task,
    fetcher: Fetcher,
    kind: int,
    link: Link,
    status: Status,
) -> bool:
    """Run one task and send its outcome; True when the dataset's stream has ended."""
    began = time.perf_counter()
    link.begin_task()
    try:
        data = fetcher.fetch(task.indices)
    except AllSkipped:
        link.cancel_task()
        link.send(Empty(task.task_id, tuple(fetcher.skipped), _position(fetcher)))
        return False
    except StopIteration as exc:
        link.cancel_task()
        if kind == ITERABLE:
            # Where it ended, for a state saved between epochs (an epoch counter).
            link.send(
                Exhausted(task.task_id, tuple(fetcher.skipped), fetcher.cut, _position(fetcher))
            )
            return True
        _fail(link, task.task_id, exc, fetcher.where)
        return False
    except Exception as exc:
        link.cancel_task()
        _fail(link, task.task_id, exc, fetcher.where)
        return False
    status.fields[STAGE] = SENDING
    try:
        packed = link.pack(data)
    except Exception as exc:
        link.cancel_task()
        where = "while sending the batch to the main process"
        _fail(link, task.task_id, exc, where)
        return False
    del data  # before the task ends: a batch still referenced here pins its segments
    try:
        state = fetcher.position()
    except Exception as exc:  # user code: reported like the dataset's own errors
        link.cancel_task()
        where = "while saving the dataset's position (state_dict())"
        _fail(link, task.task_id, exc, where)
        return False
    link.send_batch(
        Done(
            task_id=task.task_id,
            payload=b"",
            segments=(),
            skipped=tuple(fetcher.skipped),
            stream_state=state,
            samples=fetcher.count,
            load_s=time.perf_counter() - began,
            span=fetcher.span,
        ),
        packed,
    )
    return False
