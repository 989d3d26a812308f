"""Regression tests for the py-libp2p 0.8.1 relay/NAT problems worked around in ``swarm.p2p.nat`` and
``relay.service`` (workarounds (e)-(h) in ``swarm/p2p/transport.py``), each with a canary that shows
the library's own behaviour: when a canary fails, the library fixed the problem and the
workaround can be reconsidered.

(e) host.connect() skips /p2p-circuit addresses;
(f) the end of one circuit closes another circuit to the same peer; RelayLimits(data=0) kills a
    circuit at its first byte;
(g) a dial-only node with the default RelayConfig takes a reservation slot on every relay it dials
    through, and a reservation outlives its holder's connection;
(h) the AutoNAT server "dials back" over the requester's own connection, so it reports every
    address reachable;
(i) the auto-connector re-dials peerstore peers after a disconnect (a NATed volunteer dialled its
    coordinator directly even with hole punching off).
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig as LibRelayConfig
from libp2p.relay.circuit_v2.config import RelayRole
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits as LibRelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from relay.service import RelayConfig, RelayService, open_relay
from swarm.errors import TransportError
from swarm.p2p.libp2p import Libp2pTransport, connection_notifee, open_libp2p_transport
from swarm.p2p.nat import NatConfig, open_listener_host, open_nat
from swarm.p2p.transport import Stream

ECHO = "/test/echo/1"
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


async def echo(stream: Stream) -> None:
    while data := await stream.read(1 << 16):
        await stream.write(data)


async def roundtrip(s: Stream, data: bytes) -> bytes | None:
    """Echo ``data``; None if the stream is dead (reset, closed or broken)."""
    try:
        await s.write(data)
        got = b""
        with trio.fail_after(5):
            while len(got) < len(data):
                chunk = await s.read(len(data) - len(got))
                if not chunk:
                    return None
                got += chunk
        return got
    except TransportError:
        return None


@asynccontextmanager
async def our_relay(**kw: Any) -> AsyncIterator[tuple[str, RelayService]]:
    async with open_relay(RelayConfig(listen=LOOPBACK, port=0, **kw)) as service:
        yield service.announce_addrs()[0], service


@asynccontextmanager
async def library_relay(limits: LibRelayLimits) -> AsyncIterator[tuple[str, CircuitV2Protocol]]:
    """py-libp2p's own hop service (CircuitV2Protocol) on one of our hosts."""
    async with open_libp2p_transport(key_path=None) as t:
        proto = CircuitV2Protocol(t.host, limits=limits, allow_hop=True)
        async with background_trio_service(proto):
            yield t.listen_addrs[0], proto


class EchoEnds:
    """Counts the volunteer's echo streams that ended (the far end of a circuit the relay tore down)."""

    def __init__(self) -> None:
        self.n = 0
        self._changed = trio.Event()

    async def echo(self, stream: Stream) -> None:
        try:
            await echo(stream)
        except TransportError:
            pass
        finally:
            self.n += 1
            self._changed.set()
            self._changed = trio.Event()

    async def wait_for(self, n: int) -> None:
        while self.n < n:
            await self._changed.wait()


@asynccontextmanager
async def relayed_volunteer(relay_addr: str, ends: EchoEnds | None = None) -> AsyncIterator[tuple[str, str]]:
    """A volunteer reachable only through ``relay_addr``, serving ECHO: (peer id, circuit address)."""
    cfg = NatConfig(relays=(relay_addr,), hole_punch=False)
    async with open_listener_host(key_path=None, listen_addrs=(), cfg=cfg) as (t, nat):
        t.set_stream_handler(ECHO, ends.echo if ends is not None else echo)
        assert nat.advertised, "the relay gave no reservation"
        yield t.peer_id, nat.advertised[0]


@asynccontextmanager
async def dialer() -> AsyncIterator[Libp2pTransport]:
    async with open_libp2p_transport(key_path=None) as t, open_nat(t, NatConfig(hole_punch=False)):
        yield t


BIG = LibRelayLimits(duration=3600, data=1 << 40, max_circuit_conns=8, max_reservations=8)


