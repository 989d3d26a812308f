"""Can a lying volunteer change the output? Verification against liars and honest workers (DESIGN §12;
DESIGN §11 JSON).

    python benchmarks/verification.py [--quick | --smoke] [--json OUT] [--honest-calls N] [--no-throughput]

``--smoke`` (``make test``: ``tests/benchmarks``): seconds, not minutes -- the ``zeros`` liar, ``colluding-pair``,
``sub-tolerance-0.04``, ``squatter-liar``, ``budget-jam`` and 50 honest calls; no sleeper, no throughput.

In one process, on real py-libp2p hosts on loopback: a coordinator's dispatcher with the engine
(``Transformer``) on the Q8_0 golden model (``tests/fixtures/golden/qwen3moe-tiny-q8_0.gguf``: 2 layers,
8 experts top-2) and volunteers with the real ``ExpertServer`` (ggml kernel, one thread each), every
range going remote (``--dispatch offload``: the most exposure; the sampling rules are those of adaptive
dispatch) and verification at its defaults (probation 50, then ``--verify-rate`` 0.05) unless a case
says otherwise. A completion is 16 greedy tokens from one of three prompts; it *differs* when its tokens
differ from the all-local run's. Cases:

- liars beside an honest replica, lying from their first call: ``zeros``, ``scaled`` (x1.5), ``noise``
  (10 % relative Gaussian noise; the liar announces another kernel id, so the comparison is the
  tolerance one), ``intermittent`` (x1.5 on every 20th call); ``ulp`` (1 ulp on one element, equal
  kernel ids). Each reports ``calls_to_quarantine`` (its calls up to and including the one that
  quarantined it), ``completions_differing`` and ``false_quarantines`` (the honest replica);
- ``backbone-scaled``: a backbone coordinator (no expert in memory), the liar beside an honest replica;
- ``colluding-pair``: a backbone coordinator and two liars on one network agreeing on x1.5: no
  cross-check pairs them, so only the GGUF on disk (``--verify-disk-rate`` 0.02, every call of a
  probation) catches them (before issue 31: 8/8 completions wrong, both proven and credited);
  ``accomplices_quarantined``, ``disk_checks``;
- ``sub-tolerance-0.04`` / ``-0.02``: Gaussian noise of 4 % / 2 % relative L2 per pair (the tolerance is
  5 %) from a worker announcing another kernel id: each comparison passes, the mean error adds up
  (``drift_factor`` 2 x the honest spread 1.5e-2 between kernels on quantised experts). Before issue 31
  such a liar took 674 lies to be caught; 2 % is within the honest spread (not distinguishable);
- ``sleeper``: honest for its first 1,000 calls, then x1.5, at the default rate and at rate 1:
  ``calls_to_quarantine`` counts from its first lie;
- ``squatter-liar`` (the market's side of it): a backbone coordinator (no expert of its own; each
  range wanted twice, ``--remote-base-target`` 2) whose market, a real ``market.state.Market`` on
  virtual time, has a lying volunteer (x1.5) serving every range and a squatter that took the other
  lease of each and heartbeats ``loading`` for ever. Before issue 31 the squatter counted as the second
  replica for good: no honest one was recruited and every answer of the liar went unchecked. Now the
  squatter's holdings go at their download deadline and an honest newcomer gets them:
  ``recruit_wait_s`` (market seconds until the honest one held every range) and ``squatter_counted_s``
  (how long the squatter's holdings counted), then the coordinator dispatches by the market's map:
  ``calls_to_quarantine``, ``completions_differing``, ``false_quarantines``;
- ``budget-jam``: a volunteer answering only its coordinator, with a 64 MiB request budget (32 MiB a
  peer), jammed first by 4 throwaway identities x 2 streams declaring 16 MiB payloads and then closing
  or going silent (issue 31: that took a 128 MiB budget for good): ``budget_held_bytes`` after the
  attack (0), ``busy_refusals`` of the coordinator's calls (0), ``remote_calls`` it served and
  ``completions_differing`` (0);
- ``honest``: two honest volunteers (one with our kernel id: bit-exact comparisons; one with the torch
  reference kernel: tolerance comparisons), every answer compared (rate 1), ``--honest-calls`` calls
  (10^4; 10^3 with ``--quick``): ``false_quarantines``; ``offload_throughput_cost_pct``, the cost of
  the default rate here with every range remote (one honest volunteer, verification at its defaults vs
  off, interleaved rounds, medians); and ``throughput_cost_pct``, the cost in ``benchmarks/offload.py``'s
  setup (the bench model, coordinator and volunteer as processes, adaptive dispatch at 4 sessions,
  default verification vs none on a second coordinator), unless ``--no-throughput``.

Threads: the coordinator's kernels and each volunteer's one thread share the machine's two cores (one
process; the volunteers' compute runs on worker threads).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))  # _results (appended: benchmarks/market.py must not shadow the market package)

from _results import write_json  # noqa: E402

from coordinator.core.dispatch import DispatchConfig, DispatchMode  # noqa: E402
from coordinator.dispatch.dispatcher import Dispatcher  # noqa: E402
from coordinator.engine.model import KVCache, SeqChunk, Transformer  # noqa: E402
from market.policy import MarketPolicy  # noqa: E402
from market.state import Market  # noqa: E402
from market.state import Offer as MarketOffer  # noqa: E402
from market.store import InMemoryStore  # noqa: E402
from swarm.dispatch_map import DispatchMap, LayerRanges, RangeReplicas, Replica  # noqa: E402
from swarm.errors import DispatchFailed  # noqa: E402
from swarm.model.gguf import GGUFModel  # noqa: E402
from swarm.model.kernels import KernelBackend, configure_threads  # noqa: E402
from swarm.model.slices import build_manifest, cut_slice, load_slice  # noqa: E402
from swarm.p2p.libp2p import open_libp2p_transport  # noqa: E402
from swarm.protocol.expert import (  # noqa: E402
    PROTOCOL_ID,
    ExpertRequest,
    ExpertResponse,
    FrameReader,
    Pairs,
    RequestId,
    encode_frame,
    encode_message,
    make_hello,
    request_payload_len,
)
from swarm.protocol.market import (  # noqa: E402
    CoordinatorReport,
    CoverageHeartbeat,
    HeldSlice,
    HeldState,
    ProvenSlice,
    RegisterModels,
    ReportedWorker,
    VolunteerRequest,
)
from swarm.rpc.server import ByteBudget, set_expert_handlers  # noqa: E402
from volunteer.server import ExpertServer  # noqa: E402

MODEL = ROOT / "tests" / "fixtures" / "golden" / "qwen3moe-tiny-q8_0.gguf"
GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "qwen3moe-tiny-q8_0.llamacpp.json"
N_TOKENS = 16
RANGES = [(L, lo, hi) for L in (0, 1) for lo, hi in ((0, 4), (4, 8))]
Handler = Callable[[ExpertRequest, torch.Tensor, Pairs], Awaitable[torch.Tensor]]
Lie = Callable[[int, torch.Tensor], torch.Tensor | None]  # (call number from 0, honest answer) -> lie, or None


def one_ulp(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(float("inf")))
    return y


def noise(y: torch.Tensor, rel: float = 0.1) -> torch.Tensor:
    """Gaussian noise of ``rel`` x each pair's RMS: a relative L2 error of about ``rel`` per pair."""
    scale: torch.Tensor = rel * y.norm(dim=1, keepdim=True) / y.shape[1] ** 0.5
    return y + scale * torch.randn(y.shape)


