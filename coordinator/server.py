"""The coordinator service (shell): model + engine runtime + HTTP API on hypercorn's trio worker.

Rules:
- Configuration is a frozen Struct built once at the edge (CLI) and passed down by value.
- ``serve_coordinator`` is a trio service: ``task_status.started(url)`` once the HTTP socket is
  bound and the engine thread runs; cancelling it shuts both down cleanly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import tempfile
import urllib.parse
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

import gguf
import msgspec
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from coordinator.api.app import build_app
from coordinator.api.slices import slice_routes
from coordinator.core.admission import AdmissionPolicy
from coordinator.core.dispatch import DispatchConfig, DispatchMode
from coordinator.core.local_experts import parse_local_experts
from coordinator.dispatch.dispatcher import Dispatcher
from coordinator.dispatch.lanes import LaneHub
from coordinator.dispatch.mapfile import watch_dispatch_map_file
from coordinator.dispatch.market_link import MarketLink
from coordinator.engine.drafters import Drafter, HeldOnlyExperts, ModelDrafter, NgramDrafter, check_vocabulary
from coordinator.engine.model import LocalExperts, Transformer
from coordinator.engine.runtime import EngineRuntime
from swarm.config import HttpUrl, Multiaddr, NonNegFloat, NonNegInt, Port, PosFloat, PosInt, physical_cores
from swarm.errors import ConfigError, ModelError
from swarm.model.gguf import GGUFModel
from swarm.model.hub import is_hub_model, resolve_hub_model
from swarm.model.kernels import DEFAULT_BACKEND, KernelBackend, configure_threads
from swarm.model.kernels.repack import set_repack
from swarm.model.slices import SliceCache, build_manifest
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.progress import show_transfers
from swarm.protocol.coordinator import MarketLinkStatus
from swarm.protocol.expert import Dtype
from swarm.protocol.manifest import MAX_ORIGINS
from swarm.text.tokenizer import Tokenizer

__all__ = ["CoordinatorConfig", "admission_policy", "dispatch_config", "load_runtime", "serve_coordinator"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX_CACHE_MEM = 512 << 20  # --prefix-cache-mem: ~5,400 tokens of a 30B-A3B's f16 KV (96 KiB a token)


class CoordinatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``moe-swarm coordinator``'s settings (built by ``coordinator.cli``; constraints checked there)."""

    model: Annotated[str, msgspec.Meta(min_length=1)]  # a GGUF path, hf:ORG/REPO/FILE.gguf or ORG/REPO[:QUANT]
    host: str = "127.0.0.1"
    port: Port = 8080
    slots: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    ctx_size: PosInt | None = None
    n_batch: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 512
    max_queue: NonNegInt = 64
    data_dir: str | None = None  # identity key + slice cache; None: a temporary directory (embedding, tests)
    dispatch_map: str | None = None  # follow this file (DESIGN §11 dispatch map)
    p2p_listen: tuple[Multiaddr, ...] = ("/ip4/127.0.0.1/tcp/0",)
    expert_timeout_s: PosFloat = 3.0
    wire_dtype: Dtype = Dtype.FLOAT32
    market: HttpUrl | None = None  # follow this market's dispatch map and register with it
    market_replicas: tuple[HttpUrl, ...] = ()  # more replicas of the same market, failed over to (swarm.failover)
    advertise_url: HttpUrl | None = None  # our URL as the market and volunteers should reach it
    token: str | None = None  # operator token for the market
    hole_punch: bool = True  # upgrade relayed connections to volunteers with DCUtR
    kernel: KernelBackend = DEFAULT_BACKEND  # expert and dense kernels: ggml (default) or the torch reference
    kv_type: Literal["f16", "f32"] = "f16"  # KV cache element type (llama.cpp's default is f16 too)
    # compute threads: the ggml kernels' threads for big calls (torch's too with the torch kernel; with
    # ggml, torch keeps one: swarm.model.kernels.configure_threads). None: the physical cores
    threads: Annotated[int, msgspec.Meta(ge=1, le=256)] | None = None
    # repacked weights (swarm.model.kernels.repack): "on" Q4_0/IQ4_NL/MXFP4, "all" Q4_K experts too (faster
    # Q4_K_M, other last bits: its volunteers need the same setting, which their kernel id shows), "off";
    # None: MOE_SWARM_REPACK or "on"
    repack: Literal["off", "on", "all"] | None = None
    # load-adaptive dispatch (DESIGN §5 layer 1; coordinator.core.dispatch): "offload" sends every range
    # with a live replica remote whatever the load (the behaviour before adaptive dispatch)
    dispatch: Literal["adaptive", "offload"] = "adaptive"
    saturation_threshold: Annotated[int, msgspec.Meta(ge=1, le=256)] = 2  # busy slots = under load
    serve_ttl_s: NonNegFloat = 20.0  # proven workers keep their share this long after the load ends
    hedge_floor_ms: NonNegFloat = 50.0  # a remote call is raced no earlier than this (else its p95)
    hot_experts: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0  # the K most-routed experts of a layer stay local
    # under load, windows local / split / local of this many seconds measure whether remote shares pay here;
    # the faster is kept for 30 s (coordinator.core.split_check); 0: earliest finish decides alone
    split_check_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 3.0
    # verification (DESIGN §12): a volunteer's first answers, and as many after any failure, are all recomputed
    # here and compared; then this share of them
    verify_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05
    max_body: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 8 << 20  # bytes of one API request body (413 above)
    verify_probation_calls: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 50
    # experts this coordinator does not hold: this share of their remote calls (and, in a volunteer's probation,
    # every one no second replica of another network checks) recomputed from the GGUF on disk (DESIGN §12)
    verify_disk_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.02
    # a listed volunteer gets work for a slice only after answering a hold challenge for it (DESIGN §12)
    hold_proof: bool = True
    # the routed experts this coordinator computes itself (DESIGN §11 SPEC; coordinator.core.local_experts):
    # others go to volunteers only (a backbone coordinator: none)
    local_experts: Annotated[str, msgspec.Meta(min_length=1, max_length=65536)] = "all"
    # a layer routed to experts nobody serves (not held here, no live volunteer): wait for coverage (up to
    # missing_wait_s, then 503), compute them from the GGUF on disk, or fail at once
    on_missing: Literal["wait", "disk", "fail"] = "wait"
    missing_wait_s: NonNegFloat = 30.0
    # speculative decoding (coordinator.core.speculation): the drafter of requests that name none ("none": off),
    # a draft GGUF sharing the model's vocabulary (the "model" drafter), the most tokens a step drafts
    draft: Literal["none", "ngram", "model", "self"] = "ngram"
    draft_model: str | None = None
    draft_max: Annotated[int, msgspec.Meta(ge=1, le=32)] = 8
    # plain HTTP(S) mirrors of the GGUF file (``--origin``, repeatable): volunteers read their slices from
    # them with Range requests at the manifest's tensor offsets, checked against its expert hashes
    origins: Annotated[tuple[HttpUrl, ...], msgspec.Meta(max_length=MAX_ORIGINS)] = ()
    # data lanes (coordinator.dispatch.lanes): volunteers dial this port and the engine's calls to them go
    # there, off the libp2p stream; 0: any free port. ``lane_announce``: HOST[:PORT] the offers name
    # (default: the host of --advertise-url, else --host, and the bound port)
    lanes: bool = True
    lane_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    lane_announce: Annotated[str, msgspec.Meta(min_length=1, max_length=260)] | None = None
    # other names a request's ``model`` may give (the id and the file's base name always work); with
    # ``strict_model`` no other name is accepted (else any name means the one model hosted)
    aliases: Annotated[tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=256)], ...],
                       msgspec.Meta(max_length=64)] = ()
    strict_model: bool = False
    # reusable prefixes (coordinator.core.prefixes): RAM the KV rows of finished requests' sequences may keep,
    # reused by later prompts starting with them; 0: none kept
    prefix_cache_mem: Annotated[int, msgspec.Meta(ge=0, le=1 << 44)] = DEFAULT_PREFIX_CACHE_MEM
    # the disk tier: prefixes RAM evicts are written here (at most prefix_cache_disk bytes) and read back on a hit
    prefix_cache_dir: str | None = None
    prefix_cache_disk: Annotated[int, msgspec.Meta(ge=0, le=1 << 50)] = 4 << 30
    # admission with a floor (coordinator.core.admission; DESIGN §11 /capacity): the mean decode tps of the
    # running sessions kept at or above tps_floor (None: no floor); "advisory" only reports, "enforced" acts
    tps_floor: Annotated[float, msgspec.Meta(gt=0.0, le=1e6)] | None = None
    admission: Literal["advisory", "enforced"] = "advisory"
    on_saturation: Literal["reject", "warn", "queue"] = "reject"
    guarantee_min_sessions: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0
    settle_tokens: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 48  # the settle window after an admit ...
    settle_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 5.0  # ... whichever ends first
    admission_hold_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 10.0  # the bound of a held request
    preempt: Literal["park", "off"] = "park"  # enforced: park sessions while the mean stays below the floor
    max_park_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] = 30.0  # a parked session resumes by then


