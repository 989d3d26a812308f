"""The market service (shell): store + state + HTTP API on hypercorn's trio worker + loops.

Rules:
- Configuration is a frozen Struct (``MarketConfig``) built once at the edge and passed by value.
- ``serve_market`` is a trio service: ``task_status.started(url)`` once the socket is bound and
  the loops run; cancelling it stops the loops and the server, flushes the volunteers' sequence
  numbers and closes the store (a new ``serve_market`` on the same file continues where this
  one stopped).
- The store (``market.stores.open_store``: SQLite, PostgreSQL or memory) is opened and first loaded in
  a worker thread (a database server may take seconds to answer); the ``Market`` then calls it from the
  trio thread, one small batch per committing request (``market.state``'s rules).
- The market's clock is the wall clock (``time.time``): leases, ages and retirement marks are
  persisted and must stay meaningful across restarts.
- Outbound HTTP (coordinator ``/slots`` polls, ``HEAD`` of slice files) uses one httpx client;
  every call is bounded in time; foreign errors become ``SwarmError``s here.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import time
from collections import OrderedDict
from functools import partial
from typing import Annotated

import httpx
import msgspec
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from market.api import MarketApi, SliceDescriber, build_market_app
from market.core.recruit import SpeedReport
from market.loops import MarketGate, Poller, run_housekeeping, run_recruitment_loop
from market.policy import MarketPolicy
from market.replica import ReplicaLink
from market.state import Market
from market.store import MEMORY_DB, Store, is_postgres_url, mask_url
from market.stores import open_store
from swarm.config import Multiaddr, Port, PosFloat
from swarm.errors import ConfigError, RemoteProtocolError, SliceError, SwarmError, TransportError
from swarm.protocol.coordinator import slots_decoder

__all__ = ["MEMORY_DB", "MarketConfig", "make_slice_describer", "make_slots_poller", "open_store", "serve_market"]

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")


class MarketConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    db: str  # SQLite file (or sqlite:PATH), postgresql://... (market.store_pg), or ":memory:" (volatile, in-process)
    host: str = "127.0.0.1"
    port: Port = 8090
    # operator token (POST /api/models, reports, dispatch maps); required unless insecure_no_token; never
    # empty or blank, nor with blanks around it (a bearer value is compared stripped)
    token: Annotated[str, msgspec.Meta(min_length=1, max_length=4096, pattern=r"^\S(.*\S)?\Z")] | None = None
    insecure_no_token: bool = False  # run without a token: anyone may register (said in the log and /health)
    relays: tuple[Multiaddr, ...] = ()  # relay multiaddrs offered to volunteers that cannot be dialled
    poll_interval_s: PosFloat = 2.0
    poll_timeout_s: PosFloat = 1.0
    tick_s: PosFloat = 0.25
    describe_timeout_s: PosFloat = 20.0
    seed: int | None = None  # RNG seed (tie-breaks, lease ids, jitter); None = from the OS
    replica: bool = False  # share the PostgreSQL database with other market replicas (market.replica)
    policy: MarketPolicy = MarketPolicy()


def make_slots_poller(client: httpx.AsyncClient) -> Poller:
    """``GET {url}/slots`` -> ``(busy, slots)``; ``TransportError`` / ``RemoteProtocolError`` on failure."""

    async def poll(url: str) -> tuple[int, int, float, SpeedReport | None]:
        try:
            r = await client.get(url.rstrip("/") + "/slots")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise TransportError(f"GET {url}/slots: {exc!r}", code="poll_failed") from exc
        if r.status_code != 200:
            raise TransportError(f"GET {url}/slots: HTTP {r.status_code}", code="poll_failed")
        try:
            slots = slots_decoder.decode(r.content)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RemoteProtocolError(f"GET {url}/slots: unexpected body: {exc}", code="bad_slots") from exc
        first = slots[0] if slots else None
        speed = None if first is None else SpeedReport(first.mean_active_tps, first.tps_floor,
                                                       first.projected_mean_tps_if_admitted)
        return (sum(1 for s in slots if s.is_processing), len(slots),
                float(sum(s.tps_ewma for s in slots if s.is_processing)), speed)

    return poll


def make_slice_describer(client: httpx.AsyncClient, cache_size: int = 4096) -> SliceDescriber:
    """``HEAD`` a slice URL -> ``(sha256, size)`` from its strong ETag and Content-Length (cached:
    slice files are byte-deterministic, so a URL's description never changes)."""
    cache: OrderedDict[str, tuple[str, int]] = OrderedDict()

    async def describe(url: str) -> tuple[str, int]:
        hit = cache.get(url)
        if hit is not None:
            cache.move_to_end(url)
            return hit
        try:
            r = await client.head(url)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise SliceError(f"HEAD {url}: {exc!r}", code="slice_unavailable") from exc
        if r.status_code != 200:
            raise SliceError(f"HEAD {url}: HTTP {r.status_code}", code="slice_unavailable")
        etag = r.headers.get("etag", "").strip().removeprefix("W/").strip('"')
        length = r.headers.get("content-length", "")
        if not _SHA256.fullmatch(etag) or not length.isdigit() or int(length) <= 0:
            raise SliceError(f"HEAD {url}: no sha256 ETag / size (etag {etag!r})", code="slice_unavailable")
        found = (etag, int(length))
        cache[url] = found
        while len(cache) > cache_size:
            cache.popitem(last=False)
        return found

    return describe


async def serve_market(cfg: MarketConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    if cfg.token is not None and not cfg.token.strip():  # a config built in code, past the constraints
        raise ConfigError("the operator token is empty: give a real one (--token or MOE_SWARM_TOKEN)", code="token_required")
    if cfg.token is None and not cfg.insecure_no_token:
        raise ConfigError(
            "the market needs an operator token (--token or MOE_SWARM_TOKEN): without one anyone may register "
            "models and coordinators; --insecure-no-token runs it open anyway",
            code="token_required",
        )
    if cfg.token is None:
        log.warning("market running WITHOUT an operator token (--insecure-no-token): anyone may register models "
                    "and coordinators")
    clock = time.time
    # a poll must stay fresh until the next one has had its chance, whatever the interval
    policy = msgspec.structs.replace(
        cfg.policy, poll_stale_s=max(cfg.policy.poll_stale_s, 2 * cfg.poll_interval_s + cfg.poll_timeout_s)
    )
    # opening (a PostgreSQL connect, schema checks) and the first load may take seconds: worker threads
    if cfg.replica and not is_postgres_url(cfg.db):
        raise ConfigError(f"--replica needs a PostgreSQL database (--db postgresql://...), not {mask_url(cfg.db)}",
                          code="bad_flag")
    store: Store = await trio.to_thread.run_sync(partial(open_store, cfg.db, replica=cfg.replica))
    # a PostgreSQL market decides under the database's write lock (market.replica): its calls wait on the
    # database, so they run in a worker thread (market.loops.MarketGate)
    link = store if isinstance(store, ReplicaLink) else None
    gate = MarketGate(threaded=link is not None)
    try:
        market = await trio.to_thread.run_sync(partial(
            Market, store, policy, now=clock(), rng=random.Random(cfg.seed),
            net_salt=hashlib.sha256(b"moe-swarm-net\0" + (cfg.token or "").encode()).digest(), link=link))
        try:
            timeout = httpx.Timeout(cfg.describe_timeout_s, connect=min(5.0, cfg.describe_timeout_s))
            async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
                api = MarketApi(
                    market,
                    clock,
                    make_slice_describer(client),
                    token=cfg.token,
                    relays=list(cfg.relays),
                    describe_timeout_s=cfg.describe_timeout_s,
                    gate=gate,
                )
                app = build_market_app(api)
                hc = HyperConfig()
                hc.bind = [f"{cfg.host}:{cfg.port}"]
                hc.accesslog = None
                hc.errorlog = logging.getLogger("hypercorn.error")
                hc.graceful_timeout = 1.0
                # an idle connection outlives the clients' own keep-alive (httpx: 5 s) and the volunteers' heartbeat
                # interval: with hypercorn's default 5 s, a heartbeat sent every 5 s on the pooled connection raced the
                # server closing it ("Server disconnected without sending a response": a failed heartbeat)
                hc.keep_alive_timeout = max(30.0, 2 * policy.heartbeat_s)
                async with trio.open_nursery() as nursery:
                    await nursery.start(partial(run_housekeeping, market, api.watch, clock=clock, tick_s=cfg.tick_s,
                                                    gate=gate))
                    await nursery.start(
                        partial(
                            run_recruitment_loop,
                            market,
                            make_slots_poller(client),
                            clock=clock,
                            interval_s=cfg.poll_interval_s,
                            timeout_s=cfg.poll_timeout_s,
                            gate=gate,
                        )
                    )
                    binds = await nursery.start(hypercorn_serve, app, hc)
                    url = binds[0] if binds else f"http://{cfg.host}:{cfg.port}"
                    log.info(
                        "market serving at %s (db %s; %d models, %d coordinators, %d volunteers with coverage)",
                        url,
                        mask_url(cfg.db),
                        len(market.ix.models),
                        len(market.ix.coordinators),
                        market.ix.live_volunteers(),
                    )
                    task_status.started(url)
        finally:
            try:
                with trio.CancelScope(shield=True):
                    await gate.call(lambda: market.flush(clock()))
            except SwarmError:
                log.exception("could not flush volunteer sequence numbers")
    finally:
        store.close()
