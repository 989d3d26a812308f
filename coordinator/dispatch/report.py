"""``/dispatch`` and ``/metrics`` of a dispatcher (shell, read on the trio thread): the map followed,
every worker's health and path, rows per layer, the load state, decisions by reason, the last
failures, verification and hold-challenge counts, coverage holes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.dispatch_map import partition_layer
from swarm.protocol.coordinator import DispatchErrorReport, DispatchReport, LayerPath, LayerRows, WorkerReport
from swarm.protocol.expert import PROTOCOL_ID

if TYPE_CHECKING:
    from coordinator.dispatch.dispatcher import Dispatcher
    from coordinator.dispatch.layer import LayerTiming

__all__ = ["DispatchCollector", "dispatch_report", "holes"]


def dispatch_report(d: Dispatcher) -> DispatchReport:
    """``/dispatch``: the map followed, every worker's health and path, rows per layer, the load
    state, decisions by reason and the last failures (trio side)."""
    now = d._now()
    core = d.core
    c = d.config
    m = d.map
    s = core.sample
    book = d.holdings
    return DispatchReport(
        model_id=d.model.model_id,
        map_version=m.version if m is not None else None,
        maps_rejected=d.maps_rejected,
        map_error=d.map_error,
        policy=c.mode.value,
        timeout_s=d.timeout_s,
        wire_dtype=str(d.wire_dtype),
        kernel_id=d.our_kernel_id if d.kernel is not None else "",
        workers=[
            WorkerReport(
                **v.__dict__,
                addrs=d.peers.addrs.get(v.peer_id, []),
                path=d.peers.path(v.peer_id),
                relayed_bytes=d.transport.relayed_bytes(v.peer_id, PROTOCOL_ID)
                if d.transport is not None
                else 0,
                kernel_id=d.peers.kernel_of(v.peer_id),
                holdings_proven=len(book.proven(v.peer_id)) if book is not None else None,
                holdings_pending=book.pending(v.peer_id) if book is not None else None,
                lane=_lane_calls(d, v.peer_id) is not None,
                lane_calls=_lane_calls(d, v.peer_id) or 0,
            )
            for v in core.table.views(now)
        ],
        layers=[
            LayerRows(
                layer=i,
                local_rows=r.local_rows,
                remote_rows=r.remote_rows,
                fallback_rows=r.fallback_rows,
                verified_rows=r.verified_rows,
            )
            for i, r in enumerate(core.rows)
        ],
        mode=c.mode.value,
        load_state=core.load_state(now).value,
        busy=s.busy if s is not None else None,
        n_slots=s.n_slots if s is not None else None,
        load_sample_age_s=round(now - s.at, 3) if s is not None else None,
        load_samples_failed=core.samples_failed,
        saturation_threshold=c.saturation_threshold,
        serve_ttl_s=c.serve_ttl_s,
        hedge_floor_ms=c.hedge_floor_s * 1000.0,
        hot_experts=c.hot_experts,
        decisions={r.value: n for r, n in sorted(core.decisions.items())},
        errors_total=core.errors_total,
        errors=[
            DispatchErrorReport(
                at_ms=e.wall_ms,
                peer=e.peer,
                layer=e.layer,
                lo=e.lo,
                hi=e.hi,
                attempt=e.attempt,
                reason=e.kind.value,
                message=e.message,
            )
            for e in core.errors
        ],
        stale_answers=core.stale_answers,
        mode_changes=list(d.executor.mode_changes),
        split_arm=core.split.arm().value,
        split_checking=core.split.checking,
        split_rate=round(core.split.outcomes[-1].split_rate, 1) if core.split.outcomes else 0.0,
        local_rate=round(core.split.outcomes[-1].local_rate, 1) if core.split.outcomes else 0.0,
        verify_rate=c.verify_rate,
        verify_probation_calls=c.verify_probation_calls,
        verifications=core.verifications,
        verified_equal=core.verified_equal,
        quarantines=core.quarantines,
        hold_challenges=book.challenges if book is not None else 0,
        hold_passes=book.passes if book is not None else 0,
        hold_failures=book.failures if book is not None else 0,
        hold_refutations=book.refutations if book is not None else 0,
        holes=holes(d, now),
        missing_waits=d.missing_waits,
        missing_failed=d.missing_failed,
        layer_path=layer_path(d),
    )


def _lane_calls(d: Dispatcher, peer: str) -> int | None:
    """Calls sent on the worker's live data lane; None without one."""
    lane = d.lanes.live(peer) if d.lanes is not None else None
    return lane.sent if lane is not None else None


