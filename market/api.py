"""The market's HTTP API (shell: Starlette ASGI app over ``market.state.Market``).

Endpoints (bodies are JSON of the Structs in ``swarm.protocol.market``):

- ``POST /api/models`` (operator token: ``Authorization: Bearer TOKEN``) ``RegisterModels``
  ``{url, models: [manifest...], epoch}`` -> ``RegisterAck``. Several coordinators may host one
  model; a coordinator's list replaces its previous one; an older ``epoch`` is refused (409).
- ``POST /api/coordinator-report`` (operator token) ``CoordinatorReport {url, model_id, workers:
  [{peer_id, calls, rows, verified, pairs, path, quarantine, evidence, held}], ranges}`` -> ``ReportAck
  {workers, quarantined, ignored}``. Only workers holding (coverage or lease) a slice of ``model_id``
  count; the others are listed in ``ignored`` and change nothing. Counts within int64, at most
  ``max_report_pairs`` a worker and report. A quarantine needs ``evidence`` (``QuarantineEvidence {layer,
  lo, hi, input_sha256, remote_sha256, local_sha256, method, detail}``; 400 ``missing_evidence`` /
  ``bad_evidence`` refuse the whole report): the worker loses its coverage and lease and is refused
  (pull: ``nothing_needed`` ``quarantined``; heartbeat: 403 ``quarantined``) for ``quarantine_s``, the
  evidence kept and shown (``GET /api/volunteers/{peer_id}``). One with ``verified`` answers is *served*
  (its coverage rows of that model: preferred in maps and at age-out); the slices a worker proved it
  holds (``held``: a hold challenge passed) are marked ``held``; per-range routed rows are kept.
- Volunteer requests (polls and heartbeats) are signed: ``X-Moe-Signature`` (``swarm.p2p.identity.
  sign_request``), ``sent_at_ms`` within 120 s, one ``(epoch, sequence)`` counter; heartbeats with
  only the older body signature are accepted for one release. A heartbeat's new slice counts only
  with the volunteer's lease for it (``not_assigned`` otherwise).
- ``POST /api/expert-volunteer`` ``VolunteerRequest {peer_id, max_bytes | max_experts, models?}``
  -> ``{"kind": "assignment", model_id, layer, lo, hi, slice, url, size, sha256, lease_id,
  lease_expires_in_s, scarcity, relays, heartbeat_s, coordinator}`` or ``{"kind":
  "nothing_needed", reason, retry_after_s}`` (also sent as ``Retry-After``). Polling again
  while a lease is open returns the same lease. Size and sha256 come from a ``HEAD`` of the
  slice URL on the coordinator (its ETag), bounded in time; when no coordinator answers, the
  lease is cancelled and the answer is ``nothing_needed`` / ``coordinator_unreachable``.
- ``POST /api/expert-coverage`` ``CoverageHeartbeat {peer_id, epoch, sequence, addrs, slices:
  [{model_id, layer, lo, hi, state, last_serve_ms}], load, max_bytes, signature}`` -> ``CoverageAck
  {peer_id, epoch, sequence, slices: [SliceDirective], heartbeat_s, ttl_s, relays}``.
  ``signature`` (base64 in JSON) must be the peer's Ed25519 signature (``swarm.p2p.identity``).
  ``share_slices`` (default false): the volunteer serves its slices to downloading volunteers
  (``/moe-swarm/slice/1``), so the market may name it in ``Assignment.sources``. ``paused`` (default
  ""): its owner's preferences paused it (the reason): it reports its slices ``draining`` (not counted,
  not dispatched, not dropped), its polls get ``nothing_needed`` / ``paused`` until a heartbeat says
  it resumed, and ``/api/volunteers/{peer_id}`` and the recruitment view show it paused.
- ``GET /api/expert-demand[?model=ID]`` -> ``DemandView``: per model and segment the replicas,
  pending, target and scarcity, plus ``recruiting``.
- (operator token) ``GET /api/expert-dispatch-map?model=ID[&after=V&wait_s=S]`` -> the DESIGN §11 dispatch map.
  With ``after``, waits up to ``wait_s`` (<= 30) for a version above ``V`` (long poll), then
  answers with the current map either way. ``ETag`` is the quoted version; ``If-None-Match``
  with it -> 304.
- ``Assignment.sources``: where to download the slice, best first (``market.core.sources``): up to 4
  volunteers serving a range of the same model and layer that contains it and sharing their slices
  (``kind: "peer"``, ``peer_id``, ``addrs``: direct ones only; a volunteer reachable only through a
  relay is no source), the GGUF's origin mirrors (``"origin"``, ``url``), then
  the coordinators' slice URLs (``"coordinator"``, ``url``; the one that described the file first).
- ``GET /api/models/{model_id}/manifest`` -> the model's ``ModelManifest`` as registered (404
  ``unknown_model``): what a volunteer needs to check the bytes it downloads from peers and mirrors.
- ``GET /api/leases/{lease_id}`` -> ``LeaseView {lease_id, peer_id, model_id, layer, lo, hi,
  expires_in_s, state}`` (404 ``unknown_lease``): an open lease (``leased``), or the coverage it was
  converted into while the volunteer still reports it ``loading`` (``loading``; it holds for the
  holder's remaining heartbeat TTL). A volunteer asked for slice bytes over ``/moe-swarm/slice/1``
  checks the asker's lease here. No token: lease ids are unguessable, and the answer names only a peer id
  and a slice (``/api/moe/recruitment`` shows both), never an address.
- ``GET /api/coordinators[?model=ID]`` -> ``CoordinatorDirectory`` (``market.directory``): each model's
  coordinators, for gateways.
- ``GET /api/moe/recruitment`` -> ``RecruitmentView``; ``GET /api/volunteers/{peer_id}`` ->
  ``VolunteerCredit`` (404 ``unknown_volunteer``); ``GET /api/volunteers?limit=N`` -> ``CreditBoard``
  (by recent average credit); ``GET /metrics`` (Prometheus);
  ``GET /health`` (also lists the relays offered to volunteers). ``/metrics`` is bounded: per-model
  series for the first 64 models (by id), 1,024 per-layer series in all, regenerated at most every 5 s
  by a refresh that yields to the event loop after every model.

The release / age-out protocol (what a volunteer does with ``CoverageAck.slices``):

1. A heartbeat lists every slice the volunteer holds, with ``state`` ``loading`` (downloading or
   loading: not dispatched, but its lease is converted, so nobody else is sent for it),
   ``serving`` (dispatchable) or ``draining`` (the volunteer is leaving: not dispatched). A
   slice left out of a heartbeat is released: the market forgets it. An empty list deregisters.
2. Each directive says what to do with one listed slice: ``keep`` (``dispatched`` tells whether
   coordinators are told to use it); ``drain`` — the target fell and this holding is surplus: it
   is out of the dispatch map (coordinators stop sending new calls within about a second);
   keep answering calls in flight and keep listing it; ``release_in_s`` says when it will be
   released; if demand rises again before then, it turns back into ``keep`` / dispatched;
   ``release`` — drop the slice now (``reason``: ``surplus`` after the cooldown, or
   ``unknown_model`` / ``bad_slice_range``), leave it out of the next heartbeat and poll
   ``/api/expert-volunteer`` again when idle.
3. A volunteer silent for ``ttl_s`` expires (its slices leave the map). Heartbeat every
   ``heartbeat_s`` (a third of the TTL). On a market outage keep serving and retry; the market
   keeps its registrations, and its first answers after a restart are normal ones.

Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` with stable codes:
``invalid_body`` (400: not JSON or not the schema), ``missing_budget``, ``missing_parameter``,
``bad_parameter``, ``bad_peer_id``, ``bad_manifest``, ``bad_url``, ``duplicate_slice`` (400);
``bad_signature``, ``unauthorized`` (401); ``unknown_model``, ``unknown_lease``, ``not_found`` (404);
``method_not_allowed`` (405); ``stale_epoch``, ``replayed_sequence``, ``stale_registration``,
``manifest_conflict`` (409); ``body_too_large`` (413); ``too_many_identities`` (429: a new identity
at an address that speaks for ``max_identities_per_address`` already); ``store_error`` (503: the
request changed nothing, in memory or on disk).
Bad input never takes the market down.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from market.core.assign import NoOfferReason
from market.directory import directory_view
from market.loops import Clock, MapWatch, MarketGate
from market.state import Market, NoOffer, Offer
from market.views import remote_and_holes
from swarm.core.histogram import Histogram
from swarm.errors import ConfigError, RequestError, SwarmError
from swarm.http_io import close_if_unread, read_body
from swarm.p2p.identity import SIGNATURE_HEADER, check_peer_id, verify_body, verify_request
from swarm.protocol.http import encode_error
from swarm.protocol.market import (
    Assignment,
    DownloadSource,
    NothingNeeded,
    SourceKind,
    coverage_decoder,
    register_decoder,
    report_decoder,
    volunteer_decoder,
)

__all__ = ["MarketApi", "SliceDescriber", "build_market_app", "error_response"]

log = logging.getLogger(__name__)

_MAX_BODY: Final = 4 << 20
_MAX_WAIT_S: Final = 30.0
_UNREACHABLE_RETRY_S: Final = 2.0
_MAX_SKEW_S: Final = 120.0  # a signed request's sent_at_ms may be this far from our clock
_encoder = msgspec.json.Encoder()

# url -> (sha256 hex, size); raises SwarmError when the coordinator cannot describe the file
SliceDescriber = Callable[[str], Awaitable[tuple[str, int]]]


@dataclass
class MarketApi:
    """What the HTTP layer needs: the market, its clock and the shell's I/O helpers."""

    market: Market
    clock: Clock
    describe_slice: SliceDescriber
    watch: MapWatch = field(default_factory=MapWatch)
    gate: MarketGate = field(default_factory=MarketGate)  # threaded for PostgreSQL (market.loops)
    token: str | None = None
    relays: list[str] = field(default_factory=list)
    describe_timeout_s: float = 10.0


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(obj), status_code=status, headers=headers, media_type="application/json")