def open_model(ref: str, kernel: KernelBackend) -> GGUFModel:
    """A GGUF by path, or by Hugging Face reference (``swarm.model.hub``: downloaded into its cache,
    progress on stderr, checked against the hub's sha256 as the model is hashed for its id)."""
    if not is_hub_model(ref):
        return GGUFModel(Path(ref), kernel=kernel)
    with show_transfers(prefix="[coordinator] ") as transfers:
        hub = resolve_hub_model(ref, progress=transfers)
    try:
        model = GGUFModel(hub.path, kernel=kernel)
    except ModelError:
        hub.check()  # a corrupt download says so (and leaves the cache) before the parser's complaint
        raise
    hub.check(model.sha256)
    return model


def load_runtime(cfg: CoordinatorConfig) -> EngineRuntime:
    threads = cfg.threads or physical_cores()
    configure_threads(threads, cfg.kernel)
    if cfg.repack is not None:  # before any weight is bound: a kernel keeps the layout it was built with
        set_repack(cfg.repack)
    model = open_model(cfg.model, cfg.kernel)
    tok = Tokenizer.from_gguf_fields(model.fields)
    n_ctx = min(cfg.ctx_size, model.config.n_ctx_train) if cfg.ctx_size else model.config.n_ctx_train
    local = parse_local_experts(cfg.local_experts, model.config.n_moe_layer, model.config.n_expert)
    held: dict[int, list[tuple[int, int]]] = {}
    for layer, lo, hi in local.ranges():
        held.setdefault(layer, []).append((lo, hi))
    drafters: dict[str, Drafter] = {
        "ngram": NgramDrafter(),
        "self": ModelDrafter("self", Transformer(model, HeldOnlyExperts(model, held)), cfg.slots, n_ctx),
    }
    if cfg.draft_model is not None:
        dm = open_model(cfg.draft_model, cfg.kernel)
        check_vocabulary(model, dm)
        drafters["model"] = ModelDrafter("model", Transformer(dm, LocalExperts(dm)), cfg.slots, n_ctx)
    elif cfg.draft == "model":
        raise ConfigError("--draft model needs --draft-model PATH (a GGUF with the model's vocabulary)",
                          code="bad_draft_model")
    return EngineRuntime(model, tok, n_slots=cfg.slots, n_ctx=cfg.ctx_size, n_batch=cfg.n_batch, max_queue=cfg.max_queue,
                         kv_type=cfg.kv_type, drafters=drafters, draft=cfg.draft, draft_max=cfg.draft_max,
                         prefix_cache_bytes=cfg.prefix_cache_mem,
                         prefix_cache_dir=Path(cfg.prefix_cache_dir) if cfg.prefix_cache_dir else None,
                         prefix_cache_disk_bytes=cfg.prefix_cache_disk, admission=admission_policy(cfg))


