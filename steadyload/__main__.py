"""``python -m steadyload``: the command-line interface."""

from .cli.__main__ import main

# The guard matters: forkserver/spawn workers started by `bench` import this module again
# (as __mp_main__), which must not re-run the command.
if __name__ == "__main__":
    raise SystemExit(main())
