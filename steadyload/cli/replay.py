"""`steadyload replay DIR --epoch E --step S [--rank R] --loader MODULE:FUNCTION [--out FILE]`:
one recorded step's batch rebuilt offline (`steadyload.replay`), its indices and a digest of
every tensor printed, or the batch saved with ``torch.save``. torch and the user's module
are imported when it runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Register ``replay``."""
    p = subparsers.add_parser(
        "replay",
        help="rebuild the batch a recorded step trained on (ledger=)",
        description=(
            "Rebuild one step's batch from a ledger folder, in this process: the recorded "
            "indices loaded through your loader's dataset and collate function (bit for bit "
            "with sample_seeds=True). Prints the indices and a digest of every tensor."
        ),
    )
    p.add_argument("folder", help="the ledger folder (DataLoader(ledger=...))")
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--rank", type=int, default=None, help="needed when several ranks ran")
    p.add_argument(
        "--loader",
        required=True,
        metavar="MODULE:FUNCTION",
        help="a function (in a module importable from the current folder) returning the loader",
    )
    p.add_argument("--out", default=None, help="save the batch here (torch.save)")


def _loader(spec: str) -> Any:
    module_name, sep, function = spec.partition(":")
    if not sep or not module_name or not function:
        raise SystemExit(f"--loader must be MODULE:FUNCTION, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    return getattr(module, function)()


def digests(batch: Any, path: str = "batch") -> list[tuple[str, str]]:
    """(path, description) of every tensor in ``batch``: shape, dtype and a sha256 prefix."""
    import torch

    if isinstance(batch, torch.Tensor):
        data = batch.detach().cpu().contiguous()
        digest = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[
            :16
        ]
        return [(path, f"{tuple(data.shape)} {data.dtype} sha256:{digest}")]
    if isinstance(batch, dict):
        return [d for k, v in batch.items() for d in digests(v, f"{path}[{k!r}]")]
    if isinstance(batch, (list, tuple)):
        return [d for i, v in enumerate(batch) for d in digests(v, f"{path}[{i}]")]
    return [(path, repr(batch)[:80])]


def run(args: argparse.Namespace) -> int:
    """Rebuild the step; print what it holds (or save it)."""
    import torch

    from ..resume.ledger.replay import find_step, replay

    loader = _loader(args.loader)
    record = find_step(args.folder, args.epoch, args.step, args.rank)
    batch = replay(loader, args.folder, epoch=args.epoch, step=args.step, rank=record.rank)
    print(f"epoch {args.epoch} step {args.step} rank {record.rank} (run {record.segment})")
    print(f"indices: {record.indices}")
    for where, what in digests(batch):
        print(f"  {where}: {what}")
    if args.out:
        torch.save(batch, args.out)
        print(f"saved to {args.out}")
    return 0
