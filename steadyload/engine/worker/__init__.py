"""The worker's side, the same for every kind: its set-up (serve.py), the one loop (loop.py),
fetching and collating (fetch.py), torch's per-worker hooks (torch_hooks.py), the status
fields the parent reads (status.py) and the memory cap (memory_cap.py)."""
