"""Real processes on loopback: ``moe-swarm relay``, a coordinator and a volunteer reachable only
through the relay (``--no-direct``). The relay is killed (-9) mid-generation and restarted: the
coordinator falls back to its local experts, the volunteer re-reserves, dispatch to it resumes,
and no token is lost, duplicated or changed."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from swarm.model.gguf import model_id_for
from tests.conftest import GOLDEN_GGUF, eventually
from tests.e2e.test_process_e2e import (
    UNVERIFIED,
    Proc,
    attach_single_worker,
    cli,
    procs,
    stream_with_fault,
    wait_for_line,
)

pytestmark = pytest.mark.slow
__all__ = ["procs"]  # the fixture, shared with test_process_e2e


def relay_cmd(data_dir: Path, listen: str) -> list[str]:
    return cli("relay", "--listen", listen, "--port", "0", "--data-dir", str(data_dir))


async def start_relay(procs: list[Proc], tmp_path: Path, listen: str, name: str) -> tuple[Proc, str, str]:
    relay = Proc(relay_cmd(tmp_path / "relay", listen), tmp_path / f"{name}.log")
    procs.append(relay)
    line = await wait_for_line(relay, "relay ready ")
    m = re.search(r"addrs=(\S+) metrics=(\S+)", line)
    assert m, line
    return relay, m.group(1).split(",")[0], m.group(2)


async def test_relay_restart_mid_generation(procs: list[Proc], tmp_path: Path) -> None:
    relay, relay_addr, metrics = await start_relay(procs, tmp_path, "/ip4/127.0.0.1/tcp/0", "relay")
    port = relay_addr.split("/tcp/")[1].split("/")[0]
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps({"model_id": model_id_for(GOLDEN_GGUF), "version": 0, "layers": []}))
    # --no-hole-punch and --no-lanes: the traffic stays on the relay, so restarting the relay matters (a data
    # lane is a direct TCP connection the volunteer dials out to the coordinator: once it is open the expert
    # calls no longer cross the relay and its death costs nothing, which made this test depend on whether the
    # lane had opened before the kill)
    coord = Proc(cli("coordinator", "--dispatch", "offload", *UNVERIFIED, "--model", str(GOLDEN_GGUF), "--port", "0", "--data-dir", str(tmp_path / "c"),
                     "--expert-timeout", "1.0", "--dispatch-map", str(map_path), "--no-hole-punch", "--no-lanes"),
                 tmp_path / "coordinator.log")
    procs.append(coord)
    url = (await wait_for_line(coord, "coordinator ready at ")).split()[-1]
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        model_id = (await h.get("/v1/models")).json()["data"][0]["id"]
        body: dict[str, Any] = {"model": model_id, "prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True}
        local = (await h.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        assert len(local) == 200

        vol = Proc(cli("--log-level", "INFO", "volunteer", "--coordinator", url, "--slice", "0:0-8", "--slice", "1:0-8",
                       "--data-dir", str(tmp_path / "v"), "--no-progress", "--no-direct", "--relay", relay_addr,
                       "--no-hole-punch"), tmp_path / "volunteer.log")
        procs.append(vol)
        await wait_for_line(vol, "volunteer ready ")
        info = json.loads((tmp_path / "v" / "volunteer.json").read_text())
        assert info["reachability"] == "private"
        assert info["addrs"] == [f"{relay_addr}/p2p-circuit/p2p/{info['peer_id']}"]
        await attach_single_worker(h, map_path, model_id, info)

        async def kill_relay() -> None:
            [w] = (await h.get("/dispatch")).json()["workers"]
            assert w["calls"] > 0 and w["path"] == "relayed"  # it really served through the relay
            relay.p.send_signal(signal.SIGKILL)
            relay.p.wait()

        tokens, killed_at = await stream_with_fault(h, body, after_tokens=20, fault=kill_relay)
        assert killed_at is not None and killed_at < 200
        assert tokens == local  # no token lost, duplicated or changed
        rep = (await h.get("/dispatch")).json()
        assert rep["workers"][0]["failures"] >= 1
        assert sum(L["fallback_rows"] for L in rep["layers"]) > 0  # the coordinator fell back to its own experts

        # the relay comes back with the same identity on the same port
        _, relay_addr2, metrics2 = await start_relay(procs, tmp_path, f"/ip4/127.0.0.1/tcp/{port}", "relay2")
        assert relay_addr2 == relay_addr
        await wait_for_line(vol, "[volunteer] addresses now: /ip4/127.0.0.1", within=60)  # re-reserved
        assert "withdrawing its circuit address" in vol.text()

        calls_before = rep["workers"][0]["calls"]
        last: list[dict[str, Any]] = []

        async def serving_again() -> bool:
            short = {**body, "max_tokens": 4}
            toks = (await h.post("/v1/completions", json=short)).json()["choices"][0]["token_ids"]
            assert toks == local[:4]
            last[:] = (await h.get("/dispatch")).json()["workers"]
            w = last[0]
            return bool(w["calls"] > calls_before and w["state"] == "up" and w["path"] == "relayed")

        try:
            await eventually(serving_again, within=60, interval=0.5)
        except trio.TooSlowError:
            raise AssertionError(f"dispatch did not resume: {last}") from None
        again = (await h.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
        assert again == local
        async with httpx.AsyncClient() as m:
            text = (await m.get(metrics2)).text
        assert "moe_swarm_relay_reservations 1.0" in text
        assert re.search(r"moe_swarm_relay_bytes_relayed_total [1-9]", text)
