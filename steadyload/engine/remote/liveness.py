"""Why a remote worker is gone (`RemoteCause`), in Ray's own words: what happened, why, what
to do.

Ray's exception says *that* an actor died; its cause lives in Ray's control store (the
actor's ``DeathCause``: worker died, node died, killed, out of memory, preempted) and in
the node table (a node's death reason). Both are read here without the dashboard, from
Ray's private state API; every read is guarded, so a Ray that changed falls back to the
exception's text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import WorkerDiedError
from ..events import Loss, Lost
from ..protocol import Failed
from ..worker.loop import failed_outcome
from .actor import CONTROL
from .sources import located

_LOGS = "Ray's logs on that node (/tmp/ray/session_latest/logs/, worker-*-{pid}.err and raylet.out)"


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteCause:
    """Why a remote worker (or its node, with every worker on it: ``group``) is gone."""

    short: str
    """For the restart list: "node 1a2b3c (10.0.0.7) lost", "its Ray worker process died"."""
    why: str
    fix: str
    node_id: str = ""
    address: str = ""
    node_lost: bool = False
    ray_text: str = ""
    """Ray's own words (the exception or the control store's death cause)."""
    blames_sample: bool = True
    """Whether the batch may have caused it (a process death, Ray's memory monitor): only
    then does it count toward "killed a worker twice"; a lost node or object does not."""
    group: Lost = ()
    """The remote workers a lost node took with it (one event for all of them)."""
    clean: bool = False
    """The actor ended itself (after `Retire`, at ``max_worker_memory``)."""

    @property
    def name(self) -> str:
        """The short form, as in the restart list."""
        return self.short

    def heal(self, pool: Any) -> tuple[str, ...]:
        """Nothing to restart: Ray places the new actors (off a lost node)."""
        return ()

    def explain(self, loss: Loss) -> WorkerDiedError:
        """The actor's node, pid, Ray's cause and the samples it held."""
        worker_id, outcome = loss.worker_id, loss.outcome
        if self.group:  # a node: one message for all its workers
            workers = sorted(w for w, _, _ in self.group)
            worker_id, outcome = workers[0], f"It took remote workers {workers} with it. {outcome}"
        return remote_died(
            worker_id=worker_id,
            pid=loss.pid,
            cause=self,
            sample_indices=loss.sample_indices,
            batches_held=loss.batches_held,
            sample=loss.sample,
            outcome=outcome,
            stream_batches=loss.stream_batches,
        )


RETIRED = RemoteCause("retired", "its memory passed max_worker_memory", "", clean=True)
"""An actor that stopped itself after `Retire` (the pool ends it and says so)."""


def _enum_name(message: Any, field: str) -> str:
    try:
        enum = message.DESCRIPTOR.fields_by_name[field].enum_type
        return str(enum.values_by_number[getattr(message, field)].name)
    except Exception:
        return ""


def actor_death(ray: Any, actor_id: str) -> dict[str, Any]:
    """What Ray's control store says of a dead actor: reason, preempted, node death, OOM,
    text. Empty when it cannot be read."""
    try:
        from ray._private import state

        info = state.actors(actor_id)
        cause = info.get("DeathCause") if isinstance(info, dict) else None
    except Exception:
        return {}
    if cause is None:
        return {}
    out: dict[str, Any] = {}
    try:
        if cause.HasField("oom_context"):
            out["oom"] = True
            out["text"] = cause.oom_context.error_message
        if cause.HasField("actor_died_error_context"):
            ctx = cause.actor_died_error_context
            out["reason"] = _enum_name(ctx, "reason")
            out["text"] = ctx.error_message
            out["preempted"] = bool(getattr(ctx, "preempted", False))
            if ctx.HasField("node_death_info"):
                out["node_reason"] = _enum_name(ctx.node_death_info, "reason")
                out["node_text"] = ctx.node_death_info.reason_message
    except Exception:
        pass
    return out


def node_state(ray: Any, node_id: str) -> tuple[bool | None, str]:
    """(alive, Ray's death reason) of a node; alive None when unknown."""
    try:
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                reason = node.get("DeathReasonMessage") or ""
                return bool(node.get("Alive")), str(reason)
    except Exception:
        pass
    return None, ""


def draining(node_id: str) -> bool:
    """Whether Ray is draining the node (the autoscaler's preemption notice: a busy node is
    drained only for that); False when unknown."""
    try:
        from ray._private import state

        return node_id in state.state.get_draining_nodes()
    except Exception:
        return False


def first_lines(text: str, n: int = 3) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " ".join(lines[:n])


def task_failed(ray: Any, exc: BaseException, task_id: int) -> Failed | None:
    """The task's `Failed` when its call raised in an actor that is still alive (Ray could
    not serialize the batch it returned, for one), or None: the actor, its node or the
    result is gone (a death, for `classify`)."""
    errors = ray.exceptions
    if not isinstance(exc, errors.RayTaskError) or isinstance(exc, errors.RayActorError):
        return None
    cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
    return failed_outcome(task_id, cause, "while Ray sent the batch to the main process")


def answers(ray: Any, handle: Any, wait_s: float = 5.0) -> bool:
    """Whether the actor answers a call of its control group within ``wait_s``."""
    try:
        ray.get(handle.stack.options(concurrency_group=CONTROL).remote(), timeout=wait_s)
    except Exception:
        return False
    return True


def classify(
    ray: Any, exc: BaseException | None, handle: Any, node_id: str, address: str, pid: int | None
) -> RemoteCause:
    """The cause of a remote worker's end from ``exc`` (what its call raised; None: the
    actor answered nothing) and Ray's state."""
    actor_id = handle._actor_id.hex()
    errors = ray.exceptions
    text = first_lines(str(exc)) if exc is not None else ""
    node = f"node {node_id[:12]} ({address})"
    logs = _LOGS.format(pid=pid)
    if exc is not None and isinstance(exc, getattr(errors, "ObjectLostError", ())):
        return RemoteCause(
            "its result object was lost",
            f"Ray lost the batch's result object on {node}: {text}",
            "nothing, if it is rare (the batch is re-run, once); if it repeats, give the "
            "object store more memory (ray start --object-store-memory) or check that node.",
            node_id,
            address,
            ray_text=text,
            blames_sample=False,
        )
    death = actor_death(ray, actor_id)
    alive, node_reason = node_state(ray, node_id)
    ray_text = first_lines(death.get("text") or text)
    unreachable = exc is not None and isinstance(exc, getattr(errors, "ActorUnavailableError", ()))
    if death.get("oom") or (exc is not None and isinstance(exc, errors.OutOfMemoryError)):
        return RemoteCause(
            "killed by Ray's memory monitor",
            f"{node} ran short of memory and Ray's memory monitor killed the actor: {ray_text}",
            "give each remote worker room: RemoteWorkers(memory=...) reserves it per actor, "
            "fewer actors per node (num_cpus=2), or a smaller batch; max_worker_memory= "
            "replaces a leaking worker before that.",
            node_id,
            address,
            ray_text=ray_text,
        )
    if unreachable and alive is not False and answers(ray, handle):
        return RemoteCause(
            "its connection broke",
            f"Ray lost its connection to the actor on {node} ({ray_text}); "
            "the actor still answers, but a call may have been lost with it, so steadyload "
            "replaced the actor",
            f"nothing, if it is rare; if it repeats, check the network between this machine "
            f"and {node}.",
            node_id,
            address,
            ray_text=ray_text,
            blames_sample=False,
        )
    preempted = death.get("preempted") or death.get("node_reason") == "AUTOSCALER_DRAIN_PREEMPTED"
    if preempted or (node_id and draining(node_id)):
        return RemoteCause(
            f"{node} preempted",
            f"{node} was preempted: Ray was draining it for preemption "
            "(a spot node its cloud provider takes back)" + (f"; Ray: {ray_text}" if death else ""),
            "nothing: spot nodes go; the batches were re-run on the others. Use on-demand "
            "nodes (or a label_selector) for a pool that must not shrink.",
            node_id,
            address,
            node_lost=True,
            ray_text=ray_text,
            blames_sample=False,
        )
    if death.get("reason") == "NODE_DIED" or alive is False or unreachable:
        why = node_reason or death.get("node_text") or ray_text
        return RemoteCause(
            f"{node} lost",
            f"{node} left the cluster"
            + (f" (Ray: {why})" if why else "")
            + ("; its raylet stopped answering" if unreachable and alive is not False else ""),
            "nothing, if it is rare: the batches were re-run on the other workers. If nodes "
            f"go often, look at {logs} and at the machine (kernel log, power, network).",
            node_id,
            address,
            node_lost=True,
            ray_text=ray_text,
            blames_sample=False,
        )
    if death.get("reason") == "RAY_KILL":
        return RemoteCause(
            "killed through Ray",
            f"something other than steadyload killed the actor (ray.kill, `ray stop`): {ray_text}",
            "do not kill a loader's actors by hand; they end with the loader.",
            node_id,
            address,
            ray_text=ray_text,
            blames_sample=False,
        )
    return RemoteCause(
        "its Ray worker process died",
        f"the actor's process (pid {pid}) on {node} exited "
        f"unexpectedly: a signal (SIGKILL from the OOM killer or a person), a crash in "
        f"native code, or os._exit. Ray: {ray_text}",
        f"look at the node's kernel log (dmesg: an OOM kill names pid {pid}) and {logs}.",
        node_id,
        address,
        ray_text=ray_text,
    )


def remote_died(
    *,
    worker_id: int,
    pid: int | None,
    cause: RemoteCause,
    sample_indices: list[Any],
    batches_held: int,
    sample: Any,
    outcome: str,
    stream_batches: list[int],
) -> WorkerDiedError:
    """The `WorkerDiedError` of a remote worker: its node, pid, Ray's cause and the samples
    it held (re-run elsewhere when ``outcome`` says so)."""
    if stream_batches:
        held = f"batches {stream_batches} of the epoch (a stream's items have no indices)"
    else:
        held = f"samples {sample_indices}" if sample_indices else "no batch"
    where = f" while loading sample {sample!r}" if sample is not None else ""
    message = (
        f"DataLoader remote worker {worker_id} (Ray actor, pid {pid}, node "
        f"{cause.node_id[:12]} at {cause.address}) is gone: {cause.short}{where}. It held "
        f"{batches_held} batch{'es' if batches_held != 1 else ''}: {held}.\n"
        f"Why: {cause.why}\nFix: {cause.fix}"
    )
    if outcome:
        message += f"\n{outcome}"
    return WorkerDiedError(
        message,
        worker_id=worker_id,
        pid=pid,
        sample_indices=sample_indices,
        evidence={
            "kind": "remote",
            "node_id": cause.node_id,
            "address": cause.address,
            "node_lost": cause.node_lost,
            "ray": cause.ray_text,
            "sample": sample,
        },
    )


def stack(ray: Any, a: Any, wait_s: float) -> str:
    """A remote worker's Python stacks, asked of its actor's control group (answered while
    the loop is busy), headed by where it runs; keeps its status fields on ``a`` (its
    `records.Actor`) for the hang report. [Unit: second]"""
    head = (
        f"Remote worker {a.worker_id} (Ray actor, pid {a.pid}, node {a.node_id[:12]} at "
        f"{a.address})"
    )
    try:
        ref = a.handle.stack.options(concurrency_group=CONTROL).remote()
        text, fields = ray.get(ref, timeout=max(wait_s, 5.0))
    except Exception as exc:
        return f"{head}: no stack ({type(exc).__name__}: {first_lines(str(exc))})"
    a.fields = fields
    return f"{head}:\n{located(text)}"
