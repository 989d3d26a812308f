"""Slots, admission and continuous batching (pure core: no I/O, no clock, no torch).

Rules:
- Requests wait in a bounded FIFO queue; past ``max_queue`` a submission is rejected (the shell
  answers 503 + Retry-After). A free slot takes the oldest waiting request.
- Every step batches all active slots: each decoding slot feeds exactly one token; prefilling
  slots share the remaining token budget (``n_batch``) as prompt chunks, oldest first.
- A slot samples only when its pending tokens are all fed; the shell reports the sampled token
  (with its decoded text piece) and the core decides what to emit and when to finish.
- Stop strings: emitted text never contains a stop string, and text that could still become one
  is held back until it cannot. EOS ends a request unless ``ignore_eos``.
- A cancelled request frees its slot at once (before the next step is planned).
- A *parked* request (``park``; the admission core's preemption) keeps its slot and KV rows but is left
  out of every step until ``resume``; nothing of it is lost (its pending token is fed when it resumes).
- Reusable prefixes (with a ``coordinator.core.prefixes.PrefixIndex``): a slot knows the tokens whose
  rows its KV cache holds (``seq``: prompt and generated tokens fed, in position order). A finished
  request's ``seq`` is offered to the index as it ends; a newly admitted request looks its prompt up
  there when the next step is planned and starts at the longest kept prefix. Both become
  KV ops, in the order the index decided them and every lookup's ``LoadRows`` last, which the shell
  performs before the step runs: a slot's rows are copied out before a new request writes there, and
  a spilled entry is written before its rows are freed. A load the shell cannot make
  (``load_failed``: a disk file corrupt or gone) forgets the entry and the request prefills its
  whole prompt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from coordinator.core.prefixes import Drop, Keep, PrefixIndex, Spill, Unlink

__all__ = [
    "Admitted",
    "Emit",
    "Finish",
    "FinishReason",
    "GenParams",
    "FreeRows",
    "GenRequest",
    "KvOp",
    "LoadRows",
    "RejectReason",
    "Rejected",
    "SaveRows",
    "SpillRows",
    "UnlinkRows",
    "Scheduler",
    "SlotView",
    "StepEntry",
]


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context is full
    CANCELLED = "cancelled"  # client went away


@dataclass(frozen=True)
class GenParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    draft: str | None = None  # speculative decoding's drafter (None: the coordinator's default)
    skip_special: bool = True  # control tokens (``<|im_start|>``) add no text, as llama-server's default


@dataclass(frozen=True)
class GenRequest:
    id: int
    prompt: tuple[int, ...]
    params: GenParams


# -- effects -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    req_id: int
    slot: int


class RejectReason(StrEnum):
    QUEUE_FULL = "queue_full"  # every slot busy and the queue at its bound
    PROMPT_TOO_LONG = "prompt_too_long"  # the prompt leaves no room in a slot's context
    EMPTY_PROMPT = "empty_prompt"


@dataclass(frozen=True)
class Rejected:
    req_id: int
    reason: RejectReason


@dataclass(frozen=True)
class Emit:
    req_id: int
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    req_id: int
    reason: FinishReason
    n_prompt: int
    n_decoded: int
    n_cached: int = 0  # prompt tokens whose KV rows came from a kept prefix (not computed)


@dataclass(frozen=True)
class SaveRows:
    """Copy rows ``[0, n_tokens)`` of ``slot``'s KV cache into kept prefix ``entry``."""

    slot: int
    entry: int
    n_tokens: int


@dataclass(frozen=True)
class FreeRows:
    entry: int


