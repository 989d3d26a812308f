"""The engine runtime (shell): one engine thread owns the model, KV caches and slots.

Rules:
- Exactly one thread (``engine``) runs forward passes and sampling; the trio loop submits and
  cancels requests and receives per-request events over trio memory channels.
- The scheduling decisions are the pure ``coordinator.core.scheduler.Scheduler``; this shell only
  moves tokens between it, the model and the channels. A lock guards the scheduler because both
  threads touch it; it is never held during a forward pass.
- Events reach trio through a ``swarm.courier.Courier`` (never blocks the engine thread, and never makes it
  give up the interpreter lock to the trio thread between two graphs: the courier's thread wakes the loop
  while the next graph computes).
- A cancelled request frees its slot before the next step is planned.
- Speculative decoding (``coordinator.core.speculation``, drafters in ``coordinator.engine.drafters``):
  a decoding session whose drafter proposes tokens feeds them after its pending token in the same
  step, with logits at every position; ``verify`` samples the target at each position in order (one
  draw per emitted token, as plain decoding draws) and keeps the drafts that match. The accepted
  drafts' rows stay in the KV cache, the others are overwritten by the next step. Each session's
  draft length follows its acceptance (``DraftLength``); the counters per drafter are ``drafts``.
- Reusable prefixes (``prefix_cache_bytes > 0``): the scheduler decides (``coordinator.core.prefixes``)
  and this thread copies: before each step it performs the step's KV ops in order (a finished
  request's rows copied out of its slot, evicted copies freed, a kept prefix's rows copied into a
  new request's slot), so the new request prefills only the rest of its prompt. A copy is the rows'
  bits, and every kernel is batch-invariant, so the request computes what a full prefill computes.
- Experienced speed and admission (``coordinator.core.admission``, under the same lock): a request the
  scheduler takes is a session from ``submit`` until it leaves the scheduler (finished, cancelled,
  failed); the engine thread reports each step's sampled tokens per session. The API asks ``decide``
  before it submits (no await in between, so two requests never both see the same free room) and
  waits on ``wait_changed`` while held. A continuation: a remembered ``X-Session-Id``, or a prompt
  that starts with (and is longer than) a prompt admitted within the policy's TTL.
- Preemption by parking: before planning each step (and every 50 ms while idle) the engine thread asks the
  core's ``police`` and parks or resumes the sessions it names in the scheduler (a parked request keeps
  its slot and KV rows, skips steps, and its stream waits); the trio side's held requests are woken then.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import trio

from coordinator.core.admission import AdmissionCore, AdmissionPolicy, Capacity, Decision, Park, Verdict
from coordinator.core.prefixes import PrefixIndex, PrefixStats, prefix_hashes
from coordinator.core.scheduler import (
    Admitted,
    Emit,
    Finish,
    GenParams,
    GenRequest,
    KvOp,
    Rejected,
    RejectReason,
    Scheduler,
    SlotView,
    StepEntry,
)
from coordinator.core.speculation import DraftLength, DraftStats, verify
from coordinator.engine.drafters import Drafter
from coordinator.engine.model import KV_TYPES, ExpertBackend, KVCache, SeqChunk, Transformer
from coordinator.engine.prefix_store import PrefixStore
from coordinator.engine.sampling import make_generator, sample
from swarm.courier import Courier
from swarm.errors import DispatchFailed, RequestError
from swarm.model.gguf import GGUFModel
from swarm.model.kernels import KernelBackend
from swarm.text.tokenizer import StreamDecoder, Tokenizer

__all__ = ["CapacityInfo", "EngineFailed", "EngineRuntime", "EngineStats", "OverCapacity", "PrefixCacheInfo",
           "RequestHandle", "prefix_salt"]

SESSION_SALT = b"moe-swarm-session-v1"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineFailed:
    """The forward pass raised: the request ends with this error."""

    req_id: int
    message: str
    code: str = "engine_error"
    status: int = 500  # 503: experts nobody serves right now (DispatchFailed), worth a retry


Event = Emit | Finish | EngineFailed


@dataclass
class RequestHandle:
    req_id: int
    n_prompt: int
    events: trio.MemoryReceiveChannel[Event]


@dataclass
class EngineStats:
    requests_total: int = 0
    rejected_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    steps_total: int = 0
    decode_tps_ewma: float = 0.0  # aggregate generated tokens/s over recent steps
    prompt_tps_ewma: float = 0.0
    last_step_ms: float = 0.0


class OverCapacity(RequestError):
    """429: admitting the request would take the sessions' mean speed below the floor (``retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, code="over_capacity", status=429)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class CapacityInfo:
    """The admission core's capacity with what the runtime knows: free slots, queue, KV room."""

    capacity: Capacity
    slots: int
    free_slots: int
    queue: int
    kv_headroom_pct: float


