"""One MoE layer in flight: the typed hand-off between its driver and the dispatcher (shell).

The driver is the engine thread in production and a trio task in the virtual-time suite; both run
the same four stages, and nothing else moves a layer's routed experts:

1. **begin** (``Dispatcher.begin``, on the driver's thread): the layer's routed pairs are grouped by
   the dispatch map's ranges (``RangeJob``: the rows and pairs as the wire carries them, built once
   with numpy); the core places every range at once (under the dispatcher's lock, so no thread
   crossing is needed to learn the placement); the remote calls go to the trio thread in **one**
   hand-off (crossing 1), already encoded.
2. **placed**: the ranges placed here are the call's local work, known when ``begin`` returns.
3. **local done**: the driver computes the local work itself (one kernel call over every range of
   it: ``Dispatcher.compute_local``) while the remote calls are in flight, and reports it
   (``local_done``, under the lock: the core may combine the layer right there).
4. **result**: the driver waits for the layer (crossing 2, only when a remote answer is still
   outstanding: the trio thread wakes it once the core combines or fails the layer) and combines the
   per-pair outputs in ascending expert order (``combine_pairs``: the bits of any partition).

Later local work the core asks for while the driver waits (a hedge's local copy, a fallback after a
failure, a dispute's copy) is handed to the same driver through the call, which wakes it: every
local share of every layer is computed by one route, on the driver's thread.

Rules:
- The call's state (its pending local work, its results, its end) is guarded by the dispatcher's
  lock; ``Waker.wake`` is the only thing another thread does to a driver.
- A call ends exactly once: ``Combine`` (every range has a result), ``Fail`` (a range nobody can
  compute: ``missing`` when for want of a live replica) or a bug on the trio side (``error``).
- Timestamps (``LayerTiming``) are ``time.perf_counter`` seconds taken where each stage happens:
  the breakdown a benchmark reports, not an input to any decision.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import trio

from coordinator.core.events import CallId, Fail, StepId
from swarm.protocol.expert import Pairs

__all__ = ["AsyncWaker", "LayerCall", "LayerTiming", "LocalJob", "RangeJob", "ThreadWaker", "WaitSource", "Waker",
           "job_of"]


@dataclass(frozen=True, eq=False)
class RangeJob:
    """One range of a layer with routed pairs: ``rows`` = the layer's rows with pairs in ``[lo, hi)``
    (ascending), ``x`` = those rows, ``pairs`` = the range's pairs in wire order (rows index ``x``,
    experts relative to ``lo``)."""

    lo: int
    hi: int
    replicas: tuple[str, ...]
    held: bool
    rows: np.ndarray  # int64
    x: np.ndarray  # float32 [n_rows, d_model], C-contiguous
    pairs: Pairs

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def n_pairs(self) -> int:
        return len(self.pairs)


@dataclass(frozen=True, eq=False)
class LocalJob:
    """What the local kernel computes: rows ``x`` and pairs (row into ``x``, expert relative to
    ``lo``, weight) in wire order; the result is each pair's weighted output ``[n_pairs, d_model]``
    float32 in that order. ``whole`` = every routed pair of the layer (the kernel may then compute
    the layer in one graph; the bits are the same)."""

    layer: int
    lo: int
    hi: int
    x: np.ndarray
    pair_rows: np.ndarray  # int64
    pair_experts: np.ndarray  # int64, relative to lo
    pair_weights: np.ndarray  # float32

    @property
    def n_pairs(self) -> int:
        return int(self.pair_rows.shape[0])


@dataclass
class LayerTiming:
    """``perf_counter`` stamps of one layer's stages (0.0: did not happen) and what it cost in thread
    crossings (a hand-off to the trio thread, or a wake of the driver from another thread)."""

    dense_s: float = 0.0  # the engine's dense half before the layer began (set by the engine)
    begin: float = 0.0  # the driver called begin
    grouped: float = 0.0  # the pairs are grouped by range
    placed: float = 0.0  # the core's placement is known (and the remote calls encoded and handed over)
    handed: float = 0.0  # the remote calls were handed to the trio thread
    sent: float = 0.0  # the trio thread took them (first of them)
    answered: float = 0.0  # the last remote answer the layer used arrived (decoded)
    ended: float = 0.0  # the core combined (or failed) the layer
    woken: float = 0.0  # the driver saw it
    combined: float = 0.0  # the driver's combine finished
    local_s: float = 0.0  # seconds the driver computed local work
    calls: int = 0  # wire calls answered for the layer
    volunteer_s: float = 0.0  # the volunteers' own arrival-to-answer time (max over the calls)
    compute_s: float = 0.0  # of which computing (max over the calls)
    crossings: int = 0


class Waker(Protocol):
    def wake(self) -> None:
        """Called under the dispatcher's lock from any thread: the call has news for its driver."""


class WaitSource(Protocol):
    """What else a driver's waker waits on: the data lanes' sockets and the dispatch timers
    (``coordinator.dispatch.lanes.LaneDriver``). Called on the driver's thread only."""

    def sockets(self) -> list[socket.socket]: ...

    def ready_now(self) -> list[socket.socket]: ...

    def timeout(self) -> float | None: ...

    def poll(self, ready: Iterable[socket.socket]) -> None: ...


