"""``moe-swarm coordinator`` (shell: flags -> ``CoordinatorConfig`` -> ``serve_coordinator``)."""

from __future__ import annotations

import argparse
from typing import Any

from coordinator.server import CoordinatorConfig, serve_coordinator
from swarm.config import build_config, data_dir_for, env_token
from swarm.service import run_announced, size_flag

__all__ = ["add_parser", "config_from_args"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    c: argparse.ArgumentParser = subparsers.add_parser(
        "coordinator", help="host a GGUF MoE model behind an OpenAI-compatible API")
    c.add_argument("--model", required=True,
                   help="a GGUF MoE model: a path, hf:ORG/REPO/FILE.gguf, or ORG/REPO[:QUANT] (the file as llama.cpp's "
                        "-hf picks it: QUANT such as Q4_K_M, default Q4_K_M then Q8_0), downloaded into the Hugging "
                        "Face cache (HF_HOME, HF_ENDPOINT and HF_TOKEN apply) and checked against the hub's sha256")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8080)
    c.add_argument("--slots", type=int, default=4, help="parallel sequences batched per step")
    c.add_argument("--ctx-size", type=int, default=None, help="context per slot (default: the model's)")
    c.add_argument("--batch-size", type=int, default=512, help="max tokens per engine step")
    c.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503")
    c.add_argument("--data-dir", default=None,
                   help="identity key and slice cache (default ~/.local/share/moe-swarm/coordinator)")
    c.add_argument("--dispatch-map", default=None, help="follow this dispatch-map JSON file (re-read when it changes)")
    c.add_argument("--p2p-listen", action="append", default=None, help="libp2p listen multiaddr (repeatable)")
    c.add_argument("--expert-timeout", type=float, default=3.0, help="seconds before a remote expert call falls back")
    c.add_argument("--wire-dtype", choices=["float32", "bfloat16"], default="float32", help="activations on the wire")
    c.add_argument("--market", default=None, help="register with this market and follow its dispatch map")
    c.add_argument("--advertise-url", default=None, help="this coordinator's URL as others reach it (default: bound URL)")
    c.add_argument("--token", default=None, help="operator token for the market (or MOE_SWARM_TOKEN)")
    c.add_argument("--kernel", choices=["ggml", "torch"], default="ggml",
                   help="expert kernels: ggml's on the stored quantised bytes, or the torch reference")
    c.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache element type")
    c.add_argument("--threads", type=int, default=None, help="compute threads in all (default: the physical cores)")
    c.add_argument("--no-hole-punch", action="store_true",
                   help="keep relayed connections relayed (no DCUtR upgrade to a direct connection)")
    c.add_argument("--dispatch", choices=["adaptive", "offload"], default="adaptive",
                   help="adaptive: local when idle, split with proven volunteers under load (default); "
                        "offload: every range with a live volunteer goes remote")
    c.add_argument("--saturation-threshold", type=int, default=2,
                   help="busy slots from which the coordinator counts as under load")
    c.add_argument("--serve-ttl", type=float, default=20.0,
                   help="seconds proven volunteers keep their share after the load ends")
    c.add_argument("--split-check", type=float, default=3.0, metavar="SECONDS",
                   help="under load, windows local / split / local this long measure whether sending shares to "
                        "volunteers pays here; the faster is kept for 30 s (0: earliest finish decides alone)")
    c.add_argument("--hedge-floor-ms", type=float, default=50.0,
                   help="a slow remote call is raced against another copy after max(this, its p95)")
    c.add_argument("--hot-experts", type=int, default=0,
                   help="the K most-routed experts of each layer always run locally")
    c.add_argument("--max-body", type=size_flag, default=8 << 20,
                   help="largest API request body, e.g. 8M (larger: 413 body_too_large)")
    c.add_argument("--verify-rate", type=float, default=0.05,
                   help="share of volunteers' answers recomputed here and compared, after their probation")
    c.add_argument("--verify-disk-rate", type=float, default=0.02,
                   help="experts not held here: the share of volunteers' answers recomputed from the GGUF on disk "
                        "(pread, off the engine thread; every one in a volunteer's probation that no second replica "
                        "of another network checks), so replicas agreeing on a lie are caught too (0: never)")
    c.add_argument("--verify-probation", type=int, default=50,
                   help="a volunteer's first N answers (and N after any failure) are all verified")
    c.add_argument("--local-experts", default="all", metavar="SPEC",
                   help="routed experts computed here: all (default), none, or LAYERS:EXPERTS items such as "
                        "0-8:all,8-48:none (half-open); the others only on volunteers")
    c.add_argument("--on-missing", choices=["wait", "disk", "fail"], default="wait",
                   help="experts nobody serves (not held here, no live volunteer): wait for coverage up to "
                        "--missing-wait seconds then 503 (default), compute them from the GGUF on disk, or fail")
    c.add_argument("--missing-wait", type=float, default=30.0, help="seconds a layer waits for missing experts")
    c.add_argument("--origin", action="append", default=None, metavar="URL",
                   help="an http(s) URL serving this GGUF file with Range requests (a mirror; repeatable): "
                        "volunteers download their slices from it, checked against the manifest's expert hashes")
    c.add_argument("--draft", choices=["none", "ngram", "model", "self"], default="ngram",
                   help="speculative decoding: the drafter of requests that name none (a request's 'draft' field "
                        "chooses its own): ngram = prompt lookup (free), model = --draft-model, self = this model's "
                        "own blocks with only the experts held here; none = off. The output is the same either way")
    c.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a smaller GGUF with this model's vocabulary, run here, for the 'model' drafter")
    c.add_argument("--draft-max", type=int, default=8, help="the most tokens one step drafts (default 8)")
    c.add_argument("--no-hold-proof", action="store_true",
                   help="give listed volunteers work without first checking they hold their slices (hold challenge)")
    c.add_argument("--alias", action="append", default=None, metavar="NAME",
                   help="another name requests may give as 'model' (repeatable; the model id and the GGUF file's "
                        "base name always work)")
    c.add_argument("--strict-model", action="store_true",
                   help="refuse requests naming another model (default: any name means the one model hosted, "
                        "as with llama-server)")
    c.set_defaults(func=run)
    return c


def config_from_args(ns: argparse.Namespace) -> CoordinatorConfig:
    return build_config(CoordinatorConfig, {
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
        "market": ns.market,
        "advertise_url": ns.advertise_url,
        "token": env_token(ns.token),
        "hole_punch": not ns.no_hole_punch,
        "kernel": ns.kernel,
        "kv_type": ns.kv_type,
        "threads": ns.threads,
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
        "draft": ns.draft,
        "draft_model": ns.draft_model,
        "draft_max": ns.draft_max,
        "aliases": tuple(ns.alias or ()),
        "strict_model": ns.strict_model,
    }, flags={"n_batch": "--batch-size", "expert_timeout_s": "--expert-timeout", "hole_punch": "--no-hole-punch",
              "serve_ttl_s": "--serve-ttl", "origins": "--origin", "split_check_s": "--split-check",
              "verify_probation_calls": "--verify-probation", "verify_disk_rate": "--verify-disk-rate", "hold_proof": "--no-hold-proof",
              "missing_wait_s": "--missing-wait", "aliases": "--alias"})


def run(ns: argparse.Namespace) -> int:
    run_announced(serve_coordinator, config_from_args(ns), lambda url: f"coordinator ready at {url}")
    return 0
