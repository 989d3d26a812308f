"""The relay's HTTP side (shell): ``/metrics`` (Prometheus) and ``/health`` (JSON).

Rules:
- ``/health`` is ``relay.service.RelayHealth``, encoded by this module's one encoder.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from relay.service import RelayService

__all__ = ["build_app"]

_encoder = msgspec.json.Encoder()


class _RelayCollector(Collector):
    def __init__(self, service: RelayService) -> None:
        self.service = service

    def collect(self) -> Iterable[Metric]:
        self.service.ledger.expire(trio.current_time())
        s = self.service.ledger.stats()
        lim = self.service.ledger.limits

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            return c

        yield gauge("moe_swarm_relay_reservations", "Live reservations", s.reservations)
        yield gauge("moe_swarm_relay_reservations_max", "Reservation slots", lim.max_reservations)
        yield gauge("moe_swarm_relay_circuits", "Open circuits", s.circuits)
        yield counter("moe_swarm_relay_reservations_granted", "Reservations granted or refreshed", s.reservations_granted_total)
        yield counter("moe_swarm_relay_circuits_opened", "Circuits opened", s.circuits_opened_total)
        yield counter("moe_swarm_relay_bytes_relayed", "Bytes forwarded through circuits (both directions)", s.bytes_relayed_total)
        refusals = CounterMetricFamily("moe_swarm_relay_refusals", "Reservations and circuits refused", labels=["reason"])
        for reason, n in s.refusals.items():
            refusals.add_metric([reason], n)
        yield refusals
        dialbacks = CounterMetricFamily("moe_swarm_relay_autonat_dialbacks", "AutoNAT dial-back answers", labels=["status"])
        for status, n in sorted(self.service.dialback_results.items()):
            dialbacks.add_metric([status], n)
        yield dialbacks


def build_app(service: RelayService) -> Starlette:
    registry = CollectorRegistry()
    registry.register(_RelayCollector(service))

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(_: Request) -> Response:
        return Response(_encoder.encode(service.health()), media_type="application/json")

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"]), Route("/health", health, methods=["GET"])])