@dataclass(frozen=True)
class LoadRows:
    """Copy kept prefix ``entry``'s rows ``[0, n_tokens)`` into ``slot``'s KV cache (``tokens``: the
    entry's, what a disk file must hold; the shell reads no index)."""

    slot: int
    entry: int
    n_tokens: int
    tokens: tuple[int, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class SpillRows:
    """Write kept prefix ``entry``'s rows (of ``tokens``) to the disk tier, then free them in RAM."""

    entry: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class UnlinkRows:
    """Delete kept prefix ``entry``'s file on the disk tier."""

    entry: int


KvOp = SaveRows | FreeRows | LoadRows | SpillRows | UnlinkRows
Effect = Admitted | Rejected | Emit | Finish


@dataclass(frozen=True)
class StepEntry:
    slot: int
    req_id: int
    tokens: tuple[int, ...]
    pos: int
    sample: bool  # the last token of this chunk produces a token to sample
    prefill: bool = False  # prompt tokens (not a decode token)


@dataclass
class _Slot:
    id: int
    req: GenRequest | None = None
    pending: list[int] = field(default_factory=list)  # tokens not yet fed
    n_past: int = 0  # tokens in the KV cache
    n_decoded: int = 0
    text: str = ""  # generated text not yet emitted (held back for stop strings)
    held_ids: list[int] = field(default_factory=list)
    t_start: float = 0.0
    t_prompt_done: float | None = None
    tps_ewma: float = 0.0
    last_token_at: float | None = None
    seq: list[int] = field(default_factory=list)  # tokens whose rows the KV cache holds, by position
    fresh: bool = False  # admitted, its prompt not yet looked up among the kept prefixes
    n_cached: int = 0


@dataclass(frozen=True)
class SlotView:
    id: int
    is_processing: bool
    n_ctx: int
    n_prompt: int
    n_decoded: int
    tps_ewma: float
    req_id: int | None
    parked: bool = False


class Scheduler:
    def __init__(self, *, n_slots: int, n_ctx: int, n_batch: int = 512, max_queue: int = 64, eot_ids: frozenset[int],
                 prefixes: PrefixIndex | None = None) -> None:
        if n_slots < 1 or n_batch < 1 or max_queue < 0:
            raise ValueError("n_slots and n_batch must be >= 1, max_queue >= 0")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.max_queue = max_queue
        self.eot_ids = eot_ids
        self.slots = [_Slot(i) for i in range(n_slots)]
        self.queue: deque[GenRequest] = deque()
        self.ewma_alpha = 0.2
        self.total_decoded = 0
        self.prefixes = prefixes
        self._ops: list[KvOp] = []
        self.parked: set[int] = set()  # request ids left out of every step until resumed

    # -- admission ------------------------------------------------------------------------------
    def submit(self, req: GenRequest, now: float) -> list[Effect]:
        if not req.prompt:
            return [Rejected(req.id, RejectReason.EMPTY_PROMPT)]
        if len(req.prompt) >= self.n_ctx:
            return [Rejected(req.id, RejectReason.PROMPT_TOO_LONG)]
        if len(self.queue) >= self.max_queue and self._free_slot() is None:
            return [Rejected(req.id, RejectReason.QUEUE_FULL)]
        self.queue.append(req)
        return self._admit(now)

    def _free_slot(self) -> _Slot | None:
        return next((s for s in self.slots if s.req is None), None)

    def _admit(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        while self.queue and (slot := self._free_slot()) is not None:
            req = self.queue.popleft()
            slot.req = req
            slot.pending = list(req.prompt)
            slot.n_past = 0
            slot.n_decoded = 0
            slot.text = ""
            slot.held_ids = []
            slot.t_start = now
            slot.t_prompt_done = None
            slot.tps_ewma = 0.0
            slot.last_token_at = None
            slot.seq = []
            slot.fresh = self.prefixes is not None
            slot.n_cached = 0
            out.append(Admitted(req.id, slot.id))
        return out

    def cancel(self, req_id: int, now: float, *, keep: bool = True) -> list[Effect]:
        """``keep``: its KV rows may be kept as a prefix (False: its numbers broke)."""
        self.parked.discard(req_id)
        for i, r in enumerate(self.queue):
            if r.id == req_id:
                del self.queue[i]
                return [Finish(req_id, FinishReason.CANCELLED, len(r.prompt), 0)]
        for s in self.slots:
            if s.req is not None and s.req.id == req_id:
                return self._finish(s, FinishReason.CANCELLED, now, flush=False, keep=keep)
        return []

    # -- planning ---------------------------------------------------------------------------------
    def plan(self) -> list[StepEntry]:
        self._prepare()
        entries: list[StepEntry] = []
        budget = self.n_batch
        active = [s for s in self.slots if s.req is not None and s.pending and s.req.id not in self.parked]
        decoding = [s for s in active if s.t_prompt_done is not None]
        prefilling = sorted((s for s in active if s.t_prompt_done is None), key=lambda s: s.t_start)
        for s in decoding:
            assert s.req is not None
            entries.append(StepEntry(s.id, s.req.id, tuple(s.pending), s.n_past, True, False))
            budget -= len(s.pending)
        for s in prefilling:
            assert s.req is not None
            if budget <= 0 and entries:
                break
            take = max(1, min(budget, len(s.pending)))
            entries.append(StepEntry(s.id, s.req.id, tuple(s.pending[:take]), s.n_past, take == len(s.pending), True))
            budget -= take
        return sorted(entries, key=lambda e: e.slot)

    def fed(self, entry: StepEntry, now: float) -> None:
        """The shell ran ``entry`` through the model: its tokens are now in the KV cache."""
        s = self.slots[entry.slot]
        if s.req is None or s.req.id != entry.req_id:
            return  # cancelled while the step ran
        n = len(entry.tokens)
        del s.pending[:n]
        s.n_past += n
        s.seq.extend(entry.tokens)
        if not s.pending and s.t_prompt_done is None:
            s.t_prompt_done = now

    # -- tokens ------------------------------------------------------------------------------------
    def token(self, slot_id: int, req_id: int, token: int, piece: str, now: float, *, fed: bool = False
              ) -> list[Effect]:
        """A token was sampled for ``slot_id``; ``piece`` is its newly complete decoded text; ``fed``:
        it is in the KV cache already (an accepted draft), so nothing is pending after it."""
        s = self.slots[slot_id]
        if s.req is None or s.req.id != req_id:
            return []
        p = s.req.params
        if s.last_token_at is not None and now > s.last_token_at:
            inst = 1.0 / (now - s.last_token_at)
            s.tps_ewma = inst if s.tps_ewma == 0.0 else (1 - self.ewma_alpha) * s.tps_ewma + self.ewma_alpha * inst
        s.last_token_at = now
        if token in self.eot_ids and not p.ignore_eos:
            return self._finish(s, FinishReason.STOP, now, flush=True)
        s.n_decoded += 1
        self.total_decoded += 1
        s.text += piece
        s.held_ids.append(token)
        out: list[Effect] = []
        if p.stop:
            hit = min((i for i in (s.text.find(x) for x in p.stop) if i >= 0), default=-1)
            if hit >= 0:
                s.text = s.text[:hit]
                return self._finish(s, FinishReason.STOP, now, flush=True)
            keep = _stop_prefix_len(s.text, p.stop)
        else:
            keep = 0
        emit_upto = len(s.text) - keep
        if emit_upto > 0 or (s.held_ids and keep == 0):
            out.append(Emit(s.req.id, s.text[:emit_upto], tuple(s.held_ids)))
            s.text = s.text[emit_upto:]
            s.held_ids = []
        if s.n_decoded >= p.max_tokens or s.n_past >= self.n_ctx:  # no room to feed this token
            return out + self._finish(s, FinishReason.LENGTH, now, flush=True)
        if fed:  # an accepted draft: its row is in the cache already (the rejected drafts' rows are not
            s.n_past += 1  # the sequence's: the next step overwrites them)
            s.seq.append(token)
        else:
            s.pending = [token]
        return out

    def draft_room(self, slot_id: int) -> int:
        """How many tokens a decoding slot may draft after its pending one: what its request may still
        emit beyond the next token, and what its context still holds."""
        s = self.slots[slot_id]
        if s.req is None or s.t_prompt_done is None:
            return 0
        return max(0, min(s.req.params.max_tokens - s.n_decoded - 1, self.n_ctx - s.n_past - 1))

    def last_token_due(self, slot_id: int) -> bool:
        """Whether the next token sampled for this slot ends its request by length (max_tokens or
        context), so the shell can flush the detokeniser's incomplete tail into that last piece."""
        s = self.slots[slot_id]
        if s.req is None:
            return False
        return s.n_decoded + 1 >= s.req.params.max_tokens or s.n_past >= self.n_ctx

    def _finish(self, s: _Slot, reason: FinishReason, now: float, *, flush: bool, keep: bool = True) -> list[Effect]:
        assert s.req is not None
        out: list[Effect] = []
        if flush and (s.text or s.held_ids):
            out.append(Emit(s.req.id, s.text, tuple(s.held_ids)))
        out.append(Finish(s.req.id, reason, len(s.req.prompt), s.n_decoded, s.n_cached))
        self.parked.discard(s.req.id)
        if self.prefixes is not None and keep and s.seq:
            self._offer(s.id, tuple(s.seq))
        s.seq = []
        s.req = None
        s.pending = []
        s.text = ""
        s.held_ids = []
        return out + self._admit(now)

    # -- kept prefixes ------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Offer the finished requests' sequences, then look the fresh requests' prompts up."""
        px = self.prefixes
        if px is None:
            return
        for s in self.slots:
            if s.req is None or not s.fresh:
                continue
            s.fresh = False
            hit = px.lookup(s.req.prompt)
            if hit is not None:
                n = hit.n_tokens
                s.n_past = n
                s.pending = list(s.req.prompt[n:])
                s.seq = list(s.req.prompt[:n])
                s.n_cached = n
                self._ops.append(LoadRows(s.id, hit.entry, n, px.tokens_of(hit.entry)))

    def _offer(self, slot_id: int, seq: tuple[int, ...]) -> None:
        """A finished request's sequence to the index, its decisions queued as KV ops (the slot's rows are
        saved before any later op loads into it: ops run in order)."""
        px = self.prefixes
        assert px is not None
        for eff in px.offer(seq):
            match eff:
                case Keep(entry, n):
                    self._ops.append(SaveRows(slot_id, entry, n))
                case Drop(entry):
                    self._ops.append(FreeRows(entry))
                case Spill(entry):
                    self._ops.append(SpillRows(entry, px.tokens_of(entry)))
                case Unlink(entry):
                    self._ops.append(UnlinkRows(entry))

    def load_failed(self, slot_id: int, entry: int) -> None:
        """The shell could not load ``entry``'s rows into ``slot_id`` (a disk file corrupt or gone): the
        entry is forgotten and the slot's request, if it has not moved on, prefills its whole prompt."""
        s = self.slots[slot_id]
        undo = s.req is not None and s.n_cached > 0 and s.n_past == s.n_cached and len(s.seq) == s.n_cached
        if self.prefixes is not None:
            self.prefixes.forget(entry, s.n_cached if undo else 0)
        if undo:
            assert s.req is not None
            s.n_past = 0
            s.pending = list(s.req.prompt)
            s.seq = []
            s.n_cached = 0

    def take_kv_ops(self) -> list[KvOp]:
        """The KV copies the shell must make, in order, before it runs the step ``plan`` returned."""
        ops, self._ops = self._ops, []
        return ops

    # -- views ---------------------------------------------------------------------------------------
    def busy(self) -> int:
        return sum(1 for s in self.slots if s.req is not None)

    def queue_depth(self) -> int:
        return len(self.queue)

    def has_work(self) -> bool:
        return any(s.req is not None and s.pending and s.req.id not in self.parked for s in self.slots)

    def park(self, req_id: int) -> bool:
        """Leave a running or queued request out of every step (its slot and rows kept); whether it runs here."""
        if self.slot_of(req_id) is None and all(r.id != req_id for r in self.queue):
            return False
        self.parked.add(req_id)
        return True

    def resume(self, req_id: int) -> None:
        self.parked.discard(req_id)

    def views(self) -> list[SlotView]:
        return [
            SlotView(
                id=s.id,
                is_processing=s.req is not None,
                n_ctx=self.n_ctx,
                n_prompt=len(s.req.prompt) if s.req is not None else 0,
                n_decoded=s.n_decoded if s.req is not None else 0,
                tps_ewma=s.tps_ewma,
                req_id=s.req.id if s.req is not None else None,
                parked=s.req is not None and s.req.id in self.parked,
            )
            for s in self.slots
        ]

    def slot_of(self, req_id: int) -> int | None:
        return next((s.id for s in self.slots if s.req is not None and s.req.id == req_id), None)

    def params_of(self, slot_id: int) -> GenParams | None:
        r = self.slots[slot_id].req
        return r.params if r is not None else None


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                best = max(best, n)
                break
    return best
