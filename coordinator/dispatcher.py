"""Remote experts: the coordinator's dispatcher (shell between the engine thread and libp2p).

Rules:
- ``Dispatcher.moe`` is the engine's ``ExpertBackend``; it runs in the engine thread. Per MoE
  layer it partitions the experts by the dispatch map's ranges, groups the routed (row, expert)
  pairs by range, asks the policy (pure, ``coordinator.core.dispatch``) where each range goes,
  hands the remote ones to the trio loop *before* computing the local ones, then waits for the
  remote answers and combines every range's partial sum in ascending ``lo`` (canonical order).
- A remote range whose worker errors, times out, or answers the wrong shape or NaN is retried on
  the next live replica with the next attempt number; when none is left it is computed locally
  (the coordinator holds every expert: the replica of last resort). The failing worker is marked
  down with backoff. A late answer of an old attempt is dropped by the client.
- A range's partial sum is computed by its ``swarm.model.kernels.ExpertKernel`` on exactly the rows
  that have pairs in the range, locally or on a volunteer, so both give the same bits.
- The worker table is shared by the two threads under one lock; the trio side owns the clients.
- Volunteers behind NATs are reached through ``/p2p-circuit`` addresses and upgraded to direct
  connections by DCUtR hole punching (``swarm.p2p.nat``, attached to a libp2p transport while the
  dispatcher serves). A worker's expert stream that may have opened on the relayed connection
  moves once the connection turned direct (``swarm.core.paths.should_migrate``): new calls open a
  new stream, calls in flight finish on the old one, which is closed after ``timeout_s``. The
  report gives each worker's path: ``direct``, ``relayed`` or ``hole-punched`` (null: not
  connected), and ``relayed_bytes``: the expert-stream payload bytes that have crossed a relay to
  and from it (``Transport.relayed_bytes``; it stops growing once the stream has moved).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio

from coordinator.core.dispatch import BalancedPolicy, DispatchPolicy, WorkerTable
from swarm.core.paths import Path as ConnPath
from swarm.core.paths import session_path, should_migrate
from swarm.dispatch_map import DispatchMap, RangeReplicas, decode_dispatch_map, partition_layer
from swarm.errors import ConfigError, SwarmError
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend, expert_kernel, kernel_id
from swarm.p2p.libp2p import Libp2pTransport
from swarm.p2p.nat import Nat, NatConfig, open_nat
from swarm.p2p.transport import Transport
from swarm.protocol.coordinator import DispatchReport, LayerRows, WorkerReport
from swarm.protocol.expert import PROTOCOL_ID, ExpertRequest, RequestId
from swarm.rpc.client import ExpertClient

__all__ = ["Dispatcher", "watch_dispatch_map_file"]

log = logging.getLogger(__name__)


@dataclass
class _RangeJob:
    r: RangeReplicas
    rows: torch.Tensor  # indices into the layer's rows, ascending
    x: torch.Tensor  # x[rows]
    pair_rows: torch.Tensor  # indices into ``x`` (this job's rows)
    pair_experts: torch.Tensor  # local expert index (relative to lo)
    pair_weights: torch.Tensor
    candidates: tuple[str, ...] = ()
    result: torch.Tensor | None = None
    served_by: str | None = None
    errors: list[str] = field(default_factory=list)


@dataclass
class LayerCounters:
    local_rows: int = 0
    remote_rows: int = 0
    fallback_rows: int = 0


class Dispatcher:
    def __init__(
        self,
        model: GGUFModel,
        transport: Transport | None,
        *,
        policy: DispatchPolicy | None = None,
        timeout_s: float = 3.0,
        wire_dtype: str = "float32",
        hole_punch: bool = True,
        kernel: KernelBackend | None = None,
    ) -> None:
        self.kernel = kernel if kernel is not None else model.kernel
        self.model = model
        self.cfg = model.config
        self.transport = transport
        self.policy: DispatchPolicy = policy if policy is not None else BalancedPolicy()
        self.timeout_s = timeout_s
        self.wire_dtype = wire_dtype
        self.table = WorkerTable()
        self.map: DispatchMap | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._clients: dict[str, ExpertClient] = {}
        self._addrs: dict[str, list[str]] = {}
        self.hole_punch = hole_punch
        self._session_opened: dict[str, float] = {}  # peer -> start of the call that opened its stream
        self._sessions_seen: dict[str, tuple[int, int]] = {}  # peer -> (id(client), sessions_opened)
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.counters = [LayerCounters() for _ in range(self.cfg.n_layer)]
        self.maps_rejected = 0  # map files or market maps that could not be adopted
        self.map_error = ""  # why the last one was not

    def reject_map(self, reason: str) -> None:
        """A map from the file or the market was not adopted: count it, keep the reason for /dispatch."""
        self.maps_rejected += 1
        self.map_error = reason
        log.error("%s", reason)

    # -- trio side --------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self._nat_support():
            await self._serve(task_status=task_status)

    @contextlib.asynccontextmanager
    async def _nat_support(self) -> AsyncIterator[None]:
        """Circuit dialing and hole punching on a libp2p transport (unless someone attached them)."""
        if isinstance(self.transport, Libp2pTransport) and self.transport.nat is None:
            async with open_nat(self.transport, NatConfig(hole_punch=self.hole_punch)):
                yield
        else:
            yield

    async def _serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._watch_paths)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                for c in list(self._clients.values()):
                    with trio.CancelScope(shield=True):
                        await c.aclose()
                self._clients.clear()

    def set_map(self, m: DispatchMap, *, force: bool = False) -> bool:
        """Adopt ``m`` (trio side). Returns False if it is older than the current map (unless ``force``)."""
        if m.model_id != self.model.model_id:
            raise ConfigError(f"dispatch map is for {m.model_id!r}, this coordinator hosts {self.model.model_id!r}",
                              code="bad_dispatch_map")
        m.validate(n_layer=self.cfg.n_layer, n_expert=self.cfg.n_expert)
        if self.map is not None and m.version < self.map.version and not force:
            return False
        peers = m.peers()
        with self._lock:
            added, removed = self.table.sync(set(peers), time.monotonic())
            self.map = m
        for p in removed:
            c = self._clients.pop(p, None)
            self._addrs.pop(p, None)
            self._session_opened.pop(p, None)
            if c is not None and self._nursery is not None:
                self._nursery.start_soon(c.aclose)
        for p, addrs in peers.items():
            if p in self._clients and self._addrs.get(p) != addrs:
                c = self._clients.pop(p)
                if self._nursery is not None:
                    self._nursery.start_soon(c.aclose)
            self._addrs[p] = addrs
        log.info("dispatch map v%d: %d workers (+%d -%d)", m.version, len(peers), len(added), len(removed))
        return True

    def _client(self, peer: str) -> ExpertClient:
        c = self._clients.get(peer)
        if c is None:
            assert self._nursery is not None and self.transport is not None
            c = ExpertClient(self.transport, peer, self._addrs.get(peer, []), self._nursery)
            self._clients[peer] = c
        return c

    async def _run_remote(self, layer: int, job: _RangeJob, done: queue.SimpleQueue[_RangeJob]) -> None:
        try:
            req_id = RequestId(next(self._ids))
            experts: list[list[int]] = [[] for _ in range(job.x.shape[0])]
            weights: list[list[float]] = [[] for _ in range(job.x.shape[0])]
            for r, e, w in zip(job.pair_rows.tolist(), job.pair_experts.tolist(), job.pair_weights.tolist(), strict=True):
                experts[r].append(e)
                weights[r].append(w)
            for attempt, peer in enumerate(job.candidates):
                if self.transport is None or self._nursery is None:
                    break
                with self._lock:
                    if peer not in self.table.workers:
                        continue  # detached by a map change since this job was planned
                req = ExpertRequest(
                    request_id=req_id, attempt=attempt, model_id=self.model.model_id, layer=layer, lo=job.r.lo,
                    hi=job.r.hi, n_rows=int(job.x.shape[0]), dtype=self.wire_dtype, d_model=self.cfg.d_model,
                    experts=experts, weights=weights,
                )
                t0 = time.monotonic()
                call_started = trio.current_time()
                with self._lock:
                    self.table.started(peer)
                try:
                    out = await self._client(peer).call(req, job.x, timeout=self.timeout_s)
                except SwarmError as exc:
                    msg = f"{type(exc).__name__}[{exc.code}]: {exc.message}"
                    job.errors.append(f"{peer}: {msg}")
                    log.warning("expert call to %s failed (layer %d %d-%d): %s", peer, layer, job.r.lo, job.r.hi, msg)
                    with self._lock:
                        self.table.failed(peer, msg, time.monotonic())
                    continue
                finally:
                    with self._lock:
                        self.table.finished(peer)
                with self._lock:
                    self.table.succeeded(peer, rows=int(job.x.shape[0]), latency_s=time.monotonic() - t0,
                                         wall_ms=int(time.time() * 1000))
                self._note_session(peer, call_started)
                job.result = out
                job.served_by = peer
                break
        finally:
            done.put(job)

    def _note_session(self, peer: str, call_started: float) -> None:
        """Remember when the client's current stream opened: no later than the call that opened it."""
        c = self._clients.get(peer)
        if c is None:
            return
        key = (id(c), c.sessions_opened)
        if self._sessions_seen.get(peer) != key:
            self._sessions_seen[peer] = key
            self._session_opened[peer] = call_started

    def _upgraded_at(self, peer: str) -> float | None:
        nat = getattr(self.transport, "nat", None)
        return nat.upgraded_at.get(peer) if isinstance(nat, Nat) else None

    async def _watch_paths(self, interval_s: float = 1.0) -> None:
        """Move expert streams off relays once a direct connection to their worker exists (woken by
        the NAT layer's change event; ``interval_s`` bounds the wait for changes it does not see)."""
        while True:
            changed = getattr(getattr(self.transport, "nat", None), "changed", None)
            with trio.move_on_after(interval_s):
                if isinstance(changed, trio.Event):
                    await changed.wait()
                else:
                    await trio.sleep_forever()
            if self.transport is None:
                continue
            for peer, opened_at in list(self._session_opened.items()):
                if should_migrate(opened_at=opened_at, upgraded_at=self._upgraded_at(peer)):
                    old = self._clients.pop(peer, None)
                    self._sessions_seen.pop(peer, None)
                    del self._session_opened[peer]
                    log.info("worker %s: moving its expert stream from the relay to the %s connection", peer,
                             self.transport.path_to(peer))
                    if old is not None and self._nursery is not None:
                        self._nursery.start_soon(self._close_later, old)

    async def _close_later(self, client: ExpertClient) -> None:
        await trio.sleep(self.timeout_s)  # calls in flight on the old stream finish first
        await client.aclose()

    def _start_remote(self, layer: int, jobs: list[_RangeJob], done: queue.SimpleQueue[_RangeJob]) -> None:
        """Runs in the trio thread (``run_sync_soon``)."""
        for job in jobs:
            if self._nursery is None:
                done.put(job)
            else:
                self._nursery.start_soon(self._run_remote, layer, job, done)

    # -- engine thread ------------------------------------------------------------------------------
    def moe(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        n_tok, k = topk_ids.shape
        all_rows = torch.arange(n_tok).repeat_interleave(k)
        all_e = topk_ids.reshape(-1)
        all_w = topk_w.reshape(-1)
        m = self.map
        ranges = partition_layer(m.ranges_of(layer) if m is not None else [], self.cfg.n_expert)
        jobs: list[_RangeJob] = []
        now = time.monotonic()
        for r in ranges:
            sel = (all_e >= r.lo) & (all_e < r.hi)
            if not bool(sel.any()):
                continue
            pr = all_rows[sel]
            rows = torch.unique(pr)
            job = _RangeJob(r, rows, x.index_select(0, rows), torch.searchsorted(rows, pr), all_e[sel] - r.lo, all_w[sel])
            with self._lock:
                job.candidates = self.policy.choose([rep.peer_id for rep in r.replicas], self.table, now).candidates
            jobs.append(job)
        remote = [j for j in jobs if j.candidates and self.transport is not None]
        done: queue.SimpleQueue[_RangeJob] = queue.SimpleQueue()
        if remote:
            assert self._token is not None
            self._token.run_sync_soon(self._start_remote, layer, remote, done)
        c = self.counters[layer]
        for j in jobs:
            if not (j.candidates and self.transport is not None):
                j.result = self._local(layer, j)
                c.local_rows += int(j.x.shape[0])
        # every remote job reports back (success or exhausted candidates) within
        # len(candidates) * timeout; the margin only guards against a dead trio loop
        deadline = time.monotonic() + max((len(j.candidates) for j in remote), default=0) * self.timeout_s + 5.0
        for _ in remote:
            try:
                j = done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
        for j in remote:
            if j.result is None or j.served_by is None:
                j.result = self._local(layer, j)
                c.fallback_rows += int(j.x.shape[0])
            else:
                c.remote_rows += int(j.x.shape[0])
        out = torch.zeros(n_tok, self.cfg.d_model, dtype=torch.float32)
        for j in sorted(jobs, key=lambda j: j.r.lo):
            assert j.result is not None
            out.index_add_(0, j.rows, j.result)
        return out

    def _local(self, layer: int, j: _RangeJob) -> torch.Tensor:
        sub = self.model.expert_stack(layer, j.r.lo, j.r.hi)
        return expert_kernel(sub, self.kernel).partial_sum(j.x, j.pair_rows, j.pair_experts, j.pair_weights)

    # -- reporting ------------------------------------------------------------------------------------
    def _peer_kernel_id(self, peer: str) -> str:
        c = self._clients.get(peer)
        hello = c.peer_hello if c is not None else None
        return hello.kernel_id if hello is not None else ""

    def _path(self, peer: str) -> ConnPath | None:
        """The path of the worker's expert stream, else of its connection; None if not connected."""
        if self.transport is None:
            return None
        best = self.transport.path_to(peer)
        return session_path(ConnPath(best) if best else None, opened_at=self._session_opened.get(peer),
                            upgraded_at=self._upgraded_at(peer))

    def report(self) -> DispatchReport:
        """``/dispatch``: the map followed, every worker's health and path, rows per layer."""
        with self._lock:
            views = self.table.views(time.monotonic())
        m = self.map
        return DispatchReport(
            model_id=self.model.model_id,
            map_version=m.version if m is not None else None,
            maps_rejected=self.maps_rejected,
            map_error=self.map_error,
            policy=type(self.policy).__name__,
            timeout_s=self.timeout_s,
            wire_dtype=str(self.wire_dtype),
            kernel_id=kernel_id(self.kernel),
            workers=[WorkerReport(**v.__dict__, addrs=self._addrs.get(v.peer_id, []), path=self._path(v.peer_id),
                                  relayed_bytes=self.transport.relayed_bytes(v.peer_id, PROTOCOL_ID)
                                  if self.transport is not None else 0,
                                  kernel_id=self._peer_kernel_id(v.peer_id))
                     for v in views],
            layers=[LayerRows(layer=i, local_rows=c.local_rows, remote_rows=c.remote_rows, fallback_rows=c.fallback_rows)
                    for i, c in enumerate(self.counters)],
        )


async def watch_dispatch_map_file(
    path: Path, dispatcher: Dispatcher, *, interval_s: float = 0.25,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Follow ``--dispatch-map FILE``: re-read and adopt it whenever its contents change."""
    last: bytes | None = None
    first = True
    while True:
        try:
            data = await trio.Path(path).read_bytes()
        except OSError as exc:
            if first:
                raise ConfigError(f"cannot read dispatch map {path}: {exc}") from exc
            data = last or b""
        if data != last:
            last = data
            try:
                m = decode_dispatch_map(data)
                if not dispatcher.set_map(m):
                    log.warning("ignoring %s: version %d is older than the current map", path, m.version)
            except SwarmError as exc:
                if first:
                    raise
                dispatcher.reject_map(f"ignoring the changed dispatch map {path}: {exc}")
        if first:
            first = False
            task_status.started()
        await trio.sleep(interval_s)
