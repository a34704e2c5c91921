"""Iterators: one per epoch (torch's ``_BaseDataLoaderIter``), in-process or over workers.

`in_process` loads in this process (``num_workers=0``); `workers` drives the supervised
worker processes (task table in `tasks`, recovery policy in `recovery`); `common` holds
what both share (skip guard, empty batches, timing). See docs/design/layers.md.
"""
