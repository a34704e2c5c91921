"""The ledger: what every step trained on, recorded, verified, shown and replayed (issue #37).

record.py writes (`Recorder`, one per loader with ``ledger=``); files.py is the format (one
append-only file per segment) and reads a folder back; docs/design/ledger.md.
"""
