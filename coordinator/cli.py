"""``moe-swarm coordinator`` (shell: flags -> ``CoordinatorConfig`` -> checks -> ``serve_coordinator``).

Rules:
- Importing this module imports nothing heavy (``swarm.flags``): the parser is built for every
  ``moe-swarm --help``. ``config_from_args`` and ``run`` import the coordinator.
- ``run`` checks what a person can get wrong before the model loads, each a one-line ``ConfigError``
  naming the flag: experts computed nowhere (``--local-experts`` other than ``all`` with no market,
  dispatch map or disk fallback), the data dir held by another coordinator (a lock for the process's
  life: ``swarm.lockfile``), the GGUF missing or cut short, the ports taken, the market unreachable
  or refusing the token (``swarm.preflight``).
"""

from __future__ import annotations

import argparse
from typing import Any

from swarm.config import data_dir_for, env_token
from swarm.errors import ConfigError
from swarm.flags import size_flag

__all__ = ["add_parser", "config_from_args", "run"]

_FLAGS = {"n_batch": "--batch-size", "prefix_cache_mem": "--prefix-cache-mem",
          "prefix_cache_dir": "--prefix-cache-dir", "prefix_cache_disk": "--prefix-cache-disk", "expert_timeout_s": "--expert-timeout", "hole_punch": "--no-hole-punch",
          "serve_ttl_s": "--serve-ttl", "origins": "--origin", "split_check_s": "--split-check",
          "verify_probation_calls": "--verify-probation", "verify_disk_rate": "--verify-disk-rate",
          "hold_proof": "--no-hold-proof", "missing_wait_s": "--missing-wait", "lanes": "--no-lanes",
          "aliases": "--alias", "tps_floor": "--tps-floor", "on_saturation": "--on-saturation",
          "guarantee_min_sessions": "--guarantee-min-sessions", "settle_tokens": "--settle-tokens",
          "settle_s": "--settle-time", "admission_hold_s": "--admission-hold",
          "preempt": "--preempt", "max_park_s": "--max-park-time"}


