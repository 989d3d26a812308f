"""Which identities speak from which IP address (runtime, never stored; sans-IO: ``now`` is given).

Rules (DESIGN §12: Sybil bounds, per address):
- ``note``: an identity is marked at the address it last spoke from; a new identity at an address
  that already has ``max_per_address`` live ones, or past ``max_total`` marked identities in all, is
  refused (False) and nothing is recorded. An identity that moves leaves its old address.
- ``holdings``: slices held or leased from an address: the coverage of the identities marked there
  plus the open leases taken from it (the per-address cap counts holdings, not only open leases).
- ``forget_idle``: the mark of an identity that holds nothing and has no lease goes after ``idle_s``
  of silence, so the bounds follow the live identities.
"""

from __future__ import annotations

from market.indexes import Indexes

__all__ = ["AddressBook"]


class AddressBook:
    def __init__(self) -> None:
        self.addr_peers: dict[str, dict[str, float]] = {}  # IP address -> identities seen there -> when
        self.peer_addr: dict[str, str] = {}  # identity -> the address it last spoke from
        self.lease_address: dict[str, str] = {}  # lease id -> the IP address that took it

    def note(self, peer: str, address: str, now: float, *, max_per_address: int, max_total: int) -> bool:
        peers = self.addr_peers.get(address, {})
        if peer not in peers and (len(peers) >= max_per_address
                                  or (peer not in self.peer_addr and len(self.peer_addr) >= max_total)):
            return False
        self.addr_peers[address] = peers
        old = self.peer_addr.get(peer)
        if old is not None and old != address:
            gone = self.addr_peers.get(old, {})
            gone.pop(peer, None)
            if not gone:
                self.addr_peers.pop(old, None)
        self.peer_addr[peer] = address
        peers[peer] = now
        return True

    def leased(self, lease_id: str, address: str) -> None:
        self.lease_address[lease_id] = address

    def keep_open_leases(self, ix: Indexes) -> None:
        self.lease_address = {k: a for k, a in self.lease_address.items() if k in ix.leases}

    def holdings(self, address: str, ix: Indexes) -> int:
        self.keep_open_leases(ix)
        held = sum(len(ix.coverage.get(p, {})) for p in self.addr_peers.get(address, {}))
        return held + sum(a == address for a in self.lease_address.values())

    def forget_idle(self, now: float, idle_s: float, ix: Indexes) -> None:
        for address, peers in list(self.addr_peers.items()):
            for peer, at in list(peers.items()):
                if now - at > idle_s and peer not in ix.coverage and peer not in ix.lease_of:
                    del peers[peer]
                    if self.peer_addr.get(peer) == address:
                        del self.peer_addr[peer]
            if not peers:
                del self.addr_peers[address]