class Worker:
    """A volunteer's expert server on its own libp2p host, optionally lying."""

    def __init__(self, model: GGUFModel, *, lie: Lie | None = None, kernel: KernelBackend = KernelBackend.GGML,
                 announce: str | None = None, authorize: Callable[[str], bool] | None = None,
                 budget: ByteBudget | None = None, net: str = "") -> None:
        self.net = net  # the market's tag of its network ("": unknown): one net's replicas never check each other
        self.server = ExpertServer([load_slice(cut_slice(model, L, lo, hi)) for L, lo, hi in RANGES], threads=1, kernel=kernel)
        self.lie = lie
        self.authorize = authorize
        self.budget = budget
        self.announce = announce or self.server.kernel_id
        self.calls = 0
        self.first_lie: int | None = None
        self.peer_id = ""
        self.addrs: list[str] = []

    async def handle(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        n = self.calls
        self.calls += 1
        out = await self.server.handle(req, rows, pairs)
        bad = self.lie(n, out) if self.lie is not None else None
        if bad is None:
            return out
        if self.first_lie is None:
            self.first_lie = n
        return bad

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
            await n.start(self.server.serve)
            set_expert_handlers(t, self.handle, hello=make_hello(kernel_id=self.announce), authorize=self.authorize,
                                budget=self.budget)
            self.peer_id, self.addrs = t.peer_id, t.listen_addrs
            task_status.started()
            await trio.sleep_forever()


def dmap(model: GGUFModel, workers: list[Worker]) -> DispatchMap:
    layers: dict[int, list[RangeReplicas]] = {}
    for L, lo, hi in RANGES:
        layers.setdefault(L, []).append(RangeReplicas(lo, hi, [Replica(w.peer_id, w.addrs, net=w.net) for w in workers]))
    return DispatchMap(model.model_id, 1, [LayerRanges(L, r) for L, r in sorted(layers.items())])


async def complete(tr: Transformer, prompt: list[int]) -> list[int]:
    def run() -> list[int]:
        cache = KVCache(tr.cfg, 128)
        lg = tr.forward([SeqChunk(cache, list(prompt), 0)])[0]
        out, pos = [], len(prompt)
        for _ in range(N_TOKENS):
            t = int(lg[-1].argmax())
            out.append(t)
            lg = tr.forward([SeqChunk(cache, [t], pos)])[0]
            pos += 1
        return out

    return await trio.to_thread.run_sync(run)


async def completions(tr: Transformer, d: Dispatcher, prompts: list[list[int]], ref: list[list[int]], limit: int
                      ) -> tuple[int, int, int]:
    """Greedy completions until ``limit`` or the first quarantine: (done, differing from all-local,
    failed). A completion fails when every replica of a range it needs was quarantined and the
    coordinator does not hold it (a 503 for a client): that is no wrong token, and the last one."""
    done = differing = failed = 0
    while done < limit and not d.core.quarantines:
        i = done % len(prompts)
        try:
            differing += (await complete(tr, prompts[i])) != ref[i]
        except DispatchFailed:
            failed += 1
            break
        done += 1
    return done, differing, failed


async def liar_case(model: GGUFModel, prompts: list[list[int]], ref: list[list[int]], name: str, workers: list[Worker],
                    liar: Worker, cfg: DispatchConfig, max_completions: int, *, from_first_lie: bool = False,
                    backbone: bool = False, accomplices: tuple[Worker, ...] = ()) -> dict[str, Any]:
    """``backbone``: the coordinator holds no expert (``--local-experts none``): checks run on a second
    replica of another network, or on the GGUF on disk (``verify_disk_rate``). ``accomplices``: other
    liars (their quarantines are not false ones; ``accomplices_quarantined`` counts them)."""
    async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
        for w in workers:
            await n.start(w.run)
        d = Dispatcher(model, t, config=cfg, **({"held": lambda layer, lo, hi: False} if backbone else {}))
        await n.start(d.serve)
        d.set_map(dmap(model, workers))
        tr = Transformer(model, d)
        t0 = time.perf_counter()
        done, differing, failed = await completions(tr, d, prompts, ref, max_completions)
        await trio.sleep(0.2)  # comparisons still in flight
        rep = d.report()
        q = {w.peer_id for w in rep.workers if w.state == "quarantined"}
        disk_checks = d.executor.disk_checks_done
        calls = liar.calls
        if from_first_lie and liar.first_lie is not None:
            calls -= liar.first_lie
        n.cancel_scope.cancel()
    case = {"case": name, "verify_rate": cfg.verify_rate, "completions": done, "disputes": d.core.disputes,
            "calls_to_quarantine": calls if liar.peer_id in q else None, "completions_differing": differing,
            "completions_failed": failed, "false_quarantines": len(q - {liar.peer_id} - {a.peer_id for a in accomplices}), "liar_calls": liar.calls,
            "disk_checks": disk_checks, "seconds": round(time.perf_counter() - t0, 1)}
    if accomplices:
        case["accomplices_quarantined"] = len(q & {a.peer_id for a in accomplices})
    print(f"  {name:<13} rate {cfg.verify_rate:<5} calls to quarantine {case['calls_to_quarantine']}, completions "
          f"differing {differing}/{done}, failed {failed}, false quarantines {case['false_quarantines']}", flush=True)
    return case


def _hb(peer: str, seq: int, addrs: list[str], held: list[tuple[int, int, int]], state: HeldState, mid: str) -> CoverageHeartbeat:
    return CoverageHeartbeat(peer, 1, seq, addrs, [HeldSlice(mid, L, lo, hi, state) for L, lo, hi in held], protocols=[2])


async def squatter_liar_case(model: GGUFModel, prompts: list[list[int]], ref: list[list[int]],
                             max_completions: int) -> dict[str, Any]:
    """The market's side of a squatter beside a liar (module docstring)."""
    policy = MarketPolicy(remote_base_target=2, base_target=1, boost=0, heartbeat_ttl_s=60.0, lease_s=30.0,
                          download_grace_s=60.0, proof_grace_s=120.0, header_allowance=0)
    market = Market(InMemoryStore(), policy, now=0.0, rng=random.Random(0))
    manifest = build_manifest(model)
    url = "http://backbone.bench"
    market.register(RegisterModels(url, [manifest], epoch=1, local_experts={manifest.model_id: []}), 0.0)
    mid = manifest.model_id
    liar, honest = Worker(model, lie=lambda n, y: y * 1.5), Worker(model)
    seqs: dict[str, int] = {}

    def take_all(peer: str, now: float, addrs: list[str], state: HeldState) -> list[tuple[int, int, int]]:
        """Poll, lease and report until the market offers nothing more: every range it gets, in ``state``."""
        held: list[tuple[int, int, int]] = []
        while True:
            seqs[peer] = seqs.get(peer, 0) + 1
            got = market.volunteer(VolunteerRequest(peer, max_experts=4, epoch=1, sequence=seqs[peer]), now)
            if not isinstance(got, MarketOffer):
                return held
            s = got.lease.slice
            held.append((s.layer, s.lo, s.hi))
            seqs[peer] += 1
            market.heartbeat(_hb(peer, seqs[peer], addrs, held, state, mid), now)

    async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
        for w in (liar, honest):
            await n.start(w.run)
        liar_held = take_all(liar.peer_id, 1.0, liar.addrs, HeldState.SERVING)
        squatter = "12D3KooWSquatterSquatterSquatterSquatterSquatter1"
        squat = take_all(squatter, 2.0, [], HeldState.LOADING)  # takes the other lease of each, never downloads
        market.report(CoordinatorReport(url=url, model_id=mid, workers=[
            ReportedWorker(peer_id=liar.peer_id, held=[ProvenSlice(*h) for h in liar_held])]), 3.0)
        now, recruited_at, squat_gone_at = 3.0, None, None
        while now < 600.0 and recruited_at is None:  # the market's clock: heartbeats every 5 s, the honest one polls
            now += 5.0
            for peer, addrs, held, state in ((liar.peer_id, liar.addrs, liar_held, HeldState.SERVING),
                                             (squatter, [], squat, HeldState.LOADING)):
                seqs[peer] += 1
                market.heartbeat(_hb(peer, seqs[peer], addrs, held, state, mid), now)
            market.tick(now)
            if squat_gone_at is None and squatter not in market.ix.coverage:
                squat_gone_at = now
            got = take_all(honest.peer_id, now, honest.addrs, HeldState.SERVING)
            if got:
                market.report(CoordinatorReport(url=url, model_id=mid, workers=[
                    ReportedWorker(peer_id=honest.peer_id, held=[ProvenSlice(*h) for h in got])]), now)
                recruited_at = now
        market.tick(now + 0.5)
        dm = market.dispatch_map(mid)
        d = Dispatcher(model, t, config=DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False),
                       held=lambda layer, lo, hi: False)
        await n.start(d.serve)
        d.set_map(dm)
        tr = Transformer(model, d)
        t0 = time.perf_counter()
        done, differing, failed = await completions(tr, d, prompts, ref, max_completions if recruited_at is not None else 0)
        await trio.sleep(0.2)  # comparisons still in flight
        q = {w.peer_id for w in d.report().workers if w.state == "quarantined"}
        n.cancel_scope.cancel()
    mapped = {r.peer_id for L in dm.layers for rr in L.ranges for r in rr.replicas}
    case = {"case": "squatter-liar", "verify_rate": DispatchConfig().verify_rate, "completions": done,
            "squatter_counted_s": None if squat_gone_at is None else round(squat_gone_at - 2.0, 1),
            "recruit_wait_s": None if recruited_at is None else round(recruited_at - 2.0, 1),
            "honest_mapped": honest.peer_id in mapped, "squatter_mapped": squatter in mapped,
            "calls_to_quarantine": liar.calls if liar.peer_id in q else None, "completions_differing": differing,
            "completions_failed": failed, "false_quarantines": len(q - {liar.peer_id}), "liar_calls": liar.calls,
            "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  squatter-liar the squatter counted {case['squatter_counted_s']} s, an honest replica after "
          f"{case['recruit_wait_s']} s; calls to quarantine {case['calls_to_quarantine']}, completions differing "
          f"{differing}/{done}", flush=True)
    return case