def layer_path(d: Dispatcher) -> LayerPath:
    """The means of the last remote layers' stages (``LayerTiming``), in ms."""
    ts = list(d.timings)
    if not ts:
        return LayerPath()

    def ms(f: Callable[[LayerTiming], float]) -> float:
        return round(1000.0 * sum(max(0.0, f(t)) for t in ts) / len(ts), 4)

    return LayerPath(
        layers=len(ts),
        dense=ms(lambda t: t.dense_s),
        group=ms(lambda t: t.grouped - t.begin),
        place=ms(lambda t: t.placed - t.grouped),
        encode=ms(lambda t: (t.handed - t.placed) if t.handed else 0.0),
        to_trio=ms(lambda t: (t.sent - t.handed) if t.sent and t.handed else 0.0),
        wire=ms(lambda t: (t.answered - t.sent - t.volunteer_s) if t.sent and t.answered else 0.0),
        queue=ms(lambda t: t.volunteer_s - t.compute_s),
        compute=ms(lambda t: t.compute_s),
        core=ms(lambda t: (t.ended - t.answered) if t.answered else 0.0),
        wake=ms(lambda t: t.woken - t.ended),
        combine=ms(lambda t: t.combined - t.woken),
        local=ms(lambda t: t.local_s),
        total=ms(lambda t: t.combined - t.begin),
        crossings=round(sum(t.crossings for t in ts) / len(ts), 3),
    )


def holes(d: Dispatcher, now: float) -> int:
    """Ranges of the current partition not held here with no live (and, if checked, proved) replica."""
    m = d.map
    n = 0
    for layer in range(d.cfg.n_moe_layer):
        for r in partition_layer(m.ranges_of(layer) if m is not None else [], d.cfg.n_expert):
            if not d.held(layer, r.lo, r.hi) and not any(
                    d.core.table.is_live(p, now) for p in d._replicas(layer, r)):
                n += 1
    return n


class DispatchCollector(Collector):
    """``/metrics``: dispatch decisions by reason, failures, rows by where they ran, the load state."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.d = dispatcher

    def collect(self) -> Iterable[Metric]:
        core = self.d.core
        model = self.d.model.model_id
        dec = CounterMetricFamily(
            "moe_swarm_dispatch_decisions", "Dispatch decisions by reason", labels=["model", "reason"]
        )
        for r, n in sorted(core.decisions.items()):
            dec.add_metric([model, r.value], n)
        yield dec
        err = CounterMetricFamily(
            "moe_swarm_dispatch_errors", "Failed expert calls by reason", labels=["model", "reason"]
        )
        for k, n in sorted(core.errors_by_kind.items()):
            err.add_metric([model, k.value], n)
        yield err
        rows = CounterMetricFamily(
            "moe_swarm_dispatch_rows", "Expert rows by where they were computed", labels=["model", "where"]
        )
        rows.add_metric([model, "local"], sum(r.local_rows for r in core.rows))
        rows.add_metric([model, "remote"], sum(r.remote_rows for r in core.rows))
        rows.add_metric([model, "fallback"], sum(r.fallback_rows for r in core.rows))
        rows.add_metric([model, "verified"], sum(r.verified_rows for r in core.rows))
        yield rows
        ver = CounterMetricFamily(
            "moe_swarm_dispatch_verifications", "Remote answers compared with the coordinator's", labels=["model", "outcome"]
        )
        ver.add_metric([model, "equal"], core.verified_equal)
        ver.add_metric([model, "quarantined"], core.quarantines)
        yield ver
        state = GaugeMetricFamily(
            "moe_swarm_dispatch_loaded",
            "1 while dispatch treats the coordinator as loaded",
            labels=["model", "state"],
        )
        state.add_metric([model, core.load_state(self.d._now()).value], 1.0)
        yield state
        split = GaugeMetricFamily("moe_swarm_dispatch_split_arm",
                                  "1 for the split check's arm in force (split: earliest finish; local: all held here)",
                                  labels=["model", "arm"])
        split.add_metric([model, core.split.arm().value], 1.0)
        yield split
        now = self.d._now()
        holes_g = GaugeMetricFamily("moe_swarm_dispatch_holes",
                                  "Ranges not held here that no live volunteer serves now", labels=["model"])
        holes_g.add_metric([model], holes(self.d, now))
        yield holes_g
        book = self.d.holdings
        hold = CounterMetricFamily("moe_swarm_dispatch_hold_challenges", "Hold challenges by outcome",
                                   labels=["model", "outcome"])
        for outcome, n in (("passed", book.passes if book else 0), ("failed", book.failures if book else 0),
                           ("refuted", book.refutations if book else 0)):
            hold.add_metric([model, outcome], n)
        yield hold
        cross = CounterMetricFamily("moe_swarm_dispatch_cross_checks",
                                    "Second-replica checks of experts not held here, by outcome", labels=["model", "outcome"])
        cross.add_metric([model, "compared"], core.cross_checks)
        cross.add_metric([model, "disputed"], core.disputes)
        cross.add_metric([model, "unverifiable"], core.unverifiable)
        yield cross
        missing = CounterMetricFamily("moe_swarm_dispatch_missing", "Layers that waited for experts nobody served",
                                      labels=["model", "outcome"])
        missing.add_metric([model, "waited"], self.d.missing_waits)
        missing.add_metric([model, "failed"], self.d.missing_failed)
        yield missing
        lat = HistogramMetricFamily("moe_swarm_dispatch_remote_latency_seconds",
                                    "Latency of answered remote expert calls", labels=["model"])
        lat.add_metric([model], self.d.executor.latency_hist.buckets(), sum_value=self.d.executor.latency_hist.total)
        yield lat



