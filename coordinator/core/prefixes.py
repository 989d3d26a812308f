"""Reusable prefixes ("auto-P"): which finished sequences' KV rows are kept, and the longest kept
prefix of a new prompt (pure core: no clock, I/O or torch; the shell holds the rows themselves).

Rules:
- A token sequence is named at every position by a chain hash (``prefix_hashes``):
  ``h[0] = blake2b(salt)``, ``h[i+1] = blake2b(h[i] || token_i)`` (16 bytes, tokens as 4 bytes
  little-endian). ``h[i]`` names ``tokens[0:i]`` and nothing else; the salt names the model and its KV
  layout, so two models' hashes never meet (the gateway may compare advertised hashes as they are).
- An entry is one whole sequence whose KV rows ``[0, n)`` the shell holds (its own copy). The index
  maps each of the entry's hashes ``h[1..n]`` to the entries holding that prefix, so the set of
  indexed hashes is prefix-closed: the longest kept prefix of a prompt is found by walking its chain
  until the first miss (O(match) hashes and lookups).
- ``lookup(prompt)`` gives the longest kept prefix of at most ``len(prompt) - 1`` tokens (one token is
  always left to compute, the one whose logits are sampled) and at least ``min_tokens``, from the most
  recently used entry holding it; the entry's tokens are compared too, so a hash collision can never
  hand a request another sequence's rows. The entry becomes the most recently used. No hit: a miss.
- ``offer(seq)``: a sequence that is a prefix of a kept entry (its whole hash is indexed) only touches
  that entry; entries that are prefixes of the new sequence are dropped (the new one holds their rows);
  then the least recently used entries are dropped until the new one fits. A sequence shorter than
  ``min_tokens`` or bigger than the whole budget is not kept. Bytes are ``tokens * row_bytes``; the
  kept bytes never exceed ``capacity``.
- Effects: ``Keep(entry, n)`` (the shell copies the rows of the offered sequence), ``Drop(entry)``
  (the shell frees them). A ``Drop`` always precedes the ``Keep`` that needs its room.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Drop", "Hit", "Keep", "PrefixEffect", "PrefixIndex", "PrefixStats", "prefix_hashes"]

HASH_BYTES = 16


def prefix_hashes(tokens: Sequence[int], salt: bytes, *, limit: int | None = None) -> list[bytes]:
    """``h[0..n]`` of ``tokens`` (``n = min(len(tokens), limit)``): ``h[i]`` names ``tokens[0:i]``."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    h = hashlib.blake2b(salt, digest_size=HASH_BYTES).digest()
    out = [h]
    for t in tokens[:n]:
        h = hashlib.blake2b(h + int(t).to_bytes(4, "little"), digest_size=HASH_BYTES).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class Keep:
    entry: int
    n_tokens: int


@dataclass(frozen=True)
class Drop:
    entry: int


PrefixEffect = Keep | Drop


@dataclass(frozen=True)
class Hit:
    entry: int
    n_tokens: int


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens whose rows were reused
    hit_bytes: int = 0
    kept: int = 0  # entries stored
    dropped: int = 0  # entries freed (evicted or superseded)


@dataclass
class _Entry:
    id: int
    tokens: tuple[int, ...]
    hashes: list[bytes]  # h[1..n]
    nbytes: int


@dataclass
class PrefixIndex:
    """The kept sequences, by chain hash, in least-recently-used order (see the module rules)."""

    capacity: int  # bytes
    row_bytes: int  # KV bytes of one token (every layer's K and V row)
    salt: bytes
    min_tokens: int = 4
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)  # least recently used first
    _by_hash: dict[bytes, dict[int, None]] = field(default_factory=dict)
    _by_full: dict[bytes, int] = field(default_factory=dict)  # an entry's whole-sequence hash -> the entry
    _next_id: int = 1
    used: int = 0  # bytes kept

    def __post_init__(self) -> None:
        if self.capacity < 0 or self.row_bytes < 1 or self.min_tokens < 1:
            raise ValueError("capacity >= 0, row_bytes >= 1 and min_tokens >= 1")

    def __len__(self) -> int:
        return len(self._entries)

    def tokens_of(self, entry: int) -> tuple[int, ...]:
        return self._entries[entry].tokens

    def advertised(self) -> list[bytes]:
        """Each entry's whole-sequence hash (most recently used first): what a router compares a
        request's chain with."""
        return [e.hashes[-1] for e in reversed(self._entries.values())]

    def lookup(self, prompt: Sequence[int]) -> Hit | None:
        limit = len(prompt) - 1
        best: int | None = None
        n = 0
        if limit >= self.min_tokens and self._entries:
            h = hashlib.blake2b(self.salt, digest_size=HASH_BYTES).digest()
            for i in range(limit):
                h = hashlib.blake2b(h + int(prompt[i]).to_bytes(4, "little"), digest_size=HASH_BYTES).digest()
                holders = self._by_hash.get(h)
                if not holders:
                    break
                best, n = next(iter(holders)), i + 1  # any holder: their first i + 1 rows are the same rows
        if best is None or n < self.min_tokens or self._entries[best].tokens[:n] != tuple(prompt[:n]):
            self.stats.misses += 1
            return None
        self._entries.move_to_end(best)
        self.stats.hits += 1
        self.stats.hit_tokens += n
        self.stats.hit_bytes += n * self.row_bytes
        return Hit(best, n)

    def offer(self, seq: Sequence[int]) -> list[PrefixEffect]:
        n = len(seq)
        nbytes = n * self.row_bytes
        if n < self.min_tokens or nbytes > self.capacity:
            return []
        hashes = prefix_hashes(seq, self.salt)[1:]
        holders = self._by_hash.get(hashes[-1])
        if holders:  # held already (as a whole entry or a prefix of one)
            for eid in holders:
                if self._entries[eid].tokens[:n] == tuple(seq):
                    self._entries.move_to_end(eid)
                    return []
        out: list[PrefixEffect] = []
        for i in range(n - 1):  # entries that are prefixes of seq are superseded (it holds their rows)
            if hashes[i] not in self._by_hash:
                break  # prefix-closed: nothing longer is held either
            whole = self._by_full.get(hashes[i])
            if whole is not None and self._entries[whole].tokens == tuple(seq[: i + 1]):
                out.append(self._drop(whole))
        while self.used + nbytes > self.capacity:
            out.append(self._drop(next(iter(self._entries))))
        eid = self._next_id
        self._next_id += 1
        self._entries[eid] = _Entry(eid, tuple(seq), hashes, nbytes)
        for h in hashes:
            self._by_hash.setdefault(h, {})[eid] = None
        self._by_full[hashes[-1]] = eid
        self.used += nbytes
        self.stats.kept += 1
        out.append(Keep(eid, n))
        return out

    def _drop(self, eid: int) -> Drop:
        e = self._entries.pop(eid)
        for h in e.hashes:
            holders = self._by_hash[h]
            del holders[eid]
            if not holders:
                del self._by_hash[h]
        del self._by_full[e.hashes[-1]]
        self.used -= e.nbytes
        self.stats.dropped += 1
        return Drop(eid)
