"""How process workers' messages and batches cross: framed socket messages with descriptors
(channel.py), the worker's shared-memory segments (arena.py), the parent's mappings
(segments.py) and a batch's wire format (storage_table.py)."""