async def budget_jam_case(model: GGUFModel, prompts: list[list[int]], ref: list[list[int]],
                          n_completions: int) -> dict[str, Any]:
    """Strangers declare 16 MiB payloads and leave or fall silent; the coordinator is served after (module docstring)."""
    budget = ByteBudget(per_peer=32 << 20, total=64 << 20)
    coordinator_peer: list[str] = []
    vol = Worker(model, authorize=lambda p: p in coordinator_peer, budget=budget)
    big = ExpertRequest(request_id=RequestId(1), attempt=0, model_id=model.model_id, layer=0, lo=0, hi=4, n_rows=1024,
                        d_model=4096, n_pairs=1024, dtype="float32")
    header = encode_message(big)
    declared = struct.pack("<II", len(header), request_payload_len(big)) + header + b"\0" * 1000
    async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
        coordinator_peer.append(t.peer_id)
        await n.start(vol.run)
        refused = 0
        for _ in range(4):
            async with open_libp2p_transport(key_path=None) as stranger:
                for j in range(2):
                    s = await stranger.open_stream(vol.peer_id, vol.addrs, PROTOCOL_ID)
                    await s.write(encode_frame(make_hello(kernel_id="x")) + declared)
                    reader = FrameReader(s)
                    with trio.fail_after(30):  # the volunteer's Hello, then its answer to the header
                        got = [await reader.receive_message(), await reader.receive_message()]
                    refused += isinstance(got[1] and got[1][0], ExpertResponse) and got[1][0].status == "not_authorized"  # type: ignore[union-attr]
                    if j == 0:
                        await s.aclose()  # the second stays open, silent, until the stranger leaves
        held_after = budget.held
        d = Dispatcher(model, t, config=DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False))
        await n.start(d.serve)
        d.set_map(dmap(model, [vol]))
        tr = Transformer(model, d)
        refused_before = budget.refused
        differing = 0
        t0 = time.perf_counter()
        for i in range(n_completions):
            differing += (await complete(tr, prompts[i % len(prompts)])) != ref[i % len(prompts)]
        n.cancel_scope.cancel()
    case = {"case": "budget-jam", "verify_rate": DispatchConfig().verify_rate, "completions": n_completions,
            "calls_to_quarantine": None, "completions_differing": differing, "false_quarantines": 0,
            "declared_bytes": 8 * request_payload_len(big), "headers_refused_at_once": refused,
            "budget_held_bytes": held_after, "busy_refusals": budget.refused - refused_before,
            "remote_calls": vol.calls, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  budget-jam    {case['declared_bytes'] >> 20} MiB declared by 8 strangers' streams: {held_after} bytes held "
          f"after; the coordinator's {vol.calls} calls, {case['busy_refusals']} refused busy, completions differing "
          f"{differing}/{n_completions}", flush=True)
    return case


