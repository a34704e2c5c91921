"""Remote workers: steadyload's worker loop in Ray actors (spec.py, actor.py, pool.py)."""
