"""`steadyload ledger verify|show DIR`: check and read a ledger (``DataLoader(ledger=DIR)``).

``verify`` prints one line per epoch (exit status 1 on a hole, a repeat or an incomplete
epoch); ``show`` prints what one step trained on. The work is in `resume.ledger.verify`
and `resume.ledger.show`, imported on dispatch.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``steadyload ledger`` and its commands."""
    p = subparsers.add_parser(
        "ledger",
        help="verify or read a ledger: what every step trained on",
        description="Read a folder written by DataLoader(..., ledger=DIR): verify that every "
        "epoch delivered each sample exactly once over ranks and resumes, or show what a "
        "step trained on.",
    )
    commands = p.add_subparsers(dest="ledger_command", metavar="COMMAND", required=True)
    v = commands.add_parser(
        "verify",
        help="check each epoch: every sample exactly once (exit 1 if not)",
        description="Resolve the timeline (a resume supersedes the steps after its state), "
        "then check each epoch against its plan: one line per epoch with a digest and the "
        "counts; holes and repeats named with their rank, step and run. Exit status 0 when "
        "exact, 1 on a hole, a repeat or an incomplete epoch.",
    )
    v.add_argument("folder", metavar="DIR", help="the ledger folder")
    v.add_argument("--epoch", type=int, metavar="E", help="verify only epoch E")
    v.add_argument(
        "--plan",
        action="store_true",
        help="check against the recorded plan (each step once, as recorded) "
        "instead of every index of the dataset",
    )
    v.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="an epoch not finished (a run still going, or crashed) passes",
    )
    s = commands.add_parser(
        "show",
        help="what one step trained on",
        description="Print what step S of epoch E trained on: its indices, seeds (with "
        "sample_seeds=True), worker and events, on each rank or on --rank R.",
    )
    s.add_argument("folder", metavar="DIR", help="the ledger folder")
    s.add_argument("--epoch", type=int, required=True, metavar="E")
    s.add_argument("--step", type=int, required=True, metavar="S")
    s.add_argument("--rank", type=int, metavar="R", help="one rank (default: every rank)")
    s.add_argument(
        "--json",
        action="store_true",
        help="one JSON object {epoch, step, rank, run, indices, seeds, workers, "
        "events} with --rank, else a list of them, one per rank",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``verify`` or ``show``; the exit status (2 when the ledger cannot be read)."""
    try:
        if args.ledger_command == "verify":
            from ..resume.ledger.verify import verify

            verdict = verify(
                args.folder,
                epoch=args.epoch,
                plan=args.plan,
                allow_incomplete=args.allow_incomplete,
            )
            print(verdict.text())
            return 0 if verdict.ok else 1
        from ..resume.ledger.show import show, text

        shown = show(args.folder, args.epoch, args.step, args.rank)
    except (FileNotFoundError, LookupError, ValueError) as exc:
        print(f"steadyload ledger {args.ledger_command}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(shown[0] if args.rank is not None else shown, indent=2))
    else:
        print(text(shown))
    return 0
