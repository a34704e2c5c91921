"""`RemoteWorkers`: how many remote workers a loader asks Ray for, and where they go.

Ray is an optional dependency: this module imports it only when a loader with remote
workers starts them (`import_ray`), and says how to install it when it is missing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

RAY_EXTRA = 'pip install "steadyload[ray]"  (or: pip install "ray[default]==2.60.0")'


@dataclasses.dataclass(frozen=True)
class RemoteWorkers:
    """Remote workers of one loader: Ray actors on the cluster, each running steadyload's
    worker loop (every promise of a local worker holds: order, exactly-once, skip, hang
    stacks, resume). ``DataLoader(..., remote_workers=8)`` is ``RemoteWorkers(8)``.

    Args:
        count: how many actors; a ``(min, max)`` pair lets the loader grow the pool while
            the training loop waits for data and shrink it when batches pile up (a
            map-style dataset only: a stream is sharded by the worker count).
        num_cpus: CPUs Ray reserves for each actor (default 1).
        resources: other Ray resources each actor needs (``{"cpu_pool": 1}``).
        label_selector: Ray node labels an actor's node must have.
        scheduling_strategy: Ray's placement ("SPREAD", the default: one actor per node
            before two on one; "DEFAULT"; or a Ray strategy object).
        memory: bytes of memory Ray reserves for each actor (None: no reservation).
        address: passed to ``ray.init`` when this process has not connected to Ray yet
            (None: Ray's own choice, ``RAY_ADDRESS`` or a local cluster; "auto": the running
            cluster this machine belongs to).
        runtime_env: Ray's runtime environment for the actors (your code's
            ``working_dir``, ``pip`` packages) when the nodes do not have it.
        prestart: start the actors when the loader is built, if this process is connected
            to Ray then (their placement and imports overlap with your set-up, as the fork
            server's do); False: when the loader is first iterated.
    """

    count: int | tuple[int, int] = 1
    num_cpus: float = 1.0
    resources: dict[str, float] | None = None
    label_selector: dict[str, str] | None = None
    scheduling_strategy: Any = "SPREAD"
    memory: int | None = None
    address: str | None = None
    runtime_env: dict[str, Any] | None = None
    prestart: bool = True

    def __post_init__(self) -> None:
        count = self.count
        if isinstance(count, tuple) and len(count) == 2 and all(_count(c) for c in count):
            if not 0 <= count[0] <= count[1] or count[1] < 1:
                raise ValueError(
                    f"remote_workers=(min, max) needs 0 <= min <= max and max >= 1, got {count}"
                )
        elif not (_count(count) and count >= 1):  # type: ignore[operator]
            raise ValueError(
                "remote_workers must be an int >= 1 (that many Ray actors), a (min, max) "
                f"pair (grown and shrunk on the data stall), or steadyload.RemoteWorkers(...); "
                f"got {count!r}"
            )
        if not isinstance(self.num_cpus, (int, float)) or self.num_cpus < 0:
            raise ValueError(f"RemoteWorkers.num_cpus must be a number >= 0, got {self.num_cpus!r}")

    @property
    def minimum(self) -> int:
        """The fewest actors the pool keeps (the count itself without a range)."""
        return self.count[0] if isinstance(self.count, tuple) else self.count

    @property
    def maximum(self) -> int:
        """The most actors the pool may run: the worker ids it reserves."""
        return self.count[1] if isinstance(self.count, tuple) else self.count

    @property
    def scales(self) -> bool:
        """Whether the pool grows and shrinks (a range)."""
        return self.minimum != self.maximum

    def actor_options(self, excluded_nodes: set[str]) -> dict[str, Any]:
        """The actors' Ray options: placement as asked, no retry by Ray (steadyload re-runs
        tasks itself), never on ``excluded_nodes`` (lost: Ray may place actors there until
        its health check notices)."""
        options: dict[str, Any] = dict(
            num_cpus=self.num_cpus,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=self.scheduling_strategy,
        )
        for key in ("resources", "memory", "label_selector", "runtime_env"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        if excluded_nodes:
            labels = dict(self.label_selector or {})
            labels["ray.io/node-id"] = f"!in({', '.join(sorted(excluded_nodes))})"
            options["label_selector"] = labels
        return options


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def remote_spec(value: Any) -> RemoteWorkers | None:
    """``remote_workers=`` as given (None, an int, a (min, max) pair, a `RemoteWorkers`),
    checked. Raises ValueError with what is accepted."""
    if value is None or value == 0:
        return None
    if isinstance(value, RemoteWorkers):
        return value
    if isinstance(value, list):
        value = tuple(value)
    return RemoteWorkers(value)


def remote_count(loader: Any) -> int:
    """The worker ids a loader reserves for remote workers (0: none)."""
    spec = remote_spec(getattr(loader, "remote_workers", None))
    return spec.maximum if spec is not None else 0


def import_ray() -> Any:
    """``ray``, connected (``ray.init`` if this process is not yet). Raises ImportError
    with the install line when Ray is missing."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "remote_workers needs Ray, which is not installed in this environment.\n"
            "Why: remote workers are Ray actors; steadyload installs without Ray.\n"
            f"Fix: {RAY_EXTRA}, the same Ray version on every node of the cluster."
        ) from exc
    return ray


def connect(ray: Any, spec: RemoteWorkers) -> None:
    """Connect this process to Ray once (``ray.init``), as ``spec.address`` says."""
    if not ray.is_initialized():
        ray.init(address=spec.address, include_dashboard=False, log_to_driver=True)


def all_workers(loader: Any) -> int:
    """A loader's workers, local and remote: the worker ids its iterator uses (0: it loads
    in this process)."""
    return int(loader.num_workers) + remote_count(loader)


RemoteWorkers.__module__ = "steadyload"  # its public name (see steadyload/__init__.py)
