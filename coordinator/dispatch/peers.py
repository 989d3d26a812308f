"""The dispatcher's volunteers as peers (shell, trio thread only): expert clients, their addresses,
NAT path migration and hold challenges.

Rules:
- One ``ExpertClient`` per listed worker, opened lazily by its first call; a worker the map drops,
  or whose addresses change, has its client closed.
- Volunteers behind NATs are reached through ``/p2p-circuit`` addresses and upgraded to direct
  connections by DCUtR hole punching (``swarm.p2p.nat``, attached to a libp2p transport while the
  dispatcher serves). A worker's expert stream that may have opened on the relayed connection
  moves once the connection turned direct (``swarm.core.paths.should_migrate``): new calls open a
  new stream, calls in flight finish on the old one, which is closed after ``timeout_s``. A
  worker's path is ``direct``, ``relayed`` or ``hole-punched`` (None: not connected).
- Hold challenges (DESIGN §12 "proved it holds it"): with ``prove_holdings``, a listed worker gets
  work for a slice only once it answered a challenge for it -- random windows of the slice's bytes
  hashed with a nonce, checked against the coordinator's own GGUF file (read off the event loop).
  At most ``max_in_flight`` challenges at once; a wrong digest is reported to the core
  (``HoldRefuted``: quarantine), a failed or unanswered one is retried later.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import trio

from coordinator.core.events import HoldRefuted, Proof
from coordinator.core.holdings import HoldBook, Holding
from swarm.core.paths import Path as ConnPath
from swarm.core.paths import session_path, should_migrate
from swarm.dispatch_map import DispatchMap
from swarm.errors import SwarmError
from swarm.model.gguf import GGUFModel
from swarm.model.slices import hold_digest_from_file
from swarm.p2p.libp2p import Libp2pTransport
from swarm.p2p.nat import Nat, NatConfig, open_nat
from swarm.p2p.transport import Transport
from swarm.protocol.expert import HoldChallenge, RequestId, Status
from swarm.rpc.client import ExpertClient

__all__ = ["HOLD_WINDOWS", "HOLD_WINDOW_BYTES", "PeerHooks", "Peers"]

log = logging.getLogger(__name__)

# A hold challenge: this many random windows of this many bytes of the slice's tensor data. A worker
# holding a share f of the file answers right with probability about f**4.
HOLD_WINDOWS = 4
HOLD_WINDOW_BYTES = 4096


@dataclass(frozen=True)
class PeerHooks:
    quarantined: Callable[[str], bool]  # is this peer quarantined (no challenges for it)
    refuted: Callable[[HoldRefuted], None]  # a wrong digest: the core hears of it
    proven: Callable[[Holding], None]  # a passed challenge (the market link reports it)


class Peers:
    def __init__(self, transport: Transport | None, *, kernel_id: str, timeout_s: float, hole_punch: bool,
                 model: object, holdings: HoldBook | None) -> None:
        self.transport = transport
        self.kernel_id = kernel_id
        self.timeout_s = timeout_s
        self.hole_punch = hole_punch
        self.model = model
        self.holdings = holdings
        self.clients: dict[str, ExpertClient] = {}
        self.addrs: dict[str, list[str]] = {}
        self._session_opened: dict[str, float] = {}  # peer -> start of the call that opened its stream
        self._sessions_seen: dict[str, tuple[int, int]] = {}  # peer -> (id(client), sessions_opened)
        self._nursery: trio.Nursery | None = None
        self._prove_wake = trio.Event()
        self._hold_ids = itertools.count(1 << 62)  # challenge ids: apart from the core's request ids
        self.hooks: PeerHooks | None = None

    # -- lifetime -----------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def open(self, nursery: trio.Nursery, hooks: PeerHooks) -> AsyncIterator[None]:
        """Circuit dialing and hole punching on a libp2p transport (unless someone attached them),
        the path watcher and the challenge loop; clients closed on exit."""
        self._nursery, self.hooks = nursery, hooks
        async with contextlib.AsyncExitStack() as stack:
            if isinstance(self.transport, Libp2pTransport) and self.transport.nat is None:
                await stack.enter_async_context(open_nat(self.transport, NatConfig(hole_punch=self.hole_punch)))
            async with trio.open_nursery() as tasks:
                tasks.start_soon(self._watch_paths)
                if self.holdings is not None:
                    tasks.start_soon(self._prove_loop)
                try:
                    yield
                finally:
                    tasks.cancel_scope.cancel()
                    self._nursery = None
                    for c in list(self.clients.values()):
                        with trio.CancelScope(shield=True):
                            await c.aclose()
                    self.clients.clear()

    def client(self, peer: str) -> ExpertClient:
        c = self.clients.get(peer)
        if c is None:
            assert self._nursery is not None and self.transport is not None
            c = ExpertClient(self.transport, peer, self.addrs.get(peer, []), self._nursery, kernel_id=self.kernel_id)
            self.clients[peer] = c
        return c

    def adopt(self, m: DispatchMap, before: set[str], now: float) -> tuple[set[str], set[str]]:
        """A new map: clients of dropped workers (or of changed addresses) closed, holdings synced.
        Returns (added, removed) workers."""
        peers = m.peers()
        if self.holdings is not None:
            self.holdings.sync({Holding(rep.peer_id, lr.layer, r.lo, r.hi)
                                for lr in m.layers for r in lr.ranges for rep in r.replicas}, now)
            self._prove_wake.set()
        added, removed = peers.keys() - before, before - peers.keys()
        for p in removed:
            c = self.clients.pop(p, None)
            self.addrs.pop(p, None)
            self._session_opened.pop(p, None)
            if c is not None and self._nursery is not None:
                self._nursery.start_soon(c.aclose)
        for p, addrs in peers.items():
            if p in self.clients and self.addrs.get(p) != addrs:
                c = self.clients.pop(p)
                if self._nursery is not None:
                    self._nursery.start_soon(c.aclose)
            self.addrs[p] = addrs
        return set(added), set(removed)

    def kernel_of(self, peer: str) -> str:
        """The kernel id the worker's Hello announced ("" before its stream opened)."""
        c = self.clients.get(peer)
        hello = c.peer_hello if c is not None else None
        return hello.kernel_id if hello is not None else ""

    def features_of(self, peer: str) -> list[str]:
        c = self.clients.get(peer)
        hello = c.peer_hello if c is not None else None
        return list(hello.features) if hello is not None else []

    # -- NAT path migration ---------------------------------------------------------------------------
    def note_session(self, peer: str, call_started: float) -> None:
        """Remember when the client's current stream opened: no later than the call that opened it."""
        c = self.clients.get(peer)
        if c is None:
            return
        key = (id(c), c.sessions_opened)
        if self._sessions_seen.get(peer) != key:
            self._sessions_seen[peer] = key
            self._session_opened[peer] = call_started

    def _upgraded_at(self, peer: str) -> float | None:
        nat = getattr(self.transport, "nat", None)
        return nat.upgraded_at.get(peer) if isinstance(nat, Nat) else None

    async def _watch_paths(self, interval_s: float = 1.0) -> None:
        """Move expert streams off relays once a direct connection to their worker exists (woken by
        the NAT layer's change event; ``interval_s`` bounds the wait for changes it does not see)."""
        while True:
            nat = getattr(self.transport, "nat", None)
            with trio.move_on_after(interval_s):
                if isinstance(nat, Nat):
                    await nat.changed.wait()
                else:
                    await trio.sleep_forever()
            if self.transport is None:
                continue
            for peer, opened_at in list(self._session_opened.items()):
                if should_migrate(opened_at=opened_at, upgraded_at=self._upgraded_at(peer)):
                    old = self.clients.pop(peer, None)
                    self._sessions_seen.pop(peer, None)
                    del self._session_opened[peer]
                    log.info("worker %s: moving its expert stream from the relay to the %s connection", peer,
                             self.transport.path_to(peer))
                    if old is not None and self._nursery is not None:
                        self._nursery.start_soon(self._close_later, old)

    async def _close_later(self, client: ExpertClient) -> None:
        await trio.sleep(self.timeout_s)  # calls in flight on the old stream finish first
        await client.aclose()

    def path(self, peer: str) -> ConnPath | None:
        """The path of the worker's expert stream, else of its connection; None if not connected."""
        if self.transport is None:
            return None
        best = self.transport.path_to(peer)
        return session_path(ConnPath(best) if best else None, opened_at=self._session_opened.get(peer),
                            upgraded_at=self._upgraded_at(peer))

    # -- hold challenges ------------------------------------------------------------------------------
    async def _prove_loop(self, *, max_in_flight: int = 4) -> None:
        """Challenge listed holdings not proven yet, ``max_in_flight`` at a time, as the book says."""
        book, hooks = self.holdings, self.hooks
        assert book is not None and hooks is not None
        running = 0

        async def one(h: Holding) -> None:
            nonlocal running
            try:
                await self._challenge(h)
            finally:
                running -= 1
                self._prove_wake.set()  # a slot is free

        async with trio.open_nursery() as nursery:
            while True:
                self._prove_wake = trio.Event()  # set by a new map or a finished challenge
                now = trio.current_time()
                for h in book.due(now, max_in_flight - running):
                    if hooks.quarantined(h.peer):
                        book.refuted(h, "quarantined")
                        continue
                    running += 1
                    nursery.start_soon(one, h)
                nxt = book.next_retry()
                with trio.move_on_after(5.0 if nxt is None else max(0.01, min(5.0, nxt - trio.current_time()))):
                    await self._prove_wake.wait()

    async def _challenge(self, h: Holding) -> None:
        book, hooks, model = self.holdings, self.hooks, self.model
        assert book is not None and hooks is not None and isinstance(model, GGUFModel)
        stack = model.expert_stack(h.layer, h.lo, h.hi)
        size = stack.nbytes
        n = min(HOLD_WINDOW_BYTES, size)
        windows = [(secrets.randbelow(size - n + 1), n) for _ in range(HOLD_WINDOWS)]
        nonce = secrets.token_bytes(16)
        ch = HoldChallenge(request_id=RequestId(next(self._hold_ids)), attempt=0, model_id=model.model_id,
                           layer=h.layer, lo=h.lo, hi=h.hi, nonce=nonce, windows=windows)
        try:
            spans = tuple(model.file_span(t.raw) for t in stack.tensors().values())  # the slice file's data order
            expected = await trio.to_thread.run_sync(hold_digest_from_file, model.path, spans, nonce, windows)
            started = trio.current_time()
            proof = await self.client(h.peer).prove_hold(ch, timeout=self.timeout_s)
            self.note_session(h.peer, started)  # the challenge may have opened the stream (path migration)
        except SwarmError as exc:
            book.failed(h, trio.current_time(), f"{exc.code}: {exc.message}")
            log.info("hold challenge to %s for %d:%d-%d failed: %s", h.peer, h.layer, h.lo, h.hi, exc.message)
            return
        if proof.status != Status.OK:
            book.failed(h, trio.current_time(), f"{proof.status}: {proof.message}")
            log.info("hold challenge to %s for %d:%d-%d answered %s: %s", h.peer, h.layer, h.lo, h.hi,
                     proof.status, proof.message)
            return
        if proof.digest != expected:
            detail = f"hold digest {proof.digest.hex()[:16]} is not {expected.hex()[:16]} (nonce {nonce.hex()})"
            book.refuted(h, detail)
            log.warning("worker %s does not hold %d:%d-%d: %s", h.peer, h.layer, h.lo, h.hi, detail)
            asked = hashlib.sha256(msgspec.msgpack.encode([nonce, windows])).hexdigest()
            hooks.refuted(HoldRefuted(h.peer, h.layer, h.lo, h.hi, detail,
                                      Proof(asked, proof.digest.hex(), expected.hex(), "hold_digest")))
            return
        book.passed(h)
        log.info("worker %s proved it holds %d:%d-%d", h.peer, h.layer, h.lo, h.hi)
        hooks.proven(h)
