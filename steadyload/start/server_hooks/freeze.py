"""Imported last by the fork server: moves every object it has made out of the GC's reach.

A worker forked from the server shares the server's pages (torch and the other preloads)
until it writes to them. A full collection in the worker writes the GC header of every
tracked object it traverses, and so un-shares the pages holding them (the figures:
docs/design/figures.md#fork-server).
``gc.freeze()`` moves the server's objects to the permanent generation, which collections
skip (the CPython docs recommend it before fork). No ``gc.collect()`` first: after torch's
import it is slow, on the path to every fresh process's first batch, and frees little (the
garbage stays frozen, shared by the workers). Workers freeze again once started
(engine/process/worker.py).
"""

from __future__ import annotations

import gc

from .probe import IN_FORK_SERVER

if IN_FORK_SERVER:
    gc.freeze()
