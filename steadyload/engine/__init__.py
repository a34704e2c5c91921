"""The supervised worker engine: parent side (supervisor), child side (worker, config),
messages (protocol), batches in shared memory (transport), status blocks, fetch, stopping.

See docs/design/protocol.md for the message flow and docs/design/shutdown.md for teardown.
"""
