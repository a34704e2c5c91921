"""Command-line interface (``steadyload``, ``python -m steadyload``)."""
