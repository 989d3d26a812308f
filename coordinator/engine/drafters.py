"""Drafters for speculative decoding (shell: the engine thread runs them; the rules of verification
and draft length are ``coordinator.core.speculation``).

- ``ngram``: prompt lookup over the session's prompt and generated tokens (free to run).
- ``model``: a smaller GGUF with the target's vocabulary (``--draft-model``), all-local on the
  coordinator: greedy, one single-row step a drafted token, its own KV cache per slot.
- ``self``: the target model's own blocks computing only the routed experts this coordinator holds
  (the others contribute nothing; a backbone holds none): no round trip while drafting, its own KV
  cache per slot.

Rules:
- A model drafter keeps, per slot, how many of the session's tokens its cache holds (``valid``) and
  the tokens it fed beyond them last time (its drafts): those the session then accepted are still
  valid rows, the rest are overwritten (the same rollback as the target's cache).
- A drafter never proposes past its cache's context; a new request in a slot starts its cache over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from coordinator.core.events import CallId
from coordinator.core.speculation import ngram_draft
from coordinator.dispatch.dispatcher import Dispatcher
from coordinator.dispatch.layer import LayerCall, RangeJob
from coordinator.engine.model import KVCache, SeqChunk, Transformer
from swarm.errors import ConfigError
from swarm.model.gguf import GGUFModel

__all__ = ["Drafter", "HeldOnlyExperts", "ModelDrafter", "NgramDrafter", "check_vocabulary"]


class Drafter(Protocol):
    name: str

    def propose(self, slot: int, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``history`` (the session's prompt and emitted tokens)."""
        ...

    def reset(self, slot: int) -> None:
        """A new request took the slot."""
        ...


class NgramDrafter:
    name = "ngram"

    def propose(self, slot: int, history: list[int], k: int) -> list[int]:
        return ngram_draft(history, k)

    def reset(self, slot: int) -> None:
        pass


class HeldOnlyExperts(Dispatcher):
    """The experts of the ranges ``held(layer, lo, hi)`` says this coordinator holds, computed here;
    pairs routed elsewhere contribute nothing (the ``self`` drafter's backend: no round trip)."""

    def __init__(self, model: GGUFModel, held_ranges: dict[int, list[tuple[int, int]]]) -> None:
        super().__init__(model, None, kernel=model.kernel)
        self.held_ranges = held_ranges

    def _jobs(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> list[RangeJob]:
        keep = np.zeros(ids.shape, dtype=bool)
        for lo, hi in self.held_ranges.get(layer, []):
            keep |= (ids >= lo) & (ids < hi)
        return super()._jobs(layer, x, ids if keep.all() else np.where(keep, ids, -1), w)  # -1: in no range

    def whole_layer_here(self, layer: int, n_pairs: int) -> bool:
        return self.held_ranges.get(layer) == [(0, self.cfg.n_expert)]

    def _whole(self, call: LayerCall, work: list[tuple[CallId, int]]) -> bool:
        return self.whole_layer_here(call.layer, 0) and super()._whole(call, work)


@dataclass
class _SlotCache:
    cache: KVCache
    valid: int = 0  # session tokens whose rows the cache holds
    drafted: list[int] = field(default_factory=list)  # tokens fed after them last time


class ModelDrafter:
    """Greedy drafts from a transformer of its own (a draft GGUF, or the target's blocks on held experts)."""

    def __init__(self, name: str, transformer: Transformer, n_slots: int, n_ctx: int) -> None:
        self.name = name
        self.tr = transformer
        self.n_ctx = n_ctx
        self.slots: list[_SlotCache | None] = [None] * n_slots  # a slot's cache once it drafts (memory)

    def reset(self, slot: int) -> None:
        st = self.slots[slot]
        if st is not None:
            st.valid, st.drafted = 0, []

    def propose(self, slot: int, history: list[int], k: int) -> list[int]:
        st = self.slots[slot]
        if st is None:
            st = self.slots[slot] = _SlotCache(KVCache(self.tr.cfg, self.n_ctx, torch.float16))
        j = 0  # last time's drafts the session accepted: their rows are valid
        while j < len(st.drafted) and st.valid + j < len(history) - 1 and history[st.valid + j] == st.drafted[j]:
            j += 1
        st.valid = min(st.valid + j, len(history) - 1)
        feed = history[st.valid:]
        if not feed or k <= 0 or len(history) + k > self.n_ctx:
            return []
        out: list[int] = []
        logits = self.tr.forward([SeqChunk(st.cache, list(feed), st.valid)])[0]
        pos = len(history)
        st.valid = pos
        for i in range(k):
            tok = int(torch.argmax(logits[-1]))
            out.append(tok)
            if i == k - 1:
                break
            logits = self.tr.forward([SeqChunk(st.cache, [tok], pos + i)])[0]
        st.drafted = out[:-1]
        return out


def check_vocabulary(target: GGUFModel, draft: GGUFModel) -> None:
    """A draft model must tokenise as the target does (the same vocabulary, token for token)."""
    a, b = target.config.n_vocab, draft.config.n_vocab
    if a != b:
        raise ConfigError(f"--draft-model has {b} tokens, the model {a}: it must share the model's vocabulary",
                          code="bad_draft_model")
    ta, tb = target.fields.get("tokenizer.ggml.tokens"), draft.fields.get("tokenizer.ggml.tokens")
    if ta is not None and tb is not None and list(ta) != list(tb):
        raise ConfigError("--draft-model's tokens differ from the model's: it must share the model's vocabulary",
                          code="bad_draft_model")
