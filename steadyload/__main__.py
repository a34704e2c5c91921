"""``python -m steadyload``: the command-line interface."""

from steadyload.cli.__main__ import main

raise SystemExit(main())
