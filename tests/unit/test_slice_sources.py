"""Slices from many sources, the pure parts: the canonical file rebuilt from a manifest alone, the
per-expert hashes and their cache, manifest validation, the upload token bucket under virtual time,
the ranking of download sources, and the market's lease view."""

from __future__ import annotations

import argparse
import hashlib
import random
from pathlib import Path

import msgspec
import pytest

from market.core.records import HeldState, ModelManifest, SliceRef
from market.core.sources import PeerCandidate, rank_origins, rank_peer_sources
from market.state import Market, Offer
from market.store import InMemoryStore, MemoryBacking
from swarm.core.ratelimit import TokenBucket
from swarm.errors import RequestError, SliceError
from swarm.model.gguf import GGUFModel
from swarm.model.slices import build_manifest, cut_slice, expert_digests, plan_slice
from swarm.protocol.market import (
    CoordinatorReport,
    EvidenceMethod,
    QuarantineEvidence,
    RegisterModels,
    ReportedWorker,
    VolunteerRequest,
)
from tests.conftest import FIXTURES
from tests.unit.test_market_state import MID, POLICY, URL, hb, manifest
from tests.unit.test_slices import write_quant_model

# gpt-oss: MXFP4 experts with F32 biases (six kinds a slice); deepseek2: expert layer 0 is block 1
GGUFS = ["qwen3moe-tiny-f32", "qwen3moe-tiny-q4_0", "qwen3moe-tiny-q8_0", "qwen3moe-small-w224-q4_k_m",
         "gpt-oss-tiny-mxfp4_moe", "deepseek2-tiny-q8_0", "mixed"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GGUFModel]:
    out = {name: GGUFModel(FIXTURES / "golden" / f"{name}.gguf") for name in GGUFS[:-1]}
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"  # layer 0: Q8_0 / Q4_0 / F16, layer 1: Q8_0
    write_quant_model(path)
    out["mixed"] = GGUFModel(path)
    return out