def admission_policy(cfg: CoordinatorConfig) -> AdmissionPolicy:
    return AdmissionPolicy(tps_floor=cfg.tps_floor, mode=cfg.admission, on_saturation=cfg.on_saturation,
                           guarantee_min_sessions=cfg.guarantee_min_sessions, settle_tokens=cfg.settle_tokens,
                           settle_s=cfg.settle_s, hold_s=cfg.admission_hold_s, preempt=cfg.preempt,
                           max_park_s=cfg.max_park_s)


def dispatch_config(cfg: CoordinatorConfig) -> DispatchConfig:
    """The dispatch core's policy from the coordinator's settings."""
    return DispatchConfig(mode=DispatchMode(cfg.dispatch), saturation_threshold=cfg.saturation_threshold,
                          serve_ttl_s=cfg.serve_ttl_s, hedge_floor_s=cfg.hedge_floor_ms / 1000.0,
                          hot_experts=cfg.hot_experts, timeout_s=cfg.expert_timeout_s,
                          split_check_s=cfg.split_check_s,
                          verify_rate=cfg.verify_rate, verify_probation_calls=cfg.verify_probation_calls,
                          missing_disk=cfg.on_missing == "disk", verify_disk_rate=cfg.verify_disk_rate)


def honest_error(model: GGUFModel, wire_dtype: str) -> float:
    """The mean relative error between honest kernels on this model (``DispatchConfig.honest_error``),
    as measured on the golden files: ggml rounds activations to 8 bits for quantised weights (ggml
    against torch: mean 1.2-1.4e-2 on Q8_0 and Q4_K_M experts), not for float ones (4e-7 on F32); a
    16-bit wire adds ~2.5e-3 on float experts. The largest of what applies, with a margin."""
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    if model.expert_stack(0).gate_t.qtype not in float_types:
        return 0.015
    return 0.004 if wire_dtype != "float32" else 1e-5


