"""A real NAT: Linux network namespaces, veth pairs and nftables masquerade (needs root).

Topology (every address lives inside namespaces this test creates and removes)::

    pub     10.77.1.1/24 on a bridge: relay, coordinators A (--no-hole-punch) and B
    nat1    10.77.1.11 (WAN) / 10.77.2.1 (LAN), masquerade, unsolicited inbound dropped
    home1   10.77.2.2: the volunteer, behind nat1
    nat2    10.77.1.12 (WAN) / 10.77.3.1 (LAN), same rules
    home2   10.77.3.2: coordinator C, behind a second NAT

Every process is a real ``moe-swarm`` process started with ``ip netns exec``. Asserted: nobody
can dial the volunteer directly; through the relay it serves coordinator A (path ``relayed``);
coordinator B (public) gets a direct connection by hole punching (``hole-punched``); coordinator
C behind its own NAT too (simultaneous TCP open through both NATs); every generation gives the
same tokens as all-local. Where namespaces cannot be created the module is skipped with the
reason printed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from swarm.model.gguf import model_id_for
from tests.conftest import GOLDEN_GGUF
from tests.e2e.test_process_e2e import UNVERIFIED

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PUB, NAT1_WAN, NAT2_WAN, HOME1, HOME2 = "10.77.1.1", "10.77.1.11", "10.77.1.12", "10.77.2.2", "10.77.3.2"
VOL_PORT = 4010
NFT_RULES = """
table ip nat {{
  chain post {{ type nat hook postrouting priority srcnat; policy accept; oifname "{wan}" masquerade; }}
}}
table inet filter {{
  chain input {{ type filter hook input priority 0; policy accept; iifname "{wan}" ct state new drop; }}
  chain forward {{ type filter hook forward priority 0; policy accept; iifname "{wan}" ct state new drop; }}
}}
"""


def run(*cmd: str, check: bool = True, timeout: float = 30, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout, input=input)


def why_no_namespaces() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs as root)"
    for tool in ("ip", "nft", "curl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 nftables curl)"
    probe = f"msw-probe-{uuid.uuid4().hex[:6]}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        nft = run("ip", "netns", "exec", probe, "nft", "-f", "-", check=False, input=NFT_RULES.format(wan="lo"))
        if nft.returncode != 0:
            return f"nftables does not work in a namespace: {nft.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class World:
    tag: str
    tmp: Path
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    def ns(self, name: str) -> str:
        return f"msw-{name}-{self.tag}"

    def sh(self, ns: str, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return run("ip", "netns", "exec", self.ns(ns), *cmd, check=check, timeout=timeout)

    def add_ns(self, name: str) -> None:
        run("ip", "netns", "add", self.ns(name))
        self.namespaces.append(self.ns(name))
        run("ip", "-n", self.ns(name), "link", "set", "lo", "up")

    def veth(self, a_ns: str, a_if: str, b_ns: str, b_if: str) -> None:
        run("ip", "link", "add", a_if, "netns", self.ns(a_ns), "type", "veth", "peer", "name", b_if, "netns", self.ns(b_ns))

    def addr(self, ns: str, ifname: str, cidr: str) -> None:
        run("ip", "-n", self.ns(ns), "addr", "add", cidr, "dev", ifname)
        run("ip", "-n", self.ns(ns), "link", "set", ifname, "up")

    def build(self) -> None:
        self.add_ns("pub")
        run("ip", "-n", self.ns("pub"), "link", "add", "br0", "type", "bridge")
        self.addr("pub", "br0", f"{PUB}/24")
        for i, (wan, lan_net) in enumerate(((NAT1_WAN, "10.77.2"), (NAT2_WAN, "10.77.3")), start=1):
            nat, home = f"nat{i}", f"home{i}"
            self.add_ns(nat)
            self.add_ns(home)
            wan_if, pub_if, lan_if, home_if = (f"n{i}w{self.tag}", f"n{i}p{self.tag}", f"n{i}l{self.tag}", f"h{i}e{self.tag}")
            self.veth(nat, wan_if, "pub", pub_if)
            run("ip", "-n", self.ns("pub"), "link", "set", pub_if, "master", "br0", "up")
            self.addr(nat, wan_if, f"{wan}/24")
            self.veth(nat, lan_if, home, home_if)
            self.addr(nat, lan_if, f"{lan_net}.1/24")
            self.addr(home, home_if, f"{lan_net}.2/24")
            run("ip", "-n", self.ns(home), "route", "add", "default", "via", f"{lan_net}.1")
            self.sh(nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            run("ip", "netns", "exec", self.ns(nat), "nft", "-f", "-", input=NFT_RULES.format(wan=wan_if))

    def start(self, name: str, ns: str, *args: str) -> Path:
        log = self.tmp / f"{name}.log"
        fh = open(log, "wb")  # noqa: SIM115 - the process owns it until it exits
        cmd = ["ip", "netns", "exec", self.ns(ns), sys.executable, "-m", "swarm.cli", "--log-level", "INFO", *args]
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        fh.close()
        self.procs.append((name, p, log))
        return log

    def wait_line(self, name: str, prefix: str, within: float = 90) -> str:
        _, p, log = next(x for x in self.procs if x[0] == name)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
            if p.poll() is not None:
                raise AssertionError(f"{name} exited {p.returncode}:\n{log.read_text(errors='replace')}")
            time.sleep(0.1)
        raise AssertionError(f"{name}: no line starting with {prefix!r} in {within}s:\n{log.read_text(errors='replace')}")

    def http(self, ns: str, url: str, body: dict[str, Any] | None = None) -> Any:
        cmd = ["curl", "-sS", "--max-time", "60", url]
        if body is not None:
            cmd += ["-H", "content-type: application/json", "-d", json.dumps(body)]
        return json.loads(self.sh(ns, *cmd, timeout=90).stdout)

    def stop_all(self) -> None:
        for _, p, _ in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for name, p, _ in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop in 15 s; killing it", file=sys.stderr)
                p.kill()
                p.wait()

    def remove(self) -> None:
        for ns in reversed(self.namespaces):
            run("ip", "netns", "del", ns, check=False)


def eventually(check: Callable[[], Any], within: float = 30, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met in {within}s (last: {last!r})")


@dataclass
class Swarm:
    world: World
    relay_addr: str
    volunteer: dict[str, Any]
    local_tokens: list[int]
    body: dict[str, Any]

    def generate(self, ns: str, url: str) -> list[int]:
        out: list[int] = self.world.http(ns, f"{url}/v1/completions", self.body)["choices"][0]["token_ids"]
        return out

    def worker(self, ns: str, url: str) -> dict[str, Any]:
        [w] = self.world.http(ns, f"{url}/dispatch")["workers"]
        return dict(w)

    def relay_metrics(self) -> dict[str, float]:
        text = self.world.sh("pub", "curl", "-sS", f"http://{PUB}:9090/metrics").stdout
        return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


A, B, C = f"http://{PUB}:8080", f"http://{PUB}:8081", f"http://{HOME2}:8082"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    reason = why_no_namespaces()
    if reason is not None:
        print(f"\ntest_nat_netns skipped: {reason}", file=sys.stderr)
        pytest.skip(reason)
    world = World(tag=uuid.uuid4().hex[:5], tmp=tmp_path_factory.mktemp("netns"))
    try:
        world.build()
        yield start_swarm(world)
    finally:
        world.stop_all()
        world.remove()


def start_swarm(w: World) -> Swarm:
    model_id = model_id_for(GOLDEN_GGUF)
    maps = {c: w.tmp / f"map-{c}.json" for c in "ABC"}
    for path in maps.values():
        path.write_text(json.dumps({"model_id": model_id, "version": 0, "layers": []}))
    w.start("relay", "pub", "relay", "--listen", f"/ip4/{PUB}/tcp/4001", "--host", PUB, "--port", "9090",
            "--data-dir", str(w.tmp / "relay"))
    common = ["--model", str(GOLDEN_GGUF), "--expert-timeout", "2.0", "--dispatch", "offload", *UNVERIFIED]
    w.start("A", "pub", "coordinator", *common, "--host", PUB, "--port", "8080", "--p2p-listen", f"/ip4/{PUB}/tcp/4002",
            "--data-dir", str(w.tmp / "A"), "--dispatch-map", str(maps["A"]), "--no-hole-punch", "--no-lanes")
    w.start("B", "pub", "coordinator", *common, "--host", PUB, "--port", "8081", "--p2p-listen", f"/ip4/{PUB}/tcp/4003",
            "--data-dir", str(w.tmp / "B"), "--dispatch-map", str(maps["B"]))
    w.start("C", "home2", "coordinator", *common, "--host", HOME2, "--port", "8082", "--p2p-listen", f"/ip4/{HOME2}/tcp/4004",
            "--data-dir", str(w.tmp / "C"), "--dispatch-map", str(maps["C"]))
    line = w.wait_line("relay", "relay ready ")
    relay_addr = line.split("addrs=")[1].split()[0].split(",")[0]
    for c in "ABC":
        w.wait_line(c, "coordinator ready at ")
    body = {"model": model_id, "prompt": "The quick brown fox", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    local = w.http("pub", f"{A}/v1/completions", body)["choices"][0]["token_ids"]
    assert len(local) == 48
    # the volunteer listens on its private address: a home machine behind nat1; it answers A (its
    # --coordinator) and, told so, B and C
    allow = [a for ns, url in (("pub", B), ("home2", C)) for a in ("--allow-peer", w.http(ns, f"{url}/health")["peer_id"])]
    w.start("volunteer", "home1", "volunteer", "--coordinator", A, "--slice", "0:0-8", "--slice", "1:0-8", *allow,
            "--listen", f"/ip4/{HOME1}/tcp/{VOL_PORT}", "--relay", relay_addr, "--data-dir", str(w.tmp / "v"), "--no-progress")
    w.wait_line("volunteer", "volunteer ready ")
    info = json.loads((w.tmp / "v" / "volunteer.json").read_text())
    layers = [{"layer": L, "ranges": [{"lo": 0, "hi": 8, "replicas": [{"peer_id": info["peer_id"], "addrs": info["addrs"]}]}]}
              for L in (0, 1)]
    for path in maps.values():
        path.write_text(json.dumps({"model_id": model_id, "version": 1, "layers": layers}))
    s = Swarm(w, relay_addr, info, local, body)
    for ns, url in (("pub", A), ("pub", B), ("home2", C)):

        def adopted(ns: str = ns, url: str = url) -> bool:
            return bool(w.http(ns, f"{url}/dispatch")["map_version"] == 1)

        eventually(adopted)
    return s


def test_nobody_can_dial_the_volunteer_directly(swarm: Swarm) -> None:
    w = swarm.world
    # it learnt it is not reachable: the relay saw it at nat1's address, not at the one it listens on
    assert swarm.volunteer["reachability"] == "private"
    assert swarm.volunteer["addrs"] == [f"{swarm.relay_addr}/p2p-circuit/p2p/{swarm.volunteer['peer_id']}"]
    assert swarm.relay_metrics()['moe_swarm_relay_autonat_dialbacks_total{status="E_DIAL_REFUSED"}'] == 1
    # a libp2p dial from the public side, to its private address and to its NAT's public one, fails
    probe = (
        "import sys, trio\n"
        "from swarm.p2p.libp2p import open_libp2p_transport\n"
        "async def main():\n"
        f"    async with open_libp2p_transport(key_path=None, listen_addrs=['/ip4/{PUB}/tcp/0'], dial_timeout_s=3) as t:\n"
        f"        for a in ('/ip4/{HOME1}/tcp/{VOL_PORT}', '/ip4/{NAT1_WAN}/tcp/{VOL_PORT}'):\n"
        "            try:\n"
        f"                await t.open_stream('{swarm.volunteer['peer_id']}', [a], '/moe-swarm/expert/2')\n"
        "                print('CONNECTED', a)\n"
        "            except Exception as exc:\n"
        "                print('FAILED', a, type(exc).__name__)\n"
        "trio.run(main)\n"
    )
    out = w.sh("pub", sys.executable, "-c", probe, timeout=60).stdout
    assert out.count("FAILED") == 2 and "CONNECTED" not in out, out


def test_served_through_the_relay_without_hole_punching(swarm: Swarm) -> None:
    before = swarm.relay_metrics()["moe_swarm_relay_bytes_relayed_total"]
    assert swarm.generate("pub", A) == swarm.local_tokens
    w = swarm.worker("pub", A)
    assert w["path"] == "relayed" and w["calls"] > 0 and w["failures"] == 0, w
    m = swarm.relay_metrics()
    assert m["moe_swarm_relay_bytes_relayed_total"] > before + 20_000  # the activations went through the relay
    assert m["moe_swarm_relay_reservations"] == 1 and m["moe_swarm_relay_circuits"] >= 1


def test_hole_punched_with_a_public_coordinator(swarm: Swarm) -> None:
    assert swarm.generate("pub", B) == swarm.local_tokens
    eventually(lambda: swarm.worker("pub", B)["path"] == "hole-punched")
    # once moved, not one byte of B's expert stream crosses the relay. (Not the relay's byte total:
    # that also counts the muxers' pings on A's idle circuit and on B's relayed connection until it
    # closes, and the relay sees only ciphertext, so it cannot tell expert frames from those.)
    before = swarm.worker("pub", B)["relayed_bytes"]
    assert before > 0  # B's first calls went through the relay: the counter sees this path
    assert swarm.generate("pub", B) == swarm.local_tokens
    w = swarm.worker("pub", B)
    assert w["path"] == "hole-punched" and w["failures"] == 0, w
    assert w["relayed_bytes"] == before, w


def test_a_volunteer_behind_a_nat_dials_a_public_coordinators_data_lane(swarm: Swarm) -> None:
    """B is public and offers data lanes: the volunteer dials out through its NAT (outbound, like any
    home connection), and B's engine sends its calls there -- not through the relay, not on the
    libp2p stream. (A runs with --no-lanes: its calls keep the relayed stream, the test above; C is
    behind a NAT of its own, where no lane can be dialled: the stream, hole-punched, the test below.)"""
    assert swarm.generate("pub", B) == swarm.local_tokens
    eventually(lambda: swarm.worker("pub", B)["lane"])
    before = swarm.worker("pub", B)
    assert swarm.generate("pub", B) == swarm.local_tokens
    w = swarm.worker("pub", B)
    assert w["lane"] and w["lane_calls"] > before["lane_calls"] and w["failures"] == 0, w
    assert w["relayed_bytes"] == before["relayed_bytes"], w


def test_hole_punched_through_two_nats(swarm: Swarm) -> None:
    """Coordinator C is behind nat2: the direct connection is a simultaneous TCP open through both
    NATs (both routers drop unsolicited inbound, like home routers, so neither SYN is answered
    with a reset)."""
    assert swarm.generate("home2", C) == swarm.local_tokens
    eventually(lambda: swarm.worker("home2", C)["path"] == "hole-punched")
    before = swarm.worker("home2", C)["relayed_bytes"]
    assert swarm.generate("home2", C) == swarm.local_tokens
    w = swarm.worker("home2", C)
    assert w["path"] == "hole-punched" and w["failures"] == 0 and w["relayed_bytes"] == before, w
    conntrack = swarm.world.sh("nat1", "cat", "/proc/net/nf_conntrack", check=False).stdout
    if conntrack:  # nat1 keeps the flow: volunteer -> nat2's public address, coordinator C's port
        assert any("ESTABLISHED" in ln and f"dst={NAT2_WAN} " in ln and "dport=4004 " in ln
                   for ln in conntrack.splitlines()), conntrack
