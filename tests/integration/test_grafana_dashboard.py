"""The Grafana dashboard shipped in ``ops/`` (issue 13 item 4) parses and names only metrics that the
real services export: a market, a coordinator and a relay are started here and their ``/metrics``
scraped (every family, samples or not, is announced by a ``# TYPE`` line)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import trio

from coordinator.server import CoordinatorConfig, serve_coordinator
from market.server import MarketConfig, serve_market
from relay.service import RelayConfig, open_relay
from tests.conftest import GOLDEN_GGUF

DASHBOARD = Path(__file__).parents[2] / "ops" / "grafana-dashboard.json"
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def families(text: str) -> set[str]:
    """The metric families of an exposition, by base name (a counter's ``_total`` dropped)."""
    return {base(line.split()[2]) for line in text.splitlines() if line.startswith("# TYPE ")}


def base(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


async def test_the_dashboard_names_only_exported_metrics(nursery: trio.Nursery, tmp_path: Path) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert dash["uid"] == "moe-swarm" and len(dash["panels"]) >= 15 and all(exprs)
    named = {m for e in exprs for m in re.findall(r"moe_swarm_[a-z0-9_]+", e)}
    market = await nursery.start(serve_market, MarketConfig(db=str(tmp_path / "m.db"), port=0, insecure_no_token=True))
    coord = await nursery.start(serve_coordinator, CoordinatorConfig(model=str(GOLDEN_GGUF), port=0,
                                                                     data_dir=str(tmp_path / "c"), local_experts="none"))
    exported: set[str] = set()
    async with open_relay(RelayConfig(listen=("/ip4/127.0.0.1/tcp/0",), port=0)) as relay, \
            httpx.AsyncClient(timeout=30) as h:
        await h.get(f"{market}/api/expert-demand")  # one request, so the per-handler families have a series
        assert relay.metrics_url is not None
        for url in (f"{market}/metrics", f"{coord}/metrics", relay.metrics_url):
            r = await h.get(url)
            assert r.status_code == 200
            exported |= families(r.text)
    missing = sorted(m for m in named if base(m) not in exported)
    assert not missing, f"the dashboard names metrics no service exports: {missing}"
    # and the operator's alerts have their metrics: holes on both sides, verification, latency
    for m in ("moe_swarm_dispatch_holes", "moe_swarm_market_holes", "moe_swarm_dispatch_verifications",
              "moe_swarm_dispatch_remote_latency_seconds", "moe_swarm_market_request_seconds"):
        assert m in exported
