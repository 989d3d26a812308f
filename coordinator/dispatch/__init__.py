"""The coordinator's dispatch subsystem: the shell around ``coordinator.core.dispatch`` that moves
a layer's routed experts between the engine thread, the local kernel and volunteers, and the link to
the market that lists them."""
