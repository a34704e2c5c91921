"""``worker_type="auto"``: the rule that picks threads or processes (worker_kind.py) and the
pool that starts on threads and hands over to processes (handover.py)."""
