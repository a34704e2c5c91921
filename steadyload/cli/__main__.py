"""Entry point of the ``steadyload`` command.

For quick start-up, nothing heavy (torch) is imported at module level: subcommands import
what they need when dispatched.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the process exit code."""
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="steadyload",
        description="Multi-worker data loading for PyTorch that never hangs silently.",
    )
    parser.add_argument("--version", action="version", version=f"steadyload {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if "-v" in (argv or sys.argv) else logging.INFO)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
