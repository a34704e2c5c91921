"""The supervised worker engine: parent side (supervisor), child side (worker), messages.

See docs/design/protocol.md for the message flow and docs/design/shutdown.md for teardown.
"""
