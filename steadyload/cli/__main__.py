"""Entry point of the ``steadyload`` command.

For quick start-up, nothing heavy (torch) is imported at module level: each subcommand
module imports only the standard library when its parser is built, and what it needs
when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging

SUBCOMMANDS = ("doctor", "bench", "ledger", "replay")
"""Modules of `steadyload.cli`, one per subcommand, each with ``add_parser(subparsers)``
(registering a subparser named like the module) and ``run(args) -> int`` (the exit status).
Adding one is adding its name here."""


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the process exit code."""
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="steadyload",
        description="Multi-worker data loading for PyTorch that never hangs silently.",
    )
    parser.add_argument("--version", action="version", version=f"steadyload {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {name: importlib.import_module(f"{__package__}.{name}") for name in SUBCOMMANDS}
    for module in modules.values():
        module.add_parser(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    if args.command is None:
        parser.print_help()
        return 0
    code: int = modules[args.command].run(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
