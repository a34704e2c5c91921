"""Modules the fork server imports by name around its preloads; each acts at import.

Order (start/preload.py): `path` first (the parent's ``sys.path``), then the preloads,
then `freeze` (``gc.freeze()``), then `probe` (records what was imported). They import
nothing of steadyload but each other, so that importing them costs microseconds.
"""
