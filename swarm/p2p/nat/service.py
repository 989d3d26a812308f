"""Relay and NAT traversal for a libp2p host (shell): the ``Nat`` that ties circuit dialing, hole
punching, reachability and relay reservations together. Decisions live in ``swarm.core.paths`` and
``swarm.core.reservation``; the wire exchanges in ``circuit``, ``autonat`` and ``reservations``.

``open_nat(transport, cfg)`` attaches a ``Nat`` to a ``Libp2pTransport`` for the lifetime of the
context (its ``nat`` hook), so ``transport.open_stream`` reaches peers by ``/p2p-circuit``
addresses too and ``transport.path_to`` reports how a peer is reached.

Rules:
- Dialing (both roles): a peer with a live connection is not dialled again. Direct addresses are
  dialled first; ``/p2p-circuit`` addresses after ``circuit_delay_s`` (at once if there are no
  direct ones), one after another; the first connection wins. A circuit dial sends HOP CONNECT
  to the relay and runs Noise + Yamux over the relayed stream, so the peer's identity is proven
  end to end; the relay sees only ciphertext. A dialer never reserves a slot on a relay.
- Hole punching (the dialer of a circuit, if ``hole_punch``): right after a circuit dial, DCUtR
  (``/libp2p/dcutr``) asks the peer to dial back while we dial its observed addresses; a NATed
  peer can always reach a public dialer this way. Once a direct connection exists new streams
  use it (py-libp2p prefers direct connections) and the relayed one is closed after
  ``relayed_close_grace_s``. ``upgraded_at[peer]`` is when a direct connection joined relayed
  ones (stamped as the swarm registers it, whoever dialled, so at the instant ``path_to``
  changes; ``changed`` fires): what ``swarm.core.paths.should_migrate`` compares sessions with.
  A listener only answers DCUtR (it never drives it: two NATed peers dialling each other "as
  responder" deadlock their Noise handshakes).
- Listening through relays (``relays``): reachability is asked of the relays first (AutoNAT v1
  dial-back); ``swarm.core.paths`` decides what to advertise and whether to reserve. Each relay
  gets its own ``swarm.core.reservation`` machine: reserve, refresh, re-reserve with backoff after
  a lost connection or a refusal. Inbound circuits (STOP) are accepted only from those relays.
- ``advertised`` is the current address list (direct and/or circuit); ``changed`` is set and
  replaced whenever it or a reservation's state changes.
- Only ``swarm.errors`` escape: ``DialError`` when no address led to a connection.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from swarm.core.paths import (
    Reachability,
    advertised_addrs,
    classify_path,
    dial_plan,
    is_circuit,
    reachability_verdict,
    should_reserve,
)
from swarm.core.reservation import (
    ConnectionLost,
    Event,
    ReservationClient,
    ReservationPolicy,
)
from swarm.errors import ConfigError, DialError
from swarm.p2p.libp2p import Libp2pTransport, connection_notifee
from swarm.p2p.nat.addrs import (
    DCUTR_PROTOCOL,
    STOP_PROTOCOL,
    NatConfig,
    circuit_parts,
    close_conn,
    is_relayed_conn,
    parse_relay_addr,
    pid,
)
from swarm.p2p.nat.autonat import ask_dial_back
from swarm.p2p.nat.circuit import accept_circuit, open_circuit
from swarm.p2p.nat.reservations import RelayStatus, Reservation, run_reservation

if TYPE_CHECKING:
    from libp2p.abc import INetConn, INetStream

__all__ = ["Nat", "open_listener_host", "open_nat"]

log = logging.getLogger(__name__)

class Nat:
    """Relay and NAT support of one ``Libp2pTransport``. Create with ``open_nat``."""

    def __init__(self, transport: Libp2pTransport, cfg: NatConfig, nursery: trio.Nursery, rng: random.Random) -> None:
        from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

        self.transport = transport
        self.host = transport.host
        self.cfg = cfg
        self._nursery = nursery
        self._rng = rng
        self.relays = [parse_relay_addr(a) for a in cfg.relays]
        self._relay_ids = {r.peer_id for r in self.relays}
        self._connecting: dict[str, trio.Event] = {}
        self._via_relay: set[str] = set()  # peers first reached through a relay (either direction)
        self._punching: set[str] = set()
        self._reservations: dict[str, Reservation] = {}
        self.reachability = Reachability.UNKNOWN
        self.direct_addrs: tuple[str, ...] = ()
        self.advertised: tuple[str, ...] = ()
        self.changed = trio.Event()
        self.upgrades = 0  # relayed connections that turned direct
        self.upgraded_at: dict[str, float] = {}  # peer -> trio time its relayed connection turned direct
        self._direct_noted: set[str] = set()  # peers with a direct connection _on_connected has seen
        dial_timeout = max(1, int(cfg.relay_timeout_s))
        self._dcutr = DCUtRProtocol(self.host, read_timeout=dial_timeout, write_timeout=dial_timeout,
                                    dial_timeout=max(1, dial_timeout // 3))
        self._new_connection = trio.Event()  # set and replaced whenever a connection opens
        self._notifee = connection_notifee(self._on_connected, self._on_disconnected)

    # -- NatHooks ----------------------------------------------------------------------------------
    async def connect(self, peer_id: str, addrs: Sequence[str]) -> None:
        if self._live(peer_id):
            return
        while (pending := self._connecting.get(peer_id)) is not None:
            await pending.wait()  # one dial per peer at a time; the next caller reuses its result
            if self._live(peer_id):
                return
        done = self._connecting[peer_id] = trio.Event()
        try:
            await self._dial(peer_id, addrs)
        finally:
            del self._connecting[peer_id]
            done.set()

    def path_to(self, peer_id: str) -> str | None:
        conns = self._live(peer_id)
        if not conns:
            return None
        relayed = all(is_relayed_conn(c) for c in conns)  # new streams prefer a direct connection
        return classify_path(relayed=relayed, reached_via_relay_before=peer_id in self._via_relay).value

    # -- dialing -----------------------------------------------------------------------------------
    def _live(self, peer_id: str) -> list[INetConn]:
        from libp2p.peer.id import ID

        try:
            pid = ID.from_base58(peer_id)
        except Exception:
            return []
        return [c for c in self.host.get_network().get_connections(pid) if not c.is_closed]

    async def _dial(self, peer_id: str, addrs: Sequence[str]) -> None:
        plan = dial_plan(list(addrs), circuit_delay_s=self.cfg.circuit_delay_s)
        network = self.host.get_network()
        if not plan.circuit:
            await network.dial_peer(pid(peer_id))  # the tested direct path, addresses from the peerstore
            return
        errors: list[str] = []
        won = False
        async with trio.open_nursery() as nursery:

            async def direct() -> None:
                nonlocal won
                try:
                    await network.dial_peer(pid(peer_id))
                except Exception as exc:
                    errors.append(f"direct: {exc!r}")
                    return
                won = True
                nursery.cancel_scope.cancel()

            async def via_relays() -> None:
                nonlocal won
                await trio.sleep(plan.circuit_delay_s)
                for addr in plan.circuit:
                    if self._live(peer_id):
                        break
                    try:
                        await self.dial_circuit(addr, peer_id)
                    except DialError as exc:
                        errors.append(f"{addr}: {exc.message}")
                        continue
                    won = True
                    nursery.cancel_scope.cancel()
                    return

            if plan.direct:
                nursery.start_soon(direct)
            nursery.start_soon(via_relays)
        if not won and not self._live(peer_id):
            raise DialError(f"cannot reach {peer_id}: " + "; ".join(errors))

    async def dial_circuit(self, addr: str, peer_id: str | None = None) -> None:
        """Connect to the destination of a ``/p2p-circuit`` address through its relay."""
        try:
            relay_addr, relay_id, dest = circuit_parts(addr)
        except ConfigError as exc:
            raise DialError(exc.message) from exc
        if peer_id is not None and dest != peer_id:
            raise DialError(f"circuit address {addr} leads to {dest}, not {peer_id}")
        await open_circuit(self.host, relay_addr, relay_id, dest, timeout_s=self.cfg.relay_timeout_s)
        self._via_relay.add(dest)
        log.info("connected to %s through relay %s", dest, relay_id)
        if self.cfg.hole_punch and dest not in self._punching:
            self._punching.add(dest)
            self._nursery.start_soon(self._hole_punch, dest)

    async def _hole_punch(self, peer_id: str) -> None:
        """DCUtR on a fresh relayed connection; then wait for the peer's dial-back to land."""
        try:
            with trio.move_on_after(self.cfg.hole_punch_timeout_s):
                try:
                    ok = await self._dcutr.initiate_hole_punch(pid(peer_id))
                    log.debug("DCUtR with %s returned %s", peer_id, ok)
                except Exception as exc:  # the library logs and returns False; guard the rest
                    log.debug("DCUtR with %s failed: %r", peer_id, exc)
                while not self._direct_conns(peer_id):  # the upgrade itself is noted by _on_connected
                    await self._new_connection.wait()
            if not self._direct_conns(peer_id):
                log.info("no direct connection to %s: staying relayed", peer_id)
                return
            await trio.sleep(self.cfg.relayed_close_grace_s)
            if self._direct_conns(peer_id):
                for conn in [c for c in self._live(peer_id) if is_relayed_conn(c)]:
                    await close_conn(conn)
        finally:
            self._punching.discard(peer_id)

    def _direct_conns(self, peer_id: str) -> list[INetConn]:
        return [c for c in self._live(peer_id) if not is_relayed_conn(c)]

    # -- listening through relays --------------------------------------------------------------------
    def relay_status(self) -> list[RelayStatus]:
        now = trio.current_time()
        out = []
        for r in self._reservations.values():
            m = r.machine
            out.append(RelayStatus(
                relay=r.relay.addr, state=m.state.value, reservations=m.reservations, failures=m.failures,
                last_error=m.last_error, expires_in_s=round(r.expires_at - now, 1) if r.expires_at is not None else None,
                addrs=m.advertised,
            ))
        return out

    async def serve_listener(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Be reachable: check reachability, then hold reservations on the relays that need them.

        ``task_status.started()`` once the first advertised address list is known (a reservation
        granted, or found reachable directly, or every relay has answered once).
        """
        from libp2p.custom_types import TProtocol

        self.host.set_stream_handler(TProtocol(STOP_PROTOCOL), self._on_stop)
        if self.cfg.hole_punch:
            self.host.set_stream_handler(TProtocol(DCUTR_PROTOCOL), self._dcutr._handle_dcutr_stream)
        self.direct_addrs = tuple(a for a in self._own_transport_addrs() if not is_circuit(a))
        self.reachability = await self._check_reachability()
        log.info("reachability: %s (direct addresses: %s)", self.reachability.value, ", ".join(self.direct_addrs) or "none")
        self._update_advertised()
        if not self.relays or not should_reserve(self.reachability):
            task_status.started()
            await trio.sleep_forever()
        first = trio.Event()
        async with trio.open_nursery() as nursery:
            for relay in self.relays:
                send, receive = trio.open_memory_channel[Event](16)
                res = Reservation(relay, ReservationClient(
                    ReservationPolicy(backoff_base_s=self.cfg.backoff_base_s, backoff_max_s=self.cfg.backoff_max_s),
                    self._rng), send, receive)
                self._reservations[relay.peer_id] = res
                nursery.start_soon(run_reservation, self.host, res, self.cfg.relay_timeout_s, first, self._reservation_changed)
            with trio.move_on_after(self.cfg.relay_timeout_s * 2):
                await first.wait()
            task_status.started()

    def _own_transport_addrs(self) -> list[str]:
        me = str(self.host.get_id())
        out = []
        for a in self.host.get_addrs():
            s = str(a)
            out.append(s.removesuffix(f"/p2p/{me}"))
        return out

    async def _check_reachability(self) -> Reachability:
        dialable = [a for a in self.direct_addrs if "/ip4/0.0.0.0/" not in a and "/ip6/::/" not in a]
        if not self.cfg.check_reachability or not dialable:
            return reachability_verdict([], has_dialable_addr=False)
        results = []
        for relay in self.relays:
            results.append(await ask_dial_back(self.host, relay, dialable, timeout_s=self.cfg.relay_timeout_s))
        return reachability_verdict(results, has_dialable_addr=True)

    def _update_advertised(self) -> None:
        circuit: list[str] = []
        for r in self._reservations.values():
            circuit.extend(a for a in r.machine.advertised if a not in circuit)
        new = advertised_addrs(self.reachability, self.direct_addrs, tuple(circuit))
        if new != self.advertised:
            self.advertised = new
            self._notify()

    def _reservation_changed(self) -> None:
        self._update_advertised()
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _on_connected(self, conn: Any) -> None:
        self._new_connection.set()
        self._new_connection = trio.Event()
        if not is_relayed_conn(conn):
            try:
                peer = str(conn.muxed_conn.peer_id)
            except Exception:
                return
            self._note_direct(peer, conn)

    def _note_direct(self, peer_id: str, conn: Any) -> None:
        """``conn``, direct, just opened: if it is the first direct connection to ``peer_id`` while
        a relayed one is open, this is the moment the peer's connection turned direct
        (``upgraded_at``).

        Noted here, when the swarm registers the connection -- the moment ``path_to`` starts to say
        ``hole-punched`` -- not when DCUtR returns: py-libp2p 0.8.1 polls for the connection every
        0.2 s and then closes its stream over the relay, and until ``upgraded_at`` is set, expert
        streams opened on the relay are neither moved nor reported ``relayed``. A hole punch can
        land two direct connections at once (both dials succeed); the swarm may register both
        before notifying either, hence "first" by notification, not by the connection list.
        """
        first = peer_id not in self._direct_noted
        self._direct_noted.add(peer_id)
        if not first or not any(is_relayed_conn(c) for c in self._live(peer_id) if c is not conn):
            return  # another direct connection, or a first connection that replaced no relayed one
        self.upgrades += 1
        self.upgraded_at[peer_id] = trio.current_time()
        log.info("connection to %s upgraded from relayed to direct (hole punch)", peer_id)
        self._notify()

    def _on_disconnected(self, conn: Any) -> None:
        try:
            peer = str(conn.muxed_conn.peer_id)
        except Exception:
            return
        if not self._direct_conns(peer):
            self._direct_noted.discard(peer)  # a later direct connection is an upgrade again
        res = self._reservations.get(peer)
        if res is not None and not self._live(peer):
            try:
                res.send.send_nowait(ConnectionLost())
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass

    async def _on_stop(self, stream: INetStream) -> None:
        """An inbound circuit (STOP CONNECT) from one of our relays."""
        src = await accept_circuit(self.host, stream, self._relay_ids, timeout_s=self.cfg.relay_timeout_s)
        if src is not None:
            self._via_relay.add(src)


@asynccontextmanager
async def open_nat(
    transport: Libp2pTransport, cfg: NatConfig, *, rng: random.Random | None = None
) -> AsyncIterator[Nat]:
    """Attach relay/NAT support to ``transport`` (``transport.nat``) until the context exits."""
    if transport.nat is not None:
        raise ConfigError("this transport already has NAT support attached")
    network = transport.host.get_network()
    async with trio.open_nursery() as nursery:
        nat = Nat(transport, cfg, nursery, rng if rng is not None else random.Random())
        network.register_notifee(nat._notifee)
        transport.nat = nat
        try:
            yield nat
        finally:
            transport.nat = None
            nursery.cancel_scope.cancel()
            try:
                network.remove_notifee(nat._notifee)
            except Exception:
                pass


@asynccontextmanager
async def open_listener_host(
    *,
    key_path: Path | None,
    listen_addrs: Sequence[str],
    cfg: NatConfig,
    yamux_window_bytes: int | None = None,
) -> AsyncIterator[tuple[Libp2pTransport, Nat]]:
    """A libp2p host that is reachable somehow: directly, or through ``cfg.relays``.

    On entry the host runs, reachability is known and, if needed, the first reservation is held
    (or the relays did not answer in time: ``nat.advertised`` may then be empty and fills in
    later; wait on ``nat.changed``). An empty ``listen_addrs`` makes a relay-only host.
    """
    from swarm.p2p.libp2p import open_libp2p_transport

    if not listen_addrs and not cfg.relays:
        raise ConfigError("a host without a listen address needs at least one relay (--relay)")
    ws = any("/ws" in a for a in (*listen_addrs, *cfg.relays))
    async with open_libp2p_transport(key_path=key_path, listen_addrs=listen_addrs, websocket=ws,
                                     yamux_window_bytes=yamux_window_bytes) as transport, \
            open_nat(transport, cfg) as nat, trio.open_nursery() as nursery:
        await nursery.start(nat.serve_listener)
        try:
            yield transport, nat
        finally:
            nursery.cancel_scope.cancel()