def error_response(exc: SwarmError, status: int | None = None, headers: dict[str, str] | None = None) -> Response:
    st = status if status is not None else getattr(exc, "status", 400)
    body = encode_error(st, exc.code, exc.message, getattr(exc, "param", None))
    return Response(body, status_code=st, headers=close_if_unread(exc, headers), media_type="application/json")


async def _read_body(request: Request, limit: int = _MAX_BODY) -> bytes:
    return await read_body(request, limit)


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid body: {exc}", code="invalid_body") from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"body is not valid JSON: {exc}", code="invalid_body") from exc


def _required_param(request: Request, name: str) -> str:
    v = request.query_params.get(name)
    if v is None:
        raise RequestError(f"query parameter {name!r} is required", code="missing_parameter", param=name)
    return v


def _float_param(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise RequestError(f"{name} must be a number", code="bad_parameter", param=name) from None
    if not lo <= v <= hi:
        raise RequestError(f"{name} must be within [{lo}, {hi}]", code="bad_parameter", param=name)
    return v


def _int_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise RequestError(f"{name} must be a non-negative integer", code="bad_parameter", param=name)
    return int(raw)


Handler = Callable[[Request], Awaitable[Response]]


@functools.cache
def _dashboard() -> tuple[bytes, str]:
    """The page and its Content-Security-Policy: everything it runs comes from the market itself (no CDN;
    works offline), its one inline script and style by their sha256 (no other inline code runs: a
    stranger's text that became markup could not execute), it talks to this market only and cannot be
    framed."""
    html = (Path(__file__).parent / "static" / "dashboard.html").read_bytes()

    def hashes(tag: bytes) -> str:
        blocks = re.findall(rb"<" + tag + rb">(.*?)</" + tag + rb">", html, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks)

    csp = (f"default-src 'none'; script-src {hashes(b'script')}; style-src {hashes(b'style')}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, csp


class _RequestStats:
    """Requests per handler and status, and their durations (for ``/metrics``)."""

    BOUNDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}
        self.durations: dict[str, Histogram] = {}

    def observe(self, handler: str, status: int, seconds: float) -> None:
        self.counts[(handler, status)] = self.counts.get((handler, status), 0) + 1
        self.durations.setdefault(handler, Histogram(self.BOUNDS)).observe(seconds)


def _guarded(fn: Handler) -> Handler:
    name = fn.__name__

    async def run(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            resp = await fn(request)
        except RequestError as exc:
            resp = error_response(exc)
        except SwarmError as exc:  # a store failure: the request did not complete
            log.error("%s %s failed: %s [%s]", request.method, request.url.path, exc, exc.code)
            resp = error_response(exc, 503)
        stats = getattr(request.app.state, "request_stats", None)
        if isinstance(stats, _RequestStats):
            stats.observe(name, resp.status_code, time.perf_counter() - t0)
        return resp

    return run


METRICS_MAX_MODELS: Final = 64  # per-model series for the first this many models (by id); the rest are counted
METRICS_MAX_LAYER_SERIES: Final = 1024  # per-layer series in all
METRICS_TTL_S: Final = 5.0  # a scrape within this long of the last one gets its text again


@dataclass
class _ModelGauges:
    model_id: str
    recruiting: bool
    saturated: bool
    target: int
    replicas_min: int
    map_version: int
    holes: int


class _MarketCollector(Collector):
    """The market's series, bounded (``METRICS_MAX_MODELS`` models, ``METRICS_MAX_LAYER_SERIES`` layer
    series: a registration of many models cannot make ``/metrics`` megabytes). The per-model part is
    computed by ``refresh`` -- a task that yields to the event loop after every model -- and read from
    its snapshot by ``collect``; so is the rest, which costs no more than a few hundred series."""

    def __init__(self, api: MarketApi, stats: _RequestStats) -> None:
        self.api = api
        self.stats = stats
        self.models: list[_ModelGauges] = []
        self.layers: list[tuple[str, int, int]] = []  # (model, layer, fewest replicas)
        self.omitted = 0

    async def refresh(self) -> None:
        m = self.api.market
        models: list[_ModelGauges] = []
        layers: list[tuple[str, int, int]] = []
        ids = sorted(m.ix.models)
        for mid in ids[:METRICS_MAX_MODELS]:
            if mid in m.ix.models:  # a checkpoint ago it was
                now = self.api.clock()
                _, holes = remote_and_holes(m.ix, mid)
                counts = m.ix.counts[mid]
                models.append(_ModelGauges(mid, m.ix.recruiting(mid), m.ix.saturated_now(mid, now), m.ix.target(mid),
                                           counts.min_replicas(), m.map_version(mid), holes))
                for layer, row in enumerate(counts.replicas[: max(0, METRICS_MAX_LAYER_SERIES - len(layers))]):
                    layers.append((mid, layer, min(row, default=0)))
            await trio.lowlevel.checkpoint()  # one model at a time: the loop keeps serving
        self.models, self.layers, self.omitted = models, layers, max(0, len(ids) - METRICS_MAX_MODELS)

    def collect(self) -> Iterable[Metric]:
        m = self.api.market
        c = CounterMetricFamily("moe_swarm_market_events", "Market events by kind", labels=["event"])
        for k, v in sorted(m.counters.items()):
            c.add_metric([k], v)
        yield c
        g = GaugeMetricFamily("moe_swarm_market_volunteers", "Volunteers holding coverage")
        g.add_metric([], m.ix.live_volunteers())
        yield g
        g = GaugeMetricFamily("moe_swarm_market_leases", "Open leases")
        g.add_metric([], len(m.ix.leases))
        yield g
        g = GaugeMetricFamily("moe_swarm_market_coordinators", "Registered coordinators")
        g.add_metric([], len(m.ix.coordinators))
        yield g
        g = GaugeMetricFamily("moe_swarm_market_models", "Registered models")
        g.add_metric([], len(m.ix.models))
        yield g
        g = GaugeMetricFamily("moe_swarm_market_models_omitted",
                              f"Models without per-model series (only the first {METRICS_MAX_MODELS} by id have them)")
        g.add_metric([], self.omitted)
        yield g
        per_model = {
            "recruiting": ("moe_swarm_market_recruiting", "1 while the model's target is boosted"),
            "saturated": ("moe_swarm_market_saturated", "1 while a coordinator of the model is saturated, by its last poll (before "
                                      "hysteresis: moe_swarm_market_recruiting is the smoothed signal)"),
            "target": ("moe_swarm_market_effective_target", "Replicas wanted per expert"),
            "min": ("moe_swarm_market_replicas_min", "Fewest live replicas of any expert"),
            "version": ("moe_swarm_market_map_version", "Dispatch map version"),
            "holes": ("moe_swarm_market_holes",
                      "Experts nobody can compute now (no replica, not held by every hosting coordinator)"),
        }
        fams = {k: GaugeMetricFamily(n, d, labels=["model"]) for k, (n, d) in per_model.items()}
        for x in self.models:
            fams["recruiting"].add_metric([x.model_id], float(x.recruiting))
            fams["saturated"].add_metric([x.model_id], float(x.saturated))
            fams["target"].add_metric([x.model_id], x.target)
            fams["min"].add_metric([x.model_id], x.replicas_min)
            fams["version"].add_metric([x.model_id], x.map_version)
            fams["holes"].add_metric([x.model_id], x.holes)
        yield from fams.values()
        layer_min = GaugeMetricFamily("moe_swarm_market_layer_replicas_min", "Fewest live replicas of an expert, per layer",
                                      labels=["model", "layer"])
        for mid, layer, n in self.layers:
            layer_min.add_metric([mid, str(layer)], n)
        yield layer_min
        credit = CounterMetricFamily("moe_swarm_market_credit_flops", "Credit granted to volunteers, in FLOPs")
        credit.add_metric([], sum(r.total_flops for r in m.ix.credit.values()))
        yield credit
        stats = self.stats
        req = CounterMetricFamily("moe_swarm_market_requests", "API requests by handler and status",
                                  labels=["handler", "status"])
        for (h, st), n in sorted(stats.counts.items()):
            req.add_metric([h, str(st)], n)
        yield req
        lat = HistogramMetricFamily("moe_swarm_market_request_seconds", "API request durations", labels=["handler"])
        for h, hist in sorted(stats.durations.items()):
            lat.add_metric([h], hist.buckets(), sum_value=hist.total)
        yield lat


class _MetricsPage:
    """``/metrics``' text, regenerated at most every ``METRICS_TTL_S`` by one scrape at a time (the
    others get the last text): what unauthenticated scrapers cost is bounded."""

    def __init__(self, collector: _MarketCollector, registry: CollectorRegistry) -> None:
        self.collector = collector
        self.registry = registry
        self.text = b""
        self.at = -math.inf
        self._lock = trio.Lock()

    async def get(self) -> bytes:
        if self.text and trio.current_time() - self.at < METRICS_TTL_S:
            return self.text
        async with self._lock:
            if not (self.text and trio.current_time() - self.at < METRICS_TTL_S):
                await self.collector.refresh()
                self.text = generate_latest(self.registry)
                self.at = trio.current_time()
        return self.text


class _ReadGate:
    """ASGI middleware: a read (``GET``/``HEAD``) holds the gate while it runs, so a threaded market's call
    never changes the indexes under it (the dispatch map's long poll takes it itself, around its reads)."""

    def __init__(self, app: ASGIApp, gate: MarketGate) -> None:
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (not self.gate.threaded or scope["type"] != "http" or scope.get("method") not in ("GET", "HEAD")
                or scope.get("path") == "/api/expert-dispatch-map"):
            await self.app(scope, receive, send)
            return
        async with self.gate.reading():
            await self.app(scope, receive, send)


def build_market_app(api: MarketApi) -> Starlette:
    m = api.market
    registry = CollectorRegistry()
    stats = _RequestStats()
    collector = _MarketCollector(api, stats)
    registry.register(collector)
    metrics_page = _MetricsPage(collector, registry)

    if api.token is not None and not api.token.strip():
        raise ConfigError("an empty operator token would let any bearer in: give a real one or none", code="token_required")

    def check_token(request: Request) -> None:
        if api.token is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), api.token.encode()):
            raise RequestError("operator token required (Authorization: Bearer TOKEN)", code="unauthorized", status=401)

    @_guarded
    async def register(request: Request) -> Response:
        check_token(request)
        req = _decode(register_decoder, await _read_body(request))
        try:
            parsed = httpx.URL(req.url)
        except (httpx.InvalidURL, ValueError) as exc:
            raise RequestError(f"url {req.url[:200]!r} is not a valid URL: {exc}", code="bad_url", param="url") from exc
        if not parsed.host or parsed.query or parsed.fragment or parsed.userinfo:
            # no credentials either: the URL is shown on the public recruitment page
            raise RequestError("url must be a plain http(s)://host[:port][/prefix] base URL (no credentials)",
                               code="bad_url", param="url")
        ack = await api.gate.call(lambda: m.register(req, api.clock()))
        log.info("coordinator %s registered %s", req.url, ", ".join(ack.model_ids) or "no models")
        return _json(ack)

    async def describe(offer: Offer) -> tuple[str, str, int] | None:
        path = offer.lease.slice.http_path
        for base in offer.sources:
            url = base.rstrip("/") + path
            with trio.move_on_after(api.describe_timeout_s):
                try:
                    sha, size = await api.describe_slice(url)
                except SwarmError as exc:
                    log.warning("cannot describe %s: %s", url, exc)
                    continue
                return url, sha, size
            log.warning("describing %s timed out", url)
        return None

    def nothing(reason: str, retry_after_s: float, message: str = "") -> Response:
        body = NothingNeeded(reason, round(retry_after_s, 3), message)
        return _json(body, headers={"retry-after": str(max(1, round(retry_after_s)))})

    @_guarded
    async def coordinator_report(request: Request) -> Response:
        check_token(request)
        rep = _decode(report_decoder, await _read_body(request))
        ack = await api.gate.call(lambda: m.report(rep, api.clock()))
        for peer in ack.quarantined:
            log.warning("volunteer %s quarantined on the report of %s", peer, rep.url)
        return _json(ack)

    def check_signed(request: Request, raw: bytes, peer_id: str, sent_at_ms: int | None) -> bool:
        """The request scheme (DESIGN §11): True if ``X-Moe-Signature`` verifies and ``sent_at_ms`` is
        within ``_MAX_SKEW_S`` of our clock; False without the header (the caller decides); else 401."""
        header = request.headers.get(SIGNATURE_HEADER)
        if header is None:
            return False
        verify_request(peer_id, request.method, request.url.path, raw, header)
        if sent_at_ms is None:
            raise RequestError("a signed request needs sent_at_ms", code="bad_signature", status=401, param="sent_at_ms")
        skew = abs(api.clock() - sent_at_ms / 1000.0)
        if skew > _MAX_SKEW_S:
            raise RequestError(f"sent_at_ms is {skew:.0f} s from the market's clock (at most {_MAX_SKEW_S:.0f})",
                               code="stale_request", status=401, param="sent_at_ms")
        return True

    @_guarded
    async def volunteer(request: Request) -> Response:
        raw = await _read_body(request)
        req = _decode(volunteer_decoder, raw)
        check_peer_id(req.peer_id)
        if not check_signed(request, raw, req.peer_id, req.sent_at_ms):
            raise RequestError("polls must be signed (X-Moe-Signature; DESIGN §11)", code="signature_required", status=401)
        if req.epoch is None or req.sequence is None:
            raise RequestError("a poll carries the volunteer's (epoch, sequence)", code="invalid_body", param="sequence")
        host = request.client.host if request.client is not None else ""
        res = await api.gate.call(lambda: m.volunteer(req, api.clock(), address=host))
        if isinstance(res, NoOffer):
            return nothing(res.reason.value, res.retry_after_s)
        found = await describe(res)
        if found is None:
            lease_id = res.lease.lease_id
            await api.gate.call(lambda: m.cancel_lease(lease_id, api.clock()))
            return nothing(
                NoOfferReason.COORDINATOR_UNREACHABLE.value,
                _UNREACHABLE_RETRY_S,
                "no coordinator hosting the model could describe the slice file",
            )
        url, sha, size = found
        s = res.lease.slice
        others = [b.rstrip("/") + s.http_path for b in res.sources]
        sources = [
            *(DownloadSource(kind=SourceKind.PEER, peer_id=p.peer_id, addrs=list(p.addrs)[:16]) for p in res.peers),
            *(DownloadSource(kind=SourceKind.ORIGIN, url=u) for u in res.origins),
            *(DownloadSource(kind=SourceKind.COORDINATOR, url=u) for u in [url, *(o for o in others if o != url)]),
        ]
        # within what a volunteer decodes (swarm.protocol.market.Assignment's limits): a longer answer is refused whole
        sources = [x for x in sources if len(x.url) <= 2048][:64]
        return _json(
            Assignment(
                model_id=s.model_id,
                layer=s.layer,
                lo=s.lo,
                hi=s.hi,
                slice=str(s),
                url=url,
                size=size,
                sha256=sha,
                lease_id=res.lease.lease_id,
                lease_expires_in_s=round(max(0.0, res.lease.expires_at - api.clock()), 3),
                scarcity=res.scarcity,
                relays=list(api.relays)[:16],
                heartbeat_s=m.policy.heartbeat_s,
                coordinator=url[: len(url) - len(s.http_path)],
                sources=sources,
            )
        )

    @_guarded
    async def model_manifest(request: Request) -> Response:
        row = m.ix.models.get(str(request.path_params["model_id"]))
        if row is None:
            raise RequestError("no such model is registered here", code="unknown_model", status=404)
        return _json(row.manifest, headers={"cache-control": "no-cache"})

    @_guarded
    async def lease(request: Request) -> Response:
        lease_id = str(request.path_params["lease_id"])
        if not 0 < len(lease_id) <= 128:
            raise RequestError("no such lease", code="unknown_lease", status=404)
        return _json(m.lease_view(lease_id, api.clock()))

    @_guarded
    async def coverage(request: Request) -> Response:
        raw = await _read_body(request)
        hb = _decode(coverage_decoder, raw)
        if not check_signed(request, raw, hb.peer_id, hb.sent_at_ms):
            verify_body(hb.peer_id, hb, hb.signature)  # the body-signature scheme, accepted for one release
            m.counters["heartbeats_legacy_signature"] += 1
        host = request.client.host if request.client is not None else ""
        ack = await api.gate.call(lambda: m.heartbeat(hb, api.clock(), address=host))
        return _json(msgspec.structs.replace(ack, relays=list(api.relays)))

    @_guarded
    async def demand(request: Request) -> Response:
        model = request.query_params.get("model")
        return _json(m.demand(api.clock(), None if model is None else [model]))

    @_guarded
    async def dispatch_map(request: Request) -> Response:
        check_token(request)  # volunteers' addresses: for the coordinators (operators) only (DESIGN §12)
        model = _required_param(request, "model")
        async with api.gate.reading():
            m.dispatch_map(model)  # 404 for an unknown model before any waiting
        after = _int_param(request, "after")
        if after is not None:
            wait_s = _float_param(request, "wait_s", 10.0, 0.0, _MAX_WAIT_S)
            await api.watch.wait_until(lambda: m.map_version(model) > after, wait_s)
        async with api.gate.reading():
            dm = m.dispatch_map(model)
        etag = f'"{dm.version}"'
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"etag": etag})
        return _json(dm, headers={"etag": etag, "cache-control": "no-cache"})

    @_guarded
    async def coordinators(request: Request) -> Response:  # gateways' view (market/directory.py)
        return _json(directory_view(m.ix, api.clock(), request.query_params.get("model")))

    @_guarded
    async def recruitment(_: Request) -> Response:
        return _json(m.recruitment(api.clock()))

    @_guarded
    async def history(_: Request) -> Response:
        return _json(m.history())

    @_guarded
    async def events(request: Request) -> Response:
        return _json(m.events(_int_param(request, "after") or 0))

    async def dashboard(_: Request) -> Response:
        html, csp = _dashboard()
        return Response(html, media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-cache", "content-security-policy": csp})

    @_guarded
    async def volunteer_credit(request: Request) -> Response:
        return _json(m.volunteer_credit(str(request.path_params["peer_id"]), api.clock()))

    @_guarded
    async def credit_board(request: Request) -> Response:
        limit = _int_param(request, "limit")
        return _json(m.credit_board(api.clock(), 100 if limit is None else max(0, min(limit, 1000))))

    async def metrics(_: Request) -> Response:
        return Response(await metrics_page.get(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(_: Request) -> Response:
        return _json({"status": "ok", "models": len(m.ix.models), "volunteers": m.ix.live_volunteers(),
                      "relays": list(api.relays),
                      # without a token anyone may register models and coordinators (--insecure-no-token)
                      "auth": "token" if api.token is not None else "none (insecure: anyone may register)"})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = str(exc.detail) if isinstance(exc, HTTPException) else "internal error"
        headers = dict(exc.headers) if isinstance(exc, HTTPException) and exc.headers else None
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        return error_response(RequestError(detail, code=code, status=status), headers=headers)

    app = Starlette(
        routes=[
            Route("/api/models", register, methods=["POST"]),
            Route("/api/coordinator-report", coordinator_report, methods=["POST"]),
            Route("/api/expert-volunteer", volunteer, methods=["POST"]),
            Route("/api/expert-coverage", coverage, methods=["POST"]),
            Route("/api/expert-demand", demand, methods=["GET"]),
            Route("/api/expert-dispatch-map", dispatch_map, methods=["GET"]),
            Route("/api/moe/recruitment", recruitment, methods=["GET"]),
            Route("/api/coordinators", coordinators, methods=["GET"]),
            Route("/api/volunteers", credit_board, methods=["GET"]),
            Route("/api/events", events, methods=["GET"]),
            Route("/api/history", history, methods=["GET"]),
            Route("/dashboard", dashboard, methods=["GET"]),
            Route("/api/volunteers/{peer_id}", volunteer_credit, methods=["GET"]),
            Route("/api/leases/{lease_id}", lease, methods=["GET"]),
            Route("/api/models/{model_id}/manifest", model_manifest, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(_ReadGate, gate=api.gate)],
    )
    app.state.request_stats = stats
    return app