async def honest_case(model: GGUFModel, prompts: list[list[int]], ref: list[list[int]], n_calls: int) -> dict[str, Any]:
    same, other = Worker(model), Worker(model, kernel=KernelBackend.TORCH)
    cfg = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=1.0)
    async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
        for w in (same, other):
            await n.start(w.run)
        d = Dispatcher(model, t, config=cfg)
        await n.start(d.serve)
        d.set_map(dmap(model, [same, other]))
        tr = Transformer(model, d)
        differing = done = 0
        t0 = time.perf_counter()
        while same.calls + other.calls < n_calls:
            i = done % len(prompts)
            differing += (await complete(tr, prompts[i])) != ref[i]
            done += 1
        await trio.sleep(0.2)
        rep = d.report()
        n.cancel_scope.cancel()
    case = {"case": "honest", "calls": same.calls + other.calls, "calls_same_kernel": same.calls,
            "calls_torch_kernel": other.calls, "verifications": rep.verifications,
            "false_quarantines": rep.quarantines, "completions": done, "completions_differing": differing,
            "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  honest        {case['calls']} calls ({same.calls} bit-exact, {other.calls} by tolerance), "
          f"{rep.verifications} compared, false quarantines {rep.quarantines}", flush=True)
    return case


async def offload_throughput(model: GGUFModel, prompts: list[list[int]], rounds: int) -> dict[str, Any]:
    """Every range remote (offload mode), one honest volunteer: completions/s with verification at its
    defaults vs off, interleaved round by round (medians), after a warm-up that also spends the
    verified dispatcher's probation."""
    vol = Worker(model)
    cfgs = {"verified": DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False),
            "unverified": DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=0.0, verify_probation_calls=0)}
    rates: dict[str, list[float]] = {k: [] for k in cfgs}
    async with trio.open_nursery() as n:
        await n.start(vol.run)
        trs: dict[str, Transformer] = {}
        ds: dict[str, Dispatcher] = {}
        for name, cfg in cfgs.items():
            t = await n.start(_transport)
            d = Dispatcher(model, t, config=cfg)
            await n.start(d.serve)
            d.set_map(dmap(model, [vol]))
            trs[name], ds[name] = Transformer(model, d), d
            for p in prompts * 2:  # warm-up; 96 tokens: the probation's 50 verified calls are spent
                await complete(trs[name], p)
        for _ in range(rounds):
            for name, tr in trs.items():
                t0 = time.perf_counter()
                for p in prompts * 2:
                    await complete(tr, p)
                rates[name].append(len(prompts) * 2 * N_TOKENS / (time.perf_counter() - t0))
        verified = sum(r.verified_rows for r in ds["verified"].core.rows)
        n.cancel_scope.cancel()
    v, u = statistics.median(rates["verified"]), statistics.median(rates["unverified"])
    return {"offload_tokens_per_s_verified": round(v, 1), "offload_tokens_per_s_unverified": round(u, 1),
            "offload_throughput_cost_pct": round(100.0 * (1 - v / u), 1), "offload_verified_rows": verified,
            "offload_rounds": rounds}


