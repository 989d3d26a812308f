"""Relay and NAT traversal for a libp2p host (shell): circuit dialing, hole punching, reachability,
relay reservations. Decisions live in ``swarm.core.paths`` and ``swarm.core.reservation``.

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
  ``relayed_close_grace_s``. A listener only answers DCUtR (it never drives it: two NATed peers
  dialling each other "as responder" deadlock their Noise handshakes).
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
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec
import trio

from swarm.core.paths import (
    DialResult,
    Reachability,
    advertised_addrs,
    classify_path,
    dial_plan,
    is_circuit,
    reachability_verdict,
    should_reserve,
)
from swarm.core.reservation import (
    Advertise,
    ConnectionLost,
    Event,
    ReservationClient,
    ReservationPolicy,
    ReservationState,
    ReserveFailed,
    ReserveSucceeded,
    SendReserve,
    SetTimer,
    Start,
    Stop,
    TimerFired,
    Withdraw,
)
from swarm.errors import ConfigError, DialError
from swarm.p2p.libp2p import Libp2pTransport
from swarm.p2p.transport import quietly

if TYPE_CHECKING:
    from libp2p.abc import INetConn, INetStream
    from libp2p.peer.id import ID

__all__ = [
    "AUTONAT_PROTOCOL",
    "DCUTR_PROTOCOL",
    "HOP_PROTOCOL",
    "STOP_PROTOCOL",
    "Nat",
    "NatConfig",
    "RelayAddr",
    "RelayStatus",
    "is_relayed_conn",
    "open_listener_host",
    "open_nat",
    "parse_relay_addr",
]

log = logging.getLogger(__name__)

HOP_PROTOCOL: Final = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL: Final = "/libp2p/circuit/relay/0.2.0/stop"
DCUTR_PROTOCOL: Final = "/libp2p/dcutr"
AUTONAT_PROTOCOL: Final = "/libp2p/autonat/1.0.0"


class NatConfig(msgspec.Struct, frozen=True, kw_only=True):
    relays: tuple[str, ...] = ()  # listen through these (multiaddrs ending in /p2p/<relay id>)
    hole_punch: bool = True  # drive DCUtR after circuit dials / answer it as a listener
    circuit_delay_s: float = 0.3  # head start of direct addresses over circuit ones
    relay_timeout_s: float = 10.0  # one RESERVE, CONNECT or AutoNAT exchange
    hole_punch_timeout_s: float = 15.0  # how long a relayed connection may take to turn direct
    relayed_close_grace_s: float = 10.0  # keep the relayed connection this long after an upgrade
    check_reachability: bool = True  # ask the relays (AutoNAT); off = assume private
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0


@dataclass(frozen=True)
class RelayAddr:
    addr: str  # as given, ending in /p2p/<relay id>
    peer_id: str
    transport_addr: str  # without /p2p/<relay id>

    def circuit_for(self, peer_id: str) -> str:
        return f"{self.addr}/p2p-circuit/p2p/{peer_id}"


def parse_relay_addr(addr: str) -> RelayAddr:
    """``/ip4/1.2.3.4/tcp/4001/p2p/<relay id>`` -> ``RelayAddr``; ``ConfigError`` if malformed."""
    from multiaddr import Multiaddr

    try:
        maddr = Multiaddr(addr)
        peer = maddr.get_peer_id()
    except Exception as exc:
        raise ConfigError(f"bad relay address {addr!r}: {exc}") from exc
    if peer is None or is_circuit(addr):
        raise ConfigError(f"relay address {addr!r} must end in /p2p/<relay peer id> (the relay prints it at start)")
    return RelayAddr(addr=str(maddr), peer_id=str(peer), transport_addr=str(maddr.decapsulate(Multiaddr(f"/p2p/{peer}"))))


def is_relayed_conn(conn: Any) -> bool:
    """True if a swarm connection runs through a relay."""
    from libp2p.connection_types import ConnectionType

    try:
        if conn.get_connection_type() == ConnectionType.RELAYED:
            return True
        return any(is_circuit(str(a)) for a in conn.get_transport_addresses() or [])
    except Exception:
        return False


def _circuit_parts(addr: str) -> tuple[str, str, str]:
    """``<relay>/p2p/R/p2p-circuit/p2p/D`` -> (relay transport addr, relay id, destination id)."""
    relay_part, _, rest = addr.partition("/p2p-circuit")
    relay = parse_relay_addr(relay_part)
    dest = rest.removeprefix("/p2p/").split("/")[0]
    if not dest:
        raise ConfigError(f"circuit address {addr!r} does not name its destination peer")
    return relay.transport_addr, relay.peer_id, dest


@dataclass
class RelayStatus:
    relay: str
    state: str = ReservationState.IDLE.value
    reservations: int = 0
    failures: int = 0
    last_error: str = ""
    expires_in_s: float | None = None
    addrs: tuple[str, ...] = ()


class _Watcher:
    """Swarm notifee: reports closed connections to a callback (sync, non-blocking)."""

    def __init__(self, on_connected: Any, on_disconnected: Any) -> None:
        from libp2p.abc import INotifee

        outer = self

        class Notifee(INotifee):
            async def opened_stream(self, network: Any, stream: Any) -> None:
                return None

            async def closed_stream(self, network: Any, stream: Any) -> None:
                return None

            async def connected(self, network: Any, conn: Any) -> None:
                outer.on_connected(conn)

            async def disconnected(self, network: Any, conn: Any) -> None:
                outer.on_disconnected(conn)

            async def listen(self, network: Any, multiaddr: Any) -> None:
                return None

            async def listen_close(self, network: Any, multiaddr: Any) -> None:
                return None

        self.on_connected = on_connected
        self.on_disconnected = on_disconnected
        self.notifee = Notifee()


@dataclass
class _Reservation:
    relay: RelayAddr
    machine: ReservationClient
    send: trio.MemorySendChannel[Event]
    receive: trio.MemoryReceiveChannel[Event]
    expires_at: float | None = None  # trio clock


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
        self._reservations: dict[str, _Reservation] = {}
        self.reachability = Reachability.UNKNOWN
        self.direct_addrs: tuple[str, ...] = ()
        self.advertised: tuple[str, ...] = ()
        self.changed = trio.Event()
        self.upgrades = 0  # relayed connections that turned direct
        self.upgraded_at: dict[str, float] = {}  # peer -> trio time its relayed connection turned direct
        dial_timeout = max(1, int(cfg.relay_timeout_s))
        self._dcutr = DCUtRProtocol(self.host, read_timeout=dial_timeout, write_timeout=dial_timeout,
                                    dial_timeout=max(1, dial_timeout // 3))
        self._new_connection = trio.Event()  # set and replaced whenever a connection opens
        self._watcher = _Watcher(self._on_connected, self._on_disconnected)

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
            await network.dial_peer(_pid(peer_id))  # the tested direct path, addresses from the peerstore
            return
        errors: list[str] = []
        won = False
        async with trio.open_nursery() as nursery:

            async def direct() -> None:
                nonlocal won
                try:
                    await network.dial_peer(_pid(peer_id))
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
        from libp2p.connection_types import ConnectionType
        from libp2p.custom_types import TProtocol
        from libp2p.network.connection.raw_connection import RawConnection
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as PbPeerId
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
        from multiaddr import Multiaddr

        try:
            relay_addr, relay_id, dest = _circuit_parts(addr)
        except ConfigError as exc:
            raise DialError(exc.message) from exc
        if peer_id is not None and dest != peer_id:
            raise DialError(f"circuit address {addr} leads to {dest}, not {peer_id}")
        stream: INetStream | None = None
        with trio.move_on_after(self.cfg.relay_timeout_s) as scope:
            try:
                await self._ensure_relay_connection(relay_id, relay_addr)
                stream = await self.host.new_stream(_pid(relay_id), [TProtocol(HOP_PROTOCOL)])
                await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT, peer=PbPeerId(id=_pid(dest).to_bytes())))
                resp = await read_delimited_msg(stream, HopMessage)
                status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
                if resp.type != HopMessage.STATUS or status != StatusCode.OK:
                    raise DialError(f"relay {relay_id} refused the circuit to {dest}: {status.name}")
                circuit = Multiaddr(f"/p2p/{relay_id}/p2p-circuit/p2p/{dest}")
                raw = RawConnection(stream=stream, initiator=True, connection_type=ConnectionType.RELAYED, addresses=[circuit])
                conn = await self.host.upgrade_outbound_connection(raw, _pid(dest))
                conn.set_transport_info([circuit], ConnectionType.RELAYED)  # type: ignore[attr-defined]
                stream = None
            except DialError:
                raise
            except Exception as exc:
                raise DialError(f"circuit to {dest} via {relay_id} failed: {exc!r}") from exc
            finally:
                if stream is not None:
                    with trio.CancelScope(shield=True):
                        await _reset_quietly(stream)
        if scope.cancelled_caught:
            raise DialError(f"circuit to {dest} via {relay_id} took longer than {self.cfg.relay_timeout_s}s")
        self._via_relay.add(dest)
        log.info("connected to %s through relay %s", dest, relay_id)
        if self.cfg.hole_punch and dest not in self._punching:
            self._punching.add(dest)
            self._nursery.start_soon(self._hole_punch, dest)

    async def _ensure_relay_connection(self, relay_id: str, relay_addr: str) -> None:
        from multiaddr import Multiaddr

        if self._live(relay_id):
            return
        await self.host.get_network().dial_addr(Multiaddr(relay_addr), _pid(relay_id))

    async def _hole_punch(self, peer_id: str) -> None:
        """DCUtR on a fresh relayed connection; then wait for the peer's dial-back to land."""
        try:
            with trio.move_on_after(self.cfg.hole_punch_timeout_s):
                try:
                    ok = await self._dcutr.initiate_hole_punch(_pid(peer_id))
                    log.debug("DCUtR with %s returned %s", peer_id, ok)
                except Exception as exc:  # the library logs and returns False; guard the rest
                    log.debug("DCUtR with %s failed: %r", peer_id, exc)
                while not self._direct_conns(peer_id):
                    await self._new_connection.wait()
                self.upgrades += 1
                self.upgraded_at[peer_id] = trio.current_time()
                log.info("connection to %s upgraded from relayed to direct (hole punch)", peer_id)
                self._notify()
            if not self._direct_conns(peer_id):
                log.info("no direct connection to %s: staying relayed", peer_id)
                return
            await trio.sleep(self.cfg.relayed_close_grace_s)
            if self._direct_conns(peer_id):
                for conn in [c for c in self._live(peer_id) if is_relayed_conn(c)]:
                    await _close_conn(conn)
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
                res = _Reservation(relay, ReservationClient(
                    ReservationPolicy(backoff_base_s=self.cfg.backoff_base_s, backoff_max_s=self.cfg.backoff_max_s),
                    self._rng), send, receive)
                self._reservations[relay.peer_id] = res
                nursery.start_soon(self._run_reservation, res, first)
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
            results.append(await self._autonat(relay, dialable))
        return reachability_verdict(results, has_dialable_addr=True)

    async def _autonat(self, relay: RelayAddr, addrs: list[str]) -> DialResult:
        """Ask ``relay`` to dial us back (AutoNAT v1)."""
        from libp2p.host.autonat.autonat import AutoNATService
        from libp2p.host.autonat.pb.autonat_pb2 import Message
        from multiaddr import Multiaddr

        with trio.move_on_after(self.cfg.relay_timeout_s):
            try:
                await self._ensure_relay_connection(relay.peer_id, relay.transport_addr)
                client = AutoNATService(self.host, serve=False)
                status, addr = await client.query_server(
                    _pid(relay.peer_id), [Multiaddr(a).to_bytes() for a in addrs], timeout=self.cfg.relay_timeout_s)
            except Exception as exc:
                log.info("reachability check via %s failed: %r", relay.addr, exc)
                return DialResult.ERROR
            result = {int(Message.OK): DialResult.OK, int(Message.E_DIAL_REFUSED): DialResult.REFUSED,
                      int(Message.E_DIAL_ERROR): DialResult.FAILED}.get(status, DialResult.ERROR)
            log.info("relay %s dialled us back: %s%s", relay.peer_id, result.value,
                     f" at {Multiaddr(addr)}" if addr else "")
            return result
        return DialResult.ERROR

    async def _run_reservation(self, res: _Reservation, first: trio.Event) -> None:
        machine = res.machine
        pending: list[Event] = [Start()]
        deadline = float("inf")
        try:
            while True:
                if pending:
                    event = pending.pop(0)
                else:
                    event = TimerFired()
                    with trio.move_on_at(deadline):
                        event = await res.receive.receive()
                    if isinstance(event, TimerFired):
                        deadline = float("inf")
                now = trio.current_time()
                for effect in machine.handle(event, now):
                    match effect:
                        case SendReserve(refresh=refresh):
                            pending.append(await self._reserve(res, refresh=refresh))
                        case SetTimer(at=at):
                            deadline = at
                        case Advertise(addrs=addrs):
                            log.info("reserved on relay %s: reachable at %s", res.relay.peer_id, ", ".join(addrs))
                            self._update_advertised()
                            first.set()
                        case Withdraw(reason=reason):
                            res.expires_at = None
                            log.warning("relay %s: withdrawing its circuit address (%s)", res.relay.peer_id, reason)
                            self._update_advertised()
                self._notify()
        finally:
            machine.handle(Stop(), trio.current_time())
            self._update_advertised()

    async def _reserve(self, res: _Reservation, *, refresh: bool) -> Event:
        from libp2p.custom_types import TProtocol
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
        from multiaddr import Multiaddr

        relay = res.relay
        stream = None
        with trio.move_on_after(self.cfg.relay_timeout_s):
            try:
                await self._ensure_relay_connection(relay.peer_id, relay.transport_addr)
                stream = await self.host.new_stream(_pid(relay.peer_id), [TProtocol(HOP_PROTOCOL)])
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                resp = await read_delimited_msg(stream, HopMessage)
            except Exception as exc:
                return ReserveFailed(f"{'refresh' if refresh else 'reservation'} failed: {exc!r}")
            finally:
                if stream is not None:
                    with trio.CancelScope(shield=True):
                        await _close_stream_quietly(stream)
            status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
            if resp.type != HopMessage.STATUS or status != StatusCode.OK or not resp.HasField("reservation"):
                return ReserveFailed(f"relay refused the reservation: {status.name}")
            me = str(self.host.get_id())
            addrs = [relay.circuit_for(me)]
            for raw in resp.reservation.addrs:  # the relay's own public addresses, if it announces any
                try:
                    a = str(Multiaddr(raw))
                except Exception:
                    continue
                if f"/p2p/{relay.peer_id}" not in a:
                    a += f"/p2p/{relay.peer_id}"
                c = f"{a}/p2p-circuit/p2p/{me}"
                if c not in addrs and "/ip4/0.0.0.0/" not in c:
                    addrs.append(c)
            res.expires_at = trio.current_time() + max(0.0, resp.reservation.expire - time.time())
            return ReserveSucceeded(res.expires_at, tuple(addrs))
        return ReserveFailed(f"relay did not answer within {self.cfg.relay_timeout_s}s")

    def _update_advertised(self) -> None:
        circuit: list[str] = []
        for r in self._reservations.values():
            circuit.extend(a for a in r.machine.advertised if a not in circuit)
        new = advertised_addrs(self.reachability, self.direct_addrs, tuple(circuit))
        if new != self.advertised:
            self.advertised = new
            self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _on_connected(self, conn: Any) -> None:
        self._new_connection.set()
        self._new_connection = trio.Event()

    def _on_disconnected(self, conn: Any) -> None:
        try:
            peer = str(conn.muxed_conn.peer_id)
        except Exception:
            return
        res = self._reservations.get(peer)
        if res is not None and not self._live(peer):
            try:
                res.send.send_nowait(ConnectionLost())
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass

    async def _on_stop(self, stream: INetStream) -> None:
        """An inbound circuit (STOP CONNECT) from one of our relays."""
        from libp2p.connection_types import ConnectionType
        from libp2p.network.connection.raw_connection import RawConnection
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import StopMessage
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
        from multiaddr import Multiaddr

        relay = str(stream.muxed_conn.peer_id)
        try:
            with trio.fail_after(self.cfg.relay_timeout_s):
                msg = await read_delimited_msg(stream, StopMessage)
                if relay not in self._relay_ids:
                    await write_delimited_msg(stream, StopMessage(
                        type=StopMessage.STATUS, status=to_proto_status(StatusCode.PERMISSION_DENIED)))
                    await _close_stream_quietly(stream)
                    log.warning("refused a circuit from %s: not one of our relays", relay)
                    return
                if msg.type != StopMessage.CONNECT or not msg.peer.id:
                    await write_delimited_msg(stream, StopMessage(
                        type=StopMessage.STATUS, status=to_proto_status(StatusCode.MALFORMED_MESSAGE)))
                    await _close_stream_quietly(stream)
                    return
                src = ID(msg.peer.id)
                await write_delimited_msg(stream, StopMessage(type=StopMessage.STATUS, status=to_proto_status(StatusCode.OK)))
                circuit = Multiaddr(f"/p2p/{relay}/p2p-circuit/p2p/{src}")
                raw = RawConnection(stream=stream, initiator=False, connection_type=ConnectionType.RELAYED, addresses=[circuit])
                muxed = await self.host.upgrade_inbound_connection(raw, circuit)
            for conn in self.host.get_network().get_connections(src):
                if getattr(conn, "muxed_conn", None) is muxed:
                    conn.set_transport_info([circuit], ConnectionType.RELAYED)  # type: ignore[attr-defined]
            self._via_relay.add(str(src))
            log.info("inbound circuit from %s through relay %s", src, relay)
        except Exception as exc:
            log.info("inbound circuit through %s failed: %r", relay, exc)
            with trio.CancelScope(shield=True):
                await _reset_quietly(stream)


