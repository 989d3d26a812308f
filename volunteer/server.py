"""The volunteer's expert server (shell): loaded slices served on ``/moe-swarm/expert/2``.

Rules:
- A request is served by the held slice that contains its ``[lo, hi)`` (local indices shift by
  the slice's ``lo``), or -- ``FEATURE_MULTI_RANGE``, one call per coordinator per layer -- by held
  slices of its layer that tile ``[lo, hi)`` side by side: its pairs split by slice, computed on
  each, and put back in the request's order. Anything else is answered ``slice_not_held`` and the
  server keeps serving.
- Compute runs on one lane at a time (``lanes``, default 1, a trio ``CapacityLimiter``), each
  computation with the process's ggml threads for big calls (``--threads``, as llama.cpp's ``-t``),
  never on the event loop. A request that finds its slice idle is computed at once from its own
  task (one hop to the compute thread and back); requests for a slice that queue up while it
  computes are merged into one batch (rows concatenated), so concurrent callers share the expert
  weights' reads. A small call (``inline_macs``) on an idle slice is computed on the event loop itself.
  The answer says how long the computation took (``compute_us``).
- ``sum_rows`` (``FEATURE_ROW_SUMS``): the answer is each row's sum over its pairs, added in
  ascending expert order from zero -- the bits the coordinator's combine would give them.
- The kernel computes straight from the request's pair arrays (``Pairs``): a batch concatenates
  them with numpy, shifting rows and experts; nothing per row is built in Python.
- A request whose caller cancelled it (``Cancel``, or the stream died) while it was queued is
  skipped when its batch is formed; one already computing finishes and its result is dropped.
- Draining (Ctrl-C): new requests are refused with ``draining`` (the coordinator falls back),
  requests already accepted finish and are answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import trio

from swarm.errors import Draining, RemoteProtocolError, SliceNotHeld
from swarm.model.kernels import DEFAULT_BACKEND, KernelBackend, add_in_expert_order, expert_kernel, kernel_id
from swarm.model.slices import LoadedSlice, hold_digest
from swarm.protocol.expert import (
    FEATURE_MULTI_RANGE,
    FEATURE_ROW_SUMS,
    ExpertRequest,
    Hello,
    HoldChallenge,
    Pairs,
    make_hello,
)
from swarm.rpc.server import Computed
from swarm.rpc.tensors import pairs_to_tensors

__all__ = ["INLINE_MACS", "ExpertServer", "ServeStats", "shielded_until_cancelled"]

# An idle slice computes calls up to this size on the event loop: below it, the hop to a compute thread
# and back (~0.3 ms measured on the 2-core VM) costs more than the call (a few hundred microseconds)
INLINE_MACS = 8_000_000

log = logging.getLogger(__name__)


@asynccontextmanager
async def shielded_until_cancelled() -> AsyncIterator[trio.Event]:
    """Run the body shielded from the caller's cancellation; the yielded event is set when that
    cancellation arrives, so the body can drain (answer calls in flight, deregister) and then end.

    Without this, Ctrl-C cancels the libp2p host and the compute loops at the same moment as the
    shutdown code starts, and calls in flight are cut instead of answered. The body must end on
    its own once the event is set (bound its shutdown in time).
    """
    stop = trio.Event()
    async with trio.open_nursery() as outer:

        async def watch() -> None:
            try:
                await trio.sleep_forever()
            finally:
                stop.set()

        outer.start_soon(watch)
        try:
            with trio.CancelScope(shield=True):
                yield stop
        finally:
            outer.cancel_scope.cancel()


@dataclass
class ServeStats:
    calls: int = 0
    rows: int = 0
    batches: int = 0
    errors: int = 0
    in_flight: int = 0
    last_call_at: float = 0.0  # monotonic
    last_serve_ms: int = 0  # Unix ms of the last answered call
    latency_ewma_ms: float = 0.0  # from a request's arrival here to its answer (queueing + compute)
    bytes_in: int = 0  # request rows received
    bytes_out: int = 0  # answers sent


@dataclass
class _Pending:
    req: ExpertRequest
    rows: torch.Tensor
    pairs: Pairs
    offset: int  # slice-local index of the request's lo
    done: trio.Event = field(default_factory=trio.Event)
    result: torch.Tensor | None = None
    error: BaseException | None = None
    abandoned: bool = False  # the caller stopped waiting: skip it if it is still queued
    compute_s: float = 0.0  # the batch's computation it was part of


class _SliceWorker:
    """Serialises one slice's computations and merges requests that queue up meanwhile."""

    def __init__(self, sl: LoadedSlice, limiter: trio.CapacityLimiter, max_batch_rows: int,
                 kernel: KernelBackend = DEFAULT_BACKEND, inline_macs: int = 0,
                 compute_lock: threading.Lock | None = None) -> None:
        self.sl = sl
        self.compute_lock = compute_lock if compute_lock is not None else threading.Lock()
        st = sl.experts
        self.macs_per_pair = 3 * st.d_model * st.d_expert
        self.inline_macs = inline_macs
        self.kernel = expert_kernel(sl.experts, kernel)
        self.limiter = limiter
        self.max_batch_rows = max_batch_rows
        self.send, self.recv = trio.open_memory_channel[_Pending](1024)
        self.batches = 0
        self.skipped = 0  # cancelled requests never computed
        self.last_serve_ms = 0
        self.running = False  # a computation of this slice is under way (direct or batched)
        self.warm_done = False
        self.warmed = trio.Event()  # set once the warm-up ended (calls then compute at once when idle)
        self._free = trio.Event()  # set when a computation ends

    async def submit(self, p: _Pending) -> torch.Tensor:
        if not self.running and self.warm_done and self.recv.statistics().current_buffer_used == 0:
            # idle: computed from the caller's task, no hop through the loop -- a small call on the
            # event loop itself (a hop to a thread and back costs more than computing it)
            small = (len(p.pairs) * self.macs_per_pair <= self.inline_macs and self.limiter.borrowed_tokens == 0
                     and not self.compute_lock.locked())  # a lane thread computing: not on the loop
            await (self._run_inline(p) if small else self._run([p]))
        else:
            try:
                try:
                    self.send.send_nowait(p)  # the queue has room: no scheduler trip before waiting
                except trio.WouldBlock:
                    await self.send.send(p)
                await p.done.wait()
            finally:
                if not p.done.is_set():
                    p.abandoned = True
        if p.error is not None:
            raise p.error
        assert p.result is not None
        return p.result

    def warm(self) -> None:
        """Before the first call (in a worker thread): every expert of the slice computed once on a
        zero row, then calls of 1..8 pairs: the weights' pages are mapped and the kernel's graphs for
        decode-sized calls are built. A cold slice answered its first calls (a coordinator's trial,
        which sets its latency estimate) several times slower than a warm one."""
        torch.set_grad_enabled(False)
        st = self.sl.experts
        x = torch.zeros(1, st.d_model)
        n = st.n_expert
        for k in sorted({n, *range(1, min(8, n) + 1)}):
            self.kernel.pair_outputs(x, torch.zeros(k, dtype=torch.long), torch.arange(k), torch.zeros(k))

    async def run(self) -> None:
        """The slice's compute loop (a task of ``ExpertServer.serve``); warms the slice first (calls
        that arrive meanwhile wait in the queue)."""
        try:
            await trio.to_thread.run_sync(self.warm, limiter=self.limiter)
        except Exception:  # a failing slice fails its calls as before; the warm-up only logs
            log.exception("warming slice %s failed", self.sl.key)
        self.warm_done = True
        self.warmed.set()
        carry: _Pending | None = None
        while True:
            if carry is not None:
                first = carry
            else:
                try:
                    first = await self.recv.receive()
                except trio.EndOfChannel:
                    return
            carry = None
            if first.abandoned:
                self.skipped += 1
                first.done.set()
                continue
            while self.running:  # a direct computation is under way: batch what queued behind it
                await self._free.wait()
            batch, n = [first], int(first.rows.shape[0])
            while True:
                try:
                    q = self.recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                if q.abandoned:
                    self.skipped += 1
                    q.done.set()
                    continue
                if n + int(q.rows.shape[0]) > self.max_batch_rows:
                    carry = q
                    break
                batch.append(q)
                n += int(q.rows.shape[0])
            await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        self.batches += 1
        self.running = True
        try:
            outs, dt = await trio.to_thread.run_sync(self._timed, batch, limiter=self.limiter)
            for p, o in zip(batch, outs, strict=True):
                p.result, p.compute_s = o, dt
            self.last_serve_ms = int(time.time() * 1000)
        except Exception as exc:  # handed to each waiting request (never a Cancelled: that one is ours)
            for p in batch:
                p.error = exc
        finally:
            self.running = False
            self._free.set()
            self._free = trio.Event()
            for p in batch:
                p.done.set()

    async def _run_inline(self, p: _Pending) -> None:
        self.batches += 1
        try:
            outs, dt = self._timed([p])
            p.result, p.compute_s = outs[0], dt
            self.last_serve_ms = int(time.time() * 1000)
        except Exception as exc:
            p.error = exc
        finally:
            p.done.set()
        await trio.lowlevel.checkpoint()

    def _timed(self, batch: list[_Pending]) -> tuple[list[torch.Tensor], float]:
        with self.compute_lock:  # one computation at a time, whichever path brought it (stream or lane)
            t0 = time.perf_counter()
            outs = self._compute(batch)
            return outs, time.perf_counter() - t0

    def compute_now(self, p: _Pending) -> None:
        """``p`` computed on the calling thread (a lane's), under the compute lock."""
        outs, p.compute_s = self._timed([p])
        p.result = outs[0]
        self.batches += 1
        self.last_serve_ms = int(time.time() * 1000)

    def _compute(self, batch: list[_Pending]) -> list[torch.Tensor]:
        torch.set_grad_enabled(False)
        if len(batch) == 1:
            p = batch[0]
            pr, pe, pw = pairs_to_tensors(p.pairs, expert_offset=p.offset)
            return [self.kernel.pair_outputs(p.rows, pr, pe, pw)]
        sizes = [int(p.rows.shape[0]) for p in batch]
        n_pairs = [len(p.pairs) for p in batch]
        bases = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        prs = np.concatenate([p.pairs.rows.astype(np.int64) + b for p, b in zip(batch, bases, strict=True)])
        pes = np.concatenate([p.pairs.experts.astype(np.int64) + p.offset for p in batch])
        pws = np.concatenate([p.pairs.weights for p in batch]).astype(np.float32, copy=False)
        x = torch.cat([p.rows for p in batch])
        out = self.kernel.pair_outputs(x, torch.from_numpy(prs), torch.from_numpy(pes), torch.from_numpy(pws))
        return list(torch.split(out, n_pairs))  # per pair: batch-invariant, so the bits of a lone call