async def two_circuits_then_end_the_first(relay_addr: str, torn_down: int) -> bytes | None:
    """Two circuits to one volunteer; the first one's dialer leaves; once ``torn_down`` of the
    volunteer's echo streams have ended (ours: the first circuit's; the library's: both, its bug --
    a fixed library never ends the second, and the wait fails), is the second circuit still there?"""
    ends = EchoEnds()
    async with relayed_volunteer(relay_addr, ends) as (peer, addr), dialer() as c2:
        async with dialer() as c1:
            s1 = await c1.open_stream(peer, [addr], ECHO)
            s2 = await c2.open_stream(peer, [addr], ECHO)
            assert await roundtrip(s1, b"one") == b"one"
            assert await roundtrip(s2, b"two") == b"two"
            await c1.disconnect(peer)  # the first circuit ends
        with trio.fail_after(10):
            await ends.wait_for(torn_down)  # the relay tore circuits down: the volunteer's ends of them are over
        return await roundtrip(s2, b"still there?")


async def test_f_the_end_of_one_circuit_leaves_the_others_alone() -> None:
    async with our_relay() as (addr, service):
        assert await two_circuits_then_end_the_first(addr, torn_down=1) == b"still there?"
        assert service.ledger.stats().circuits_opened_total == 2


async def test_f_canary_the_library_hop_closes_the_other_circuit_to_the_same_peer() -> None:
    async with library_relay(BIG) as (addr, _):
        assert await two_circuits_then_end_the_first(addr, torn_down=2) is None


async def big_echo_through(relay_addr: str) -> bytes | None:
    """Echo 1 MiB through a circuit; None if the circuit died (during the handshake or the echo)."""
    async with relayed_volunteer(relay_addr) as (peer, addr), dialer() as c:
        try:
            s = await c.open_stream(peer, [addr], ECHO)
        except TransportError:
            return None
        return await roundtrip(s, bytes(range(256)) * 4096)


async def test_f_unlimited_circuits_carry_data() -> None:
    async with our_relay(circuit_max_bytes=0, circuit_max_duration_s=0) as (addr, service):
        assert await big_echo_through(addr) == bytes(range(256)) * 4096
        assert service.ledger.stats().bytes_relayed_total >= 2 << 20


async def test_f_canary_library_data_0_kills_the_circuit() -> None:
    """``data=0`` reads as "unlimited" in the spec; py-libp2p 0.8.1 cuts the circuit at its first bytes."""
    limits = LibRelayLimits(duration=3600, data=0, max_circuit_conns=8, max_reservations=8)
    async with library_relay(limits) as (addr, _):
        assert await big_echo_through(addr) is None


async def library_dial(relay_addr: str, roles: RelayRole | None) -> int:
    """Dial a relayed volunteer with py-libp2p's CircuitV2Transport; the relay's reservation count after."""
    async with our_relay() as (addr, service), relayed_volunteer(addr) as (peer, circuit):
        assert service.ledger.stats().reservations == 1
        async with open_libp2p_transport(key_path=None) as c:
            cfg = LibRelayConfig() if roles is None else LibRelayConfig(roles=roles)
            transport = CircuitV2Transport(c.host, CircuitV2Protocol(c.host, allow_hop=False), cfg)
            await transport.dial(Multiaddr(circuit))
            n = service.ledger.stats().reservations
        # the dialer is gone: whatever it reserved is freed at once (within seconds, even on a loaded
        # machine), not after the reservation TTL of an hour
        with trio.fail_after(10):
            await service.wait_reservations(lambda n: n == 1)
        assert service.ledger.stats().reservations == 1
        return n


async def test_g_canary_default_library_dialer_takes_a_reservation_slot() -> None:
    assert await library_dial("", roles=None) == 2


async def test_g_dialing_takes_no_reservation() -> None:
    assert await library_dial("", roles=RelayRole.STOP) == 1  # the library with the STOP role only
    async with our_relay() as (addr, service), relayed_volunteer(addr) as (peer, circuit):
        for _ in range(3):
            async with dialer() as c:
                s = await c.open_stream(peer, [circuit], ECHO)
                assert await roundtrip(s, b"hi") == b"hi"
                assert service.ledger.stats().reservations == 1  # only the volunteer's


