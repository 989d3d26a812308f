"""What the serving simulation declares instead of computing: the seconds each piece of work takes.

Rules:
- A cost file is TOML (``[costs]``), every key declared here, unknown keys refused naming the key (the
  scenario's rule). Times are seconds, measured alone (no other work on the machine); the simulator's
  processor sharing stretches them when work overlaps on one machine's cores.
- ``dense(rows)`` is one MoE layer's dense work for a batch of ``rows`` decode rows (attention, norms,
  router; on the coordinator's ``threads``); ``head(rows)`` the output head once a step (``step_s`` the
  serving path's own work per token: sampling, streaming, HTTP); ``experts(pairs)``
  one local expert call of ``pairs`` routed (row, expert) pairs on the coordinator; ``worker(pairs)`` the
  same on one volunteer thread at speed 1. ``coord_call_s`` is the coordinator's CPU per remote call (encode,
  send, receive, decode), ``worker_proto_s`` the volunteer's; ``wire_s`` the transport's round trip on
  loopback; ``coord_layer_s`` the dispatcher's own work per remote layer on the engine's path; ``wake_s`` a process waking for a message;
  ``row_bytes`` the activations of one row, each way.
- The coordinator's network thread (one trio thread: the API's streams and every remote call's protocol
  and dispatch-core work) is one queue of its own: ``stream_s`` per token streamed, ``coord_call_s`` per
  remote call (half as it leaves, half as its answer comes back). It holds Python's interpreter lock
  throughout; the engine thread and the local runner hold it for their ``py_share_*`` of each job (the rest
  is ggml's graphs, which release it): the lock is the coordinator's one queue of Python work. Work queued there waits for what is ahead of it (a step's
  tokens streamed while the next step's first layer is handed off), and shares the machine's cores.
- ``calibrate`` measures the compute costs here with the real engine and ggml kernels (one process,
  the model's own graphs, a timed expert backend: ``benchmarks/offload.py``'s ``bound`` method) at
  ``threads`` for the coordinator and 1 for a volunteer, and ``local_layer`` (a layer the engine computes
  whole: since the one-graph-per-step engine, dense and experts in one graph, cheaper than their parts)
  from 1- and 4-session decodes through the real ``EngineRuntime``; the per-call costs are taken from a measured
  ``benchmarks/expert_rtt.py`` JSON when one is given, else from this machine's last measured values
  (DESIGN §11 benchmark notes: protocol 0.97-1.13 ms per call at batch 1, 0.1-0.3 ms per wake-up).
"""

from __future__ import annotations

import statistics
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any

import msgspec

from sim.scenario import ScenarioError

__all__ = ["Costs", "calibrate", "dump_costs", "load_costs"]

NonNeg = Annotated[float, msgspec.Meta(ge=0.0)]


class Costs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    dense_layer_s: NonNeg  # one layer's dense work, fixed part
    dense_row_s: NonNeg  # ... and per decode row
    head_s: NonNeg = 0.0
    step_s: NonNeg = 0.0  # the serving path's own work per token on the engine's path (sampling, streaming, HTTP)
    stream_s: NonNeg = 0.0  # per token on the coordinator's network thread (the API's streaming: one event per
    # session and step), beside the engine: it delays the remote calls' hand-offs queued behind it
    # a layer the engine computes whole, in its one graph per step (dense and experts fused, the runtime's
    # work included): local_layer_s + local_layer_row_s x rows; 0 and 0: dense(rows) + experts(pairs)
    local_layer_s: NonNeg = 0.0
    local_layer_row_s: NonNeg = 0.0
    head_row_s: NonNeg = 0.0
    expert_call_s: NonNeg = 0.0  # one local expert call, fixed part (coordinator threads)
    expert_pair_s: NonNeg  # per routed (row, expert) pair (coordinator threads)
    worker_call_s: NonNeg = 0.0  # one call on a volunteer thread, fixed part (speed 1)
    worker_pair_s: NonNeg  # per pair on one volunteer thread (speed 1)
    coord_call_s: NonNeg = 0.0005  # coordinator CPU per remote call (the protocol's share at its end)
    worker_proto_s: NonNeg = 0.0005  # a volunteer's protocol CPU per call
    wake_s: NonNeg = 0.0002  # a process waking for a message (each end of a call)
    wire_s: NonNeg = 0.0  # the transport's own round trip on loopback (both stacks), beside the declared RTT
    net_call_s: NonNeg = 0.0  # the network thread's own work per remote call, beside the call's path (the
    # dispatcher's timers and effects the engine hands it, the comparisons' calls on the streams): half at the
    # send, half at the answer
    coord_layer_s: NonNeg = 0.0  # the coordinator's machinery per remote layer on the engine's path (placing,
    # handing the calls to the network thread and the answers back, combining): from a measured breakdown
    # the share of the engine's work that holds Python's interpreter lock (outside ggml's graphs, which release
    # it): the whole local layers' and the per-layer path's (dense halves, expert calls); the network thread
    # holds it throughout, so these shares and its work go one at a time
    py_share_local: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    py_share_dense: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    row_bytes: Annotated[int, msgspec.Meta(ge=0)] = 4096
    threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1  # the coordinator threads the above were measured with
    source: str = ""  # where the numbers come from (a file, "calibrated on <host> <date>")

    def dense(self, rows: int) -> float:
        return self.dense_layer_s + self.dense_row_s * rows

    def head(self, rows: int) -> float:
        return self.head_s + self.head_row_s * rows

    def fused_experts(self, rows: int, pairs: int) -> float:
        """The experts' part of a whole local layer (its dense part already ran: ``dense(rows)``)."""
        if self.local_layer_s == 0.0 and self.local_layer_row_s == 0.0:
            return self.experts(pairs)
        return max(0.0, self.local_layer_s + self.local_layer_row_s * rows - self.dense(rows))

    def experts(self, pairs: int) -> float:
        return self.expert_call_s + self.expert_pair_s * pairs

    def worker(self, pairs: int, speed: float) -> float:
        return (self.worker_call_s + self.worker_pair_s * pairs) / speed