def _sub_pairs(pairs: Pairs, sel: np.ndarray, exps: np.ndarray, plo: int) -> Pairs:
    """The pairs at ``sel``, experts relative to ``plo`` (``exps``: the request's experts, absolute)."""
    return Pairs(np.ascontiguousarray(pairs.rows[sel]), np.ascontiguousarray((exps[sel] - plo).astype("<u4")),
                 np.ascontiguousarray(pairs.weights[sel]))


class ExpertServer:
    def __init__(self, slices: list[LoadedSlice], *, threads: int = 1, lanes: int = 1, max_batch_rows: int = 4096,
                 kernel: KernelBackend = DEFAULT_BACKEND, inline_macs: int = INLINE_MACS) -> None:
        """``threads``: the ggml threads the process gives big calls (``set_compute_threads``, set by the
        daemon); ``lanes``: computations at once; ``inline_macs``: an idle slice computes a call of at
        most this many multiply-accumulates on the event loop (0: never)."""
        self.threads = threads
        self.inline_macs = inline_macs
        self.limiter = trio.CapacityLimiter(max(1, lanes))
        self.max_batch_rows = max_batch_rows
        self.kernel = kernel
        self.kernel_id = kernel_id(kernel)  # what this server's Hello announces
        self._nursery: trio.Nursery | None = None
        self.compute_lock = threading.Lock()  # one computation at a time, from the stream's threads or a lane's
        self.workers = [_SliceWorker(s, self.limiter, max_batch_rows, kernel, inline_macs, self.compute_lock)
                        for s in slices]
        self.stats = ServeStats()
        self.draining = False
        self._idle = trio.Event()  # no stream call in flight (trio side)
        self._idle.set()
        self._lanes_busy = threading.Condition(threading.Lock())  # guards _lane_calls and draining for lanes
        self._lane_calls = 0  # lane calls in flight (computing on their lanes' threads)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for w in self.workers:
                nursery.start_soon(w.run)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def add_slice(self, sl: LoadedSlice) -> None:
        """Start serving ``sl`` (inside ``serve``)."""
        if self._nursery is None:
            raise RuntimeError("the expert server is not running")
        w = _SliceWorker(sl, self.limiter, self.max_batch_rows, self.kernel, self.inline_macs, self.compute_lock)
        self.workers.append(w)
        self._nursery.start_soon(w.run)

    def remove_slice(self, model_id: str, layer: int, lo: int, hi: int) -> bool:
        """Stop taking requests for a slice; requests already queued for it are still answered."""
        for w in self.workers:
            k = w.sl.key
            if (k.model_id, k.layer, k.lo, k.hi) == (model_id, layer, lo, hi):
                self.workers.remove(w)
                w.send.close()  # its loop answers what is queued, then ends
                return True
        return False

    def last_serve_ms_of(self, model_id: str, layer: int, lo: int, hi: int) -> int:
        for w in self.workers:
            k = w.sl.key
            if (k.model_id, k.layer, k.lo, k.hi) == (model_id, layer, lo, hi):
                return w.last_serve_ms
        return 0

    @property
    def slices(self) -> list[LoadedSlice]:
        return [w.sl for w in self.workers]

    def _containing(self, model_id: str, layer: int, lo: int, hi: int) -> tuple[_SliceWorker, int] | None:
        """The held slice that contains experts ``lo..hi-1`` of the layer, and ``lo``'s offset in it."""
        for w in self.workers:
            k = w.sl.key
            if k.model_id == model_id and k.layer == layer and k.lo <= lo and hi <= k.hi:
                return w, lo - k.lo
        return None

    def hello(self, agent: str = "moe-swarm/0.2 volunteer") -> Hello:
        """This server's Hello: its kernel id, and that it answers requests spanning several slices
        and per-row sums."""
        return make_hello(agent=agent, kernel_id=self.kernel_id, features=[FEATURE_MULTI_RANGE, FEATURE_ROW_SUMS])

    def _tiling(self, model_id: str, layer: int, lo: int, hi: int) -> list[tuple[_SliceWorker, int, int, int]]:
        """Held slices of the layer that tile ``[lo, hi)`` side by side: (worker, offset of the part's
        first expert in it, part lo, part hi), ascending; [] if they do not."""
        parts = []
        at = lo
        while at < hi:
            w = next((w for w in self.workers if w.sl.key.model_id == model_id and w.sl.key.layer == layer
                      and w.sl.key.lo <= at < w.sl.key.hi), None)
            if w is None:
                return []
            end = min(hi, w.sl.key.hi)
            parts.append((w, at - w.sl.key.lo, at, end))
            at = end
        return parts

    def _find(self, req: ExpertRequest) -> list[tuple[_SliceWorker, int, int, int]]:
        found = self._containing(req.model_id, req.layer, req.lo, req.hi)
        if found is not None:
            return [(found[0], found[1], req.lo, req.hi)]
        parts = self._tiling(req.model_id, req.layer, req.lo, req.hi) if req.hi > req.lo else []
        if parts:
            return parts
        held = ", ".join(str(w.sl.key) for w in self.workers) or "none"
        raise SliceNotHeld(
            f"slice {req.layer}:{req.lo}-{req.hi} of {req.model_id} is not held here (held: {held})"
        )

    async def _compute_parts(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs,
                             parts: list[tuple[_SliceWorker, int, int, int]]) -> tuple[torch.Tensor, float]:
        """A request over several slices: its pairs split by slice (each part keeps the request's rows,
        experts relative to the part), computed side by side, put back in the request's order."""
        exps = pairs.experts.astype(np.int64) + req.lo
        out = torch.empty(len(pairs), rows.shape[1])
        spent = 0.0
        async with trio.open_nursery() as nursery:
            for w, offset, plo, phi in parts:
                sel = np.flatnonzero((exps >= plo) & (exps < phi))
                if sel.size == 0:
                    continue
                sub = _sub_pairs(pairs, sel, exps, plo)

                async def one(w: _SliceWorker = w, offset: int = offset, sel: np.ndarray = sel, sub: Pairs = sub) -> None:
                    nonlocal spent
                    p = _Pending(req, rows, sub, offset)
                    y = await w.submit(p)
                    out[torch.from_numpy(sel)] = y
                    spent += p.compute_s

                nursery.start_soon(one)
        return out, spent

    async def prove(self, ch: HoldChallenge) -> bytes:
        """The ``Prove`` plugged into ``set_expert_handlers``: the hold digest of the slice asked for,
        from the mapped bytes of a held slice that contains it (the market's map splits a range where
        replicas' slices overlap, so a coordinator may challenge part of what we hold; the windows
        are then offsets into that part's canonical data), read in a thread: pages may come from disk."""
        found = self._containing(ch.model_id, ch.layer, ch.lo, ch.hi)
        if found is not None:
            w, off = found
            stack = w.sl.experts.experts(off, off + ch.hi - ch.lo)
            return await trio.to_thread.run_sync(hold_digest, stack, ch.nonce, ch.windows, limiter=self.limiter)
        raise SliceNotHeld(f"slice {ch.layer}:{ch.lo}-{ch.hi} of {ch.model_id} is not held here")

    async def handle(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        """An ``ExpertHandler``: the answer alone (tests and tools wrap this one)."""
        return (await self.handle_timed(req, rows, pairs)).out

    async def handle_timed(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> Computed:
        """The ``ExpertHandler`` the daemons plug into ``set_expert_handlers``: the answer and how long
        it computed (the response's ``compute_us``)."""
        parts = self._begin(req, rows)
        t0 = time.monotonic()
        try:
            if len(parts) == 1:
                p = _Pending(req, rows, pairs, parts[0][1])
                out, spent = await parts[0][0].submit(p), p.compute_s
            else:
                out, spent = await self._compute_parts(req, rows, pairs, parts)
        except BaseException as exc:
            self._failed(exc)
            raise self._error(exc) from exc
        finally:
            self._left()
        return self._done(req, rows, pairs, out, spent, t0)

    def compute_sync(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> Computed:
        """``handle_timed`` on the calling thread (a lane's): the same answer, computed at once under
        the compute lock (no batching with queued stream calls: a lane's caller waits for it alone)."""
        parts = self._begin(req, rows, lane=True)
        t0 = time.monotonic()
        try:
            if len(parts) == 1:
                p = _Pending(req, rows, pairs, parts[0][1])
                parts[0][0].compute_now(p)
                assert p.result is not None
                out, spent = p.result, p.compute_s
            else:
                exps = pairs.experts.astype(np.int64) + req.lo
                out = torch.empty(len(pairs), rows.shape[1])
                spent = 0.0
                for w, offset, plo, phi in parts:
                    sel = np.flatnonzero((exps >= plo) & (exps < phi))
                    if sel.size == 0:
                        continue
                    p = _Pending(req, rows, _sub_pairs(pairs, sel, exps, plo), offset)
                    w.compute_now(p)
                    assert p.result is not None
                    out[torch.from_numpy(sel)] = p.result
                    spent += p.compute_s
        except BaseException as exc:
            self._failed(exc)
            raise self._error(exc) from exc
        finally:
            self._left(lane=True)
        return self._done(req, rows, pairs, out, spent, t0)

    def _begin(self, req: ExpertRequest, rows: torch.Tensor, *, lane: bool = False
               ) -> list[tuple[_SliceWorker, int, int, int]]:
        """A call's parts (refused while draining, or for slices not held or of another width); counted
        in flight (a lane's call under ``_lanes_busy``: it runs off the event loop)."""
        if lane:
            with self._lanes_busy:
                if self.draining:
                    raise Draining("volunteer is shutting down")
                self._lane_calls += 1
        elif self.draining:
            raise Draining("volunteer is shutting down")
        try:
            parts = self._find(req)
            d_model = parts[0][0].sl.experts.d_model
            if rows.shape[1] != d_model:
                raise RemoteProtocolError(f"d_model {rows.shape[1]} != slice d_model {d_model}", code="bad_shape")
        except BaseException:
            if lane:
                self._left(lane=True)
            raise
        s = self.stats
        s.in_flight += 1
        if not lane and s.in_flight - self._lane_calls == 1:
            self._idle = trio.Event()
        return parts

    def _left(self, *, lane: bool = False) -> None:
        s = self.stats
        if lane:
            with self._lanes_busy:
                self._lane_calls -= 1
                s.in_flight -= 1
                self._lanes_busy.notify_all()
            return
        s.in_flight -= 1
        if s.in_flight - self._lane_calls == 0:
            self._idle.set()

    def _lanes_quiet(self, timeout_s: float) -> bool:
        """(A worker thread) wait until no lane computes; False after ``timeout_s``."""
        with self._lanes_busy:
            return self._lanes_busy.wait_for(lambda: self._lane_calls == 0, timeout_s)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, Exception):
            self.stats.errors += 1
            if not isinstance(exc, RemoteProtocolError):
                log.exception("expert computation failed")

    @staticmethod
    def _error(exc: BaseException) -> BaseException:
        if isinstance(exc, RemoteProtocolError) or not isinstance(exc, Exception):
            return exc
        return RemoteProtocolError(f"computation failed: {exc}", code="internal_error")

    def _done(self, req: ExpertRequest, rows: torch.Tensor, pairs: Pairs, out: torch.Tensor, spent: float,
              t0: float) -> Computed:
        s = self.stats
        s.calls += 1
        s.rows += int(rows.shape[0])
        ms = (time.monotonic() - t0) * 1000.0
        s.latency_ewma_ms = ms if s.latency_ewma_ms == 0 else 0.8 * s.latency_ewma_ms + 0.2 * ms
        s.bytes_in += int(rows.nbytes)
        s.bytes_out += int(out.nbytes)
        s.batches = sum(w.batches for w in self.workers)
        s.last_call_at = time.monotonic()
        s.last_serve_ms = int(time.time() * 1000)
        if req.sum_rows:  # each row's pairs added in ascending expert order from zero: the layer's sum for it
            acc = np.zeros((req.n_rows, out.shape[1]), dtype=np.float32)
            out = torch.from_numpy(add_in_expert_order(acc, pairs.rows, pairs.experts, out.numpy(), error=RemoteProtocolError))
        return Computed(out, spent)

    async def drain(self, timeout_s: float = 10.0) -> bool:
        """Refuse new requests and wait for accepted ones (on streams and lanes); True if all finished in time."""
        with self._lanes_busy:
            self.draining = True
        deadline = trio.current_time() + timeout_s
        with trio.move_on_at(deadline):
            await self._idle.wait()
            left = max(0.0, deadline - trio.current_time())
            return await trio.to_thread.run_sync(self._lanes_quiet, left)
        return False

