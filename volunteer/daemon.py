"""The volunteer desktop daemon, market mode (shell around ``volunteer.core.lifecycle``).

``moe-swarm volunteer --market URL [--max-memory SIZE] [--max-slices N] [--relay MULTIADDR ...] [--data-dir DIR]``

Rules:
- Identity: the libp2p key in ``DATA_DIR/identity.key`` (peer id stable across restarts); the
  ``epoch`` in ``DATA_DIR/epoch`` grows by one on every start, so the market can tell a restarted
  volunteer's heartbeats from stale ones.
- Memory: ``--max-memory`` bounds the process's peak resident set. Once the host, the compute
  pool and the status socket are up the daemon measures its own baseline (``VmRSS``) and keeps a
  reserve for request payloads in flight (the ``ByteBudget`` it enforces, twice: the rows in and the
  answers out); what is left is the slice budget, filled with up to ``--max-slices`` slices (their
  mapped pages are what the process grows by as it serves). A ``--max-memory`` below baseline plus
  reserve is refused at start with a clear error.
- Paths: a slice's file is ``DATA_DIR/slices/<model_id>/<layer>-<lo>-<hi>.safetensors``, made by
  ``swarm.safe_paths.slice_file`` only (the market's strings are checked twice: at decoding and where
  the path is made; a refused one creates nothing).
- Downloads: from the sources the market ranks in the assignment (volunteers holding the slice over
  ``/moe-swarm/slice/1``, HTTP mirrors of the GGUF, the coordinator), every expert checked against
  the market's manifest (``swarm.model.sources``); a market or manifest without expert hashes
  falls back to the coordinator's sha256-checked file. Slices held are shared with volunteers the
  market assigned them to (``swarm.rpc.slice_server``: rate-limited by ``--share-rate``; ``--no-share``
  opts out and the heartbeat says so).
- Throughput is measured once (a float32 expert FFN at batch 8) and kept in ``DATA_DIR/probe.json``.
- Every decision (when to poll, what to report, when to drop a slice) is the pure lifecycle core;
  this shell only performs its effects: HTTP to the market, slice downloads, loading/unloading
  slices into the ``ExpertServer``, signed heartbeats.
- A stuck request budget (requests refused ``busy`` while none is answered: ``volunteer.core.health``)
  is reported: the slices go ``draining`` until it moves again (the market dispatches others).
- The owner's preferences (``--cpu-limit``, ``--only-when-idle``, ``--schedule``, ``moe-swarm volunteer
  pause|resume`` over the status socket; ``volunteer.desktop``): paused, it refuses new calls, answers
  those in flight, reports its slices ``draining`` and the reason (``CoverageHeartbeat.paused``), asks
  for no slice and keeps heartbeating; resumed, it serves them again. ``--cpu-limit`` lowers the compute
  threads and rests after computations (``DutyCycle``).
- Ctrl-C: report the slice ``draining``, answer calls in flight, deregister (empty heartbeat), exit.
- One status line (stderr) for a person watching.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
import urllib.parse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import msgspec
import torch
import trio

from swarm.config import HttpUrl, Multiaddr, PosFloat, PosInt
from swarm.errors import ConfigError, SwarmError
from swarm.failover import client_transport
from swarm.ids import SliceKey
from swarm.model.fetch import fetch_slice
from swarm.model.kernels import DEFAULT_BACKEND, KernelBackend
from swarm.model.slices import check_activation, load_slice
from swarm.model.sources import fetch_slice_from
from swarm.p2p.identity import SIGNATURE_HEADER, load_or_create_identity, sign_body, sign_request
from swarm.p2p.nat import Nat, NatConfig, open_listener_host
from swarm.p2p.transport import Transport
from swarm.progress import Transfers
from swarm.protocol.expert import SUPPORTED_VERSIONS
from swarm.protocol.http import error_code
from swarm.protocol.manifest import ModelManifest
from swarm.protocol.market import (
    Assignment,
    CoverageAck,
    CoverageHeartbeat,
    DownloadProgress,
    HeldSlice,
    NothingNeeded,
    VolunteerCredit,
    VolunteerRequest,
)
from swarm.protocol.status import VolunteerInfo, encode_info
from swarm.rpc.server import ByteBudget, set_expert_handlers
from swarm.rpc.slice_client import sources_from_assignment
from swarm.rpc.slice_server import SliceServer, SliceShareConfig, market_lease_check, set_slice_handler
from swarm.safe_paths import slice_file
from volunteer.core.health import BudgetWatch
from volunteer.core.lifecycle import Deregister, Fetch, Lifecycle, Offer, Phase, Poll, SendHeartbeat, Unload
from volunteer.core.memory import MemoryPlan
from volunteer.core.preferences import Decision, Preferences, cpu_plan, parse_schedule
from volunteer.desktop import DutyCycle, IdleSource, Pauser, local_minute_of_day
from volunteer.lanes import VolunteerLanes
from volunteer.progress import downloaded_bytes
from volunteer.server import ExpertServer, shielded_until_cancelled
from volunteer.status import DownloadStatus, SliceStatus, VolunteerStatus, serve_status
from volunteer.view import VolunteerView

__all__ = ["PullVolunteerConfig", "measure_throughput", "serve_pull_volunteer"]

log = logging.getLogger(__name__)

_answer_decoder = msgspec.json.Decoder(Assignment | NothingNeeded)
_ack_decoder = msgspec.json.Decoder(CoverageAck)


class PullVolunteerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``moe-swarm volunteer --market``'s settings (built by ``volunteer.cli``)."""

    market: HttpUrl
    market_replicas: tuple[HttpUrl, ...] = ()  # more replicas of the same market, failed over to (swarm.failover)
    data_dir: str
    listen: tuple[Multiaddr, ...] = ("/ip4/127.0.0.1/tcp/0",)  # empty: reachable only through relays
    # the addresses coordinators should dial instead of what this host sees of itself (a port forward,
    # a proxy in front of it): announced as they are
    announce: tuple[Multiaddr, ...] = ()
    relays: tuple[Multiaddr, ...] = ()  # empty: the relays the market offers
    hole_punch: bool = True
    lanes: bool = True  # dial the data lanes coordinators offer (volunteer.lanes)
    kernel: KernelBackend = DEFAULT_BACKEND  # expert kernels: ggml or the torch reference
    max_memory: PosInt | None = None  # peak RSS budget: the slice budget is what the baseline leaves
    max_bytes: PosInt | None = None  # a slice budget given directly (embedding, tests); with max_memory: the smaller
    max_experts: PosInt | None = None
    max_slices: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64
    models: tuple[str, ...] = ()
    threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 2
    poll_interval_s: PosFloat = 2.0
    progress: bool = True
    status_interval_s: PosFloat = 5.0
    display_name: Annotated[str, msgspec.Meta(max_length=64)] = ""  # shown on the market's dashboard
    share_slices: bool = True  # serve held slices to volunteers the market assigned them to
    share_rate_bytes_per_s: PosFloat = float(16 << 20)
    # a desktop's owner's preferences (volunteer.core.preferences, volunteer.desktop): a share of the machine's
    # CPU, only after this long without keyboard/mouse input or other programs' CPU use, only in a daily window
    cpu_limit_pct: Annotated[float, msgspec.Meta(gt=0.0, le=100.0)] | None = None
    only_when_idle_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] | None = None
    schedule: Annotated[str, msgspec.Meta(max_length=32)] | None = None  # HH:MM-HH:MM, local time
    busy_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.25  # others' CPU share that counts as use
    idle_sample_s: PosFloat = 2.0  # how often --only-when-idle reads /proc


