"""How workers start: start-method choice, fork-server preloading, the zygote, fork guards.

Nothing is imported here: the fork server imports `steadyload.start.server_hooks.*` by
name, and that must not pull in torch or the rest of this package. See
docs/design/layers.md.
"""