def load_costs(path: Path) -> Costs:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"cost file {path}: {exc}") from None
    try:
        return msgspec.convert(raw.get("costs", raw), Costs)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"cost file {path}: {exc}") from None


def dump_costs(c: Costs) -> str:
    lines = ["# moe-swarm simulate --calibrate: seconds, measured alone (sim/costs.py)", "[costs]"]
    for k, v in msgspec.structs.asdict(c).items():
        lines.append(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"')
    return "\n".join(lines) + "\n"


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with ``a, b >= 0``; where noise gives a negative part, the line through
    the origin and the points' centre (``b = sum y / sum x``)."""
    through_origin = (0.0, max(sum(ys) / max(sum(xs), 1), 0.0))
    if len(xs) < 2:
        return through_origin
    b, a = statistics.linear_regression(xs, ys)
    if a < 0 or b <= 0:
        return through_origin
    return a, b


def _measure(path: Path, threads: int, batches: list[int], steps: int, runtime: bool) -> dict[str, Any]:
    """``coordinator.calibrate`` in a process of its own (ggml's and torch's threads are process-wide, and
    the simulator stays torch-free): its JSON."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "coordinator.calibrate", "--model", str(path), "--threads", str(threads),
            "--steps", str(steps), "--batches", *map(str, batches)] + (["--runtime"] if runtime else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise ScenarioError(f"--calibrate {path}: the measurement failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def calibrate(path: Path, *, threads: int, batches: tuple[int, ...] = (1, 2, 4, 8), steps: int = 48,
              rtt_json: Path | None = None) -> Costs:
    """Measure the compute costs of ``path`` on this machine (see the module's rules): the engine at
    ``threads`` (the coordinator) and then at 1 (a volunteer's thread), each in a process of its own."""
    import json
    import platform

    m_coord = _measure(path, threads, list(batches), steps, runtime=True)
    m_vol = _measure(path, 1, list(batches), steps, runtime=False)
    coord = {int(b): tuple(v) for b, v in m_coord["steps"].items()}
    vol = {int(b): tuple(v) for b, v in m_vol["steps"].items()}
    runtime = {int(n): float(v) for n, v in m_coord["runtime_steps"].items()}
    n_layer, n_moe, top_k = int(m_coord["n_layer"]), int(m_coord["n_moe_layer"]), int(m_coord["top_k"])
    xs = list(batches)
    # the dense part of a step: n_layer dense layers + the head; the head is not separable here, so it is
    # folded into the layers' fixed part (head_s 0)
    da, db = _fit(xs, [coord[b][0] / n_layer for b in xs])
    ea, eb = _fit([b * top_k for b in xs], [coord[b][1] / n_moe for b in xs])
    wa, wb = _fit([b * top_k for b in xs], [vol[b][1] / n_moe for b in xs])
    coord_call, wake = 0.0005, 0.0002
    if rtt_json is not None:
        cases = json.loads(rtt_json.read_text())["cases"]
        # the data lane's null call (the engine's calls take the lane), else the libp2p stream's
        null = ([c for c in cases if c.get("case") == "lane_null" and c.get("batch") == 1]
                or [c for c in cases if c.get("case") == "remote_null" and c.get("batch") == 1])
        if null:
            coord_call = float(null[0]["median_ms"]) / 1000 / 2  # the protocol's round trip, half at each end
            wake = 0.0
    # a whole local layer (the engine's one graph per step, the runtime's work included): its measured steps
    # at 1 and 4 sessions over the layers
    la, lb = _fit(sorted(runtime), [runtime[n] / n_layer for n in sorted(runtime)])
    return Costs(local_layer_s=la, local_layer_row_s=lb, dense_layer_s=da, dense_row_s=db, expert_call_s=ea, expert_pair_s=eb, worker_call_s=wa,
                 worker_pair_s=wb, coord_call_s=coord_call, worker_proto_s=coord_call, wake_s=wake,
                 row_bytes=4 * int(m_coord["d_model"]), threads=threads,
                 py_share_dense=float(m_coord.get("py_share_dense") or 0.0),
                 py_share_local=float(m_coord.get("py_share_local") or 0.0),
                 source=f"calibrated on {platform.node()} {time.strftime('%Y-%m-%d')} from {path.name}")
