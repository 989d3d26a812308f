"""First contact (issue 30), with real processes started from the command line as a person would:

- one daemon per data dir: a second volunteer, coordinator or market on the same ``--data-dir``
  (``--db``) exits 2 with one line naming the first one's PID, and the first is unaffected (its
  identity, epoch and answers); once the first is gone -- even by SIGKILL -- the dir is free again;
- every role's ordinary mistakes are one line on stderr and exit code 2, never a traceback: an address
  in use, an unreachable market, a refused or missing token (with what the market answered), a GGUF cut
  short, a URL without a scheme, a size without a unit, experts computed nowhere;
- a coordinator whose market goes away, comes back, goes away again, returns refusing its token, goes
  away and comes back with the right one logs each change once (not every retry, never raw JSON), and its ``/health``
  says ``degraded`` with the reason meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import GOLDEN_GGUF

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("MOE_SWARM_TOKEN", "MOE_SWARM_LOG")} | {"PYTHONUNBUFFERED": "1"}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "swarm.cli", *args]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=180, cwd=ROOT, env=ENV)


def until(check: Callable[[], Any], what: str, within: float = 60.0) -> Any:
    """Poll ``check()`` until it returns something truthy (a deadline, not a sleep-and-hope)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {within} s: {what}")


class Daemon:
    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self.fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(cli(*args), stdout=self.fh, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def line(self, prefix: str, within: float = 90.0) -> str:
        def found() -> str | None:
            if self.p.poll() is not None:
                raise AssertionError(f"{self.log.name} exited {self.p.returncode}:\n{self.text()}")
            return next((ln for ln in self.text().splitlines() if ln.startswith(prefix)), None)

        line: str = until(found, f"{prefix!r} in {self.log.name}", within)
        return line

    def stop(self, sig: int = signal.SIGINT) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.fh.close()


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in reversed(started):
        died = d.p.poll()
        d.stop()
        tail = "\n".join(d.text().splitlines()[-40:])
        print(f"--- {d.log.name} ({'exited ' + str(died) if died is not None else 'stopped'}):\n{tail}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_market(daemons: list[Daemon], tmp: Path, name: str, *args: str) -> tuple[Daemon, str]:
    d = Daemon(tmp / f"{name}.log", "market", "--db", str(tmp / "market.db"), "--token", "t0k", *args)
    daemons.append(d)
    return d, d.line("market ready at ").split()[3]


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


# -- one daemon per data dir ------------------------------------------------------------------------------

def test_a_second_volunteer_on_a_data_dir_exits_and_the_first_keeps_its_identity(daemons: list[Daemon],
                                                                                 tmp_path: Path) -> None:
    _, murl = start_market(daemons, tmp_path, "market", "--port", "0")
    vdir = tmp_path / "v"
    args = ("volunteer", "--market", murl, "--max-experts", "8", "--data-dir", str(vdir), "--no-progress")
    first = Daemon(tmp_path / "volunteer.log", *args)
    daemons.append(first)
    ready = first.line("volunteer ready ")
    peer_id = ready.split("peer_id=")[1].split()[0]
    kept = {name: (vdir / name).read_bytes() for name in ("identity.key", "epoch", "volunteer.json")}

    line = one_error_line(run(*args))
    assert line == (f"moe-swarm: error: --data-dir {vdir} is in use by another moe-swarm volunteer (pid {first.p.pid}); "
                    f"stop it, or give this one its own --data-dir [data_dir_in_use]")
    assert first.p.poll() is None
    assert {name: (vdir / name).read_bytes() for name in kept} == kept  # no new epoch, same identity
    status = subprocess.run(cli("volunteer", "status", "--json", "--data-dir", str(vdir)), capture_output=True,
                            text=True, timeout=60, env=ENV, cwd=ROOT)  # a reader: no lock needed
    assert status.returncode == 0 and json.loads(status.stdout)["peer_id"] == peer_id, status.stderr

    first.stop(signal.SIGKILL)  # no chance to clean up: its lock file stays, with its PID
    assert (vdir / "lock").read_text().strip() == str(first.p.pid)
    again = Daemon(tmp_path / "volunteer2.log", *args)
    daemons.append(again)
    ready = again.line("volunteer ready ")
    assert f"peer_id={peer_id} " in ready  # the same identity, and the next epoch
    assert int(ready.split("epoch=")[1].split()[0]) == int(kept["epoch"]) + 1


def test_a_second_coordinator_or_market_on_its_data_exits_and_the_first_serves_on(daemons: list[Daemon],
                                                                                  tmp_path: Path) -> None:
    market, murl = start_market(daemons, tmp_path, "market", "--port", "0")
    cdir = tmp_path / "c"
    args = ("coordinator", "--model", str(GOLDEN_GGUF), "--port", "0", "--data-dir", str(cdir), "--market", murl,
            "--token", "t0k")
    coord = Daemon(tmp_path / "coordinator.log", *args)
    daemons.append(coord)
    curl = coord.line("coordinator ready at ").split()[-1]

    line = one_error_line(run(*args))
    assert line == (f"moe-swarm: error: --data-dir {cdir} is in use by another moe-swarm coordinator (pid {coord.p.pid}); "
                    f"stop it, or give this one its own --data-dir [data_dir_in_use]")
    db = tmp_path / "market.db"
    line = one_error_line(run("market", "--db", str(db), "--token", "t0k", "--port", "0"))
    assert line == (f"moe-swarm: error: --db {db} is in use by another moe-swarm market (pid {market.p.pid}); "
                    f"stop it, or give this one its own --db [data_dir_in_use]")
    with httpx.Client(timeout=30) as h:
        assert h.get(f"{curl}/health").json()["status"] == "ok"
        assert h.get(f"{murl}/health").json()["status"] == "ok"
    assert coord.p.poll() is None and market.p.poll() is None


# -- errors a person can act on: every role, each case --------------------------------------------------------

@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """What the error cases need: a port something listens on, one nothing listens on, a real market
    (token ``t0k``) and a GGUF cut short."""
    tmp = tmp_path_factory.mktemp("first-contact")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    truncated = tmp / "model.gguf"
    truncated.write_bytes(GOLDEN_GGUF.read_bytes()[:1_000_000])
    market = Daemon(tmp / "market.log", "market", "--db", str(tmp / "m.db"), "--token", "t0k", "--port", "0")
    try:
        murl = market.line("market ready at ").split()[3]
        yield {"busy": str(busy.getsockname()[1]), "closed": str(free_port()), "market": murl, "trunc": str(truncated),
               "tmp": str(tmp), "gguf": str(GOLDEN_GGUF)}
    finally:
        market.stop()
        busy.close()


G = "{gguf}"
CASES: dict[str, tuple[list[str], str]] = {
    # role/case: (argv, the one line after "moe-swarm...: error: "); {...} from the scene
    "market/address-in-use": (["market", "--db", ":memory:", "--insecure-no-token", "--port", "{busy}"],
                              "--port {busy}: 127.0.0.1:{busy} is already in use (another process listens there); "
                              "stop it, or choose another port [address_in_use]"),
    "market/no-token": (["market", "--db", ":memory:", "--port", "0"],
                        "the market needs an operator token (--token or MOE_SWARM_TOKEN): without one anyone may "
                        "register models and coordinators; --insecure-no-token runs it open anyway [token_required]"),
    "coordinator/address-in-use": (["coordinator", "--model", G, "--port", "{busy}", "--data-dir", "{tmp}/c1"],
                                   "--port {busy}: 127.0.0.1:{busy} is already in use (another process listens there); "
                                   "stop it, or choose another port [address_in_use]"),
    "coordinator/p2p-address-in-use": (
        ["coordinator", "--model", G, "--port", "0", "--p2p-listen", "/ip4/127.0.0.1/tcp/{busy}", "--data-dir", "{tmp}/c2"],
        "--p2p-listen /ip4/127.0.0.1/tcp/{busy}: 127.0.0.1:{busy} is already in use (another process listens there); "
        "stop it, or choose another port [address_in_use]"),
    "coordinator/unreachable-market": (
        ["coordinator", "--model", G, "--port", "0", "--market", "http://127.0.0.1:{closed}", "--token", "t0k",
         "--data-dir", "{tmp}/c3"],
        "--market http://127.0.0.1:{closed}: cannot reach the market ([Errno 111] Connection refused); is it running, "
        "and is the URL right? [market_unreachable]"),
    "coordinator/refused-token": (
        ["coordinator", "--model", G, "--port", "0", "--market", "{market}", "--token", "wrong", "--data-dir", "{tmp}/c4"],
        "--token: the market at {market} refused the operator token (HTTP 401 unauthorized) [token_refused]"),
    "coordinator/missing-token": (
        ["coordinator", "--model", G, "--port", "0", "--market", "{market}", "--data-dir", "{tmp}/c5"],
        "--token: the market at {market} requires an operator token (HTTP 401 unauthorized): give --token or set "
        "MOE_SWARM_TOKEN [token_refused]"),
    "coordinator/truncated-gguf": (["coordinator", "--model", "{trunc}", "--port", "0", "--data-dir", "{tmp}/c6"],
                                   "--model {trunc}: the file is truncated (1,000,000 of 2,580,832 bytes): incomplete "
                                   "download? [truncated_gguf]"),
    "coordinator/truncated-draft": (
        ["coordinator", "--model", G, "--draft-model", "{trunc}", "--port", "0", "--data-dir", "{tmp}/c7"],
        "--draft-model {trunc}: the file is truncated (1,000,000 of 2,580,832 bytes): incomplete download? [truncated_gguf]"),
    "coordinator/url-without-scheme": (["coordinator", "--model", G, "--market", "127.0.0.1:8090"],
                                       "--market: '127.0.0.1:8090' has no scheme: write http://127.0.0.1:8090 (or "
                                       "https://) [config_error]"),
    "coordinator/size-without-unit": (["coordinator", "--model", G, "--max-body", "100"],
                                      "argument --max-body: '100' has no unit: write 100G, 100M or 100B (bytes) "
                                      "(see 'moe-swarm coordinator --help')"),
    "coordinator/experts-nowhere": (["coordinator", "--model", G, "--local-experts", "none"],
                                    "--local-experts none: the experts not computed here need volunteers, and without "
                                    "--market (or --dispatch-map) there are none: every request would wait and fail; "
                                    "give --market URL, or --on-missing disk to compute them from the GGUF [no_volunteers]"),
    "volunteer/address-in-use": (
        ["volunteer", "--market", "{market}", "--listen", "/ip4/127.0.0.1/tcp/{busy}", "--data-dir", "{tmp}/v1"],
        "--listen /ip4/127.0.0.1/tcp/{busy}: 127.0.0.1:{busy} is already in use (another process listens there); "
        "stop it, or choose another port [address_in_use]"),
    "volunteer/unreachable-market": (["volunteer", "--market", "http://127.0.0.1:{closed}", "--data-dir", "{tmp}/v2"],
                                     "--market http://127.0.0.1:{closed}: cannot reach the market ([Errno 111] Connection "
                                     "refused); is it running, and is the URL right? [market_unreachable]"),
    "volunteer/unreachable-coordinator": (
        ["volunteer", "--coordinator", "http://127.0.0.1:{closed}", "--slice", "0:0-4", "--data-dir", "{tmp}/v3"],
        "--coordinator http://127.0.0.1:{closed}: cannot reach the coordinator ([Errno 111] Connection refused); is it "
        "running, and is the URL right? [coordinator_unreachable]"),
    "volunteer/url-without-scheme": (["volunteer", "--market", "localhost:8090", "--data-dir", "{tmp}/v4"],
                                     "--market: 'localhost:8090' has no scheme: write http://localhost:8090 (or https://) "
                                     "[config_error]"),
    "volunteer/size-without-unit": (["volunteer", "--market", "{market}", "--max-memory", "5"],
                                    "argument --max-memory: '5' has no unit: write 5G, 5M or 5B (bytes) "
                                    "(see 'moe-swarm volunteer --help')"),
    "relay/address-in-use": (["relay", "--port", "{busy}", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", "{tmp}/r1"],
                             "--port {busy}: 127.0.0.1:{busy} is already in use (another process listens there); "
                             "stop it, or choose another port [address_in_use]"),
    "relay/listen-address-in-use": (
        ["relay", "--port", "0", "--listen", "/ip4/127.0.0.1/tcp/{busy}", "--data-dir", "{tmp}/r2"],
        "--listen /ip4/127.0.0.1/tcp/{busy}: 127.0.0.1:{busy} is already in use (another process listens there); "
        "stop it, or choose another port [address_in_use]"),
    "make-model/truncated-gguf": (["make-model", "--draft-of", "{trunc}", "--out", "{tmp}/draft.gguf"],
                                  "--draft-of {trunc}: the file is truncated (1,000,000 of 2,580,832 bytes): incomplete "
                                  "download? [truncated_gguf]"),
}


@pytest.mark.parametrize("case", CASES)
def test_an_ordinary_mistake_is_one_line_naming_the_flag(case: str, scene: dict[str, str]) -> None:
    argv, said = CASES[case]
    line = one_error_line(run(*(a.format(**scene) for a in argv)))
    prog = "moe-swarm" if said.endswith("]") else f"moe-swarm {argv[0]}"  # usage errors name the command
    assert line == f"{prog}: error: {said.format(**scene)}"


# -- the coordinator and its market --------------------------------------------------------------------------

def test_the_coordinator_says_once_when_its_market_is_lost_refuses_it_or_is_back(daemons: list[Daemon],
                                                                                tmp_path: Path) -> None:
    port = free_port()
    murl = f"http://127.0.0.1:{port}"
    market, _ = start_market(daemons, tmp_path, "market1", "--port", str(port))
    coord = Daemon(tmp_path / "coordinator.log", "coordinator", "--model", str(GOLDEN_GGUF), "--port", "0",
                   "--data-dir", str(tmp_path / "c"), "--market", murl, "--token", "t0k")
    daemons.append(coord)
    curl = coord.line("coordinator ready at ").split()[-1]
    h = httpx.Client(timeout=30)

    def health() -> dict[str, Any]:
        got: dict[str, Any] = h.get(f"{curl}/health").json()
        return got

    def ok() -> bool:
        got = health()
        return bool(got["status"] == "ok" and got["market"]["registered"] and not got["reason"]
                    and got["market"]["last_map_ok_s_ago"] is not None)

    def degraded(reason: str) -> bool:
        got = health()
        return got["status"] == "degraded" and got["reason"] == got["market"]["problem"] and reason in got["reason"]

    def retried() -> bool:  # the dispatch map has failed for 3 s: about six polls
        ago = health()["market"]["last_map_ok_s_ago"]
        return ago is not None and ago >= 3.0

    def restart(name: str, *args: str) -> Daemon:
        market.stop()
        until(lambda: degraded(f"market {murl} unreachable (ConnectError"), f"degraded: unreachable before {name}")
        until(retried, "retries while the market is down")
        return start_market(daemons, tmp_path, name, "--port", str(port), *args)[0]

    with h:
        until(ok, "registered, /health ok")
        market = restart("market2")
        until(ok, "ok again")
        market = restart("market3", "--token", "another")
        until(lambda: degraded(f"market {murl} refused the operator token (HTTP 401 unauthorized)"), "degraded: refused")
        until(retried, "retries while the market refuses the token")
        market = restart("market4")
        until(ok, "ok again after the refusal")
        until(lambda: coord.text().count("answers again") == 2, "the second outage's end logged")

    log = coord.text()
    said = [(m.group(1), m.group(2)) for m in re.finditer(r"^\S+ \S+ (\w+) coordinator\.dispatch\.market_link: "
                                                          r"(market .*)$", log, re.MULTILINE)]
    # one line per change, whatever the retries: lost (market1 stopped), back, lost again (market2 stopped),
    # refused (market3 answers with another token), lost (market3 stopped), back (market4)
    assert [(level, text.split()[2]) for level, text in said] == [
        ("WARNING", "unreachable"), ("INFO", "answers"), ("WARNING", "unreachable"), ("WARNING", "refused"),
        ("WARNING", "unreachable"), ("INFO", "answers")], said
    assert said[3][1] == (f"market {murl} refused the operator token (HTTP 401 unauthorized); give the coordinator the "
                       "market's operator token (--token or MOE_SWARM_TOKEN) (the last dispatch map stays in force)")
    assert '{"error"' not in log and "operator token required" not in log  # what the market said, not its raw body
