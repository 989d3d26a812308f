"""Only coordinators may use volunteers (DESIGN §12), with real processes: a static volunteer answers
its coordinator (tokens identical to all-local) and refuses a stranger who speaks the protocol
correctly with ``not_authorized``, for good, while it keeps serving its coordinator."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio

from swarm.errors import NotAuthorized
from swarm.model.gguf import model_id_for
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.protocol.expert import (
    PROTOCOL_ID,
    ExpertRequest,
    ExpertResponse,
    FrameReader,
    Hello,
    RequestId,
    encode_frame,
    make_hello,
    make_pairs,
)
from swarm.rpc.client import open_expert_client
from tests.conftest import GOLDEN_GGUF, eventually
from tests.e2e.test_process_e2e import (  # noqa: F401
    UNVERIFIED,
    Proc,
    attach_single_worker,
    cli,
    procs,
    start_static_volunteer,
    wait_for_line,
)

pytestmark = pytest.mark.slow


async def stranger_call(info: dict[str, Any], model_id: str) -> Exception | None:
    """One well-formed expert call from a fresh libp2p identity; the error it got, or None."""
    async with open_libp2p_transport(key_path=None) as t, open_expert_client(t, info["peer_id"], info["addrs"]) as client:
        rows = torch.randn(2, 128)  # the golden model's d_model: a well-formed call
        pairs = make_pairs([0, 1], [0, 1], [0.5, 0.5])
        req = ExpertRequest(request_id=RequestId(1), attempt=0, model_id=model_id, layer=0, lo=0, hi=8, n_rows=2,
                            d_model=128, n_pairs=len(pairs), dtype="float32")
        try:
            await client.call(req, rows, pairs, timeout=10)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    return None


async def start_coordinator(started: list[Proc], tmp_path: Path) -> tuple[str, Path, str]:
    """A coordinator process following a map file (empty for now); its URL, the file, the model id."""
    map_path = tmp_path / "map.json"
    model_id = model_id_for(GOLDEN_GGUF)
    map_path.write_text(json.dumps({"model_id": model_id, "version": 0, "layers": []}))
    coord = Proc(cli("coordinator", "--dispatch", "offload", *UNVERIFIED, "--model", str(GOLDEN_GGUF), "--port", "0",
                     "--data-dir", str(tmp_path / "c"), "--dispatch-map", str(map_path)), tmp_path / "coordinator.log")
    started.append(coord)
    return (await wait_for_line(coord, "coordinator ready at ")).split()[-1], map_path, model_id


async def test_a_static_volunteer_answers_its_coordinator_only(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    url, map_path, model_id = await start_coordinator(procs, tmp_path)
    body = {"model": model_id, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        local = (await h.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        vol = Proc(cli("--log-level", "INFO", "volunteer", "--coordinator", url, "--slice", "0:0-8", "--slice", "1:0-8",
                       "--data-dir", str(tmp_path / "v"), "--no-progress"), tmp_path / "volunteer.log")
        procs.append(vol)
        await wait_for_line(vol, "volunteer ready ")
        info = json.loads((tmp_path / "v" / "volunteer.json").read_text())
        peer = (await h.get("/health")).json()["peer_id"]
        assert f"answering expert calls from {peer}" in vol.text()

        exc = await stranger_call(info, model_id)
        assert isinstance(exc, NotAuthorized), exc
        await attach_single_worker(h, map_path, model_id, info)
        remote = (await h.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        assert remote == local
        [w] = (await h.get("/dispatch")).json()["workers"]
        assert w["calls"] > 0 and w["failures"] == 0
        assert isinstance(await stranger_call(info, model_id), NotAuthorized)  # still refused, still serving
        assert (await h.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"] == local


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_declared_sizes_cost_a_volunteer_no_memory(procs: list[Proc], tmp_path: Path) -> None:  # noqa: F811
    """The issue's attack: frames that declare a 60 MiB payload and then send nothing, from 2
    identities x 10 streams. The volunteer's memory does not grow by what was declared (its frame
    buffers grow with bytes received; and these peers may not use its experts: each header is refused
    ``not_authorized`` as it arrives, nothing reserved), and it keeps serving its coordinator."""
    url, map_path, model_id = await start_coordinator(procs, tmp_path)
    vol = Proc(cli("volunteer", "--coordinator", url, "--slice", "0:0-8", "--slice", "1:0-8",
                   "--data-dir", str(tmp_path / "v"), "--no-progress"), tmp_path / "volunteer.log")
    procs.append(vol)
    await wait_for_line(vol, "volunteer ready ")
    info = json.loads((tmp_path / "v" / "volunteer.json").read_text())
    before = rss_kb(vol.p.pid)
    hello = encode_frame(make_hello(kernel_id="x"))
    lie = encode_frame(ExpertRequest(request_id=RequestId(1), attempt=0, model_id=model_id, layer=0, lo=0, hi=8,
                                     n_rows=1, d_model=128, n_pairs=1, dtype="float32"))
    header_len = struct.unpack_from("<I", lie)[0]
    declared = struct.pack("<II", header_len, 60 << 20) + lie[8:8 + header_len]  # 60 MiB declared, none sent
    streams = []
    async with open_libp2p_transport(key_path=None) as a, open_libp2p_transport(key_path=None) as b:
        for t in (a, b):
            for _ in range(10):
                s = await t.open_stream(info["peer_id"], info["addrs"], PROTOCOL_ID)
                await s.write(hello + declared)
                streams.append(s)
        for s in streams:  # the volunteer read and judged every declared header: its refusal is the proof
            reader = FrameReader(s)
            with trio.fail_after(30):
                got = [await reader.receive_message(), await reader.receive_message()]
            assert isinstance(got[0] and got[0][0], Hello)
            answer = got[1][0] if got[1] is not None else None
            assert isinstance(answer, ExpertResponse) and answer.status == "not_authorized", answer
        grown_mb = (rss_kb(vol.p.pid) - before) / 1024
        assert grown_mb < 100, f"the volunteer grew {grown_mb:.0f} MB for 20 x 60 MiB declared"
        async with httpx.AsyncClient(base_url=url, timeout=60) as h:
            await attach_single_worker(h, map_path, model_id, info)
            body = {"model": model_id, "prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            assert (await h.post("/v1/completions", json=body)).status_code == 200
            [w] = (await h.get("/dispatch")).json()["workers"]
            assert w["calls"] > 0 and w["failures"] == 0
        for s in streams:
            await s.aclose()


async def test_a_backbone_coordinator_computes_no_expert_and_says_which_are_missing(
    procs: list[Proc], tmp_path: Path, golden: dict[str, Any]  # noqa: F811
) -> None:
    """``--local-experts none`` with real processes: without a volunteer a completion waits for coverage
    (``--missing-wait``), then fails with 503 ``experts_unavailable`` naming the experts, and /health
    counts the holes; once a static volunteer passed its hold challenges,
    every routed expert is computed by it (no local rows; in its probation each call is checked against
    the experts read from the GGUF on disk) and the tokens are llama.cpp's."""
    map_path = tmp_path / "map.json"
    model_id = model_id_for(GOLDEN_GGUF)
    map_path.write_text(json.dumps({"model_id": model_id, "version": 0, "layers": []}))
    coord = Proc(cli("coordinator", "--local-experts", "none", "--missing-wait", "1", "--model", str(GOLDEN_GGUF), "--port", "0",
                     "--data-dir", str(tmp_path / "c"), "--dispatch-map", str(map_path)), tmp_path / "coordinator.log")
    procs.append(coord)
    url = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    g = golden["greedy"][0]
    body = {"model": model_id, "prompt": g["prompt_ids"], "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        assert (await h.get("/health")).json()["coverage_holes"] == 2  # both layers' experts: nobody serves them
        r = await h.post("/v1/completions", json=body)  # waits --missing-wait for coverage, then 503
        assert r.status_code == 503 and r.json()["error"]["code"] == "experts_unavailable", r.text
        assert "experts 0-8" in r.json()["error"]["message"]
        rep = (await h.get("/dispatch")).json()
        assert (rep["missing_waits"], rep["missing_failed"], rep["holes"]) == (1, 1, 2)
        info = await start_static_volunteer(procs, tmp_path, url)
        await attach_single_worker(h, map_path, model_id, info)

        async def proved() -> bool:
            return bool((await h.get("/dispatch")).json()["hold_passes"] == 2)

        await eventually(proved)
        r = await h.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == g["greedy_ids"][:12]
        rep = (await h.get("/dispatch")).json()
        assert rep["workers"][0]["calls"] > 0 and rep["workers"][0]["holdings_proven"] == 2
        # every row of the volunteer's, each checked in its probation against the experts read from the GGUF
        # on disk (--verify-disk-rate: those copies are the rows' results, "verified"); none from memory
        assert all(L["local_rows"] == 0 and L["fallback_rows"] == 0 and L["remote_rows"] + L["verified_rows"] > 0
                   for L in rep["layers"])
        assert rep["decisions"].get("verify_disk", 0) > 0 and rep["quarantines"] == 0
        assert rep["holes"] == 0 and (await h.get("/health")).json()["coverage_holes"] == 0
