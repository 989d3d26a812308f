"""``moe-swarm relay``: a circuit relay v2 hop service sized for expert traffic (shell).

Speaks the standard protocols, so any libp2p circuit-relay-v2 client can use it and our clients
can use any standard relay:
- ``/libp2p/circuit/relay/0.2.0/hop``: RESERVE and CONNECT (then ``.../stop`` to the destination);
- ``/libp2p/autonat/1.0.0``: dial-back checks, so a volunteer learns whether it is reachable.
Admission and accounting are decided by ``relay.core.ledger``; this module moves bytes.

Rules:
- Defaults suit long-lived, high-volume expert circuits: no per-circuit byte or duration cap
  (the limit field is omitted, which the spec defines as "unlimited"), 128 reservations,
  16 circuits per peer, reservations valid 1 h and refreshed by their holders.
- Each circuit is two tasks copying bytes between two streams, in its own cancel scope; its end
  (EOF is forwarded as a half-close, an error as a reset) touches no other circuit.
- A reservation ends when its holder's last connection to the relay closes.
- AutoNAT dial-backs use a fresh TCP connection and a Noise handshake that must prove the
  requester's peer id, only to addresses on the IP the request came from, at most
  ``max_dialbacks`` at a time; requests over relayed connections are refused.
- ``/metrics`` (Prometheus) and ``/health`` (JSON) on ``--host``/``--port``.
- Shutdown (SIGINT/SIGTERM): refuse new reservations and circuits, end live circuits with a
  half-close (a reset after ``drain_timeout_s``), then close every connection and listener.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from relay.core.ledger import Admitted, Direction, Refusal, Refused, RelayLedger, RelayLimits
from swarm.errors import ConfigError
from swarm.p2p.libp2p import Libp2pTransport, open_libp2p_transport
from swarm.p2p.nat import AUTONAT_PROTOCOL, HOP_PROTOCOL, STOP_PROTOCOL, is_relayed_conn
from swarm.p2p.transport import quietly

if TYPE_CHECKING:
    from libp2p.abc import INetStream

__all__ = ["RelayConfig", "RelayService", "open_relay", "serve_relay"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 16


class RelayConfig(msgspec.Struct, frozen=True, kw_only=True):
    listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/4001",)
    announce: tuple[str, ...] = ()  # public addresses handed to volunteers (default: the listen ones)
    host: str = "127.0.0.1"  # /metrics and /health
    port: int = 9090
    data_dir: str | None = None  # identity key; None = a fresh identity per run
    max_reservations: int = 128
    max_circuits: int = 1024
    max_circuits_per_peer: int = 16
    reservation_ttl_s: int = 3600
    circuit_max_bytes: int = 0  # per direction; 0 = unlimited
    circuit_max_duration_s: int = 0  # 0 = unlimited
    timeout_s: float = 10.0  # one protocol exchange (reading a request, reaching a destination)
    max_dialbacks: int = 8
    drain_timeout_s: float = 1.0

    def limits(self) -> RelayLimits:
        try:
            return RelayLimits(
                max_reservations=self.max_reservations, max_circuits=self.max_circuits,
                max_circuits_per_peer=self.max_circuits_per_peer, reservation_ttl_s=self.reservation_ttl_s,
                circuit_max_bytes=self.circuit_max_bytes, circuit_max_duration_s=self.circuit_max_duration_s,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


_STATUS_FOR_REFUSAL = {
    Refusal.RESERVATION_LIMIT: "RESERVATION_REFUSED",
    Refusal.DRAINING: "RESERVATION_REFUSED",
    Refusal.NO_RESERVATION: "NO_RESERVATION",
    Refusal.CIRCUIT_LIMIT: "RESOURCE_LIMIT_EXCEEDED",
    Refusal.PEER_CIRCUIT_LIMIT: "RESOURCE_LIMIT_EXCEEDED",
    Refusal.SELF_CIRCUIT: "PERMISSION_DENIED",
}


class RelayService:
    """The hop and AutoNAT handlers of one relay host."""

    def __init__(self, transport: Libp2pTransport, cfg: RelayConfig) -> None:
        self.transport = transport
        self.host = transport.host
        self.cfg = cfg
        self.ledger = RelayLedger(cfg.limits())
        self._scopes: dict[int, trio.CancelScope] = {}
        self._circuit_ended = trio.Event()  # set and replaced whenever a circuit ends
        self._dialbacks = trio.CapacityLimiter(cfg.max_dialbacks)
        self.dialback_results: Counter[str] = Counter()
        self.metrics_url: str | None = None

    # -- wiring --------------------------------------------------------------------------------------
    def install(self) -> None:
        from libp2p.custom_types import TProtocol

        self.host.set_stream_handler(TProtocol(HOP_PROTOCOL), self._on_hop)
        self.host.set_stream_handler(TProtocol(AUTONAT_PROTOCOL), self._on_autonat)
        self.host.get_network().register_notifee(_DisconnectNotifee(self))

    def announce_addrs(self) -> list[str]:
        """``--announce``, else the listen addresses with wildcards expanded to this host's
        interfaces (loopback last): what volunteers are given, each ending in ``/p2p/<relay id>``."""
        from libp2p.utils.address_validation import expand_wildcard_address
        from multiaddr import Multiaddr

        me = str(self.host.get_id())
        if self.cfg.announce:
            addrs = list(self.cfg.announce)
        else:
            addrs = []
            for a in self.transport.listen_addrs:
                bare = a.removesuffix(f"/p2p/{me}")
                if "/ip4/0.0.0.0/" in bare or "/ip6/::/" in bare:
                    addrs.extend(str(x) for x in expand_wildcard_address(Multiaddr(bare)))
                else:
                    addrs.append(bare)
            addrs.sort(key=lambda x: x.startswith(("/ip4/127.", "/ip6/::1/")))
        return list(dict.fromkeys(a if a.endswith(f"/p2p/{me}") else f"{a}/p2p/{me}" for a in addrs))

    def peer_disconnected(self, peer: str) -> None:
        live = [c for c in self.host.get_network().get_connections(_id(peer)) if not c.is_closed]
        if not live and self.ledger.peer_disconnected(peer):
            log.info("reservation of %s ended: disconnected", peer)

    async def drain(self) -> None:
        """Refuse everything new, end live circuits gracefully, then reset what is left."""
        self.ledger.drain()
        for scope in list(self._scopes.values()):
            scope.cancel()  # each circuit half-closes both ends (see _splice)
        with trio.move_on_after(self.cfg.drain_timeout_s + 1):
            while self._scopes:
                await self._circuit_ended.wait()

    # -- hop -----------------------------------------------------------------------------------------
    async def _on_hop(self, stream: INetStream) -> None:
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.utils import read_delimited_msg

        peer = str(stream.muxed_conn.peer_id)
        try:
            if self._over_relay(stream):
                await self._status(stream, "PERMISSION_DENIED")
                return
            with trio.fail_after(self.cfg.timeout_s):
                msg = await read_delimited_msg(stream, HopMessage)
            if msg.type == HopMessage.RESERVE:
                await self._reserve(stream, peer)
            elif msg.type == HopMessage.CONNECT:
                await self._connect(stream, peer, msg)
            else:
                await self._status(stream, "UNEXPECTED_MESSAGE")
        except Exception as exc:  # a peer's bad input or a dead stream: this request only
            log.info("hop request from %s failed: %r", peer, exc)
            await _reset(stream)

    def _over_relay(self, stream: INetStream) -> bool:
        for conn in self.host.get_network().get_connections(stream.muxed_conn.peer_id):
            if getattr(conn, "muxed_conn", None) is stream.muxed_conn:
                return is_relayed_conn(conn)
        return False

    async def _reserve(self, stream: INetStream, peer: str) -> None:
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, Reservation
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
        from libp2p.relay.circuit_v2.utils import write_delimited_msg
        from multiaddr import Multiaddr

        now = trio.current_time()
        verdict = self.ledger.reserve(peer, now)
        if isinstance(verdict, Refused):
            log.info("reservation of %s refused: %s", peer, verdict.reason.value)
            await self._status(stream, _STATUS_FOR_REFUSAL[verdict.reason])
            return
        expire = int(time.time() + (verdict.expires_at - now))
        rsvp = Reservation(expire=expire, addrs=[Multiaddr(a).to_bytes() for a in self.announce_addrs()],
                           voucher=self._voucher(peer, expire))
        msg = HopMessage(type=HopMessage.STATUS, status=to_proto_status(StatusCode.OK), reservation=rsvp)
        self._add_limit(msg)
        await write_delimited_msg(stream, msg)
        await _close(stream)
        log.info("%s %s (%d/%d)", "refreshed reservation of" if verdict.renewed else "reserved a slot for",
                 peer, self.ledger.stats().reservations, self.cfg.max_reservations)

    async def _connect(self, stream: INetStream, src: str, msg: Any) -> None:
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, StopMessage
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as PbPeerId
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
        from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

        try:
            dst_id = ID(msg.peer.id)
        except Exception:
            await self._status(stream, "MALFORMED_MESSAGE")
            return
        dst = str(dst_id)
        if not [c for c in self.host.get_network().get_connections(dst_id) if not c.is_closed]:
            self.ledger.peer_disconnected(dst)
        adm = self.ledger.open_circuit(src, dst, trio.current_time())
        if isinstance(adm, Refused):
            log.info("circuit %s -> %s refused: %s", src, dst, adm.reason.value)
            await self._status(stream, _STATUS_FOR_REFUSAL[adm.reason])
            return
        dst_stream: INetStream | None = None
        try:
            with trio.fail_after(self.cfg.timeout_s):
                dst_stream = await self.host.new_stream(dst_id, [TProtocol(STOP_PROTOCOL)])
                stop = StopMessage(type=StopMessage.CONNECT, peer=PbPeerId(id=ID.from_base58(src).to_bytes()))
                self._add_limit(stop)
                await write_delimited_msg(dst_stream, stop)
                resp = await read_delimited_msg(dst_stream, StopMessage)
            if resp.type != StopMessage.STATUS or int(resp.status) != StatusCode.OK:
                raise ConnectionError(f"destination answered {StatusCode(resp.status).name}")
        except Exception as exc:
            log.info("circuit %s -> %s: destination unreachable: %r", src, dst, exc)
            self.ledger.close_circuit(adm.circuit_id)
            if dst_stream is not None:
                await _reset(dst_stream)
            await self._status(stream, "CONNECTION_FAILED")
            return
        ok = HopMessage(type=HopMessage.STATUS, status=to_proto_status(StatusCode.OK))
        self._add_limit(ok)
        try:
            await write_delimited_msg(stream, ok)
            log.info("circuit %d open: %s -> %s", adm.circuit_id, src, dst)
            await self._splice(adm, stream, dst_stream)
        finally:
            self.ledger.close_circuit(adm.circuit_id)
            log.info("circuit %d closed: %s -> %s", adm.circuit_id, src, dst)

    async def _splice(self, adm: Admitted, a: INetStream, b: INetStream) -> None:
        """Copy bytes both ways until both sides are done; this circuit only."""
        broken = False

        async def pipe(src: INetStream, dst: INetStream, direction: Direction) -> None:
            nonlocal broken
            from libp2p.network.stream.exceptions import StreamEOF

            while True:
                try:
                    data = await src.read(_CHUNK)
                except StreamEOF:
                    data = b""
                except Exception:
                    broken = True
                    scope.cancel()
                    return
                if not data:
                    try:
                        await cast(Any, dst).close_write()  # forward the half-close
                    except Exception:
                        broken = True
                        scope.cancel()
                    return
                if not self.ledger.record_bytes(adm.circuit_id, direction, len(data)):
                    log.info("circuit %d reached its data cap", adm.circuit_id)
                    broken = True
                    scope.cancel()
                    return
                try:
                    await dst.write(data)
                except Exception:
                    broken = True
                    scope.cancel()
                    return

        with trio.CancelScope() as scope:
            if adm.deadline is not None:
                scope.deadline = adm.deadline
            self._scopes[adm.circuit_id] = scope
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pipe, a, b, Direction.TO_DST)
                    nursery.start_soon(pipe, b, a, Direction.TO_SRC)
            finally:
                del self._scopes[adm.circuit_id]
                self._circuit_ended.set()
                self._circuit_ended = trio.Event()
        with trio.CancelScope(shield=True):
            if broken or (scope.cancelled_caught and not self.ledger.draining):
                await _reset(a)  # an error, a cap or the duration limit: both ends see a reset
                await _reset(b)
            else:  # both sides finished, or the relay is shutting down: both ends see end of stream
                with trio.move_on_after(self.cfg.drain_timeout_s):
                    await _close(a)
                    await _close(b)

    async def _status(self, stream: INetStream, name: str) -> None:
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
        from libp2p.relay.circuit_v2.utils import write_delimited_msg

        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.STATUS, status=to_proto_status(StatusCode[name])))
        except Exception as exc:
            log.debug("sending %s: %r", name, exc)
        await _close(stream)

    def _add_limit(self, msg: Any) -> None:
        """Spec: the limit field is omitted when the relay applies none (0 would also mean none)."""
        limits = self.ledger.limits
        if limits.circuit_max_bytes or limits.circuit_max_duration_s:
            msg.limit.duration = limits.circuit_max_duration_s
            msg.limit.data = limits.circuit_max_bytes

    def _voucher(self, peer: str, expire: int) -> bytes:
        """The signed reservation voucher (an Envelope, domain ``libp2p-relay-rsvp``)."""
        from libp2p.peer.envelope import Envelope, make_unsigned
        from libp2p.relay.circuit_v2.pb.circuit_pb2 import Voucher
        from libp2p.relay.circuit_v2.resources import RELAY_RSVP_DOMAIN, VOUCHER_PAYLOAD_TYPE

        payload = Voucher(relay=self.host.get_id().to_bytes(), peer=_id(peer).to_bytes(), expiration=expire).SerializeToString()
        key = self.host.get_private_key()
        signature = key.sign(make_unsigned(RELAY_RSVP_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload))
        return bytes(Envelope(public_key=key.get_public_key(), payload_type=VOUCHER_PAYLOAD_TYPE,
                              raw_payload=payload, signature=signature).marshal_envelope())

    # -- AutoNAT ---------------------------------------------------------------------------------------
    async def _on_autonat(self, stream: INetStream) -> None:
        from libp2p.host.autonat.pb.autonat_pb2 import Message
        from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(self.cfg.timeout_s):
                request = Message()
                request.ParseFromString(await read_varint_prefixed_bytes_limited(stream, 64 * 1024))
            response = Message(type=Message.DIAL_RESPONSE)
            status, text, addr = await self._dialback(stream, request)
            response.dialResponse.status = status
            response.dialResponse.statusText = text
            if addr is not None:
                response.dialResponse.addr = addr
            self.dialback_results[Message.ResponseStatus.Name(status)] += 1
            await stream.write(encode_varint_prefixed(response.SerializeToString()))
            await _close(stream)
        except Exception as exc:
            log.info("AutoNAT request from %s failed: %r", peer, exc)
            await _reset(stream)

    async def _dialback(self, stream: INetStream, request: Any) -> tuple[Any, str, bytes | None]:
        from libp2p.host.autonat.pb.autonat_pb2 import Message
        from libp2p.peer.id import ID
        from multiaddr import Multiaddr

        if request.type != Message.DIAL:
            return Message.E_BAD_REQUEST, "expected a DIAL", None
        if self._over_relay(stream):
            return Message.E_DIAL_REFUSED, "dial-back requests over relayed connections are refused", None
        peer = stream.muxed_conn.peer_id
        if request.dial.peer.id and ID(request.dial.peer.id) != peer:
            return Message.E_BAD_REQUEST, "the request names another peer", None
        remote = stream.get_remote_address()
        observed = _norm_ip(remote[0]) if remote else None
        candidates = []
        for raw in list(request.dial.peer.addrs)[:16]:
            try:
                maddr = Multiaddr(bytes(raw))
            except Exception:
                continue
            ip = _ip_of(maddr)
            if ip is not None and ip == observed and "tcp" in {p.name for p in maddr.protocols()} and "/p2p-circuit" not in str(maddr):
                candidates.append(maddr)
        if not candidates:
            return Message.E_DIAL_REFUSED, f"no address on the IP this request came from ({observed})", None
        async with self._dialbacks:
            for maddr in candidates[:4]:
                if await self._dial_fresh(peer, maddr):
                    return Message.OK, "", maddr.to_bytes()
        return Message.E_DIAL_ERROR, "dial-back failed", None

    async def _dial_fresh(self, peer: Any, maddr: Any) -> bool:
        """A new TCP connection and a Noise handshake that proves ``peer`` (the library's AutoNAT
        reused the requester's own connection and so told everyone they were reachable)."""
        network = self.host.get_network()
        transport = network.transport_manager.transport_for_dialing(maddr)  # type: ignore[attr-defined]
        if transport is None:
            return False
        raw = None
        with trio.move_on_after(min(5.0, self.cfg.timeout_s)):
            try:
                raw = await transport.dial(maddr)
                secured = await network.upgrader.upgrade_security(raw, True, peer)  # type: ignore[attr-defined]
                await secured.close()
                return True
            except Exception as exc:
                log.debug("dial-back to %s at %s failed: %r", peer, maddr, exc)
            finally:
                if raw is not None:
                    with trio.CancelScope(shield=True):
                        try:
                            await raw.close()
                        except Exception:
                            pass
        return False

    # -- reporting ------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        self.ledger.expire(trio.current_time())
        s = self.ledger.stats()
        return {
            "status": "draining" if self.ledger.draining else "ok",
            "peer_id": self.transport.peer_id,
            "addrs": self.announce_addrs(),
            "reservations": s.reservations,
            "circuits": s.circuits,
            "bytes_relayed": s.bytes_relayed_total,
            "limits": msgspec.structs.asdict(self.cfg) | {"listen": list(self.cfg.listen), "announce": list(self.cfg.announce)},
        }


class _DisconnectNotifee:
    def __new__(cls, service: RelayService) -> Any:
        from libp2p.abc import INotifee

        class Notifee(INotifee):
            async def opened_stream(self, network: Any, stream: Any) -> None:
                return None

            async def closed_stream(self, network: Any, stream: Any) -> None:
                return None

            async def connected(self, network: Any, conn: Any) -> None:
                return None

            async def disconnected(self, network: Any, conn: Any) -> None:
                try:
                    service.peer_disconnected(str(conn.muxed_conn.peer_id))
                except Exception as exc:
                    log.debug("disconnect notification: %r", exc)

            async def listen(self, network: Any, multiaddr: Any) -> None:
                return None

            async def listen_close(self, network: Any, multiaddr: Any) -> None:
                return None

        return Notifee()


class _RelayCollector(Collector):
    def __init__(self, service: RelayService) -> None:
        self.service = service

    def collect(self) -> Iterable[Metric]:
        self.service.ledger.expire(trio.current_time())
        s = self.service.ledger.stats()
        lim = self.service.ledger.limits

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            return c

        yield gauge("moe_swarm_relay_reservations", "Live reservations", s.reservations)
        yield gauge("moe_swarm_relay_reservations_max", "Reservation slots", lim.max_reservations)
        yield gauge("moe_swarm_relay_circuits", "Open circuits", s.circuits)
        yield counter("moe_swarm_relay_reservations_granted", "Reservations granted or refreshed", s.reservations_granted_total)
        yield counter("moe_swarm_relay_circuits_opened", "Circuits opened", s.circuits_opened_total)
        yield counter("moe_swarm_relay_bytes_relayed", "Bytes forwarded through circuits (both directions)", s.bytes_relayed_total)
        refusals = CounterMetricFamily("moe_swarm_relay_refusals", "Reservations and circuits refused", labels=["reason"])
        for reason, n in s.refusals.items():
            refusals.add_metric([reason], n)
        yield refusals
        dialbacks = CounterMetricFamily("moe_swarm_relay_autonat_dialbacks", "AutoNAT dial-back answers", labels=["status"])
        for status, n in sorted(self.service.dialback_results.items()):
            dialbacks.add_metric([status], n)
        yield dialbacks


def _id(peer: str) -> Any:
    from libp2p.peer.id import ID

    return ID.from_base58(peer)


def _norm_ip(ip: str) -> str | None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


def _ip_of(maddr: Any) -> str | None:
    for proto in ("ip4", "ip6"):
        try:
            return _norm_ip(str(maddr.value_for_protocol(proto)))
        except Exception:
            continue
    return None


async def _close(stream: Any) -> None:
    await quietly(stream.close, "closing a stream", shield=True)


async def _reset(stream: Any) -> None:
    await quietly(stream.reset, "resetting a stream", shield=True)


def _build_app(service: RelayService) -> Starlette:
    registry = CollectorRegistry()
    registry.register(_RelayCollector(service))

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(_: Request) -> Response:
        return JSONResponse(service.health())

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"]), Route("/health", health, methods=["GET"])])


@asynccontextmanager
async def open_relay(cfg: RelayConfig) -> AsyncIterator[RelayService]:
    """A running relay (libp2p listeners and the HTTP endpoint); drained and closed on exit."""
    key_path = Path(cfg.data_dir) / "identity.key" if cfg.data_dir is not None else None
    if not cfg.listen:
        raise ConfigError("give at least one --listen multiaddr")
    async with open_libp2p_transport(key_path=key_path, listen_addrs=cfg.listen, dial_timeout_s=cfg.timeout_s) as transport:
        service = RelayService(transport, cfg)
        service.install()
        hc = HyperConfig()
        hc.bind = [f"{cfg.host}:{cfg.port}"]
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.graceful_timeout = 1.0
        try:
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(hypercorn_serve, _build_app(service), hc)
                service.metrics_url = f"{binds[0]}/metrics" if binds else None
                try:
                    yield service
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await service.drain()
                s = service.ledger.stats()
                log.info("relay stopped: %d circuits opened, %d bytes relayed", s.circuits_opened_total, s.bytes_relayed_total)


async def serve_relay(cfg: RelayConfig, *, task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the relay until cancelled; ``task_status.started(info)`` with its peer id, addresses and
    metrics URL once both the libp2p listeners and the HTTP endpoint are up (also written to
    ``DATA_DIR/relay.json``)."""
    async with open_relay(cfg) as service:
        info: dict[str, Any] = {"peer_id": service.transport.peer_id, "addrs": service.announce_addrs(),
                                "metrics": service.metrics_url}
        if cfg.data_dir is not None:
            await trio.Path(cfg.data_dir, "relay.json").write_text(json.dumps(info, indent=2) + "\n")
        log.info("relay %s listening on %s", info["peer_id"], ", ".join(info["addrs"]))
        task_status.started(info)
        await trio.sleep_forever()