def _cache_size(text: str) -> int:
    """A cache size (``size_flag``), or 0: off."""
    return 0 if text.strip() == "0" else size_flag(text)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    c: argparse.ArgumentParser = subparsers.add_parser(
        "coordinator", usage="%(prog)s --model GGUF [--port PORT] [--market URL --token TOKEN] [options]", help="host a GGUF MoE model behind an OpenAI-compatible API",
        description="Host a GGUF MoE model behind an OpenAI-compatible API (/v1/chat/completions, /v1/completions), "
                    "computing its experts here and, through a market, on volunteers.")
    m = c.add_argument_group("model and API")
    m.add_argument("--model", required=True,
                   help="a GGUF MoE model: a path, hf:ORG/REPO/FILE.gguf, or ORG/REPO[:QUANT] (the file as llama.cpp's "
                        "-hf picks it: QUANT such as Q4_K_M, default Q4_K_M then Q8_0), downloaded into the Hugging "
                        "Face cache (HF_HOME, HF_ENDPOINT and HF_TOKEN apply) and checked against the hub's sha256")
    m.add_argument("--alias", action="append", default=None, metavar="NAME",
                   help="another name requests may give as 'model' (repeatable; the model id and the GGUF file's "
                        "base name always work)")
    m.add_argument("--strict-model", action="store_true",
                   help="refuse requests naming another model (default: any name means the one model hosted, "
                        "as with llama-server)")
    m.add_argument("--host", default="127.0.0.1", help="API bind address")
    m.add_argument("--port", type=int, default=8080, help="API port (0: any free port)")
    m.add_argument("--slots", type=int, default=4, help="parallel sequences batched per step")
    m.add_argument("--ctx-size", type=int, default=None, help="context per slot (default: the model's)")
    m.add_argument("--batch-size", type=int, default=512, help="max tokens per engine step")
    m.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503")
    m.add_argument("--max-body", type=size_flag, default="8M", metavar="SIZE", help="largest API request body (larger: 413 body_too_large)")
    m.add_argument("--kernel", choices=["ggml", "torch"], default="ggml",
                   help="kernels: ggml's on the stored quantised bytes, or the torch reference")
    m.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache element type")
    m.add_argument("--prefix-cache-mem", type=_cache_size, default="512M", metavar="SIZE",
                   help="RAM for the KV of finished requests' prompts (and replies), reused by later prompts that "
                        "start with them: only the rest is prefilled (0: off)")
    m.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="a disk tier for the prefix cache: prefixes evicted from RAM are written here and read back "
                        "(checked) when a prompt starts with one; kept across restarts")
    m.add_argument("--prefix-cache-disk", type=_cache_size, default="4G", metavar="SIZE",
                   help="the most the prefix cache's files in --prefix-cache-dir may take")
    m.add_argument("--threads", type=int, default=None, help="compute threads in all (default: the physical cores)")
    m.add_argument("--repack", choices=["off", "on", "all"], default=None,
                   help="ggml's repacked weight layouts: on (default, or MOE_SWARM_REPACK) Q4_0/IQ4_NL/MXFP4; all: Q4_K "
                        "experts too -- faster Q4_K_M, other last bits, so its volunteers need --repack all as well")
    m.add_argument("--data-dir", default=None,
                   help="identity key and slice cache, one coordinator each (default ~/.local/share/moe-swarm/coordinator)")

    k = c.add_argument_group("market and volunteers")
    k.add_argument("--market", action="append", default=None, metavar="URL",
                   help="register with this market (e.g. http://127.0.0.1:8090) and follow its dispatch map; repeat "
                        "it for replicas of one market (--market URL --market URL2): failed over in turn")
    k.add_argument("--token", default=None, help="operator token for the market (or MOE_SWARM_TOKEN)")
    k.add_argument("--advertise-url", default=None, metavar="URL",
                   help="this coordinator's URL as volunteers reach it (default: the bound URL)")
    k.add_argument("--origin", action="append", default=None, metavar="URL",
                   help="an http(s) URL serving this GGUF file with Range requests (a mirror; repeatable): "
                        "volunteers download their slices from it, checked against the manifest's expert hashes")
    k.add_argument("--dispatch-map", default=None, metavar="FILE",
                   help="follow this dispatch-map JSON file instead of a market (re-read when it changes)")
    k.add_argument("--p2p-listen", action="append", default=None, metavar="MULTIADDR",
                   help="libp2p listen multiaddr (repeatable; default /ip4/127.0.0.1/tcp/0)")
    k.add_argument("--no-hole-punch", action="store_true",
                   help="keep relayed connections relayed (no DCUtR upgrade to a direct connection)")
    k.add_argument("--lane-port", type=int, default=0,
                   help="port volunteers dial for data lanes: direct TCP connections the engine's expert calls take "
                        "(0: any free one)")
    k.add_argument("--lane-announce", default=None, metavar="HOST[:PORT]",
                   help="the lane address volunteers are told (default: --advertise-url's host, else --host, and the "
                        "bound port)")
    k.add_argument("--no-lanes", action="store_true", help="every expert call on the libp2p stream (no data lanes)")

    d = c.add_argument_group("dispatch: where experts run")
    d.add_argument("--local-experts", default="all", metavar="SPEC",
                   help="routed experts computed here: all, none, or LAYERS:EXPERTS items such as 0-8:all,8-48:none "
                        "(half-open); the others only on volunteers (needs --market or --dispatch-map)")
    d.add_argument("--dispatch", choices=["adaptive", "offload"], default="adaptive",
                   help="adaptive: local when idle, split with proven volunteers under load; "
                        "offload: every range with a live volunteer goes remote")
    d.add_argument("--saturation-threshold", type=int, default=2,
                   help="busy slots from which the coordinator counts as under load")
    d.add_argument("--serve-ttl", type=float, default=20.0,
                   help="seconds proven volunteers keep their share after the load ends")
    d.add_argument("--split-check", type=float, default=3.0, metavar="SECONDS",
                   help="under load, windows local / split / local this long measure whether sending shares to "
                        "volunteers pays here; the faster is kept for 30 s (0: earliest finish decides alone)")
    d.add_argument("--expert-timeout", type=float, default=3.0, help="seconds before a remote expert call falls back")
    d.add_argument("--hedge-floor-ms", type=float, default=50.0,
                   help="a slow remote call is raced against another copy after max(this, its p95)")
    d.add_argument("--hot-experts", type=int, default=0, help="the K most-routed experts of each layer always run locally")
    d.add_argument("--wire-dtype", choices=["float32", "bfloat16"], default="float32", help="activations on the wire")
    d.add_argument("--on-missing", choices=["wait", "disk", "fail"], default="wait",
                   help="experts nobody serves (not held here, no live volunteer): wait for coverage up to "
                        "--missing-wait seconds then 503, compute them from the GGUF on disk, or fail")
    d.add_argument("--missing-wait", type=float, default=30.0, help="seconds a layer waits for missing experts")

    v = c.add_argument_group("verification of volunteers")
    v.add_argument("--verify-rate", type=float, default=0.05,
                   help="share of volunteers' answers recomputed here and compared, after their probation")
    v.add_argument("--verify-disk-rate", type=float, default=0.02,
                   help="experts not held here: the share of volunteers' answers recomputed from the GGUF on disk "
                        "(pread, off the engine thread; every one in a volunteer's probation that no second replica "
                        "of another network checks), so replicas agreeing on a lie are caught too (0: never)")
    v.add_argument("--verify-probation", type=int, default=50,
                   help="a volunteer's first N answers (and N after any failure) are all verified")
    v.add_argument("--no-hold-proof", action="store_true",
                   help="give listed volunteers work without first checking they hold their slices (hold challenge)")

    a = c.add_argument_group("admission: the speed sessions experience")
    a.add_argument("--tps-floor", type=float, default=None, metavar="TPS",
                   help="keep the running sessions' mean decode tokens/s at or above this: a new request that would "
                        "take it below waits or is refused (--admission enforced); default: no floor")
    a.add_argument("--admission", choices=["advisory", "enforced"], default="advisory",
                   help="advisory: /capacity and /slots report what the floor allows, every request starts; "
                        "enforced: new requests are held or refused by it")
    a.add_argument("--on-saturation", choices=["reject", "warn", "queue"], default="reject",
                   help="a new request past the floor (enforced): 429 with Retry-After, or start it with the header "
                        "X-Sessions-Remaining: 0, or hold it (up to --admission-hold seconds, then 429)")
    a.add_argument("--guarantee-min-sessions", type=int, default=0, metavar="N",
                   help="always admit up to N running sessions, whatever their speed")
    a.add_argument("--settle-tokens", type=int, default=48, metavar="N",
                   help="after each admit, its session's first N decode tokens are its settle window (new "
                        "requests wait meanwhile; its speed is not counted yet)")
    a.add_argument("--settle-time", type=float, default=5.0, metavar="SECONDS",
                   help="... or this many seconds from its admission, whichever ends first")
    a.add_argument("--admission-hold", type=float, default=10.0, metavar="SECONDS",
                   help="the longest a new request is held (settle window, --on-saturation queue)")
    a.add_argument("--preempt", choices=["park", "off"], default="park",
                   help="enforced: while the mean stays below the floor past half a settle window, park the most "
                        "recently admitted session (decode paused, KV kept, its stream waits; never the first "
                        "--guarantee-min-sessions), resumed before any new admit once the projection allows")
    a.add_argument("--max-park-time", type=float, default=30.0, metavar="SECONDS",
                   help="a parked session resumes after this long whatever the projection (another is parked in "
                        "its place: over-subscribed sessions take turns)")

    s = c.add_argument_group("speculative decoding")
    s.add_argument("--draft", choices=["none", "ngram", "model", "self"], default="ngram",
                   help="the drafter of requests that name none (a request's 'draft' field chooses its own): "
                        "ngram = prompt lookup (free), model = --draft-model, self = this model's own blocks with "
                        "only the experts held here; none = off. The output is the same either way")
    s.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a smaller GGUF with this model's vocabulary, run here, for the 'model' drafter")
    s.add_argument("--draft-max", type=int, default=8, help="the most tokens one step drafts")
    c.set_defaults(func=run)
    return c