@dataclass(frozen=True)
class PrefixCacheInfo:
    """A snapshot of the kept prefixes (for /metrics)."""

    capacity: int
    used: int
    entries: int
    disk_capacity: int
    disk_used: int
    disk_entries: int
    stats: PrefixStats


def prefix_salt(model: GGUFModel, kv_type: str) -> bytes:
    """What the chain hashes of kept prefixes are salted with: rows are only reusable by the same
    model file, kernels and KV element type."""
    return f"moe-swarm-prefix-v1|{model.model_id}|{model.sha256}|{model.kernel}|kv={kv_type}".encode()


@dataclass
class _ReqState:
    send: trio.MemorySendChannel[Event]
    generator: torch.Generator
    decoder: StreamDecoder
    params: GenParams
    history: list[int]  # the prompt and every token emitted (what an n-gram drafter looks up)
    draft: str = "none"  # its drafter
    length: DraftLength = field(default_factory=DraftLength)
    t_first: float | None = None
    slot: int | None = None


class EngineRuntime:
    def __init__(
        self,
        model: GGUFModel,
        tokenizer: Tokenizer,
        *,
        n_slots: int = 4,
        n_ctx: int | None = None,
        n_batch: int = 512,
        max_queue: int = 64,
        experts: ExpertBackend | None = None,
        kv_type: str = "f16",
        drafters: dict[str, Drafter] | None = None,
        draft: str = "none",
        draft_max: int = 8,
        prefix_cache_bytes: int = 0,
        prefix_min_tokens: int = 4,
        prefix_cache_dir: Path | None = None,
        prefix_cache_disk_bytes: int = 0,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        """``drafters`` by name, ``draft`` the default of a request that names none (``none``: no
        speculation), ``draft_max`` the most tokens a step drafts; ``prefix_cache_bytes`` the RAM kept
        prefixes may use (0: none kept), ``prefix_min_tokens`` the shortest prefix worth keeping,
        ``prefix_cache_dir`` the directory of the disk tier (``prefix_cache_disk_bytes`` at most)."""
        self.model = model
        self.tokenizer = tokenizer
        train_ctx = model.config.n_ctx_train
        self.n_ctx = min(n_ctx, train_ctx) if n_ctx else train_ctx
        self.transformer = Transformer(model, experts)
        self.caches = [KVCache(model.config, self.n_ctx, KV_TYPES[kv_type]) for _ in range(n_slots)]
        if prefix_cache_bytes > 0 and model.kernel is not KernelBackend.GGML:
            # the torch reference's matmuls are not batch-invariant: a prompt prefilled in two pieces
            # differs from one piece in the last bits (tests/unit/test_prefix_reuse.py), so reused rows
            # would not be a fresh prefill's
            log.warning("the prefix cache is off: it is exact only with the ggml kernels (--kernel ggml)")
            prefix_cache_bytes = 0
        disk = prefix_cache_disk_bytes if prefix_cache_dir is not None else 0
        self.prefixes = PrefixIndex(prefix_cache_bytes, self.caches[0].row_bytes, prefix_salt(model, kv_type),
                                    min_tokens=prefix_min_tokens, disk_capacity=disk) if prefix_cache_bytes > 0 else None
        # engine thread only: the kept rows
        self._store = PrefixStore(self.caches, self.prefixes, prefix_cache_dir if disk else None) \
            if self.prefixes is not None else None
        self.sched = Scheduler(
            n_slots=n_slots, n_ctx=self.n_ctx, n_batch=n_batch, max_queue=max_queue, eot_ids=frozenset(tokenizer.eot_ids),
            prefixes=self.prefixes,
        )
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count(1)
        self._reqs: dict[int, _ReqState] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._courier: Courier | None = None
        self.drafters: dict[str, Drafter] = dict(drafters or {})
        if draft != "none" and draft not in self.drafters:
            raise ValueError(f"no drafter {draft!r}")
        self.default_draft = draft
        self.draft_max = draft_max
        self.drafts: dict[str, DraftStats] = {name: DraftStats() for name in self.drafters}
        self.admission = AdmissionCore(admission or AdmissionPolicy())
        self.decisions: dict[tuple[str, str], int] = {}  # (verdict, reason) -> requests decided so
        self._sessions: set[int] = set()  # request ids the admission core tracks
        self._changed: trio.Event | None = None

    @property
    def n_slots(self) -> int:
        return len(self.caches)

    def set_experts(self, experts: ExpertBackend) -> None:
        self.transformer.experts = experts

    # -- service ---------------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._courier = courier = Courier(self._token, name="engine-events")
        thread = threading.Thread(target=self._run, name="engine", daemon=True)
        thread.start()
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            self._stop = True
            self._wake.set()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join)
                await trio.to_thread.run_sync(courier.close)  # the engine's last events handed over

    # -- trio side ---------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: GenParams, *, prompt_param: str = "prompt",
               continuation: bool = True, session: bool = True) -> RequestHandle:
        """Queue a request; raises ``RequestError`` (status 503 when the queue is full); ``prompt_param``
        is the body field errors about the prompt name (``messages`` for chat). ``continuation``: the
        text continues the prompt's (a completion: an SPM model's first " Paris" keeps its space, as
        llama.cpp's token_to_piece streams it); False for a chat reply, which starts its own text.
        ``session``: the admission core measures it as a session (False: an internal request)."""
        if self._token is None:
            raise RuntimeError("engine is not running")
        for t in prompt:
            if not 0 <= t < self.model.config.n_vocab:
                raise RequestError(f"token id {t} is out of range [0, {self.model.config.n_vocab})", code="invalid_token")
        draft = params.draft if params.draft is not None else self.default_draft
        if draft != "none" and draft not in self.drafters:
            names = ", ".join(["none", *self.drafters])
            raise RequestError(f"'draft' {draft!r} is not available here (this coordinator drafts with: {names})",
                               code="invalid_parameter", param="draft")
        req_id = next(self._ids)
        send, recv = trio.open_memory_channel[Event](math.inf)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        state = _ReqState(send, make_generator(seed), StreamDecoder(self.tokenizer, skip_special=params.skip_special, continuation=continuation), params,
                          list(prompt), draft, DraftLength(k_max=self.draft_max))
        now = time.monotonic()
        with self._lock:
            self._reqs[req_id] = state
            effects = self.sched.submit(GenRequest(req_id, tuple(prompt), params), now)
        for eff in effects:
            if isinstance(eff, Rejected) and eff.req_id == req_id:
                with self._lock:
                    self._reqs.pop(req_id, None)
                self.stats.rejected_total += 1
                if eff.reason is RejectReason.QUEUE_FULL:
                    raise RequestError("all slots are busy and the queue is full; retry later", code="server_busy", status=503)
                if eff.reason is RejectReason.PROMPT_TOO_LONG:
                    raise RequestError(
                        f"prompt has {len(prompt)} tokens; the context is {self.n_ctx} tokens",
                        code="context_length_exceeded",
                        param=prompt_param,
                    )
                raise RequestError("the prompt is empty", code="empty_prompt", param=prompt_param)
        self.stats.requests_total += 1
        if session:
            with self._lock:
                self.admission.started(req_id, now)
                self._sessions.add(req_id)
        self._wake.set()
        return RequestHandle(req_id, len(prompt), recv)

    def cancel(self, req_id: int) -> None:
        now = time.monotonic()
        with self._lock:
            effects = self.sched.cancel(req_id, now)
            self._sync_sessions(now)
        self._deliver(effects)

    def slots(self) -> list[SlotView]:
        with self._lock:
            return self.sched.views()

    def draft_of(self, req_id: int | None) -> tuple[str | None, float | None, int | None]:
        """A running request's drafter, its acceptance so far and the length it drafts at now."""
        with self._lock:
            st = self._reqs.get(req_id) if req_id is not None else None
            if st is None or st.draft == "none":
                return None, None, None
            a = st.length.acceptance
            return st.draft, (round(a, 3) if a is not None else None), st.length.length()

    def queue_depth(self) -> int:
        with self._lock:
            return self.sched.queue_depth()

    def busy(self) -> int:
        with self._lock:
            return self.sched.busy()

    async def pin_prefix(self, tokens: list[int], *, param: str = "tokens") -> int:
        """Compute ``tokens``' KV (only what no kept prefix holds) and pin the kept entry holding it; its id.
        Raises ``RequestError`` (the prefix cache is off, the prompt is bad, the rows do not fit)."""
        px = self.prefixes
        if px is None:
            raise RequestError("the prefix cache is off on this coordinator (--prefix-cache-mem 0, or --kernel torch)",
                               code="prefix_cache_off")
        if len(tokens) < px.min_tokens:
            raise RequestError(f"a prefix needs at least {px.min_tokens} tokens", code="prefix_too_short", param=param)
        with self._lock:
            entry = px.pin_holder(tokens)
        if entry is not None:
            return entry
        # a prompt of its own: its rows are kept as it ends (its one sampled token is never fed)
        h = self.submit(tokens, GenParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                        prompt_param=param, session=False)
        async for ev in h.events:
            if isinstance(ev, EngineFailed):
                raise RequestError(ev.message, code=ev.code, status=ev.status)
        with self._lock:
            entry = px.pin_holder(tokens)
            free = px.capacity - px.pinned_bytes
        if entry is None:
            raise RequestError(f"the prefix's KV ({len(tokens) * px.row_bytes} bytes) does not fit beside the pinned "
                               f"prefixes ({free} bytes free of --prefix-cache-mem); release some", code="prefix_cache_full",
                               status=409, param=param)
        return entry

    def unpin_prefix(self, entry: int) -> None:
        if self.prefixes is not None:
            with self._lock:
                self.prefixes.unpin(entry)

    def kept_hashes(self, limit: int = 1024) -> list[str]:
        """The kept prefixes' whole-sequence chain hashes (hex; RAM then disk, most recent first)."""
        if self.prefixes is None:
            return []
        with self._lock:
            return [h.hex() for h in self.prefixes.advertised()[:limit]]

    def prefix_cache(self) -> PrefixCacheInfo | None:
        with self._lock:
            px = self.prefixes
            if px is None:
                return None
            return PrefixCacheInfo(px.capacity, px.used, len(px), px.disk_capacity, px.disk_used, px.count("disk"),
                                   px.stats.copy())

    def _deliver(self, effects: list[Admitted | Rejected | Emit | Finish] | list[Event]) -> None:
        """Runs in the trio thread: route events to request channels."""
        for eff in effects:
            if isinstance(eff, Admitted | Rejected):
                continue
            st = self._reqs.get(eff.req_id)
            if st is None:
                continue
            if isinstance(eff, Emit) and eff.token_ids and st.t_first is None:
                st.t_first = time.monotonic()
            try:
                st.send.send_nowait(eff)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass
            if isinstance(eff, Finish | EngineFailed):
                self._reqs.pop(eff.req_id, None)
                st.send.close()
        if effects:
            self._notify()

    def _post(self, effects: list[Event]) -> None:
        if effects and self._courier is not None:
            self._courier.post(self._deliver, effects)

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        self._adopt()
        while not self._stop:
            with self._lock:
                self._police(time.monotonic())
                plan = self.sched.plan()
                ops = self.sched.take_kv_ops()
            if not plan and not ops:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                if ops and self._kv(ops):
                    continue  # a kept prefix could not be loaded: planned again (that request prefills all)
                if plan:
                    self._step(plan)
            except DispatchFailed as exc:  # experts no replica serves and the coordinator does not hold
                log.warning("engine step failed: %s", exc.message)
                self._fail(plan, f"experts unavailable: {exc.message}", code="experts_unavailable", status=503)
            except Exception as exc:  # noqa: BLE001 - the engine thread must outlive any one step
                log.exception("engine step failed")
                self._fail(plan, f"engine error: {exc}")
        self._flush_kv()

    def _flush_kv(self) -> None:
        """At stop: the KV ops still queued (a request that ended last: its rows kept, what it evicted
        written to the disk tier), so the disk tier holds what the index decided."""
        if self._store is None:
            return
        with self._lock:
            ops = self.sched.take_kv_ops()
        try:
            self._store.apply(ops)
        except Exception:  # noqa: BLE001 - stopping: logged, never raised
            log.exception("prefix cache: the last KV ops failed at stop")

    def _kv(self, ops: list[KvOp]) -> bool:
        """The step's KV copies and files, in the scheduler's order; whether a load failed (then told
        to the scheduler)."""
        assert self._store is not None
        failed = self._store.apply(ops)
        if failed:
            with self._lock:
                for op in failed:
                    self.sched.load_failed(op.slot, op.entry)
        return bool(failed)

    def _adopt(self) -> None:
        """The disk tier's files of this model, from an earlier run, into the index (oldest first)."""
        if self._store is None or self._store.dir is None or self.prefixes is None:
            return
        try:
            self._store.dir.mkdir(parents=True, exist_ok=True)
            found = self._store.scan()
        except OSError as exc:
            log.warning("prefix cache directory %s is not usable: %s", self._store.dir, exc)
            return
        for tokens, path in found:
            with self._lock:
                entry, effects = self.prefixes.adopt(tokens)
            if entry is not None:
                self._store.files[entry] = path
            for eff in effects:
                gone = self._store.files.pop(eff.entry, None)
                if gone is not None:
                    gone.unlink(missing_ok=True)

    def _fail(self, plan: list[StepEntry], message: str, *, code: str = "engine_error", status: int = 500) -> None:
        """End every request of a failed step that is still running, with ``message``."""
        failed: list[Event] = []
        with self._lock:
            for e in plan:
                if self.sched.slot_of(e.req_id) is not None:
                    self.sched.cancel(e.req_id, time.monotonic())
                    failed.append(EngineFailed(e.req_id, message, code, status))
            self._sync_sessions(time.monotonic())
        self._post(failed)

    def _propose(self, plan: list[StepEntry]) -> dict[int, tuple[str, list[int]]]:
        """Drafts for the step's decoding sessions whose drafter proposes any (plan index -> drafter, tokens)."""
        out: dict[int, tuple[str, list[int]]] = {}
        for i, e in enumerate(plan):
            if e.prefill or not e.sample:
                continue
            with self._lock:
                st = self._reqs.get(e.req_id)
                room = self.sched.draft_room(e.slot)
            if st is None or st.draft == "none":
                continue
            drafter = self.drafters[st.draft]
            if st.slot != e.slot:  # the request's first decode step in this slot: the drafter starts over
                st.slot = e.slot
                drafter.reset(e.slot)
            k = st.length.next_k(room)
            if k <= 0:
                continue
            toks = drafter.propose(e.slot, st.history, k)[:k]
            if toks:
                out[i] = (st.draft, toks)
        return out

    def _step(self, plan: list[StepEntry]) -> None:
        drafts = self._propose(plan) if self.drafters else {}
        chunks = [SeqChunk(self.caches[e.slot], [*e.tokens, *drafts[i][1]] if i in drafts else list(e.tokens), e.pos,
                           all_logits=i in drafts) for i, e in enumerate(plan)]
        t0 = time.monotonic()
        logits = self.transformer.forward_np(chunks)
        now = time.monotonic()
        dt = max(now - t0, 1e-9)
        out: list[Event] = []
        n_gen = 0
        n_prompt = 0
        with self._lock:
            for i, (e, lg) in enumerate(zip(plan, logits, strict=True)):
                self.sched.fed(e, now)
                st = self._reqs.get(e.req_id)
                if st is None or self.sched.slot_of(e.req_id) != e.slot:
                    continue
                if e.prefill:
                    n_prompt += len(e.tokens)
                if not e.sample:
                    continue
                name, proposed = drafts.get(i, ("none", []))
                # the drafted positions' logits follow the pending token's: sampled in order, as plain decoding would
                # numpy rows (``forward_np``): the check and a greedy choice run no torch op (after a graph the
                # interpreter's caches are cold: torch's slicing and dispatch cost ~0.1 ms a token here)
                rows_np = lg[-1 - len(proposed):] if proposed else lg[-1:]
                broken = False

                def target(j: int, rows_np: np.ndarray = rows_np, st: _ReqState = st) -> int:
                    nonlocal broken
                    if not np.isfinite(rows_np[j]).all():
                        broken = True
                        return -1
                    return sample(rows_np[j], temperature=st.params.temperature, top_p=st.params.top_p, generator=st.generator)

                emitted = verify(proposed, target)
                if e.req_id in self._sessions:
                    self.admission.tokens(e.req_id, len(emitted), now)
                if broken:
                    # never sample from (or keep decoding, or keep the rows of) a sequence whose numbers broke
                    self.sched.cancel(e.req_id, now, keep=False)
                    out.append(EngineFailed(e.req_id, "engine error: non-finite logits"))
                    continue
                if proposed:
                    stats = self.drafts[name]
                    stats.steps += 1
                    stats.proposed += len(proposed)
                    stats.accepted += len(emitted) - 1
                    stats.emitted += len(emitted)
                    st.length.observe(len(proposed), len(emitted) - 1)
                for j, tok in enumerate(emitted):
                    last = j == len(emitted) - 1
                    piece = "" if tok in self.tokenizer.eot_ids and not st.params.ignore_eos else st.decoder.push(tok)
                    if self.sched.last_token_due(e.slot):
                        piece += st.decoder.flush()  # an incomplete UTF-8 tail ends as U+FFFD, not lost
                    effs = self.sched.token(e.slot, e.req_id, tok, piece, now, fed=not last)
                    st.history.append(tok)
                    n_gen += 1
                    out.extend(x for x in effs if isinstance(x, Emit | Finish))
                    if self.sched.slot_of(e.req_id) != e.slot:  # finished (EOS, stop, length): the rest is not its
                        break
            self._account(n_gen, n_prompt, dt)
            self._sync_sessions(now)
        self._post(out)

    def _account(self, n_gen: int, n_prompt: int, dt: float) -> None:
        s = self.stats
        s.steps_total += 1
        s.generated_tokens_total += n_gen
        s.prompt_tokens_total += n_prompt
        s.last_step_ms = dt * 1000
        a = 0.2
        if n_gen:
            inst = n_gen / dt
            s.decode_tps_ewma = inst if s.decode_tps_ewma == 0 else (1 - a) * s.decode_tps_ewma + a * inst
        if n_prompt > 1:
            inst = n_prompt / dt
            s.prompt_tps_ewma = inst if s.prompt_tps_ewma == 0 else (1 - a) * s.prompt_tps_ewma + a * inst

    # -- admission (coordinator.core.admission) -------------------------------------------------------
    def _police(self, now: float) -> None:
        """Park or resume what the admission core says (the lock is held)."""
        if not self._sessions:
            return
        acts = self.admission.police(now)
        for a in acts:
            if isinstance(a, Park):
                assert isinstance(a.sid, int)
                self.sched.park(a.sid)
                log.info("parked session %s (mean active tps below the floor)", a.sid)
            else:
                assert isinstance(a.sid, int)
                self.sched.resume(a.sid)
                log.info("resumed session %s", a.sid)
        if acts and self._courier is not None:
            self._courier.post(self._notify)

    def _sync_sessions(self, now: float) -> None:
        """Sessions that left the scheduler (finished, cancelled, failed) end (the lock is held)."""
        if not self._sessions:
            return
        live = {s.req.id for s in self.sched.slots if s.req is not None} | {r.id for r in self.sched.queue}
        for rid in self._sessions - live:
            self.admission.ended(rid, now)
        self._sessions &= live

    def _session_keys(self, prompt: list[int], session_id: str | None, lengths: list[int]) -> list[Hashable]:
        """The keys a continuation of ``prompt`` would be remembered by (hashed without the lock)."""
        keys: list[Hashable] = [("sid", session_id)] if session_id else []
        lengths = [n for n in lengths if n < len(prompt)]
        if lengths:
            hs = prefix_hashes(prompt, SESSION_SALT, limit=lengths[0])
            keys.extend((n, hs[n]) for n in lengths)
        return keys

    def decide(self, prompt: list[int], *, session_id: str | None = None, overcommit: bool = False,
               held_since: float | None = None) -> tuple[Decision, float]:
        """Whether a new request may start now (``coordinator.core.admission``), and ``now``. On ADMIT the
        caller submits at once (no await in between); ``admitted`` then remembers its keys."""
        with self._lock:
            lengths = self.admission.remembered_lengths()
        keys = self._session_keys(prompt, session_id, lengths)
        now = time.monotonic()
        with self._lock:
            self._sync_sessions(now)
            cont = self.admission.continues(keys, now)
            d = self.admission.decide(now, continuation=cont, overcommit=overcommit, held_since=held_since)
            if d.verdict is not Verdict.HOLD or held_since is None:
                key = (str(d.verdict), str(d.reason))
                self.decisions[key] = self.decisions.get(key, 0) + 1
        return d, now

    def admitted(self, prompt: list[int], session_id: str | None) -> None:
        """Remember an admitted request's keys: a later prompt that extends this one (or names the same
        session) continues it."""
        now = time.monotonic()
        h = prefix_hashes(prompt, SESSION_SALT)[-1]
        with self._lock:
            self.admission.remember((len(prompt), h), now, length=len(prompt))
            if session_id:
                self.admission.remember(("sid", session_id), now)

    async def admit(self, prompt: list[int], params: GenParams, *, session_id: str | None = None,
                    overcommit: bool = False, prompt_param: str = "prompt", continuation: bool = True
                    ) -> tuple[RequestHandle, Decision]:
        """Decide, holding while told to (woken by tokens and endings, bounded by the policy), then submit:
        the handle and the decision. Raises ``OverCapacity`` when refused, ``RequestError`` as ``submit``."""
        held: float | None = None
        while True:
            d, now = self.decide(prompt, session_id=session_id, overcommit=overcommit, held_since=held)
            if d.verdict is Verdict.ADMIT:
                handle = self.submit(prompt, params, prompt_param=prompt_param, continuation=continuation)
                self.admitted(prompt, session_id)
                return handle, d
            if d.verdict is Verdict.REJECT:
                info = self.capacity().capacity
                mean = f"{info.mean_active_tps:.2f}" if info.mean_active_tps is not None else "unknown"
                proj = (f"{info.projected_mean_tps_if_admitted:.2f}" if info.projected_mean_tps_if_admitted is not None
                        else "unknown")
                raise OverCapacity(f"over capacity ({d.reason}): {info.active_sessions} sessions at a mean of {mean} "
                                   f"tokens/s; one more would give {proj}, below the floor of {info.tps_floor} "
                                   "(retry later, another coordinator, or \"overcommit\": true)",
                                   d.retry_after_s or 1.0)
            held = now if held is None else held
            wait = max(0.0, (d.recheck_at if d.recheck_at is not None else now) - now)
            with trio.move_on_after(wait):
                await self.wait_changed()

    async def wait_changed(self) -> None:
        """Until a session's tokens arrive or a session ends (the trio side)."""
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def capacity(self) -> CapacityInfo:
        now = time.monotonic()
        with self._lock:
            self._sync_sessions(now)
            views = self.sched.views()
            busy = sum(1 for v in views if v.is_processing)
            queue = self.sched.queue_depth()
            free = max(0, self.n_slots - busy - queue)
            used = sum(min(v.n_ctx, v.n_prompt + v.n_decoded) for v in views if v.is_processing)
            cap = self.admission.capacity(now, free_slots=free)
        total = self.n_slots * self.n_ctx
        return CapacityInfo(cap, self.n_slots, free, queue, round(100.0 * (total - used) / total, 2))

    def session_speed(self, req_id: int | None) -> tuple[float | None, bool]:
        """A running request's decode tps EWMA and whether it is warming."""
        if req_id is None:
            return None, False
        now = time.monotonic()
        with self._lock:
            return self.admission.session_tps(req_id), self.admission.warming(req_id, now)