class ThreadWaker:
    """A driver thread's waker (the engine's): ``wait`` blocks until ``wake``; one waker may serve
    several calls (the engine's session groups wait for whichever is ready first). With a ``source``
    (the dispatcher's data lanes), ``wait`` also selects on its sockets and lets it read them and
    fire its timers: the driver reads its own answers, with no other thread in between.

    ``current()``: the calling thread's waker (one per thread, reused: its selector and wake pipe
    are made once)."""

    _local = threading.local()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._news = False
        self._waiting = False
        self._signalled = False
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self._tx.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._rx, selectors.EVENT_READ)
        self._watched: set[socket.socket] = set()
        self.source: WaitSource | None = None

    @classmethod
    def current(cls) -> ThreadWaker:
        w: ThreadWaker | None = getattr(cls._local, "waker", None)
        if w is None:
            w = cls._local.waker = cls()
        return w

    def wake(self) -> None:
        with self._lock:
            self._news = True
            if self._waiting and not self._signalled:
                self._signalled = True
                try:
                    self._tx.send(b"\0")
                except OSError:  # the pipe is full: a wake is pending anyway
                    pass

    def _take_news(self) -> bool:
        with self._lock:
            news, self._news = self._news, False
            return news

    def wait(self, timeout: float | None = None) -> bool:
        """Block until woken (True) or ``timeout`` (False); the source's ready sockets are read and
        its due timers fired meanwhile (which may wake us)."""
        src = self.source
        if src is not None:
            src.poll(src.ready_now())
        with self._lock:
            if self._news:
                self._news = False
                return True
            self._waiting = True
        try:
            if src is not None:
                t = src.timeout()
                timeout = t if timeout is None else (timeout if t is None else min(timeout, t))
                self._watch(src.sockets())
            ready = [k.fileobj for k, _ in self._sel.select(timeout)]
        finally:
            with self._lock:
                self._waiting = False
                if self._signalled:
                    self._signalled = False
                    try:
                        while self._rx.recv(64):
                            pass
                    except OSError:
                        pass
        if src is not None:
            src.poll([s for s in ready if s is not self._rx and isinstance(s, socket.socket)])
        return self._take_news()

    def close(self) -> None:
        """Its selector and wake pipe closed (a thread's own waker lives as long as the thread)."""
        self._sel.close()
        self._rx.close()
        self._tx.close()

    def _watch(self, socks: list[socket.socket]) -> None:
        now = set(socks)
        for s in self._watched - now:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(s)
        for s in now - self._watched:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.register(s, selectors.EVENT_READ)
        self._watched = now


class AsyncWaker:
    """A trio task's waker (the virtual-time suite's driver): woken on the trio thread itself."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def wake(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()


@dataclass(eq=False)
class LayerCall:
    """One layer in flight (see the module rules). Created by ``Dispatcher.begin``."""

    layer: int
    n_tok: int
    jobs: list[RangeJob]
    waker: Waker
    x: np.ndarray  # the layer's rows [n_tok, d_model] float32 and their routing (a retry begins again from them)
    ids: np.ndarray
    w: np.ndarray
    step: StepId = StepId(0)
    timing: LayerTiming = field(default_factory=LayerTiming)
    # -- guarded by the dispatcher's lock -------------------------------------------------------
    work: list[tuple[CallId, int]] = field(default_factory=list)  # local work to compute: (call, job index)
    results: dict[CallId, np.ndarray] = field(default_factory=dict)
    winners: tuple[CallId, ...] | None = None  # set by Combine: each range's winning call, ascending lo
    fail: Fail | None = None
    missing: bool = False  # the failure is for want of a live replica (the driver may wait and retry)
    error: str = ""  # a bug on the trio side: the layer fails, dispatch goes on
    # the local kernel answered for the whole layer at once (every pair here): per-row sums, already combined
    whole: np.ndarray | None = None
    summed: set[CallId] = field(default_factory=set)  # answers that are the rows' sums (``sum_rows``)
    driver: int = field(default_factory=threading.get_ident)  # the driver's thread

    @property
    def ended(self) -> bool:
        return self.winners is not None or self.fail is not None or bool(self.error)

    def end(self, *, winners: tuple[CallId, ...] | None = None, fail: Fail | None = None, missing: bool = False,
            error: str = "") -> None:
        """Under the lock: the layer is over (the first end counts)."""
        if self.ended:
            return
        self.winners, self.fail, self.missing, self.error = winners, fail, missing, error
        self._wake()

    def add_work(self, calls: list[tuple[CallId, int]]) -> None:
        """Under the lock: more local work for the driver (a hedge, a fallback)."""
        self.work.extend(calls)
        self._wake()

    def _wake(self) -> None:
        if threading.get_ident() != self.driver:
            self.timing.crossings += 1
        self.waker.wake()


def job_of(call: LayerCall, indices: list[int], n_expert: int) -> LocalJob:
    """One local job of the call's ranges ``indices`` (their pairs side by side)."""
    jobs = [call.jobs[i] for i in indices]
    if len(jobs) == 1:
        j = jobs[0]
        return LocalJob(call.layer, j.lo, j.hi, j.x, j.pairs.rows.astype(np.int64),
                        j.pairs.experts.astype(np.int64), np.asarray(j.pairs.weights, dtype=np.float32))
    bases = np.cumsum([0, *[j.n_rows for j in jobs[:-1]]])
    return LocalJob(call.layer, 0, n_expert, np.concatenate([j.x for j in jobs]),
                    np.concatenate([j.pairs.rows.astype(np.int64) + b for j, b in zip(jobs, bases, strict=True)]),
                    np.concatenate([j.pairs.experts.astype(np.int64) + j.lo for j in jobs]),
                    np.concatenate([np.asarray(j.pairs.weights, dtype=np.float32) for j in jobs]))
