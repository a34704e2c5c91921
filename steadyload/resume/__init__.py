"""Resume: a loader's position at any number of workers and ranks, one way through.

Capture (`checkpoint.Checkpoints.save`: what decided the epoch, kept as it began by
`epoch_order.capture`, plus the position, `progress.py`) -> validate (`validate.check`, the
one gate a loaded state passes, every field by `fields.py`, the ranks by `shards.py`) ->
apply (`apply.replay` as the next epoch begins, from the checked `validate.Resume` only).
"""