async def serve_coordinator(cfg: CoordinatorConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    rt = await trio.to_thread.run_sync(load_runtime, cfg)
    model = rt.model
    local = parse_local_experts(cfg.local_experts, model.config.n_moe_layer, model.config.n_expert)
    if not local.all:
        log.info("local experts %s: %d of %d held here, the rest only on volunteers", local.spec,
                 local.held_experts(), model.config.n_moe_layer * model.config.n_expert)
    with contextlib.ExitStack() as stack:
        if cfg.data_dir is not None:
            data_dir = Path(cfg.data_dir)  # expanded at the edge (CLI)
            await trio.Path(data_dir).mkdir(parents=True, exist_ok=True)
        else:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-swarm-coordinator-")))
        async with open_libp2p_transport(key_path=data_dir / "identity.key", listen_addrs=cfg.p2p_listen) as transport:
            dcfg = dataclasses.replace(dispatch_config(cfg), honest_error=honest_error(model, cfg.wire_dtype))
            dispatcher = Dispatcher(model, transport, config=dcfg, wire_dtype=cfg.wire_dtype,
                                    kernel=cfg.kernel, hole_punch=cfg.hole_punch,
                                    load_probe=lambda: (rt.busy(), rt.n_slots), prove_holdings=cfg.hold_proof,
                                    held=local.held,
                                    missing_wait_s=cfg.missing_wait_s if cfg.on_missing == "wait" else 0.0,
                                    lanes=lane_hub(cfg))
            rt.set_experts(dispatcher)
            caches = {model.model_id: SliceCache(model, data_dir / "slices")}
            # the expert hashes read every expert once (10-20 s for 17 GB), then come from data_dir
            manifest = await trio.to_thread.run_sync(partial(build_manifest, model, origins=cfg.origins,
                                                             cache_dir=data_dir / "manifests"))

            async def dispatch_report(request: Request) -> Response:
                # volunteers' addresses only to the operator (DESIGN §12: no IP address on a public page)
                rep = dispatcher.report()
                if not _operator(request, cfg.token):
                    rep = msgspec.structs.replace(rep, workers=[msgspec.structs.replace(w, addrs=[]) for w in rep.workers])
                return Response(msgspec.json.encode(rep), media_type="application/json")

            links: list[MarketLink] = []

            def health_extra() -> tuple[str, MarketLinkStatus | None, int]:
                holes = dispatcher.holes(trio.current_time()) if not local.all else 0
                return transport.peer_id, (links[0].status() if links else None), holes

            app = build_app(
                rt,
                model_id=model.model_id,
                aliases=[model.path.stem, *cfg.aliases],
                max_body=cfg.max_body,
                strict_model=cfg.strict_model,
                extra_routes=[*slice_routes({model.model_id: model}, caches, manifests={model.model_id: manifest}),
                              Route("/dispatch", dispatch_report, methods=["GET"])],
                extra_collectors=[dispatcher.collector()],
                extra_health=health_extra,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(dispatcher.serve)
                if cfg.dispatch_map is not None:
                    await nursery.start(watch_dispatch_map_file, Path(cfg.dispatch_map), dispatcher)
                url = await nursery.start(_serve_http, rt, app, cfg)
                if cfg.market is not None:
                    link = MarketLink(cfg.market, dispatcher, manifest,
                                      advertise_url=cfg.advertise_url or url, token=cfg.token,
                                      replicas=cfg.market_replicas,
                                      local_experts=None if local.all else local.ranges())
                    links.append(link)
                    await nursery.start(link.serve)
                task_status.started(url)


def lane_hub(cfg: CoordinatorConfig) -> LaneHub | None:
    """The data lanes' listener, or None (``--no-lanes``; or no address volunteers could dial: a
    wildcard ``--host`` without ``--advertise-url`` or ``--lane-announce``)."""
    if not cfg.lanes:
        return None
    host: str | None = None
    port: int | None = None
    if cfg.lane_announce is not None:
        h, sep, p = cfg.lane_announce.rpartition(":")
        if sep and p.isdigit() and h:
            host, port = h.strip("[]"), int(p)
        else:
            host = cfg.lane_announce
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"--lane-announce {cfg.lane_announce!r}: the port must be 1-65535", code="bad_lane_announce")
    elif cfg.advertise_url is not None:
        host = urllib.parse.urlsplit(cfg.advertise_url).hostname
    elif cfg.host not in ("0.0.0.0", "::", ""):
        host = cfg.host
    if host is None:
        log.warning("data lanes off: --host %s is no address volunteers can dial; give --advertise-url or "
                    "--lane-announce HOST[:PORT]", cfg.host)
        return None
    return LaneHub(host=cfg.host, port=cfg.lane_port, announce_host=host, announce_port=port)


def _operator(request: Request, token: str | None) -> bool:
    """Does the request carry this coordinator's operator token (``Authorization: Bearer``)?"""
    if not token:
        return False
    got = request.headers.get("authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())


async def _serve_http(
    rt: EngineRuntime, app: Starlette, cfg: CoordinatorConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    hc = HyperConfig()
    hc.bind = [f"{cfg.host}:{cfg.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 2.0
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        binds = await nursery.start(hypercorn_serve, app, hc)
        url = binds[0] if binds else f"http://{cfg.host}:{cfg.port}"
        log.info("coordinator serving %s at %s (%d slots, ctx %d)", rt.model.model_id, url, rt.n_slots, rt.n_ctx)
        task_status.started(url)