def config_from_args(ns: argparse.Namespace) -> Any:
    from coordinator.server import CoordinatorConfig
    from swarm.config import build_config

    cfg = build_config(CoordinatorConfig, {
        "model": ns.model,
        "host": ns.host,
        "port": ns.port,
        "slots": ns.slots,
        "ctx_size": ns.ctx_size,
        "n_batch": ns.batch_size,
        "max_queue": ns.max_queue,
        "data_dir": data_dir_for("coordinator", ns.data_dir),
        "dispatch_map": ns.dispatch_map,
        "p2p_listen": tuple(ns.p2p_listen or ["/ip4/127.0.0.1/tcp/0"]),
        "expert_timeout_s": ns.expert_timeout,
        "wire_dtype": ns.wire_dtype,
        "market": ns.market[0] if ns.market else None,
        "market_replicas": tuple(ns.market[1:]) if ns.market else (),
        "advertise_url": ns.advertise_url,
        "token": env_token(ns.token),
        "hole_punch": not ns.no_hole_punch,
        "kernel": ns.kernel,
        "kv_type": ns.kv_type,
        "threads": ns.threads,
        "repack": ns.repack,
        "dispatch": ns.dispatch,
        "saturation_threshold": ns.saturation_threshold,
        "serve_ttl_s": ns.serve_ttl,
        "split_check_s": ns.split_check,
        "hedge_floor_ms": ns.hedge_floor_ms,
        "hot_experts": ns.hot_experts,
        "verify_rate": ns.verify_rate,
        "max_body": ns.max_body,
        "verify_probation_calls": ns.verify_probation,
        "verify_disk_rate": ns.verify_disk_rate,
        "hold_proof": not ns.no_hold_proof,
        "local_experts": ns.local_experts,
        "on_missing": ns.on_missing,
        "missing_wait_s": ns.missing_wait,
        "origins": tuple(ns.origin or ()),
        "lanes": not ns.no_lanes,
        "lane_port": ns.lane_port,
        "lane_announce": ns.lane_announce,
        "draft": ns.draft,
        "draft_model": ns.draft_model,
        "draft_max": ns.draft_max,
        "aliases": tuple(ns.alias or ()),
        "strict_model": ns.strict_model,
        "prefix_cache_mem": ns.prefix_cache_mem,
        "prefix_cache_dir": ns.prefix_cache_dir,
        "prefix_cache_disk": ns.prefix_cache_disk,
        "tps_floor": ns.tps_floor,
        "admission": ns.admission,
        "on_saturation": ns.on_saturation,
        "guarantee_min_sessions": ns.guarantee_min_sessions,
        "settle_tokens": ns.settle_tokens,
        "settle_s": ns.settle_time,
        "admission_hold_s": ns.admission_hold,
        "preempt": ns.preempt,
        "max_park_s": ns.max_park_time,
    }, flags=_FLAGS)
    if cfg.local_experts.strip() != "all" and cfg.market is None and cfg.dispatch_map is None and cfg.on_missing != "disk":
        raise ConfigError(f"--local-experts {cfg.local_experts}: the experts not computed here need volunteers, and "
                          "without --market (or --dispatch-map) there are none: every request would wait and fail; "
                          "give --market URL, or --on-missing disk to compute them from the GGUF", code="no_volunteers")
    return cfg


def run(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from coordinator.server import serve_coordinator
    from swarm import preflight
    from swarm.lockfile import LOCK_NAME, hold
    from swarm.model.gguf_check import check_gguf_file
    from swarm.model.hub import is_hub_model
    from swarm.service import run_announced

    cfg = config_from_args(ns)
    with hold(Path(cfg.data_dir) / LOCK_NAME, flag="--data-dir", shown=cfg.data_dir, what="coordinator"):
        if not is_hub_model(cfg.model):  # a hub reference is checked as it downloads (swarm.model.hub)
            check_gguf_file(cfg.model, "--model")
        if cfg.draft_model is not None:
            check_gguf_file(cfg.draft_model, "--draft-model")
        preflight.check_port_free(cfg.host, cfg.port, "--port")
        preflight.check_listen_addrs(cfg.p2p_listen, "--p2p-listen")
        if cfg.market is not None:
            preflight.check_any_market([cfg.market, *cfg.market_replicas], token=cfg.token, operator=True)
        run_announced(serve_coordinator, cfg, lambda url: f"coordinator ready at {url}")
    return 0
