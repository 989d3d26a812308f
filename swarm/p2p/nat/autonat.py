"""AutoNAT v1 as a client asks it (shell): "relay, please dial me back at these addresses".

Rules:
- The verdict over all relays is ``swarm.core.paths.reachability_verdict``'s; this module only asks
  and maps the answer to a ``DialResult`` (``ERROR`` for no answer within ``timeout_s``).
- py-libp2p's own AutoNAT server dials back over the connection the request came on, so it says
  "reachable" to everyone (workaround (h)); ``moe-swarm relay`` dials back on a fresh connection.
  A relay that does not speak AutoNAT leaves reachability unknown.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from swarm.core.paths import DialResult
from swarm.p2p.nat.addrs import RelayAddr, pid
from swarm.p2p.nat.circuit import ensure_connection

__all__ = ["ask_dial_back"]

log = logging.getLogger(__name__)


async def ask_dial_back(host: Any, relay: RelayAddr, addrs: list[str], *, timeout_s: float) -> DialResult:
    """Ask ``relay`` to dial ``host`` back at ``addrs`` (AutoNAT v1)."""
    from libp2p.host.autonat.autonat import AutoNATService
    from libp2p.host.autonat.pb.autonat_pb2 import Message
    from multiaddr import Multiaddr

    with trio.move_on_after(timeout_s):
        try:
            await ensure_connection(host, relay.peer_id, relay.transport_addr)
            client = AutoNATService(host, serve=False)
            status, addr = await client.query_server(
                pid(relay.peer_id), [Multiaddr(a).to_bytes() for a in addrs], timeout=timeout_s)
        except Exception as exc:
            log.info("reachability check via %s failed: %r", relay.addr, exc)
            return DialResult.ERROR
        result = {int(Message.OK): DialResult.OK, int(Message.E_DIAL_REFUSED): DialResult.REFUSED,
                  int(Message.E_DIAL_ERROR): DialResult.FAILED}.get(status, DialResult.ERROR)
        log.info("relay %s dialled us back: %s%s", relay.peer_id, result.value,
                 f" at {Multiaddr(addr)}" if addr else "")
        return result
    return DialResult.ERROR