def measure_throughput(d_model: int = 1024, width: int = 2816, batch: int = 8, reps: int = 5) -> float:
    """Expert tokens/s of this machine: a float32 SwiGLU FFN at ``batch`` rows (one thread)."""
    g = torch.Generator().manual_seed(0)
    wg, wu = torch.randn(width, d_model, generator=g), torch.randn(width, d_model, generator=g)
    wd = torch.randn(d_model, width, generator=g)
    x = torch.randn(batch, d_model, generator=g)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        (torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
        best = min(best, time.perf_counter() - t0)
    return batch / best


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``), in bytes (0 off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _next_epoch(path: Path) -> int:
    try:
        epoch = int(path.read_text().strip()) + 1
    except (OSError, ValueError):
        epoch = int(time.time())  # first start: any value; later starts only grow
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{epoch}\n")
    tmp.replace(path)
    return epoch


class PullVolunteer:
    def authorize(self, peer_id: str) -> bool:
        """May ``peer_id`` use our experts? Only a coordinator the market lists for what we hold."""
        return self.allowed is None or peer_id in self.allowed

    def coordinator_hosts(self) -> set[str]:
        """The hosts of the coordinators the market's assignments named (where a data lane may be dialled)."""
        return {h for a in self._assignments.values() if (h := urllib.parse.urlsplit(a.coordinator).hostname)}

    def __init__(self, cfg: PullVolunteerConfig, *, epoch: int, key_pair: Any, peer_id: str, nat: Nat,
                 server: ExpertServer, client: httpx.AsyncClient, nursery: trio.Nursery,
                 budget: ByteBudget | None = None, max_bytes: int | None = None,
                 transport: Transport | None = None, slice_server: SliceServer | None = None) -> None:
        self.cfg = cfg
        self.base = cfg.market.rstrip("/")
        self.epoch = epoch
        self.key_pair = key_pair
        self.peer_id = peer_id
        self.nat = nat
        self.announce = cfg.announce
        self.server = server
        self.client = client
        self.nursery = nursery
        self.max_bytes = max_bytes if max_bytes is not None else cfg.max_bytes  # the slice budget
        self.core = Lifecycle(rng=random.Random(), poll_interval_s=cfg.poll_interval_s, max_bytes=self.max_bytes,
                              max_experts=cfg.max_experts, max_slices=cfg.max_slices)
        self.data_dir = Path(cfg.data_dir)
        self.status = "starting"
        # the peers whose expert calls we answer: the coordinators the market names (DESIGN §12); None
        # only behind a market that predates the rule (then anyone, as before)
        self.allowed: frozenset[str] | None = frozenset()
        self.market_ok = True
        self.heartbeat_failures = 0  # in a row; the first of an outage is logged
        self._hb_lock = trio.Lock()  # every signed request to the market, polls and heartbeats: sent in counter order
        self._wire_seq = 0  # the one (epoch, sequence) counter polls and heartbeats share (DESIGN §11)
        self._fetch_scopes: dict[Offer, trio.CancelScope] = {}
        self.deregistered = trio.Event()
        self.budget = budget
        self.budget_watch = BudgetWatch()
        self.started_at = time.monotonic()
        self.calls_per_s = 0.0
        self._rate_mark = (time.monotonic(), 0)
        self.credit: VolunteerCredit | None = None  # as the market last said
        self.transport = transport
        self.slice_server = slice_server
        self._assignments: dict[SliceKey, Assignment] = {}  # the market's word for each offer (its sources)
        self._manifests: dict[str, ModelManifest] = {}
        self.downloaded: dict[str, int] = {}  # slice bytes by source name, for the status
        self.transfers = Transfers()  # the downloads running now (the views draw them)
        self.paused = ""  # why the owner's preferences pause it ("" while it runs), on the heartbeat
        self.pause_detail = ""
        self.cpu_limit = ""  # --cpu-limit as applied, for the status
        self.downloading: tuple[Offer, Path] | None = None  # the download under way (the heartbeat's progress)

    # -- the owner's preferences ---------------------------------------------------------------------
    def pause_changed(self, d: Decision) -> None:
        """Pause (refuse new calls, finish those in flight, report the slices draining and the reason)
        or resume; the market hears it at once."""
        if self.core.stopping:
            return
        self.paused, self.pause_detail = d.wire, d.detail
        if d.run:
            self.server.draining = False
            self.status = "resumed"
            log.info("resumed: serving again")
        else:
            self.server.draining = True  # new calls are refused from now on (the coordinators fall back)
            self.status = f"paused: {d.detail}"
            log.info("paused (%s): %s; calls in flight finish", d.wire, d.detail)
            self.nursery.start_soon(self._drain_paused)
        self.apply(self.core.set_paused(not d.run, trio.current_time()))

    async def _drain_paused(self) -> None:
        if self.paused and not self.core.stopping:
            ok = await self.server.drain()
            log.info("paused: calls in flight %s", "finished" if ok else "still running after 10 s")

    # -- effects --------------------------------------------------------------------------------------
    def apply(self, effects: list[Any]) -> None:
        for e in effects:
            match e:
                case Poll(at=at):
                    self.nursery.start_soon(self._poll_at, at)
                case Fetch(offer=offer):
                    self.nursery.start_soon(self._fetch, offer)
                case SendHeartbeat(sequence=seq):
                    self.nursery.start_soon(self._heartbeat, seq)
                case Unload(offer=o, reason=reason):
                    scope = self._fetch_scopes.pop(o, None)
                    if scope is not None:
                        scope.cancel()  # a download still running for it
                    self.server.remove_slice(o.model_id, o.layer, o.lo, o.hi)
                    if self.slice_server is not None:
                        self.slice_server.remove_slice(SliceKey(o.model_id, o.layer, o.lo, o.hi))
                    self._assignments.pop(SliceKey(o.model_id, o.layer, o.lo, o.hi), None)
                    if not self.core.holdings:
                        self.status = f"released {o.layer}:{o.lo}-{o.hi} ({reason})"
                    log.info("released slice %d:%d-%d of %s (%s)", o.layer, o.lo, o.hi, o.model_id, reason)
                case Deregister(sequence=seq):
                    self.nursery.start_soon(self._deregister, seq)

    @property
    def addrs(self) -> list[str]:
        """What coordinators should dial: ``--announce`` if given, else the direct and/or
        ``/p2p-circuit`` addresses, as of now."""
        return list(self.announce) if self.announce else list(self.nat.advertised)

    async def _poll_at(self, at: float) -> None:
        await trio.sleep_until(at)
        if not self.core.wants_poll(at):
            return  # superseded, or no room for another slice
        try:
            async with self._hb_lock:
                body = VolunteerRequest(peer_id=self.peer_id, max_bytes=self.core.budget_left(),
                                        max_experts=self.core.experts_left(),
                                        models=list(self.cfg.models) or None, epoch=self.epoch, sequence=self._next_seq(),
                                        sent_at_ms=int(time.time() * 1000))
                r = await self._signed_post("/api/expert-volunteer", msgspec.json.encode(body))
            r.raise_for_status()
            ans = _answer_decoder.decode(r.content)
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            why = _poll_problem(exc)
            if self.market_ok:  # once per outage: the status line says it meanwhile
                log.warning("market poll failed (%s); retrying, still serving what we hold", why)
            self.market_ok = False
            self.status = f"market unreachable or confused ({why}); retrying"
            self.apply(self.core.poll_failed(trio.current_time()))
            return
        if not self.market_ok:
            log.info("the market answers polls again")
        self.market_ok = True
        now = trio.current_time()
        match ans:
            case Assignment():
                offer = Offer(
                    model_id=ans.model_id, layer=ans.layer, lo=ans.lo, hi=ans.hi, url=ans.url, sha256=ans.sha256,
                    size=ans.size, lease_expires_in_s=ans.lease_expires_in_s, heartbeat_s=ans.heartbeat_s,
                    relays=tuple(ans.relays), lease_id=ans.lease_id,
                )
                self.status = f"offered {offer.layer}:{offer.lo}-{offer.hi} (scarcity {ans.scarcity:.2f}); downloading"
                self._assignments[SliceKey(offer.model_id, offer.layer, offer.lo, offer.hi)] = ans
                self.apply(self.core.offered(offer, now))
            case NothingNeeded():
                if not self.core.holdings:
                    self.status = f"idle: {ans.reason}"
                self.apply(self.core.nothing_needed(ans.retry_after_s, now, reason=ans.reason))

    async def _fetch(self, offer: Offer) -> None:
        with trio.CancelScope() as scope:
            self._fetch_scopes[offer] = scope
            try:
                # the market's strings never make a path unchecked (swarm.safe_paths): refused before anything is created
                dest = await trio.to_thread.run_sync(slice_file, self.data_dir, offer.model_id, offer.layer, offer.lo,
                                                     offer.hi)
                path = await self._download(offer, dest)
                sl = await trio.to_thread.run_sync(load_slice, path)
                k = sl.key
                if (k.model_id, k.layer, k.lo, k.hi) != (offer.model_id, offer.layer, offer.lo, offer.hi):
                    raise SwarmError(f"downloaded slice is {k}, not the one offered", code="slice_mismatch")
            except (SwarmError, httpx.HTTPError, OSError) as exc:
                log.warning("could not fetch slice %d:%d-%d: %s", offer.layer, offer.lo, offer.hi, exc)
                self.apply(self.core.fetch_failed(offer, str(exc), trio.current_time()))
                return
            finally:
                if self._fetch_scopes.get(offer) is scope:
                    del self._fetch_scopes[offer]
            effects = self.core.fetched(offer, trio.current_time())
            if not effects:
                log.info("dropping slice %d:%d-%d: its offer ended while it downloaded", offer.layer, offer.lo, offer.hi)
                return
            self.server.add_slice(sl)
            if self.slice_server is not None:
                self.slice_server.add_slice(path)
            self.status = f"serving {self._held_text()} of {offer.model_id}"
            self.apply(effects)

    async def _manifest(self, model_id: str) -> ModelManifest | None:
        """The market's manifest of ``model_id`` (cached; None when the market has none to give)."""
        m = self._manifests.get(model_id)
        if m is None:
            try:
                r = await self.client.get(f"{self.base}/api/models/{model_id}/manifest")
                if r.status_code != 200:
                    return None
                m = self._manifests[model_id] = msgspec.json.decode(r.content, type=ModelManifest)
            except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError):
                return None
        return m

    async def _download(self, offer: Offer, dest: Path) -> Path:
        self.downloading = (offer, dest)
        try:
            return await self._download_from_sources(offer, dest)
        finally:
            self.downloading = None

    async def _download_from_sources(self, offer: Offer, dest: Path) -> Path:
        """The offered slice from the sources the market ranked, each expert checked against the
        manifest; from the coordinator alone when that is impossible (an older market)."""
        a = self._assignments.get(SliceKey(offer.model_id, offer.layer, offer.lo, offer.hi))
        manifest = await self._manifest(offer.model_id) if a is not None else None
        if manifest is not None:
            check_activation(manifest.expert_activation)  # before a byte is downloaded
        if a is None or manifest is None or not manifest.can_verify_experts or manifest.problems():
            return await fetch_slice(self.client, offer.url, dest, expected_sha256=offer.sha256, progress=self.transfers)
        sources = sources_from_assignment(a, client=self.client, transport=self.transport, self_peer_id=self.peer_id)
        res = await fetch_slice_from(sources, manifest, offer.layer, offer.lo, offer.hi, dest,
                                     expected_sha256=offer.sha256, progress=self.transfers)
        for name, n in res.bytes_from.items():
            self.downloaded[name] = self.downloaded.get(name, 0) + n
        if res.bytes_from or res.lied:
            log.info("slice %d:%d-%d downloaded: %s%s", offer.layer, offer.lo, offer.hi,
                     ", ".join(f"{n} B from {name}" for name, n in res.bytes_from.items()) or "cached",
                     f"; wrong bytes from {', '.join(res.lied)} (dropped)" if res.lied else "")
        return res.path

    def _held_text(self) -> str:
        return ", ".join(f"{h.offer.layer}:{h.offer.lo}-{h.offer.hi}" for h in self.core.holdings.values()) or "nothing"

    def _next_seq(self) -> int:
        self._wire_seq += 1
        return self._wire_seq

    async def _signed_post(self, path: str, raw: bytes) -> httpx.Response:
        """POST ``raw`` to the market with the request signature (``X-Moe-Signature``)."""
        return await self.client.post(f"{self.base}{path}", content=raw, headers={
            "content-type": "application/json",
            SIGNATURE_HEADER: sign_request(self.key_pair, "POST", urlsplit(self.base).path.rstrip("/") + path, raw),
        })

    def _body(self, seq: int, download: DownloadProgress | None = None) -> CoverageHeartbeat:
        slices = []
        for held, state in self.core.reported():
            o = held.offer
            slices.append(HeldSlice(model_id=o.model_id, layer=o.layer, lo=o.lo, hi=o.hi, state=state,  # type: ignore[arg-type]
                                    last_serve_ms=self.server.last_serve_ms_of(o.model_id, o.layer, o.lo, o.hi)))
        # ``seq`` is the lifecycle's heartbeat number; the wire carries the shared request counter
        body = CoverageHeartbeat(peer_id=self.peer_id, epoch=self.epoch, sequence=self._next_seq(), addrs=self.addrs,
                                 slices=slices, load=float(self.server.stats.in_flight), max_bytes=self.max_bytes,
                                 protocols=list(SUPPORTED_VERSIONS), sent_at_ms=int(time.time() * 1000),
                                 display_name=self.cfg.display_name,
                                 share_slices=self.slice_server is not None and self.slice_server.sharing,
                                 paused=self.paused, download=download)
        # the body signature too, for a market of the previous release (it ignores the header)
        return msgspec.structs.replace(body, signature=sign_body(self.key_pair, body))

    async def _post_heartbeat(self, body: CoverageHeartbeat) -> CoverageAck | None:
        try:
            r = await self._signed_post("/api/expert-coverage", msgspec.json.encode(body))
            if r.status_code != 200:
                log.warning("coverage heartbeat refused: HTTP %d %s", r.status_code, r.text[:300])
                return None
            if self.heartbeat_failures:
                log.warning("the market answers heartbeats again (after %d failed)", self.heartbeat_failures)
            self.market_ok, self.heartbeat_failures = True, 0
            return _ack_decoder.decode(r.content)
        except (httpx.HTTPError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.market_ok = False
            self.heartbeat_failures += 1
            if self.heartbeat_failures == 1:  # once per outage, not once per heartbeat
                log.warning("heartbeat to the market failed (%s: %s); still serving, retrying",
                            type(exc).__name__, exc)
            return None

    async def _heartbeat(self, seq: int) -> None:
        async with self._hb_lock:  # heartbeats leave in sequence order
            if seq < self.core.sequence and self.core.phase is not Phase.STOPPING:
                seq = self.core.sequence  # a newer one is due anyway: send the latest state
            ack = await self._post_heartbeat(self._body(seq, await self._download_progress()))
        now = trio.current_time()
        if ack is None:
            self.apply(self.core.heartbeat_failed(now))
            return
        directives = [(d.model_id, d.layer, d.lo, d.hi, d.action, d.dispatched, d.release_in_s) for d in ack.slices]
        # the lifecycle matches acks by its own heartbeat number (the wire carries the shared counter)
        self.apply(self.core.heartbeat_acked(directives, ack.heartbeat_s, seq, now))
        allowed = frozenset(ack.coordinators) if ack.coordinators is not None else None
        if allowed != self.allowed:
            if allowed is None:
                log.warning("the market names no coordinators (an older market): answering every caller")
            else:
                log.info("answering expert calls from %d coordinator(s): %s", len(allowed), ", ".join(sorted(allowed)))
            self.allowed = allowed
        hs = list(self.core.holdings.values())
        draining = [h for h in hs if h.state == "draining" and h.release_in_s is not None]
        if self.core.phase is Phase.FETCHING:
            pass  # the download's own status stands
        elif self.paused:
            self.status = f"paused: {self.pause_detail}"
        elif draining:
            h = draining[0]
            self.status = f"draining {h.offer.layer}:{h.offer.lo}-{h.offer.hi}: surplus, release in {h.release_in_s:.0f}s"
        elif hs:
            waiting = sum(not h.dispatched for h in hs)
            self.status = (f"serving {self._held_text()} of {hs[0].offer.model_id}"
                           f"{f' ({waiting} not dispatched yet)' if waiting else ''}")

    async def _download_progress(self) -> DownloadProgress | None:
        """How far the download under way got (``volunteer.progress``), for the market's dashboard."""
        if self.downloading is None:
            return None
        o, dest = self.downloading
        done = await trio.to_thread.run_sync(downloaded_bytes, dest, o.size, o.lo, o.hi)
        return DownloadProgress(model_id=o.model_id, layer=o.layer, lo=o.lo, hi=o.hi, done_bytes=done, total_bytes=o.size)

    async def _deregister(self, seq: int) -> None:
        async with self._hb_lock:
            body = CoverageHeartbeat(peer_id=self.peer_id, epoch=self.epoch, sequence=self._next_seq(),
                                     addrs=self.addrs, slices=[], load=0.0, max_bytes=self.max_bytes,
                                     protocols=list(SUPPORTED_VERSIONS), sent_at_ms=int(time.time() * 1000))
            body = msgspec.structs.replace(body, signature=sign_body(self.key_pair, body))
            with trio.move_on_after(3):
                await self._post_heartbeat(body)
        self.deregistered.set()

    # -- loops ----------------------------------------------------------------------------------------
    def snapshot(self) -> VolunteerStatus:
        """What ``moe-swarm volunteer status`` and the terminal view show."""
        s = self.server.stats
        slices = [SliceStatus(h.offer.model_id, f"{h.offer.layer}:{h.offer.lo}-{h.offer.hi}", h.state,
                              self.server.last_serve_ms_of(h.offer.model_id, h.offer.layer, h.offer.lo, h.offer.hi))
                  for h in self.core.holdings.values()]
        addrs = self.addrs
        c = self.credit
        return VolunteerStatus(
            peer_id=self.peer_id, market=self.base, phase=self.core.phase.value, waiting_for=self.status,
            market_reachable=self.market_ok, reachability=self.nat.reachability.value,
            path="relayed" if addrs and all("/p2p-circuit" in a for a in addrs) else ("direct" if addrs else "none yet"),
            addrs=addrs, slices=slices, calls=s.calls, calls_per_s=round(self.calls_per_s, 2), rows=s.rows,
            errors=s.errors, in_flight=s.in_flight, payload_bytes=self.budget.held if self.budget is not None else 0,
            latency_ms=round(s.latency_ewma_ms, 2), bytes_in=s.bytes_in, bytes_out=s.bytes_out,
            coordinators=sorted(self.allowed or ()),
            credit_flops=c.total_flops if c is not None else None,
            credit_rac_flops_per_day=c.rac_flops_per_day if c is not None else None,
            verified=c.verified if c is not None else None, uptime_s=round(time.monotonic() - self.started_at, 1),
            downloaded=dict(self.downloaded),
            shared_bytes=self.slice_server.bytes_sent if self.slice_server is not None else 0,
            display_name=self.cfg.display_name, held_bytes=self.core.held_bytes, slice_budget_bytes=self.max_bytes,
            downloads=[DownloadStatus(v.name, v.done, v.total, round(v.rate, 1)) for v in self.transfers.running()],
            paused=self.paused, pause_detail=self.pause_detail, cpu_limit=self.cpu_limit)

    def _update_rate(self) -> None:
        now, calls = time.monotonic(), self.server.stats.calls
        t0, c0 = self._rate_mark
        if now - t0 >= 1.0:
            rate = (calls - c0) / (now - t0)
            self.calls_per_s = rate if self.calls_per_s == 0 else 0.7 * self.calls_per_s + 0.3 * rate
            self._rate_mark = (now, calls)

    async def _credit_loop(self, interval_s: float = 10.0) -> None:
        """What the market credits us (``GET /api/volunteers/{peer_id}``), for the status views."""
        while True:
            try:
                r = await self.client.get(f"{self.base}/api/volunteers/{self.peer_id}")
                if r.status_code == 200:
                    self.credit = _credit_decoder.decode(r.content)
            except (httpx.HTTPError, msgspec.ValidationError, msgspec.DecodeError):
                pass
            await trio.sleep(interval_s)

    def _watch_budget(self, now: float) -> None:
        """A request budget that refuses while nothing comes back is reported (slices ``draining``), not hidden."""
        b = self.budget
        if b is None:
            return
        stuck = self.budget_watch.observe(now, held=b.held, refused=b.refused, given=b.given)
        if stuck != self.core.stuck:
            if stuck:
                log.error("the request budget is stuck (%d bytes held, requests refused, none answered for %.0f s): "
                          "reporting our slices draining", b.held, self.budget_watch.window_s)
                self.status = "request budget stuck: reported draining"
            else:
                log.warning("the request budget moves again: serving")
            self.apply(self.core.budget_stuck(stuck, now))

    async def run(self) -> None:
        self.apply(self.core.start(trio.current_time()))
        self.nursery.start_soon(self._credit_loop)
        view = VolunteerView(self.transfers, live=self.cfg.progress and sys.stderr.isatty(),
                             download_lines=self.cfg.progress, interval_s=self.cfg.status_interval_s,
                             prefix=f"[volunteer {self.cfg.display_name or self.peer_id[-8:]}] ")
        try:
            while True:
                await trio.sleep(0.2)
                now = trio.current_time()
                self.apply(self.core.tick(now))
                self._watch_budget(now)
                self._update_rate()
                view.show(self.snapshot(), now)
        finally:
            view.close()

    async def shutdown(self) -> None:
        """Report draining, answer calls in flight, deregister. Effects are awaited here, in order."""
        for e in self.core.stop(trio.current_time()):
            if isinstance(e, SendHeartbeat):
                with trio.move_on_after(3):
                    async with self._hb_lock:
                        await self._post_heartbeat(self._body(e.sequence))  # report "draining"
        ok = await self.server.drain()
        log.info("drained (%s), deregistering", "clean" if ok else "timed out")
        for e in self.core.drained(trio.current_time()):
            if isinstance(e, Deregister):
                await self._deregister(e.sequence)
            else:
                self.apply([e])


async def serve_pull_volunteer(
    cfg: PullVolunteerConfig, *, idle_source: IdleSource | None = None, minute_of_day: Callable[[], int] | None = None,
    task_status: trio.TaskStatus[VolunteerInfo] = trio.TASK_STATUS_IGNORED
) -> None:
    """``idle_source``, ``minute_of_day``: what ``--only-when-idle`` and ``--schedule`` read (tests give their
    own; default /proc and the local clock)."""
    try:
        prefs = Preferences(schedule=parse_schedule(cfg.schedule) if cfg.schedule else None,
                            idle_s=cfg.only_when_idle_s, busy_fraction=cfg.busy_fraction)
        cpu = cpu_plan(cfg.cpu_limit_pct, os.cpu_count() or 1, cfg.threads)
    except ValueError as exc:
        raise ConfigError(str(exc), code="bad_preferences") from exc
    data_dir = Path(cfg.data_dir)
    await trio.Path(data_dir).mkdir(parents=True, exist_ok=True)
    epoch = await trio.to_thread.run_sync(_next_epoch, data_dir / "epoch")
    probe_path = data_dir / "probe.json"
    try:
        probe = json.loads(await trio.Path(probe_path).read_text())
    except (OSError, ValueError):
        tps = await trio.to_thread.run_sync(measure_throughput)
        probe = {"expert_tokens_per_s": round(tps, 1), "measured_at": int(time.time())}
        await trio.Path(probe_path).write_text(json.dumps(probe) + "\n")
    key_pair = await trio.to_thread.run_sync(load_or_create_identity, data_dir / "identity.key")
    server = ExpertServer([], threads=cfg.threads, kernel=cfg.kernel)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0),
                                 transport=client_transport(cfg.market, cfg.market_replicas)) as client:
        relays = cfg.relays or await _market_relays(client, cfg.market)
        if not cfg.listen and not relays:
            raise ConfigError("reachable only through relays, but neither --relay nor the market names one")
        nat_cfg = NatConfig(relays=relays, hole_punch=cfg.hole_punch)
        async with shielded_until_cancelled() as stop, \
                open_listener_host(key_path=data_dir / "identity.key", listen_addrs=cfg.listen, cfg=nat_cfg) as (transport, nat), \
                trio.open_nursery() as nursery:
            plan: MemoryPlan | None = None
            max_bytes = cfg.max_bytes
            if cfg.max_memory is not None:
                await nursery.start(server.serve)  # the compute pool is part of the baseline
                plan = MemoryPlan.of(cfg.max_memory, rss_bytes())
                max_bytes = plan.slices if max_bytes is None else min(max_bytes, plan.slices)
                log.info("memory: %d MiB peak budget = %d MiB baseline + 2 x %d MiB requests in flight + %d MiB slices",
                         plan.max_memory >> 20, plan.baseline >> 20, plan.payload >> 20, max_bytes >> 20)
            budget = ByteBudget() if plan is None else ByteBudget(per_peer=plan.payload // 2, total=plan.payload)
            slice_server = SliceServer(market_lease_check(client, cfg.market), SliceShareConfig(
                share=cfg.share_slices, rate_bytes_per_s=cfg.share_rate_bytes_per_s,
                burst_bytes=max(1 << 20, int(cfg.share_rate_bytes_per_s))))
            set_slice_handler(transport, slice_server)  # /moe-swarm/slice/1: our slices, to assigned volunteers
            vol = PullVolunteer(cfg, epoch=epoch, key_pair=key_pair, peer_id=transport.peer_id, nat=nat,
                                server=server, client=client, nursery=nursery, budget=budget, max_bytes=max_bytes,
                                transport=transport, slice_server=slice_server)
            handler: Any = server.handle_timed
            if cfg.cpu_limit_pct is not None:
                vol.cpu_limit = f"{cfg.cpu_limit_pct:g}% of {os.cpu_count()} CPUs: {cpu.threads} thread(s), " \
                                f"computing {cpu.duty:.0%} of the time"
                log.info("--cpu-limit %s", vol.cpu_limit)
                if cpu.duty < 1.0:
                    handler = DutyCycle(server.handle_timed, cpu.duty)
            lanes = VolunteerLanes(server, authorize=vol.authorize, known_hosts=vol.coordinator_hosts, budget=budget,
                                   duty=cpu.duty if cfg.cpu_limit_pct is not None else 1.0)
            if cfg.lanes:
                await nursery.start(lanes.serve)
            # only the coordinators the market names for what we hold may use our experts
            set_expert_handlers(transport, handler, hello=server.hello(),
                                authorize=vol.authorize, prove=server.prove, budget=budget,
                                lanes=lanes.offer if cfg.lanes else None)
            if plan is None:
                await nursery.start(server.serve)
            pauser = Pauser(prefs, data_dir, vol.pause_changed, source=idle_source, sample_s=cfg.idle_sample_s,
                            minute_of_day=minute_of_day or local_minute_of_day)
            # moe-swarm volunteer status | pause | resume
            await nursery.start(partial(serve_status, data_dir, vol.snapshot, control=pauser.command))
            await nursery.start(pauser.serve)
            info = VolunteerInfo(peer_id=transport.peer_id, addrs=vol.addrs, epoch=epoch,
                                 reachability=nat.reachability.value, relays=list(relays), **probe)
            await trio.Path(data_dir / "volunteer.json").write_bytes(encode_info(info))
            print(f"volunteer ready peer_id={transport.peer_id} epoch={epoch} market={cfg.market} "
                  f"reachability={nat.reachability.value} addrs={','.join(vol.addrs) or 'none yet'} "
                  f"expert_tokens_per_s={probe['expert_tokens_per_s']}", flush=True)
            nursery.start_soon(vol.run)
            task_status.started(info)
            await stop.wait()  # Ctrl-C / SIGTERM / the caller's cancellation
            with trio.move_on_after(30):
                await vol.shutdown()  # host and compute loops still run: calls in flight are answered
            nursery.cancel_scope.cancel()


_credit_decoder = msgspec.json.Decoder(VolunteerCredit)


def _poll_problem(exc: Exception) -> str:
    """A failed poll, said for people: what the market answered (its status and error code), or why
    there was no answer."""
    if isinstance(exc, httpx.HTTPStatusError):
        r = exc.response
        return f"HTTP {r.status_code} {error_code(r.content) or ''}".rstrip()
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _market_relays(client: httpx.AsyncClient, market: str) -> tuple[str, ...]:
    """The relays the market offers (``/health``); none if it cannot be asked now."""
    try:
        r = await client.get(f"{market.rstrip('/')}/health")
        return tuple(str(x) for x in r.json().get("relays", []))
    except (httpx.HTTPError, ValueError, AttributeError):
        log.warning("could not ask the market for relays; listening directly only")
        return ()

