"""A loader state's fields: their types and ranges, checked whatever the loader
(`validate.check` calls this first). One ValueError names the field, the value found and
what was expected; nothing is applied before every check passed."""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Callable
from typing import Any

from .progress import fail
from .shards import ACCELERATE, DISTRIBUTED, consumed

STATE_FORMAT = "steadyload.DataLoader"
STATE_VERSION = 3  # 3: the ranks that saved it ("world"), its sampler kinds ("order"), the
# samples skipped on resume ("skip")
_READS = (2, 3)  # 2: without those three (checked as far as they go, with a warning)

_WHY = (
    "a loader state is what DataLoader.state_dict() returned; this one was damaged or "
    "edited, and resuming from it could repeat or skip samples."
)
_FIX = (
    "load the state as state_dict() saved it (check the checkpoint file), or start the "
    "epoch afresh without load_state_dict(). This loader was left unchanged."
)
_ORDER: dict[str, dict[str, type]] = {  # a sharding's order arguments, by kind
    DISTRIBUTED: {"seed": int, "shuffle": bool, "drop_last": bool},
    ACCELERATE: {"split_batches": bool, "even_batches": bool, "drop_last": bool},
}


def short(value: Any) -> str:
    """``value``'s repr, cut to a line."""
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict = 60, 60, 8, 6
    return r.repr(value)


def bad(field: str, found: str, expected: str) -> ValueError:
    """The error for a field that is not what `state_dict` writes."""
    return fail(f"this loader state's {field} {found}; expected {expected}.", _WHY, _FIX)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: _int(v) and v >= low


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _get(
    state: dict[str, Any], key: str, ok: Callable[[Any], bool], expected: str, within: str = ""
) -> Any:
    """``state[key]`` if ``ok``; ``within`` names the field ``state`` is (nested fields)."""
    name = f"{within}[{key!r}]" if within else repr(key)
    if key not in state:
        raise bad(name, "is missing", expected)
    value = state[key]
    if not ok(value):
        raise bad(name, f"is {short(value)}", expected)
    return value


