"""Pure relay/NAT cores, table-driven: the relay's ledger, a volunteer's reservation machine,
reachability, advertising, dial plans and path classification (no event loop)."""

from __future__ import annotations

import random

import pytest

from relay.core.ledger import Admitted, Direction, Refusal, Refused, RelayLedger, RelayLimits, Reserved
from swarm.core.paths import (
    DialPlan,
    DialResult,
    Path,
    Reachability,
    advertised_addrs,
    classify_path,
    dial_plan,
    is_circuit,
    reachability_verdict,
    session_path,
    should_migrate,
    should_reserve,
)
from swarm.core.reservation import (
    Advertise,
    ConnectionLost,
    Effect,
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

# ============================================================================================
# relay ledger


def test_throwaway_identities_from_one_address_cannot_take_every_slot() -> None:
    """128 identities from one address get that address's share (16); honest peers from other
    addresses still get slots; a /24 is capped too; an IPv6 host's /64 counts as one address."""
    led = RelayLedger(RelayLimits(max_reservations=128, reservation_ttl_s=100, max_reservations_per_address=16,
                                  max_reservations_per_prefix=40))
    got = [led.reserve(f"sybil-{i}", 0, "198.51.100.7") for i in range(128)]
    assert sum(isinstance(g, Reserved) for g in got) == 16
    assert got[16:] == [Refused(Refusal.ADDRESS_LIMIT)] * 112
    assert all(isinstance(led.reserve(f"honest-{i}", 1, f"203.0.113.{i}"), Reserved) for i in range(1, 40))
    # the same /24 from other addresses: 40 in all
    more = [led.reserve(f"neighbour-{i}", 2, f"198.51.100.{100 + i}") for i in range(40)]
    assert sum(isinstance(g, Reserved) for g in more) == 40 - 16
    assert led.reserve("sybil-0", 3, "198.51.100.7") == Reserved(103, renewed=True)  # a refresh needs no new place
    v6 = [led.reserve(f"v6-{i}", 4, f"2001:db8:1:2::{i + 1:x}") for i in range(20)]
    assert sum(isinstance(g, Reserved) for g in v6) == 16
    assert isinstance(led.reserve("mapped", 4, "::ffff:192.0.2.1"), Reserved) and led.reservations_from("192.0.2.1") == 1
    # leaving, expiring and moving free the place at the old address
    assert led.peer_disconnected("sybil-0")
    assert isinstance(led.reserve("sybil-16", 5, "198.51.100.7"), Reserved)
    assert led.reserve("honest-1", 6, "198.51.100.7") == Refused(Refusal.ADDRESS_LIMIT)  # moving there: full
    assert led.has_reservation("honest-1", 6)  # ... its reservation from before stands
    assert led.reservations_from("203.0.113.1") == 1
    led.expire(200)
    assert led.reservations_from("198.51.100.7") == 0 and led.stats().reservations == 0
    with pytest.raises(ValueError):
        RelayLimits(max_reservations_per_address=0)
    # an unknown address (None) is counted under none: the total cap alone applies
    assert isinstance(led.reserve("unknown", 300, None), Reserved)


def test_reservations_granted_renewed_refused_and_freed_on_disconnect() -> None:
    led = RelayLedger(RelayLimits(max_reservations=2, reservation_ttl_s=100))
    assert led.reserve("a", 0) == Reserved(100, renewed=False)
    assert led.reserve("b", 1) == Reserved(101, renewed=False)
    assert led.reserve("c", 2) == Refused(Refusal.RESERVATION_LIMIT)
    assert led.reserve("a", 50) == Reserved(150, renewed=True)  # a refresh never needs a free slot
    # a disconnected peer frees its slot at once, not at expiry
    assert led.peer_disconnected("b") is True
    assert led.peer_disconnected("b") is False
    assert led.reserve("c", 3) == Reserved(103, renewed=False)
    # expiry frees slots too
    assert led.expire(120) == ["c"]
    assert led.has_reservation("a", 149) and not led.has_reservation("a", 150) and not led.has_reservation("c", 102)
    s = led.stats()
    assert (s.reservations, s.reservations_granted_total, s.refusals["reservation_limit"]) == (1, 4, 1)


@pytest.mark.parametrize(
    ("limits", "opened", "src", "dst", "expected"),
    [
        (RelayLimits(), [], "s", "v", Admitted(1, None, None)),
        (RelayLimits(), [], "s", "nobody", Refused(Refusal.NO_RESERVATION)),
        (RelayLimits(), [], "v", "v", Refused(Refusal.SELF_CIRCUIT)),
        (RelayLimits(max_circuits=2), [("s", "v"), ("t", "v")], "u", "v", Refused(Refusal.CIRCUIT_LIMIT)),
        (RelayLimits(max_circuits_per_peer=2), [("s", "v"), ("t", "v")], "u", "v", Refused(Refusal.PEER_CIRCUIT_LIMIT)),
        (RelayLimits(max_circuits_per_peer=2), [("s", "v"), ("s", "w")], "s", "w", Refused(Refusal.PEER_CIRCUIT_LIMIT)),
        (RelayLimits(circuit_max_duration_s=60, circuit_max_bytes=10), [], "s", "v", Admitted(1, 65.0, 10)),
    ],
)
def test_circuit_admission(limits: RelayLimits, opened: list[tuple[str, str]], src: str, dst: str,
                           expected: Admitted | Refused) -> None:
    led = RelayLedger(limits)
    for p in ("v", "w"):
        assert isinstance(led.reserve(p, 0), Reserved)
    for s, d in opened:
        assert isinstance(led.open_circuit(s, d, 5), Admitted)
    got = led.open_circuit(src, dst, 5)
    if isinstance(expected, Admitted):
        assert isinstance(got, Admitted)
        assert (got.deadline, got.max_bytes) == (expected.deadline, expected.max_bytes)
    else:
        assert got == expected


def test_circuits_are_independent_and_counted() -> None:
    led = RelayLedger(RelayLimits(max_circuits_per_peer=2))
    led.reserve("v", 0)
    a = led.open_circuit("c1", "v", 1)
    b = led.open_circuit("c2", "v", 1)
    assert isinstance(a, Admitted) and isinstance(b, Admitted) and a.circuit_id != b.circuit_id
    assert led.open_circuit("c3", "v", 1) == Refused(Refusal.PEER_CIRCUIT_LIMIT)
    led.close_circuit(a.circuit_id)
    assert led.circuits_of("v") == [b.circuit_id]  # closing one circuit leaves the other alone
    assert led.record_bytes(b.circuit_id, Direction.TO_DST, 1000)
    assert not led.record_bytes(a.circuit_id, Direction.TO_DST, 1)  # a closed circuit carries nothing
    c = led.open_circuit("c3", "v", 2)  # the freed slot is usable again
    assert isinstance(c, Admitted)
    led.close_circuit(c.circuit_id)
    led.close_circuit(c.circuit_id)  # idempotent
    s = led.stats()
    assert (s.circuits, s.circuits_opened_total, s.bytes_relayed_total) == (1, 3, 1000)


def test_unlimited_by_default_and_data_cap_per_direction() -> None:
    free = RelayLedger(RelayLimits())
    free.reserve("v", 0)
    c = free.open_circuit("s", "v", 0)
    assert isinstance(c, Admitted)
    # the default relay never cuts a circuit for its volume (py-libp2p's data=0 cut at the first byte)
    assert all(free.record_bytes(c.circuit_id, Direction.TO_DST, 1 << 30) for _ in range(8))
    capped = RelayLedger(RelayLimits(circuit_max_bytes=100))
    capped.reserve("v", 0)
    d = capped.open_circuit("s", "v", 0)
    assert isinstance(d, Admitted)
    assert capped.record_bytes(d.circuit_id, Direction.TO_DST, 100)
    assert capped.record_bytes(d.circuit_id, Direction.TO_SRC, 60)  # each direction has its own budget
    assert not capped.record_bytes(d.circuit_id, Direction.TO_DST, 1)
    assert not capped.record_bytes(d.circuit_id, Direction.TO_SRC, 41)


def test_draining_refuses_everything_new() -> None:
    led = RelayLedger(RelayLimits())
    led.reserve("v", 0)
    led.drain()
    assert led.reserve("w", 1) == Refused(Refusal.DRAINING)
    assert led.open_circuit("s", "v", 1) == Refused(Refusal.DRAINING)


@pytest.mark.parametrize("bad", [dict(max_reservations=0), dict(reservation_ttl_s=0), dict(circuit_max_bytes=-1)])
def test_bad_limits(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        RelayLimits(**bad)


# ============================================================================================
# reservation machine


class NoJitter:
    def uniform(self, a: float, b: float) -> float:
        return 1.0


ADDRS = ("/ip4/1.2.3.4/tcp/4001/p2p/R/p2p-circuit/p2p/V",)
POLICY = ReservationPolicy(backoff_base_s=0.5, backoff_max_s=4.0, jitter=0.0, refresh_fraction=0.5, min_refresh_s=1.0)

# (now, event, expected effects, state after)
Step = tuple[float, Event, list[Effect], ReservationState]

SCENARIOS: dict[str, list[Step]] = {
    "reserve_then_refresh": [
        (0, Start(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (0.5, ReserveSucceeded(100.5, ADDRS), [Advertise(ADDRS), SetTimer(50.5)], ReservationState.RESERVED),
        (50.5, TimerFired(), [SendReserve(refresh=True)], ReservationState.RESERVING),
        # same addresses: nothing to re-advertise, refresh at half the remaining lifetime again
        (51, ReserveSucceeded(151, ADDRS), [SetTimer(101)], ReservationState.RESERVED),
    ],
    "backoff_doubles_and_caps": [
        (0, Start(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (0, ReserveFailed("refused"), [SetTimer(0.5)], ReservationState.BACKOFF),
        (0.5, TimerFired(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (0.5, ReserveFailed("refused"), [SetTimer(1.5)], ReservationState.BACKOFF),
        (1.5, TimerFired(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (1.5, ReserveFailed("timeout"), [SetTimer(3.5)], ReservationState.BACKOFF),
        (3.5, TimerFired(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (3.5, ReserveFailed("timeout"), [SetTimer(7.5)], ReservationState.BACKOFF),
        (7.5, TimerFired(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (7.5, ReserveFailed("timeout"), [SetTimer(11.5)], ReservationState.BACKOFF),  # capped at 4 s
        (11.5, TimerFired(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        # success resets the failure count
        (12, ReserveSucceeded(20, ADDRS), [Advertise(ADDRS), SetTimer(16)], ReservationState.RESERVED),
    ],
    "relay_restart_withdraws_then_reserves_again": [
        (0, Start(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (0, ReserveSucceeded(100, ADDRS), [Advertise(ADDRS), SetTimer(50)], ReservationState.RESERVED),
        (10, ConnectionLost(), [Withdraw("connection to the relay lost"), SetTimer(10.5)], ReservationState.BACKOFF),
        (10.5, TimerFired(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (10.5, ReserveFailed("connection refused"), [SetTimer(11.5)], ReservationState.BACKOFF),
        (11.5, TimerFired(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (12, ReserveSucceeded(112, ADDRS), [Advertise(ADDRS), SetTimer(62)], ReservationState.RESERVED),
    ],
    "failed_refresh_keeps_address_until_expiry": [
        (0, Start(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (0, ReserveSucceeded(4, ADDRS), [Advertise(ADDRS), SetTimer(2)], ReservationState.RESERVED),
        (2, TimerFired(), [SendReserve(refresh=True)], ReservationState.RESERVING),
        (2, ReserveFailed("timeout"), [SetTimer(2.5)], ReservationState.BACKOFF),  # still valid: keep it
        (2.5, TimerFired(), [SendReserve(refresh=True)], ReservationState.RESERVING),
        (3.5, ReserveFailed("timeout"), [SetTimer(4)], ReservationState.BACKOFF),  # retry capped at expiry
        (4, TimerFired(), [Withdraw("reservation expired"), SendReserve(refresh=False)], ReservationState.RESERVING),
    ],
    "late_or_duplicate_outcomes_are_ignored": [
        (0, ReserveSucceeded(9, ADDRS), [], ReservationState.IDLE),
        (0, ConnectionLost(), [], ReservationState.IDLE),
        (0, Start(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (0, Start(), [], ReservationState.RESERVING),
        (0, ReserveSucceeded(10, ADDRS), [Advertise(ADDRS), SetTimer(5)], ReservationState.RESERVED),
        (1, ReserveFailed("late"), [], ReservationState.RESERVED),
        (2, ReserveSucceeded(99, ADDRS), [], ReservationState.RESERVED),
    ],
    "stop": [
        (0, Start(), [SendReserve(refresh=False)], ReservationState.RESERVING),
        (0, ReserveSucceeded(10, ADDRS), [Advertise(ADDRS), SetTimer(5)], ReservationState.RESERVED),
        (1, Stop(), [Withdraw("stopped")], ReservationState.STOPPED),
        (5, TimerFired(), [], ReservationState.STOPPED),
    ],
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reservation_machine(name: str) -> None:
    m = ReservationClient(POLICY, NoJitter())
    for i, (now, event, effects, state) in enumerate(SCENARIOS[name]):
        got = m.handle(event, now)
        assert got == effects, f"step {i}: {event} at {now}"
        assert m.state is state, f"step {i}: {event} at {now}"


def test_jitter_stays_within_bounds(rng: random.Random) -> None:
    policy = ReservationPolicy(backoff_base_s=1.0, backoff_max_s=8.0, jitter=0.25)
    delays = []
    for _ in range(200):
        m = ReservationClient(policy, rng)
        m.handle(Start(), 0)
        [eff] = m.handle(ReserveFailed("x"), 0)
        assert isinstance(eff, SetTimer)
        delays.append(eff.at)
    assert 0.75 <= min(delays) < max(delays) <= 1.25
    assert len(set(delays)) > 100  # volunteers of one relay do not retry in lockstep


# ============================================================================================
# paths


@pytest.mark.parametrize(
    ("results", "dialable", "expected"),
    [
        ([], False, Reachability.PRIVATE),
        ([DialResult.OK], False, Reachability.PRIVATE),
        ([DialResult.OK], True, Reachability.PUBLIC),
        ([DialResult.REFUSED, DialResult.OK], True, Reachability.PUBLIC),
        ([DialResult.REFUSED], True, Reachability.PRIVATE),
        ([DialResult.FAILED, DialResult.ERROR], True, Reachability.PRIVATE),
        ([DialResult.ERROR], True, Reachability.UNKNOWN),
        ([], True, Reachability.UNKNOWN),
    ],
)
def test_reachability_verdict(results: list[DialResult], dialable: bool, expected: Reachability) -> None:
    assert reachability_verdict(results, has_dialable_addr=dialable) is expected


D, C = ("/ip4/10.0.0.2/tcp/1",), ("/ip4/1.2.3.4/tcp/4001/p2p/R/p2p-circuit/p2p/V",)


@pytest.mark.parametrize(
    ("reach", "expected", "reserve"),
    [(Reachability.PUBLIC, D, False), (Reachability.PRIVATE, C, True), (Reachability.UNKNOWN, D + C, True)],
)
def test_advertise_and_reserve(reach: Reachability, expected: tuple[str, ...], reserve: bool) -> None:
    assert advertised_addrs(reach, D, C) == expected
    assert should_reserve(reach) is reserve


@pytest.mark.parametrize(
    ("addrs", "plan"),
    [
        (list(D + C), DialPlan(D, C, 0.3)),
        (list(C), DialPlan((), C, 0.0)),
        (list(D), DialPlan(D, (), 0.3)),
        ([], DialPlan((), (), 0.0)),
    ],
)
def test_dial_plan(addrs: list[str], plan: DialPlan) -> None:
    assert dial_plan(addrs, circuit_delay_s=0.3) == plan


@pytest.mark.parametrize(
    ("addr", "circuit"),
    [(C[0], True), (D[0], False), ("/ip4/1.2.3.4/tcp/4001/ws/p2p/R/p2p-circuit", True), ("/dns4/p2p-circuit.example/tcp/1", False)],
)
def test_is_circuit(addr: str, circuit: bool) -> None:
    assert is_circuit(addr) is circuit


@pytest.mark.parametrize(
    ("relayed", "before", "path"),
    [(True, True, Path.RELAYED), (True, False, Path.RELAYED), (False, True, Path.HOLE_PUNCHED), (False, False, Path.DIRECT)],
)
def test_classify_path(relayed: bool, before: bool, path: Path) -> None:
    assert classify_path(relayed=relayed, reached_via_relay_before=before) is path


@pytest.mark.parametrize(
    ("opened_at", "upgraded_at", "migrate"),
    [
        (1.0, 2.0, True),  # opened on the relay, then the connection turned direct
        (2.0, 2.0, True),  # same instant: the stream may still be on the relay, move it
        (3.0, 2.0, False),  # opened after the upgrade: already on the direct connection
        (1.0, None, False),  # never upgraded
        (None, 2.0, False),  # no session
    ],
)
def test_should_migrate(opened_at: float | None, upgraded_at: float | None, migrate: bool) -> None:
    assert should_migrate(opened_at=opened_at, upgraded_at=upgraded_at) is migrate


@pytest.mark.parametrize(
    ("best", "opened_at", "upgraded_at", "path"),
    [
        (Path.HOLE_PUNCHED, 1.0, 2.0, Path.RELAYED),  # not moved yet: its bytes still cross the relay
        (Path.HOLE_PUNCHED, 3.0, 2.0, Path.HOLE_PUNCHED),
        (Path.RELAYED, 1.0, None, Path.RELAYED),
        (Path.DIRECT, None, None, Path.DIRECT),
        (None, 1.0, 2.0, None),  # not connected
    ],
)
def test_session_path(best: Path | None, opened_at: float | None, upgraded_at: float | None, path: Path | None) -> None:
    assert session_path(best, opened_at=opened_at, upgraded_at=upgraded_at) is path
