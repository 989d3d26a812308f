"""Holding reservations on relays (shell around ``swarm.core.reservation``): the RESERVE exchange and
the loop that drives one relay's reservation machine.

Rules:
- Decisions (when to reserve, refresh, back off, withdraw) are the pure machine's; this shell only
  sends RESERVE, reports ``ReserveSucceeded``/``ReserveFailed``/``ConnectionLost``, fires the one
  timer the machine asks for, and tells its owner when the advertised addresses may have changed.
- A reservation's circuit addresses are ``<relay>/p2p-circuit/p2p/<us>`` for the relay address we
  were given and for each public address the relay announces (never a wildcard address).
- Expiry is kept on trio's clock: the relay's absolute expiry (Unix time) is converted once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from swarm.core.reservation import (
    Advertise,
    Event,
    ReservationClient,
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
from swarm.p2p.nat.addrs import HOP_PROTOCOL, RelayAddr, close_stream_quietly, pid
from swarm.p2p.nat.circuit import ensure_connection

__all__ = ["RelayStatus", "Reservation", "reserve", "run_reservation"]

log = logging.getLogger(__name__)


@dataclass
class RelayStatus:
    relay: str
    state: str = ReservationState.IDLE.value
    reservations: int = 0
    failures: int = 0
    last_error: str = ""
    expires_in_s: float | None = None
    addrs: tuple[str, ...] = ()


@dataclass
class Reservation:
    relay: RelayAddr
    machine: ReservationClient
    send: trio.MemorySendChannel[Event]
    receive: trio.MemoryReceiveChannel[Event]
    expires_at: float | None = None  # trio clock


async def reserve(host: Any, relay: RelayAddr, *, refresh: bool, timeout_s: float) -> ReserveSucceeded | ReserveFailed:
    """One RESERVE (or refresh) on ``relay``: our circuit addresses through it and when they expire."""
    from libp2p.custom_types import TProtocol
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
    from multiaddr import Multiaddr

    stream = None
    with trio.move_on_after(timeout_s):
        try:
            await ensure_connection(host, relay.peer_id, relay.transport_addr)
            stream = await host.new_stream(pid(relay.peer_id), [TProtocol(HOP_PROTOCOL)])
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            resp = await read_delimited_msg(stream, HopMessage)
        except Exception as exc:
            return ReserveFailed(f"{'refresh' if refresh else 'reservation'} failed: {exc!r}")
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await close_stream_quietly(stream)
        status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.UNUSED
        if resp.type != HopMessage.STATUS or status != StatusCode.OK or not resp.HasField("reservation"):
            return ReserveFailed(f"relay refused the reservation: {status.name}")
        me = str(host.get_id())
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
        expires_at = trio.current_time() + max(0.0, resp.reservation.expire - time.time())
        return ReserveSucceeded(expires_at, tuple(addrs))
    return ReserveFailed(f"relay did not answer within {timeout_s}s")


async def run_reservation(host: Any, res: Reservation, timeout_s: float, first: trio.Event, changed: Callable[[], None]) -> None:
    """Drive ``res.machine``: send what it asks, fire its timer, report outcomes; ``first`` is set at the
    first advertised address, ``changed()`` after every event (the owner recomputes its addresses)."""
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
                        outcome = await reserve(host, res.relay, refresh=refresh, timeout_s=timeout_s)
                        if isinstance(outcome, ReserveSucceeded):
                            res.expires_at = outcome.expires_at
                        pending.append(outcome)
                    case SetTimer(at=at):
                        deadline = at
                    case Advertise(addrs=addrs):
                        log.info("reserved on relay %s: reachable at %s", res.relay.peer_id, ", ".join(addrs))
                        changed()
                        first.set()
                    case Withdraw(reason=reason):
                        res.expires_at = None
                        log.warning("relay %s: withdrawing its circuit address (%s)", res.relay.peer_id, reason)
                        changed()
            changed()
    finally:
        machine.handle(Stop(), trio.current_time())
        changed()