async def _transport(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    async with open_libp2p_transport(key_path=None) as t:
        task_status.started(t)
        await trio.sleep_forever()


def offload_namespace(quick: bool) -> argparse.Namespace:
    """What ``offload.run`` reads of its command line: every option ``offload.py`` defines, as its own
    defaults would set it, with the sessions and tokens this case measures (not ``offload``'s parser,
    which lives in its ``main``; ``tests/benchmarks`` checks this covers every option it has)."""
    return argparse.Namespace(quick=quick, smoke=False, json=None, sessions=[4], decode=12 if quick else 32, repeat=1,
                              rtt_ms=[0.0], verify_cases=True, split_forced_case=False, expert_loop=None)


def throughput_cost(quick: bool) -> dict[str, Any]:
    """offload.py's setup at 4 sessions: adaptive with default verification vs verification off."""
    sys.path.append(str(ROOT / "benchmarks"))
    import offload

    res = offload.run(offload_namespace(quick))
    by = {c["case"]: c for c in res["cases"] if c.get("sessions") == 4}
    v, u = by["adaptive"], by["adaptive_unverified"]
    return {"tokens_per_s_verified": v["tokens_per_s"], "tokens_per_s_unverified": u["tokens_per_s"],
            "throughput_cost_pct": round(100.0 * (1 - v["tokens_per_s"] / u["tokens_per_s"]), 1),
            "adaptive_rows_remote": v.get("rows_remote"), "adaptive_rows_verified": v.get("rows_verified"),
            "tokens_equal": v.get("tokens_equal_local")}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    configure_threads(1, KernelBackend.GGML)
    model = GGUFModel(MODEL)
    prompts = [g["prompt_ids"] for g in json.loads(GOLDEN.read_text())["greedy"]]
    local = Dispatcher(model, None)
    ref = [await complete(Transformer(model, local), p) for p in prompts]
    default = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False)
    cases: list[dict[str, Any]] = []
    liars: dict[str, tuple[Lie, str | None]] = {
        "zeros": (lambda n, y: torch.zeros_like(y), None),
        "scaled": (lambda n, y: y * 1.5, None),
        "ulp": (lambda n, y: one_ulp(y), None),
        "noise": (lambda n, y: noise(y), "another-kernel"),
        "intermittent": (lambda n, y: y * 1.5 if n % 20 == 19 else None, None),
    }
    smoke = getattr(args, "smoke", False)
    for name, (lie, announce) in liars.items():
        if smoke and name != "zeros":
            continue
        liar = Worker(model, lie=lie, announce=announce)
        cases.append(await liar_case(model, prompts, ref, name, [liar, Worker(model)], liar, default, 60))
    if not smoke:
        # a backbone coordinator (holds no expert): the liar's answers are checked against a second replica
        liar = Worker(model, lie=lambda n, y: y * 1.5)
        cases.append(await liar_case(model, prompts, ref, "backbone-scaled", [liar, Worker(model)], liar, default, 60,
                                     backbone=True))
    # two replicas agreeing on a lie, from one network, for experts a backbone does not hold: only the file
    # on disk can tell (--verify-disk-rate at its default; every call in probation is checked from it)
    pair = [Worker(model, lie=lambda n, y: y * 1.5, net="same-net") for _ in range(2)]
    disk_cfg = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_disk_rate=0.02)
    cases.append(await liar_case(model, prompts, ref, "colluding-pair", pair, pair[0], disk_cfg, 2 if smoke else 60,
                                 backbone=True, accomplices=(pair[1],)))
    # noise below the tolerance (5 % relative L2 per pair) from a worker announcing another kernel id: at 4 %
    # beyond 2x the honest spread between kernels (1.5e-2 on this Q8_0 file) it adds up to a quarantine; at 2 %
    # it is within what two honest kernels differ by here, and the coordinator cannot tell it (a known limit)
    for rel in (0.04,) if smoke else (0.04, 0.02):
        liar = Worker(model, lie=lambda n, y, rel=rel: noise(y, rel), announce="another-kernel")
        cases.append(await liar_case(model, prompts, ref, f"sub-tolerance-{rel:g}", [liar, Worker(model)], liar, default,
                                     8 if smoke else 60))
    cases.append(await squatter_liar_case(model, prompts, ref, 6 if smoke else 60))
    cases.append(await budget_jam_case(model, prompts, ref, 2 if smoke else 6))
    if not smoke:
        for rate in (default.verify_rate, 1.0):
            sleeper = Worker(model, lie=lambda n, y: y * 1.5 if n >= 1000 else None)
            cfg = DispatchConfig(mode=DispatchMode.OFFLOAD, hedge=False, verify_rate=rate)
            cases.append(await liar_case(model, prompts, ref, "sleeper", [sleeper], sleeper, cfg, 600, from_first_lie=True))
    honest = await honest_case(model, prompts, ref, args.honest_calls)
    if not smoke:
        honest.update(await offload_throughput(model, prompts, 3 if args.quick else 7))
        print(f"  offload mode, every range remote: {honest['offload_tokens_per_s_verified']} tokens/s verified vs "
              f"{honest['offload_tokens_per_s_unverified']} unverified ({honest['offload_throughput_cost_pct']} %)",
              flush=True)
    cases.append(honest)
    return {"benchmark": "verification", "model": model.model_id, "threads": "coordinator 1 (ggml), volunteers 1 each",
            "cases": cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10^3 honest calls, 12-token throughput sessions")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: the zeros liar, squatter-liar, budget-jam, 50 honest calls, no throughput (make test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--honest-calls", type=int, default=None)
    ap.add_argument("--no-throughput", action="store_true", help="skip the offload.py throughput cost")
    args = ap.parse_args()
    if args.smoke:
        args.no_throughput = True
    if args.honest_calls is None:
        args.honest_calls = 50 if args.smoke else 1000 if args.quick else 10_000
    result = trio.run(run, args)
    honest = next(c for c in result["cases"] if c["case"] == "honest")
    if not args.no_throughput:
        honest.update(throughput_cost(args.quick))
    print(f"\nverification benchmark: {result['model']} ({result['threads']})")
    print(f"{'case':<15} {'rate':>5} {'calls to quarantine':>20} {'completions differing':>22} {'false quarantines':>18}")
    for c in result["cases"]:
        if c["case"] == "honest":
            continue
        print(f"{c['case']:<15} {c['verify_rate']:>5} {c['calls_to_quarantine']!s:>20} "
              f"{c['completions_differing']:>14}/{c['completions']:<7} {c['false_quarantines']:>18}")
    print(f"honest: {honest['calls']} calls, {honest['verifications']} compared, {honest['false_quarantines']} false quarantines")
    if "throughput_cost_pct" in honest:
        print(f"throughput cost of the default rate (offload.py setup, 4 sessions): {honest['throughput_cost_pct']} % "
              f"({honest['tokens_per_s_verified']} vs {honest['tokens_per_s_unverified']} tokens/s)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