def gguf_bytes(model: GGUFModel, offset: int, n: int) -> bytes:
    with open(model.path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def assembled(model: GGUFModel, layer: int, lo: int, hi: int) -> bytes:
    """The slice file built from the manifest alone: its header, then each kind's experts read from
    the GGUF at the manifest's tensor offsets (what an origin mirror serves)."""
    plan = plan_slice(build_manifest(model), layer, lo, hi)
    data = [gguf_bytes(model, plan.gguf_offset(k, lo) or 0, (hi - lo) * plan.kind_bytes[k]) for k in plan.kinds]
    return plan.header + b"".join(data)


@pytest.mark.parametrize("name", GGUFS)
def test_the_manifest_alone_rebuilds_the_slice_file(models: dict[str, GGUFModel], name: str) -> None:
    model = models[name]
    cfg = model.config
    last = cfg.n_moe_layer - 1
    cases = {(0, 0, 1), (0, 0, cfg.n_expert), (last, 1, 4), (last, cfg.n_expert - 3, cfg.n_expert)}
    manifest_ = build_manifest(model)
    for layer, lo, hi in sorted(cases):
        want = cut_slice(model, layer, lo, hi)
        plan = plan_slice(manifest_, layer, lo, hi)
        assert want[: len(plan.header)] == plan.header
        assert plan.size == len(want)
        assert assembled(model, layer, lo, hi) == want
        # the plan's offsets locate each expert's kind bytes in the slice file
        stack = model.expert_stack(layer, lo, hi)
        assert plan.kinds == tuple(stack.tensors())  # gpt-oss: the weights, then their biases
        for kind, t in stack.tensors().items():
            at = plan.file_offset(kind, hi - 1)
            assert want[at : at + plan.kind_bytes[kind]] == t.raw[hi - 1 - lo].tobytes()
        assert plan.expert_sha256 == tuple(manifest_.expert_sha256[layer][lo:hi])


def test_expert_hashes_are_of_gate_up_down(models: dict[str, GGUFModel]) -> None:
    model = models["mixed"]
    m = build_manifest(model)
    for layer in range(model.config.n_layer):
        stack = model.expert_stack(layer)
        want = [hashlib.sha256(stack.gate_t.raw[e].tobytes() + stack.up_t.raw[e].tobytes() + stack.down_t.raw[e].tobytes())
                .hexdigest() for e in range(stack.n_expert)]
        assert expert_digests(model, layer) == want == m.expert_sha256[layer]
        assert m.kind_bytes[layer] == {"gate": stack.gate_t.nbytes // 6, "up": stack.up_t.nbytes // 6,
                                       "down": stack.down_t.nbytes // 6}
        assert sum(m.kind_bytes[layer].values()) == m.bytes_per_expert[layer]
    assert m.problems() == []
    assert msgspec.json.decode(msgspec.json.encode(m), type=ModelManifest) == m


def test_expert_hashes_are_cached_by_the_ggufs_sha256(models: dict[str, GGUFModel], tmp_path: Path) -> None:
    model = models["qwen3moe-tiny-q8_0"]
    first = build_manifest(model, cache_dir=tmp_path, origins=["http://mirror.test/m.gguf"] * 2)
    assert first.origins == ["http://mirror.test/m.gguf"]
    cached = tmp_path / f"{model.sha256}.experts.json"
    facts = msgspec.json.decode(cached.read_bytes())
    assert facts["expert_sha256"] == first.expert_sha256
    # a restart reads the file: planted hashes come back, so nothing was hashed again
    facts["expert_sha256"][0][0] = "ab" * 32
    cached.write_bytes(msgspec.json.encode(facts))
    assert build_manifest(model, cache_dir=tmp_path).expert_sha256[0][0] == "ab" * 32
    # a file that does not fit the model is computed again (and rewritten)
    facts["expert_sha256"] = facts["expert_sha256"][:1]
    cached.write_bytes(msgspec.json.encode(facts))
    assert build_manifest(model, cache_dir=tmp_path).expert_sha256 == first.expert_sha256
    assert msgspec.json.decode(cached.read_bytes())["expert_sha256"] == first.expert_sha256
    cached.write_bytes(b"{not json")
    assert build_manifest(model, cache_dir=tmp_path).expert_sha256 == first.expert_sha256


def test_plan_groups_and_refusals(models: dict[str, GGUFModel]) -> None:
    m = build_manifest(models["qwen3moe-tiny-q8_0"])
    plan = plan_slice(m, 1, 1, 8)
    per = m.bytes_per_expert[1]
    assert plan.groups(3 * per) == [(1, 4), (4, 7), (7, 8)]
    assert plan.groups(3 * per - 1) == [(1, 3), (3, 5), (5, 7), (7, 8)]
    assert plan.groups(1) == [(e, e + 1) for e in range(1, 8)]  # at least one expert a group
    assert plan.groups(1 << 30) == [(1, 8)]
    for layer, lo, hi in [(2, 0, 1), (0, 3, 3), (0, 0, 9), (-1, 0, 1)]:
        with pytest.raises(SliceError) as ei:
            plan_slice(m, layer, lo, hi)
        assert ei.value.code == "bad_slice_range"
    lying = msgspec.structs.replace(m, kind_bytes=[{"gate": 1, "up": 1, "down": per - 2}] * 2)
    with pytest.raises(SliceError, match="contradict") as ei:
        plan_slice(lying, 0, 0, 1)
    assert ei.value.code == "bad_manifest"


HEX = "0f" * 32


def base(**kw: object) -> ModelManifest:
    m = ModelManifest(model_id=MID, arch="qwen3moe", n_layer=2, n_expert=3, bytes_per_expert=[6, 6],
                      kind_bytes=[{"gate": 2, "up": 2, "down": 2}] * 2,
                      tensor_offsets=[{"gate": 0, "up": 6, "down": 12}, {"gate": 18, "up": 24, "down": 30}],
                      expert_sha256=[[HEX] * 3] * 2, origins=["https://mirror.test/m.gguf"])
    return msgspec.structs.replace(m, **kw)


@pytest.mark.parametrize(("changes", "problem"), [
    ({}, None),
    ({"kind_bytes": [], "tensor_offsets": [], "expert_sha256": [], "origins": []}, None),  # an older coordinator's
    ({"kind_bytes": [{"gate": 2, "up": 2, "down": 2}]}, "kind_bytes has 1 entries for 2 layers"),
    ({"kind_bytes": [{"gate": 2, "up": 4}] * 2}, "every kind_bytes entry names exactly the kinds"),
    ({"kind_bytes": [{"gate": 2, "up": 2, "down": 3}] * 2}, "kind_bytes of layer 0 do not add up"),
    ({"tensor_offsets": [{"gate": 0, "up": 6, "down": 12}]}, "tensor_offsets has 1 entries"),
    ({"expert_sha256": [[HEX] * 3]}, "expert_sha256 has 1 entries for 2 layers"),
    ({"expert_sha256": [[HEX] * 3, [HEX] * 2]}, "every expert_sha256 entry lists 3 experts"),
    ({"expert_sha256": [[HEX] * 3, [HEX, HEX, "0F" * 32]]}, "not 64 lowercase hex digits"),
    ({"expert_sha256": [[HEX] * 3, [HEX, HEX, "zz" * 32]]}, "not 64 lowercase hex digits"),
    ({"kind_bytes": [], "origins": []}, "expert_sha256 without kind_bytes"),
    ({"origins": ["ftp://mirror.test/m.gguf"]}, "origins must be at most 16 distinct http(s) URLs"),
    ({"origins": ["https://a.test/m"] * 2}, "origins must be at most 16 distinct"),
    ({"tensor_offsets": []}, "origins without tensor_offsets"),
    # biased experts (gpt-oss): six kinds in every table of a layer, or the tables disagree
    ({"tensor_types": [{k: "F32" for k in ("gate", "up", "down", "gate_b", "up_b", "down_b")}] * 2},
     "layer 0: tensor_types, kind_bytes and tensor_offsets name different kinds"),
    ({"kind_bytes": [{"gate": 2, "up": 2, "down": 2, "gate_b": 0, "up_b": 0, "down_b": 0}] * 2},
     "name different kinds"),
])
def test_manifest_problems(changes: dict[str, object], problem: str | None) -> None:
    got = base(**changes).problems()
    if problem is None:
        assert got == []
    else:
        assert len(got) == 1 and problem in got[0], got


def test_manifest_limits_are_checked_on_decode() -> None:
    raw = msgspec.to_builtins(base())
    for field, value in [("origins", ["gopher://x"]), ("expert_sha256", [["ab"] * 3] * 2),
                         ("kind_bytes", [{"gate": 0, "up": 2, "down": 4}] * 2), ("origins", ["http://a.test/"] * 17)]:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({**raw, field: value}, ModelManifest)
    # an older market's manifest (none of the new fields) and a newer one's unknown field still decode
    old = {k: v for k, v in raw.items() if k not in ("kind_bytes", "tensor_offsets", "expert_sha256", "origins")}
    assert not msgspec.convert({**old, "from_the_future": 1}, ModelManifest).can_verify_experts


# -- the upload rate ------------------------------------------------------------------------------


def test_token_bucket_in_virtual_time() -> None:
    b = TokenBucket(rate=100.0, burst=300.0, now=0.0)
    assert b.reserve(200, 0.0) == 0.0  # from the burst
    assert b.reserve(200, 0.0) == pytest.approx(1.0)  # 100 short: one second at 100/s
    assert b.tokens(0.0) == pytest.approx(-100.0)  # in debt: the next one queues behind
    assert b.reserve(100, 0.5, max_wait_s=1.0) is None  # it would wait 1.5 s: refused, nothing taken
    assert b.tokens(0.5) == pytest.approx(-50.0)
    assert b.wait_for(100, 0.5) == pytest.approx(1.5)
    assert b.reserve(100, 2.0) == pytest.approx(0.0)  # refilled to 100 by t = 2
    assert b.tokens(10.0) == pytest.approx(300.0)  # never above the burst
    assert b.tokens(5.0) == pytest.approx(300.0)  # time does not run backwards
    assert b.reserve(1000, 10.0) == pytest.approx(7.0)  # larger than the burst: still served, paced
    # the long-run rate: 20 reservations of 100 take (2000 - 300) / 100 s
    b = TokenBucket(rate=100.0, burst=300.0, now=0.0)
    now = 0.0
    for _ in range(20):
        now += b.reserve(100, now) or 0.0
    assert now == pytest.approx(17.0)
    with pytest.raises(ValueError):
        TokenBucket(rate=0.0, burst=1.0, now=0.0)


# -- ranking --------------------------------------------------------------------------------------


class Draws:
    """An Rng that returns scripted uniform draws (and counts them)."""

    def __init__(self, draws: list[float]) -> None:
        self.draws = list(draws)
        self.calls = 0

    def uniform(self, a: float, b: float) -> float:
        self.calls += 1
        return self.draws.pop(0)

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        raise AssertionError("only uniform is drawn")

    def getrandbits(self, k: int) -> int:
        raise AssertionError("only uniform is drawn")


def cand(peer: str, lo: int = 0, hi: int = 8, *, layer: int = 0, model: str = MID, addrs: tuple[str, ...] = ("/a",),
         dispatched: bool = True, shares: bool = True, quarantined: bool = False, proved: bool = False) -> PeerCandidate:
    return PeerCandidate(peer, model, layer, lo, hi, addrs, dispatched, shares, quarantined, proved)


@pytest.mark.parametrize(("cands", "draws", "want"), [
    ([cand("a"), cand("b"), cand("c")], [0.5, 0.1, 0.9], ["b", "a", "c"]),  # spread by the draw
    ([cand("a"), cand("b", proved=True)], [0.1, 0.9], ["b", "a"]),  # proved holders first
    ([cand("a", 2, 6), cand("b", 0, 4), cand("c", 3, 8), cand("d", 2, 5)], [0.5, 0.3], ["d", "a"]),  # contain [2, 5)
    ([cand("a", dispatched=False), cand("b", shares=False), cand("c", quarantined=True), cand("me"),
      cand("e", addrs=()), cand("f", layer=1), cand("g", model="other-model"), cand("h")], [0.3], ["h"]),
    ([cand("a"), cand("a", 0, 6)], [0.3], ["a"]),  # one entry a volunteer
    ([cand("a", addrs=("/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/a",)), cand("b")], [0.3], ["b"]),  # relayed only
    ([cand(p) for p in "abcdef"], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1], ["f", "e", "d", "c"]),  # at most 4
])
def test_rank_peer_sources(cands: list[PeerCandidate], draws: list[float], want: list[str]) -> None:
    rng = Draws(draws)
    got = rank_peer_sources(cands, model_id=MID, layer=0, lo=2, hi=5, requester="me", rng=rng)
    assert [c.peer_id for c in got] == want
    assert rng.calls == len(draws)  # one draw per qualifying volunteer


def test_peer_sources_carry_direct_addresses_only() -> None:
    relayed = "/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/a"
    got = rank_peer_sources([cand("a", addrs=(relayed, "/ip4/5.6.7.8/tcp/2"))], model_id=MID, layer=0, lo=0, hi=8,
                            requester="me", rng=random.Random(0))
    assert [c.addrs for c in got] == [("/ip4/5.6.7.8/tcp/2",)]


def test_rank_origins() -> None:
    assert rank_origins(["http://a", "http://b", "http://a", "http://c"]) == ["http://a", "http://b", "http://c"]
    assert rank_origins([f"http://{i}" for i in range(20)]) == [f"http://{i}" for i in range(8)]


# -- the market: sources of an offer and the lease view -----------------------------------------------


def rich_manifest() -> ModelManifest:
    m = manifest()
    return msgspec.structs.replace(m, kind_bytes=[{"gate": 300, "up": 300, "down": 400}] * 2,
                                   tensor_offsets=[{"gate": 0, "up": 8000, "down": 16000}] * 2,
                                   expert_sha256=[[HEX] * 8] * 2, origins=["http://mirror.test/m.gguf"])


def test_offers_list_sharing_holders_then_origins_and_the_lease_view_follows_the_download() -> None:
    policy = msgspec.structs.replace(POLICY, base_target=3, coverage_requires_lease=True, proof_grace_s=0.0)
    backing = MemoryBacking()
    m = Market(InMemoryStore(backing), policy, now=0.0, rng=random.Random(3))
    m.register(RegisterModels(URL, [rich_manifest()], epoch=1), 0.0)
    m.register(RegisterModels("http://c2.test", [msgspec.structs.replace(rich_manifest(), origins=["http://m2.test/g"])],
                              epoch=1), 0.0)
    holders = {}
    for i, share in enumerate([True, True, False]):  # three holders of whole layers; the third does not share
        peer = f"holder{i}"
        offer = m.volunteer(VolunteerRequest(peer, max_experts=8), 1.0)
        assert isinstance(offer, Offer)
        s = offer.lease.slice
        holders[peer] = s
        m.heartbeat(msgspec.structs.replace(hb(peer, 1, (s.layer, s.lo, s.hi, HeldState.SERVING)),
                                            share_slices=share), 2.0)
    offer = m.volunteer(VolunteerRequest("newcomer", max_experts=4), 3.0)
    assert isinstance(offer, Offer)
    s = offer.lease.slice
    sharing = sorted(p for p, h in holders.items() if h.layer == s.layer and h.lo <= s.lo and s.hi <= h.hi
                     and p != "holder2")
    assert sorted(p.peer_id for p in offer.peers) == sharing and sharing
    assert {p.addrs for p in offer.peers} == {(f"/ip4/10.0.0.1/tcp/1/p2p/{p}",) for p in sharing}
    # both coordinators' origins (the ranking's order), then the stored manifest's (the last registration)
    assert set(offer.origins) == {"http://mirror.test/m.gguf", "http://m2.test/g"} and len(offer.origins) == 2
    # a quarantined holder is no source any more
    h = holders[sharing[0]]
    ev = QuarantineEvidence(layer=h.layer, lo=h.lo, hi=h.hi, input_sha256="a" * 64, remote_sha256="b" * 64,
                            local_sha256="c" * 64, method=EvidenceMethod.BIT_EXACT)
    m.report(CoordinatorReport(URL, MID, [ReportedWorker(sharing[0], quarantine="wrong answers", evidence=ev)]), 4.0)
    again = m.volunteer(VolunteerRequest("newcomer", max_experts=4), 4.0)
    assert isinstance(again, Offer) and again.renewed and [p.peer_id for p in again.peers] == sharing[1:]

    lid = offer.lease.lease_id
    view = m.lease_view(lid, 5.0)
    assert (view.peer_id, view.model_id, view.layer, view.lo, view.hi, view.state) == (
        "newcomer", MID, s.layer, s.lo, s.hi, "leased")
    assert view.expires_in_s == pytest.approx(policy.lease_s - 2.0)
    # the first heartbeat converts the lease into loading coverage: the view still answers, for a TTL
    m.heartbeat(hb("newcomer", 1, (s.layer, s.lo, s.hi, HeldState.LOADING)), 6.0)
    assert lid not in m.ix.leases
    view = m.lease_view(lid, 7.0)
    assert view.state == "loading" and view.expires_in_s == pytest.approx(policy.heartbeat_ttl_s - 1.0)
    assert m.ix.cov_by_lease[lid].slice == SliceRef(MID, s.layer, s.lo, s.hi)
    # the conversion is durable: a restarted market still answers for the download
    restarted = Market(InMemoryStore(backing), policy, now=7.0, rng=random.Random(4))
    assert restarted.lease_view(lid, 7.5).state == "loading"
    with pytest.raises(RequestError) as ei:
        m.lease_view(lid, 6.0 + policy.heartbeat_ttl_s + 0.1)  # silent past its TTL
    assert (ei.value.status, ei.value.code) == (404, "unknown_lease")
    # serving: the download is over, the lease is no longer good for slice bytes
    m.heartbeat(hb("newcomer", 2, (s.layer, s.lo, s.hi, HeldState.SERVING)), 8.0)
    for lease_id in (lid, "0123456789abcdef", ""):
        with pytest.raises(RequestError) as ei:
            m.lease_view(lease_id, 8.0)
        assert ei.value.code == "unknown_lease"
    assert m.ix.counts == m.ix.recount()


def test_registration_keeps_expert_hashes_and_refuses_conflicting_ones() -> None:
    m = Market(InMemoryStore(), POLICY, now=0.0, rng=random.Random(0))
    m.register(RegisterModels(URL, [rich_manifest()], epoch=1), 0.0)
    # an older coordinator of the same model (no hashes): what peers and mirrors need is kept
    m.register(RegisterModels("http://old.test", [manifest()], epoch=1), 1.0)
    assert m.ix.models[MID].manifest.expert_sha256 == rich_manifest().expert_sha256
    other = msgspec.structs.replace(rich_manifest(), expert_sha256=[["1f" * 32] * 8] * 2)
    with pytest.raises(RequestError) as ei:
        m.register(RegisterModels("http://c3.test", [other], epoch=1), 2.0)
    assert (ei.value.status, ei.value.code) == (409, "manifest_conflict")
    assert m.ix.coordinators[URL].origins == {MID: ["http://mirror.test/m.gguf"]}
    assert m.ix.coordinators["http://old.test"].origins == {}


def test_origin_flags_reach_the_coordinators_config() -> None:
    from coordinator.cli import add_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["coordinator", "--model", "m.gguf", "--origin", "https://a.test/m.gguf",
                            "--origin", "http://b.test:8000/x/m.gguf"])
    assert config_from_args(ns).origins == ("https://a.test/m.gguf", "http://b.test:8000/x/m.gguf")
    assert config_from_args(parser.parse_args(["coordinator", "--model", "m.gguf"])).origins == ()