def check_format(state: Any) -> None:
    """``state`` is a steadyload loader state of a version this release reads."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise fail(
            "load_state_dict() expects the dict that steadyload.DataLoader.state_dict() "
            f"returned, got {type(state).__name__}"
            + (f" with keys {list(state)[:8]}" if isinstance(state, dict) else "")
            + ".",
            "only a steadyload loader state says where its epoch stood.",
            "pass loader.state_dict() as saved in your checkpoint.",
        )
    version = state.get("version")
    if version not in _READS:
        raise fail(
            f"this loader state has version {short(version)}; this steadyload reads "
            f"versions {', '.join(map(str, _READS))}.",
            "the state was written by a different steadyload release.",
            "resume with the steadyload version that saved it, or restart the epoch.",
        )


def check_fields(state: dict[str, Any]) -> None:
    """Every field `state_dict` writes is there, of its type and in its range."""
    _get(state, "epoch", _at_least(-1), "an int >= -1 (-1: saved before the first epoch)")
    finished = _get(state, "finished", _bool, "True or False")
    if not finished:
        _get(state, "epoch", _at_least(0), "an int >= 0 for a state saved mid-epoch")
    _get(state, "batches_yielded", _at_least(0), "an int >= 0")
    _get(
        state,
        "yielded_beyond",
        lambda v: isinstance(v, list) and all(_int(b) for b in v) and len(set(v)) == len(v),
        "a list of distinct batch numbers",
    )
    seed = _get(
        state,
        "base_seed",
        _optional(lambda v: _int(v) and 0 <= v < 2**64),
        "None or an int from 0 to 2**64 - 1",
    )
    if seed is None and not finished:
        raise bad("'base_seed'", "is None", "the epoch's base seed (an int) mid-epoch")
    _get(
        state,
        "rng",
        lambda v: (
            isinstance(v, dict)
            and all(isinstance(k, str) and isinstance(t, str) for k, t in v.items())
        ),
        "a dict of generator states as text, by generator",
    )
    _get(
        state,
        "samplers",
        lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
        "a dict of sampler states by sampler",
    )
    _get(state, "distributed_epoch", _optional(_at_least(0)), "None or an int >= 0")
    _get(state, "dataset_len", _optional(_at_least(0)), "None or an int >= 0")
    _get(state, "batch_size", _optional(_at_least(1)), "None or an int >= 1")
    _get(state, "drop_last", _bool, "True or False")
    workers = _get(state, "num_workers", _at_least(0), "an int >= 0")
    _get(state, "persistent", _bool, "True or False")
    _check_sharding(_get(state, "sharding", _optional(_dict), "None or a dict"))
    _check_positions(_get(state, "dataset_states", _optional(_dict), "None or a dict"), workers)
    ledger = (
        _get(state, "ledger", _optional(_dict), "None or a dict") if "ledger" in state else None
    )
    if ledger is not None:
        _get(ledger, "token", lambda v: isinstance(v, str), "a timeline's token (text)", "ledger")
        _get(ledger, "steps", _at_least(0), "an int >= 0", "ledger")
    if state["version"] >= 3:
        world = _get(state, "world", _dict, "a dict with the saving run's size and rank")
        size = _get(world, "size", _at_least(1), "an int >= 1", "world")
        _get(world, "rank", lambda v: _int(v) and 0 <= v < size, f"0 to {size - 1}", "world")
        _get(
            state,
            "order",
            lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
            "a list of sampler kinds",
        )
    if state["version"] >= 3 or "skip" in state:
        _check_skip(state)


def _above(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(_int(b) and b > low for b in v)


def _dict(v: Any) -> bool:
    return isinstance(v, dict)


def _check_sharding(sharding: dict[str, Any] | None) -> None:
    if sharding is None:
        return
    kind = _get(sharding, "kind", lambda v: v in _ORDER, f"one of {sorted(_ORDER)}", "sharding")
    replicas = _get(sharding, "replicas", _at_least(1), "an int >= 1", "sharding")
    _get(
        sharding,
        "rank",
        lambda v: _int(v) and 0 <= v < replicas,
        f"from 0 to {replicas - 1}",
        "sharding",
    )
    _get(sharding, "offset", _at_least(0), "an int >= 0", "sharding")
    _get(sharding, "per_batch", _optional(_at_least(1)), "None or an int >= 1", "sharding")
    _get(sharding, "exact", _bool, "True or False", "sharding")
    order = _get(sharding, "order", _dict, "a dict of the sampler's arguments", "sharding")
    for key, kind_of in _ORDER[kind].items():
        _get(
            order,
            key,
            _bool if kind_of is bool else _int,
            f"a {kind_of.__name__}",
            "sharding['order']",
        )


def _check_positions(saved: dict[str, Any] | None, workers: int) -> None:
    if saved is None:
        return
    n = max(workers, 1)
    entries = _get(
        saved,
        "workers",
        lambda v: isinstance(v, list) and len(v) == n,
        f"a list of {n} positions (one per worker, num_workers={workers})",
        "dataset_states",
    )
    for i, entry in enumerate(entries):
        if entry is not None and not (
            isinstance(entry, dict) and "dataset" in entry and "iterator" in entry
        ):
            raise bad(
                f"dataset_states['workers'][{i}]",
                f"is {short(entry)}",
                "None or a dict with the dataset's and its iterator's states",
            )
    last = _optional(lambda v: _int(v) and 0 <= v < n)
    _get(saved, "last_worker", last, f"None or 0 to {n - 1}", "dataset_states")
    _get(saved, "next_epoch", _bool, "True or False", "dataset_states")


def _check_skip(state: dict[str, Any]) -> None:
    """The skips made at earlier resumes (`skip_samples`): in the order they were made, each
    after what came before it was consumed, of indices of the dataset."""
    stages = _get(
        state,
        "skip",
        lambda v: isinstance(v, list) and all(isinstance(s, dict) for s in v),
        "a list of skips ({'at', 'beyond', 'samples'})",
    )
    n, last = state["dataset_len"], 0
    top = f" below {n}" if n is not None else ""
    for i, record in enumerate(stages):
        within = f"skip[{i}]"
        at = _get(record, "at", _at_least(last), f"an int >= {last} (skips in order)", within)
        _get(record, "beyond", _above(at), f"a list of batch numbers above {at}", within)
        _get(
            record,
            "samples",
            lambda v: (
                isinstance(v, list)
                and all(_int(x) and 0 <= x and (n is None or x < n) for x in v)
                and all(a < b for a, b in itertools.pairwise(v))
            ),
            f"a sorted list of distinct dataset indices (ints >= 0{top})",
            within,
        )
        last = at
    sharding = state["sharding"]
    if state["finished"]:
        bound, what = 0, "0 (a state saved between epochs skips from the next one's start)"
    elif sharding is None:
        bound = state["batches_yielded"]
        what = f"at most batches_yielded ({bound})"
    elif sharding["per_batch"] is not None:
        bound = consumed(sharding, state["batches_yielded"])
        what = f"at most {bound}, the part of the order the ranks had consumed"
    else:
        return  # (a sharding steadyload does not deal: refused with skips, `skip_samples`)
    if stages and last > bound:
        raise bad(f"skip[{len(stages) - 1}]['at']", f"is {last}", what)
