"""``make demo``'s own rules (``swarm.demo``): processes stop in dependency order, each role waited for before
the next is told (real processes, one of them slow to drain); printed model text carries no control tokens
or characters; the timeline names what a market worker does."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from swarm import demo

# a process that, on SIGINT, takes ``delay`` seconds (a volunteer draining) and then writes its role down
CHILD = """
import signal, sys, time
role, delay, out, name = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
def stop(*_):
    time.sleep(delay)
    with open(out, "a") as f:
        f.write(role + "\\n")
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
open(out + "." + name, "w").close()
while True:
    time.sleep(0.05)
"""


def test_processes_stop_in_dependency_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "DATA", tmp_path)
    out = tmp_path / "order"
    procs = demo.Procs()
    # started in the demo's order; the volunteers drain slowly, a coordinator a little
    for name, role, delay in [("relay", "relay", 0.0), ("market", "market", 0.0), ("coordinator", "coordinator", 0.2),
                              ("volunteer-1", "volunteer", 0.6), ("volunteer-2", "volunteer", 0.3),
                              ("backbone", "coordinator", 0.0)]:
        procs.start(name, [sys.executable, "-c", CHILD, role, str(delay), str(out), name], role)
    try:
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("order.*"))) < 6:  # every child has its handler installed
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stopped = procs.stop_all()
    assert out.read_text().split() == ["volunteer", "volunteer", "coordinator", "coordinator", "market", "relay"]
    assert stopped == ["2 volunteers", "2 coordinators", "the market", "the relay"]


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("<|im_start|>assistant\nhello<|im_end|>", "assistant hello"),
        ("a</s>b[INST]c[/INST]", "abc"),
        ("x\x1b[31my\rz", "x [31my z"),  # an escape sequence cannot colour or move the terminal
        ("caf\ufffd\ufffdé", "café"),  # partial UTF-8 from random byte tokens
        ("<|not a token|> keeps text with spaces", "<|not a token|> keeps text with spaces"),
    ],
)
def test_printed_model_text_is_clean(raw: str, want: str) -> None:
    assert demo.clean_text(raw) == want


def test_the_timeline_names_what_each_worker_does() -> None:
    def w(peer: str, dispatched: bool, *states: str) -> dict[str, object]:
        return {"peer_id": peer, "dispatched": dispatched, "slices": [{"state": s} for s in states]}

    m = {"workers": [w("a", True, "dispatched"), w("b", True, "dispatched"), w("c", False, "loading"),
                     w("d", False, "retiring"), w("e", False, "draining")]}
    rep = {"workers": [{"peer_id": "a", "last_serve_ms": 5, "path": "relayed"}, {"peer_id": "b", "last_serve_ms": 0}]}
    names = {"a": "volunteer-1", "b": "volunteer-2", "c": "volunteer-3", "d": "volunteer-4"}
    assert demo.worker_states(m, rep, names) == {"volunteer-1": "serving/relayed", "volunteer-2": "dispatched",
                                                 "volunteer-3": "downloading", "volunteer-4": "retiring", "e": "draining"}