def _pid(peer_id: str) -> ID:
    from libp2p.peer.id import ID

    try:
        return ID.from_base58(peer_id)
    except Exception as exc:
        raise DialError(f"bad peer id {peer_id!r}: {exc}") from exc


async def _close_stream_quietly(stream: Any) -> None:
    await quietly(stream.close, "closing a relay stream")


async def _reset_quietly(stream: Any) -> None:
    await quietly(stream.reset, "resetting a relay stream")


async def _close_conn(conn: Any) -> None:
    await quietly(conn.close, "closing a relayed connection", timeout_s=5, shield=True)


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
        network.register_notifee(nat._watcher.notifee)
        transport.nat = nat
        try:
            yield nat
        finally:
            transport.nat = None
            nursery.cancel_scope.cancel()
            try:
                network.remove_notifee(nat._watcher.notifee)
            except Exception:
                pass


@asynccontextmanager
async def open_listener_host(
    *,
    key_path: Path | None,
    listen_addrs: Sequence[str],
    cfg: NatConfig,
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
    async with open_libp2p_transport(key_path=key_path, listen_addrs=listen_addrs, websocket=ws) as transport, \
            open_nat(transport, cfg) as nat, trio.open_nursery() as nursery:
        await nursery.start(nat.serve_listener)
        try:
            yield transport, nat
        finally:
            nursery.cancel_scope.cancel()
