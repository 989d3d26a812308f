"""The coordinator's link to the demand market (shell: two trio loops over httpx).

Rules:
- Registration: ``POST /api/models`` with this coordinator's advertised URL and the manifest of the
  model it hosts, retried with backoff until accepted, then repeated every ``reregister_s`` so a
  market that lost its state (or was replaced) learns about us again without a restart.
- Dispatch map: ``GET /api/expert-dispatch-map?model=ID`` every ``poll_s`` (time-bounded); a map
  whose version differs from the current one is adopted, so workers attach or detach within about
  ``poll_s`` of a change. While the market is unreachable the last map stays in force: volunteers
  keep serving and nothing needs a restart when the market returns.
- Report: ``POST /api/coordinator-report`` every ``report_s`` with each worker's answered calls,
  rows and verified answers since the last report, and at once when the dispatcher quarantines a
  worker (with the evidence), so the market stops counting and assigning it. A report that fails
  is retried with the next one (its counts are added to it; quarantines are kept until sent); a report
  that may have landed (the connection broke after it was sent: a market replica killed) is sent again
  as it is, numbered (``epoch``, ``sequence``), and a ``409 replayed_sequence`` answer means it had
  landed: its counts land once, never twice, never lost. It
  also lists each worker's slices that passed our hold challenge (sent at once when one passes: the
  market counts a slice as a replica only once proved) and the rows routed to each range since the
  last report (load-weighted targets).
- Outages: every exchange's outcome goes to ``coordinator.core.market_outage``, which says when the
  market is lost, refused us (with what it answered: ``refused the operator token (HTTP 401
  unauthorized)``) or is back -- once per outage, never the raw body -- and why ``/health`` says
  ``degraded`` meanwhile (``status().problem``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import httpx
import msgspec
import trio

from coordinator.core.dispatch import Quarantine
from coordinator.core.market_outage import MarketOutage, Problem, ProblemKind
from coordinator.dispatch.dispatcher import Dispatcher
from swarm.dispatch_map import decode_dispatch_map
from swarm.errors import SwarmError
from swarm.failover import client_transport
from swarm.preflight import token_refusal
from swarm.protocol.coordinator import MarketLinkStatus
from swarm.protocol.http import error_code, error_message
from swarm.protocol.manifest import ModelManifest
from swarm.protocol.market import (
    CoordinatorReport,
    EvidenceMethod,
    ProvenSlice,
    QuarantineEvidence,
    ReportedWorker,
    RoutedRange,
)

__all__ = ["MarketLink"]

log = logging.getLogger(__name__)


class MarketLink:
    def __init__(
        self,
        market_url: str,
        dispatcher: Dispatcher,
        manifest: ModelManifest,
        *,
        advertise_url: str,
        token: str | None,
        poll_s: float = 0.5,
        reregister_s: float = 30.0,
        timeout_s: float = 2.0,
        report_s: float = 5.0,
        local_experts: list[tuple[int, int, int]] | None = None,
        replicas: Sequence[str] = (),
    ) -> None:
        """``local_experts``: the (layer, lo, hi) this coordinator computes itself (None: all of them),
        sent in the registration so the market gives the others more replicas."""
        self.local_experts = local_experts
        self.base = market_url.rstrip("/")
        self._report_epoch = int(time.time() * 1000)  # numbered reports (CoordinatorReport.sequence)
        self._report_seq = 0
        self._numbered = True  # False once a market from before numbered reports refused the fields
        self._unsent: CoordinatorReport | None = None  # a report whose answer never came: sent again as it is
        self.replicas = list(replicas)  # the same market's other replicas (swarm.failover)
        self.dispatcher = dispatcher
        self.manifest = manifest
        self.advertise_url = advertise_url
        self.token = token
        self.poll_s = poll_s
        self.reregister_s = reregister_s
        self.timeout_s = timeout_s
        self.epoch = int(time.time() * 1000)
        self.registered = False
        self.last_ok: float | None = None
        self.last_error = ""
        self._reregister = trio.Event()
        self.report_s = report_s
        self._reported: dict[str, tuple[int, int, int, int]] = {}  # peer -> (calls, rows, verified, pairs) already sent
        # peer -> (what it was caught at, its evidence), not yet accepted by the market
        self._quarantines: dict[str, tuple[str, QuarantineEvidence | None]] = {}
        self._routed: dict[tuple[int, int, int], int] = {}  # (layer, lo, hi) -> routed rows already reported
        self._report_now = trio.Event()
        self.reports_sent = 0
        self.outage = MarketOutage(self.base)
        dispatcher.on_quarantine.append(self._quarantined)
        dispatcher.on_hold_proven.append(lambda _: self._report_now.set())  # the market counts it once told

    def _quarantined(self, q: Quarantine) -> None:
        proof = None
        if q.proof is not None:
            p = q.proof
            proof = QuarantineEvidence(layer=q.layer, lo=q.lo, hi=q.hi, input_sha256=p.input_sha256,
                                       remote_sha256=p.remote_sha256, local_sha256=p.local_sha256,
                                       method=EvidenceMethod(p.method), detail=q.evidence[:2048])
        self._quarantines[q.peer] = (q.evidence[:2048], proof)
        self._report_now.set()

    def report_body(self) -> CoordinatorReport:
        """What the next report says: deltas since the last accepted one, pending quarantines."""
        rep = self.dispatcher.report()
        book = self.dispatcher.holdings
        workers = []
        seen: set[str] = set()
        for w in rep.workers:
            seen.add(w.peer_id)
            c0, r0, v0, p0 = self._reported.get(w.peer_id, (0, 0, 0, 0))
            held = [ProvenSlice(h.layer, h.lo, h.hi) for h in book.proven(w.peer_id)] if book is not None else []
            workers.append(ReportedWorker(peer_id=w.peer_id, calls=max(0, w.calls - c0), rows=max(0, w.rows - r0),
                                          verified=max(0, w.verified - v0), pairs=max(0, w.pairs - p0), path=w.path,
                                          latency_ms=w.latency_ewma_ms if w.latency_ewma_ms > 0 else None,
                                          quarantine=self._quarantines.get(w.peer_id, (None, None))[0],
                                          evidence=self._quarantines.get(w.peer_id, (None, None))[1], held=held))
        workers += [ReportedWorker(peer_id=p, quarantine=e, evidence=proof)
                    for p, (e, proof) in self._quarantines.items() if p not in seen]
        routed = self.dispatcher.core.routed
        ranges = [RoutedRange(layer=k[0], lo=k[1], hi=k[2], rows=n - self._routed.get(k, 0))
                  for k, n in sorted(routed.items()) if n > self._routed.get(k, 0)]
        return CoordinatorReport(url=self.advertise_url, model_id=self.manifest.model_id, workers=workers,
                                 ranges=ranges[:65536])

    def status(self) -> MarketLinkStatus:
        return MarketLinkStatus(
            market=self.base,
            registered=self.registered,
            last_map_ok_s_ago=None if self.last_ok is None else round(time.monotonic() - self.last_ok, 1),
            last_error=self.last_error,
            problem=self.outage.reason or "",
        )

    def _failed(self, channel: str, problem: Problem) -> None:
        self.last_error = f"{channel}: {problem.text}"
        line = self.outage.failed(channel, problem, trio.current_time())
        if line is not None:
            log.warning("%s", line)

    def _ok(self, channel: str) -> None:
        line = self.outage.ok(channel, trio.current_time())
        if line is not None:
            log.info("%s", line)

    def _unreachable(self, exc: httpx.HTTPError) -> Problem:
        return Problem(ProblemKind.UNREACHABLE, f"unreachable ({type(exc).__name__}: {exc})" if str(exc)
                       else f"unreachable ({type(exc).__name__})")

    def _answered(self, r: httpx.Response) -> Problem:
        """The problem with an answer that is not a success, said for people (never its raw body)."""
        if r.status_code in (401, 403):
            return Problem(ProblemKind.REFUSED, token_refusal(r.status_code, r.content, token_given=bool(self.token)),
                           hint="give the coordinator the market's operator token (--token or MOE_SWARM_TOKEN)")
        code = error_code(r.content)
        said = f"HTTP {r.status_code} {code}: {error_message(r.content)[:200]}" if code else f"HTTP {r.status_code}"
        if 400 <= r.status_code < 500:
            return Problem(ProblemKind.REFUSED, f"refused our request ({said})")
        return Problem(ProblemKind.ERROR, f"answered {said}")

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        transport = client_transport(self.base, self.replicas)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers, transport=transport) as client, \
                trio.open_nursery() as n:
            n.start_soon(self._register_loop, client)
            n.start_soon(self._map_loop, client)
            n.start_soon(self._report_loop, client)
            task_status.started()

    async def _register_loop(self, client: httpx.AsyncClient) -> None:
        reg: dict[str, object] = {"url": self.advertise_url, "models": [msgspec.to_builtins(self.manifest)],
                                  "epoch": self.epoch}
        peer_id = getattr(self.dispatcher.transport, "peer_id", None)
        if isinstance(peer_id, str):
            reg["peer_id"] = peer_id  # volunteers of our model answer expert calls from this id only
        if self.local_experts is not None:  # only when not all: an older market refuses the field
            reg["local_experts"] = {self.manifest.model_id: [list(r) for r in self.local_experts]}
        body = msgspec.json.encode(reg)
        backoff = 0.5
        while True:
            try:
                r = await client.post(f"{self.base}/api/models", content=body, headers={"content-type": "application/json"})
                if r.status_code // 100 == 2:
                    self._ok("register")
                    if not self.registered:
                        log.info("registered %s with the market at %s", self.manifest.model_id, self.base)
                    self.registered = True
                    backoff = 0.5
                    self._reregister = trio.Event()
                    with trio.move_on_after(self.reregister_s):
                        await self._reregister.wait()  # early when the market forgot us
                    continue
                self._failed("register", self._answered(r))
            except httpx.HTTPError as exc:
                self._failed("register", self._unreachable(exc))
            self.registered = False
            await trio.sleep(backoff)
            backoff = min(10.0, backoff * 2)

    async def _report_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            with trio.move_on_after(self.report_s):
                await self._report_now.wait()
            self._report_now = trio.Event()
            if not self.registered:
                continue
            body = self._unsent
            if body is None:
                self._report_seq += 1
                body = self.report_body()
                if self._numbered:
                    body = msgspec.structs.replace(body, epoch=self._report_epoch, sequence=self._report_seq)
            try:
                r = await client.post(f"{self.base}/api/coordinator-report", content=msgspec.json.encode(body),
                                      headers={"content-type": "application/json"})
            except httpx.HTTPError as exc:
                # maybe acted on (the market died mid-request): the same numbered report again, never its counts
                # in a new one; not sent at all: its counts go into the next report
                self._unsent = None if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) else body
                self._failed("report", self._unreachable(exc))
                continue
            self._unsent = None
            if r.status_code == 409 and error_code(r.content) == "replayed_sequence" and body.sequence == self._report_seq:
                log.info("report %d had landed before its answer was lost: counted once", body.sequence)
            elif r.status_code == 400 and body.sequence and (b"`epoch`" in r.content or b"`sequence`" in r.content):
                # a market from before numbered reports (unknown fields refused): unnumbered from now on, and this
                # report's counts go into the next one (schema evolution: it never counted)
                self._numbered = False
                log.warning("market %s does not know numbered reports: reporting unnumbered (a report resent after "
                            "a lost answer may count twice there)", self.base)
                self._failed("report", self._answered(r))
                continue
            elif r.status_code // 100 != 2:
                self._failed("report", self._answered(r))
                continue
            self._ok("report")
            self.reports_sent += 1
            listed = {w.peer_id for w in body.workers}
            for w in body.workers:  # the deltas sent are accounted for
                c0, r0, v0, p0 = self._reported.get(w.peer_id, (0, 0, 0, 0))
                self._reported[w.peer_id] = (c0 + w.calls, r0 + w.rows, v0 + w.verified, p0 + w.pairs)
                if w.quarantine is not None:
                    self._quarantines.pop(w.peer_id, None)
            for rr in body.ranges:
                k = (rr.layer, rr.lo, rr.hi)
                self._routed[k] = self._routed.get(k, 0) + rr.rows
            for p in list(self._reported):
                if p not in listed:  # detached: its counts start again from 0 if it comes back
                    del self._reported[p]

    async def _map_loop(self, client: httpx.AsyncClient) -> None:
        url = f"{self.base}/api/expert-dispatch-map"
        params = {"model": self.manifest.model_id}
        while True:
            try:
                r = await client.get(url, params=params)
                if r.status_code in (200, 404):
                    self._ok("dispatch map")  # 404: it answers (and took our token) but lost the model
                if r.status_code == 200:
                    m = decode_dispatch_map(r.content)
                    cur = self.dispatcher.map
                    if cur is None or m.version != cur.version:
                        # the market is the source of truth: a lower version means it was reset
                        self.dispatcher.set_map(m, force=True)
                    self.last_ok = time.monotonic()
                    self.last_error = ""
                elif r.status_code == 404:  # the market does not know the model (yet, or any more)
                    self.last_error = "dispatch map: the market does not know this model; registering"
                    self._reregister.set()
                else:
                    self._failed("dispatch map", self._answered(r))
            except httpx.HTTPError as exc:
                self._failed("dispatch map", self._unreachable(exc))
            except SwarmError as exc:  # a map the dispatcher cannot use: keep the last good one
                self.last_error = f"dispatch map: {type(exc).__name__}: {exc}"
                self.dispatcher.reject_map(f"ignoring the market's dispatch map: {exc}")
            await trio.sleep(self.poll_s)
