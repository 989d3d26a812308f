"""Everything that touches py-libp2p's internals (shell), for the pinned version only.

py-libp2p is pinned (``libp2p==0.8.1`` in pyproject): the patches below override private methods
and replace the Yamux muxer, which is safe only against the exact code they were written for.
``check_libp2p_version()`` runs whenever a host is built and refuses any other installed version
with a ``ConfigError`` naming both versions. Nothing is patched at import: each workaround is
applied per host (``swarm.p2p.patches.host``, ``swarm.p2p.patches.yamux``) or lives in our own
code in place of the library's (``swarm.p2p.nat``, ``relay``). Each has a regression test
(``tests/integration/test_libp2p_workarounds.py``, ``tests/integration/test_relay_workarounds.py``,
``tests/integration/test_yamux_tuning.py``) with a canary that fails when the library fixes the bug itself.
"""

from __future__ import annotations

from importlib import metadata
from typing import Final

from swarm.errors import ConfigError

__all__ = ["PINNED_LIBP2P", "check_libp2p_version", "installed_libp2p_version"]

PINNED_LIBP2P: Final = "0.8.1"


def installed_libp2p_version() -> str | None:
    try:
        return metadata.version("libp2p")
    except metadata.PackageNotFoundError:
        return None


def check_libp2p_version(installed: str | None = None) -> None:
    """Refuse to run the patches against a py-libp2p they were not written for."""
    found = installed_libp2p_version() if installed is None else installed
    if found != PINNED_LIBP2P:
        raise ConfigError(
            f"py-libp2p {found or 'is not installed'}{'' if found is None else ' is installed'}: moe-swarm's "
            f"libp2p patches (swarm/p2p/patches) are written for exactly {PINNED_LIBP2P}; "
            f"install it with `pip install libp2p=={PINNED_LIBP2P}`"
        )


# --------------------------------------------------------------------------------------------
# py-libp2p 0.8.1 workarounds: the one place where library behaviour is changed.
#
# (a) A listener refused every connection after its 250th inbound connection ever.
#     Cause: Swarm._handle_inbound_connection takes a slot of ``_inbound_limiter`` (a
#     CapacityLimiter of max_connections - min_connections = 300 - 50 = 250 tokens) and
#     _do_handle_inbound_connection then parks on ``self.manager.wait_finished()`` -- the whole
#     swarm's lifetime -- to keep the transport from closing the socket. The slot (and the task)
#     is released only at shutdown, not when the connection closes.
#     Fix: ``_WorkaroundSwarm`` overrides _do_handle_inbound_connection to park until *that*
#     connection's muxer reports it closed, so the slot is returned with the connection.
# (b) Every dial waited ~250 ms. Cause: Swarm.dial_peer's happy-eyeballs loop starts a dial and
#     then waits _HAPPY_EYEBALLS_DELAY (250 ms) for it to *fail* before moving on -- also after the
#     last address, and a success only ends the wait if it reaches max_connections_per_peer (3 by
#     default). Fix: max_connections_per_peer=1 (we want one connection per peer anyway), so the
#     first success cancels the wait, as happy eyeballs intends.
# (c) A stream per call costs a multistream-select round trip (~3.5 ms): not patched here;
#     swarm.rpc.client keeps one long-lived, pipelined stream per peer instead.
# (d) Shutdown leaked sockets: the library closes connections and listeners in its service's
#     ``finally`` while being cancelled, so each close stops at its first checkpoint. The
#     listening socket lives in a trio system task and stays open; with SO_REUSEPORT a peer
#     restarted on the same port shares it with the dead listener, which swallows some of its
#     connections. Fix: ``_close_network`` closes listeners, then connections, shielded, before
#     the service stops; ``_close_quietly`` shields every connection close (an interrupted close
#     marks the connection closed, so a second close() returns without closing the socket).
# Also configured: no dial retries and no negative dial cache (a failed dial otherwise blocks
# that peer for 60 s even after it is back): retry policy belongs to the caller, who can see it.
# min_connections = low_watermark = 0 (fewer connections kept open by the auto-connector).
# Only Noise and Yamux are offered (new_host also offers TLS, SECIO and plaintext, and Mplex).
# No ResourceManager: its default circuit breaker, per-peer connection rate limit and
# memory-based admission fail connections in ways the caller cannot see or configure here; the
# limits that matter are max_connections (swarm) and max_inbound_streams_per_peer (ours).
# Relay and NAT traversal (swarm/p2p/nat/, relay/; tests/integration/test_relay_workarounds.py):
# (e) host.connect() and Swarm.dial_peer skip /p2p-circuit addresses. Libp2pTransport.open_stream
#     calls swarm.p2p.nat's connect hook, which dials them itself (HOP CONNECT, then Noise + Yamux
#     over the relayed stream).
# (f) CircuitV2Protocol keys live circuits by peer id, so the end of one circuit closes another
#     circuit to the same peer, and RelayLimits(data=0) cuts a circuit at its first byte (0 is
#     meant as "unlimited" by the spec). relay.service is our own hop service (same wire format,
#     the library's protobufs): one id per circuit, 0 = unlimited, limits omitted when unlimited.
# (g) A dial-only node with the default RelayConfig roles (CLIENT) sends a RESERVE before every
#     circuit dial and takes a reservation slot it never uses; reservations also outlived their
#     peer's connection until expiry. Our dialer never reserves; the relay frees a reservation
#     when its peer disconnects.
# (h) The AutoNAT v1 server "dials back" with host.connect(), which returns the connection the
#     request came in on: every node is told it is reachable. relay.service answers AutoNAT with
#     a fresh TCP connection and a Noise handshake that proves the peer's identity.
# (i) The auto-connector re-dialled every peer in the peerstore after any disconnect, even with
#     min_connections = low_watermark = 0: its target is the midpoint of the low and high
#     watermarks (150). A NATed volunteer thus re-dialled its coordinator directly behind the
#     operator's back (--no-hole-punch), and a coordinator re-dialled volunteers it had dropped.
#     Fix: _WorkaroundSwarm disables it; connections are opened by the caller, who can see them.