async def test_e_canary_host_connect_skips_circuit_addresses() -> None:
    async with our_relay() as (addr, _), relayed_volunteer(addr) as (peer, circuit):
        async with open_libp2p_transport(key_path=None) as c:
            with pytest.raises(Exception, match="relay-only|unusable|No supported transport"):
                await c.host.connect(PeerInfo(ID.from_base58(peer), [Multiaddr(circuit)]))


async def test_e_open_stream_dials_circuit_addresses() -> None:
    async with our_relay() as (addr, _), relayed_volunteer(addr) as (peer, circuit), dialer() as c:
        s = await c.open_stream(peer, [circuit], ECHO)
        assert await roundtrip(s, b"through the relay") == b"through the relay"
        assert c.path_to(peer) == "relayed"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def autonat_verdict(server: Libp2pTransport, client: Libp2pTransport, addr: str) -> int:
    await client.host.connect(PeerInfo(server.host.get_id(), [Multiaddr(server.listen_addrs[0])]))
    status, _ = await AutoNATService(client.host, serve=False).query_server(
        server.host.get_id(), [Multiaddr(addr).to_bytes()], timeout=10)
    return status


async def test_h_canary_library_autonat_says_reachable_where_nothing_listens() -> None:
    async with open_libp2p_transport(key_path=None) as server, open_libp2p_transport(key_path=None) as client:
        AutoNATService(server.host, serve=True)
        nowhere = f"/ip4/127.0.0.1/tcp/{closed_port()}"
        assert await autonat_verdict(server, client, nowhere) == Message.OK


async def test_h_autonat_dials_back_on_a_fresh_connection() -> None:
    async with our_relay() as (_, service), open_libp2p_transport(key_path=None) as client:
        nowhere = f"/ip4/127.0.0.1/tcp/{closed_port()}"
        assert await autonat_verdict(service.transport, client, nowhere) == Message.E_DIAL_ERROR
        there = client.listen_addrs[0].split("/p2p/")[0]
        assert await autonat_verdict(service.transport, client, there) == Message.OK
        assert dict(service.dialback_results) == {"E_DIAL_ERROR": 1, "OK": 1}


async def redialled_after_disconnect(restore_auto_connector: bool) -> bool:
    """B dials A, then drops the connection: does B's auto-connector dial A again by itself?
    (The library runs it every 30 s and skips a peer for 60 s after its disconnect; here the
    cycle is run at once with that back-off cleared.)"""
    from libp2p.network.auto_connector import AutoConnector

    async with open_libp2p_transport(key_path=None) as a, open_libp2p_transport(key_path=None) as b:
        a.set_stream_handler(ECHO, echo)
        network = b.host.get_network()
        auto = network.auto_connector  # type: ignore[attr-defined]
        if restore_auto_connector:
            auto.maybe_connect = AutoConnector.maybe_connect.__get__(auto)
        gone = trio.Event()
        network.register_notifee(connection_notifee(lambda conn: None, lambda conn: gone.set()))
        s = await b.open_stream(a.peer_id, a.listen_addrs, ECHO)
        assert await roundtrip(s, b"x") == b"x"
        # a disconnect also schedules a cycle in the background (at most one per cooldown): hold it off, so
        # the one cycle that runs is ours, awaited below
        network._last_auto_connect_trigger = time.monotonic()  # type: ignore[attr-defined]
        await b.disconnect(a.peer_id)
        with trio.fail_after(10):
            await gone.wait()
        assert not [c for c in network.get_connections(ID.from_base58(a.peer_id)) if not c.is_closed]
        auto._recent_disconnects.clear()
        await auto.maybe_connect()  # runs one cycle and returns once the dials it started are over
        return bool([c for c in network.get_connections(ID.from_base58(a.peer_id)) if not c.is_closed])


async def test_i_no_redial_behind_the_callers_back() -> None:
    assert not await redialled_after_disconnect(restore_auto_connector=False)


async def test_i_canary_the_auto_connector_redials_peerstore_peers() -> None:
    assert await redialled_after_disconnect(restore_auto_connector=True)
