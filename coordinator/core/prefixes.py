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
- A second tier on disk (``disk_capacity > 0``): an entry the RAM budget evicts moves there
  (``Spill``: the shell writes its rows to a file, then frees them) if it fits the disk budget,
  whose own least recently used entries go first (``Unlink``); a lookup finds entries of both
  tiers (RAM preferred among equals) and a disk hit is read back by the shell. ``adopt`` takes in an
  entry the shell found on disk at start; ``forget`` an entry whose file the shell could not load
  (the request then prefills its whole prompt). A sequence held only on disk is kept in RAM again
  when offered (the disk copy, then a prefix of it, is superseded).
- Pins (explicit prefixes, ``coordinator.core.prefix_pool``): a pinned RAM entry is never evicted,
  spilled or superseded until its pins are released; a sequence that does not fit beside the pinned
  bytes is not kept.
- Effects: ``Keep(entry, n)`` (the shell copies the rows of the offered sequence), ``Drop(entry)``
  (frees them), ``Spill(entry)``, ``Unlink(entry)``. An effect that frees room always precedes the
  one that needs it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from swarm.core.prefix_hash import HASH_BYTES, prefix_hashes

__all__ = ["TIERS", "Drop", "Hit", "Keep", "PrefixEffect", "PrefixIndex", "PrefixStats", "Spill", "Tier", "TierStats",
           "Unlink", "prefix_hashes"]

@dataclass(frozen=True)
class Keep:
    entry: int
    n_tokens: int


@dataclass(frozen=True)
class Drop:
    entry: int


@dataclass(frozen=True)
class Spill:
    entry: int


@dataclass(frozen=True)
class Unlink:
    entry: int


PrefixEffect = Keep | Drop | Spill | Unlink
Tier = Literal["ram", "disk"]
TIERS: tuple[Tier, ...] = ("ram", "disk")


@dataclass(frozen=True)
class Hit:
    entry: int
    n_tokens: int
    tier: Tier = "ram"


@dataclass
class TierStats:
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens whose rows were reused from this tier
    hit_bytes: int = 0
    kept: int = 0  # entries that came into this tier
    dropped: int = 0  # entries that left it (evicted, spilled, superseded or forgotten)


@dataclass
class PrefixStats:
    misses: int = 0
    failed: int = 0  # entries the shell could not load (``forget``)
    tiers: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})

    def copy(self) -> PrefixStats:
        return PrefixStats(self.misses, self.failed, {t: TierStats(**vars(s)) for t, s in self.tiers.items()})


@dataclass
class _Entry:
    id: int
    tokens: tuple[int, ...]
    hashes: list[bytes]  # h[1..n]
    nbytes: int
    tier: Tier = "ram"
    pins: int = 0


@dataclass
class PrefixIndex:
    """The kept sequences, by chain hash, in least-recently-used order per tier (see the module rules)."""

    capacity: int  # bytes in RAM
    row_bytes: int  # KV bytes of one token (every layer's K and V row)
    salt: bytes
    min_tokens: int = 4
    disk_capacity: int = 0  # bytes on disk (0: no disk tier)
    stats: PrefixStats = field(default_factory=PrefixStats)
    _tiers: dict[str, OrderedDict[int, _Entry]] = field(
        default_factory=lambda: {t: OrderedDict() for t in TIERS})  # least recently used first
    _by_hash: dict[bytes, dict[int, None]] = field(default_factory=dict)
    _by_full: dict[bytes, int] = field(default_factory=dict)  # an entry's whole-sequence hash -> the entry
    _next_id: int = 1
    _used: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def __post_init__(self) -> None:
        if self.capacity < 0 or self.disk_capacity < 0 or self.row_bytes < 1 or self.min_tokens < 1:
            raise ValueError("capacity >= 0, disk_capacity >= 0, row_bytes >= 1 and min_tokens >= 1")

    def __len__(self) -> int:
        return len(self._tiers["ram"])

    @property
    def used(self) -> int:
        """Bytes kept in RAM."""
        return self._used["ram"]

    @property
    def disk_used(self) -> int:
        return self._used["disk"]

    def count(self, tier: Tier) -> int:
        return len(self._tiers[tier])

    def _entry(self, eid: int) -> _Entry:
        e = self._tiers["ram"].get(eid)
        return e if e is not None else self._tiers["disk"][eid]

    def tokens_of(self, entry: int) -> tuple[int, ...]:
        return self._entry(entry).tokens

    def tier_of(self, entry: int) -> Tier | None:
        return next((t for t in TIERS if entry in self._tiers[t]), None)

    def advertised(self) -> list[bytes]:
        """Each entry's whole-sequence hash (RAM then disk, most recently used first): what a router
        compares a request's chain with."""
        return [e.hashes[-1] for t in TIERS for e in reversed(self._tiers[t].values())]

    def lookup(self, prompt: Sequence[int]) -> Hit | None:
        limit = len(prompt) - 1
        deepest: dict[int, None] = {}
        n = 0
        if limit >= self.min_tokens and self._by_hash:
            h = hashlib.blake2b(self.salt, digest_size=HASH_BYTES).digest()
            for i in range(limit):
                h = hashlib.blake2b(h + int(prompt[i]).to_bytes(4, "little"), digest_size=HASH_BYTES).digest()
                holders = self._by_hash.get(h)
                if not holders:
                    break
                deepest, n = holders, i + 1
        # any holder's first n rows are the same rows: one in RAM if there is one
        best = next((eid for eid in deepest if eid in self._tiers["ram"]), next(iter(deepest), None))
        if best is None or n < self.min_tokens or self._entry(best).tokens[:n] != tuple(prompt[:n]):
            self.stats.misses += 1
            return None
        e = self._entry(best)
        self._tiers[e.tier].move_to_end(best)
        st = self.stats.tiers[e.tier]
        st.hits += 1
        st.hit_tokens += n
        st.hit_bytes += n * self.row_bytes
        return Hit(best, n, e.tier)

    @property
    def pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self._tiers["ram"].values() if e.pins)

    def pin_holder(self, tokens: Sequence[int]) -> int | None:
        """Pin a RAM entry holding ``tokens`` (the shortest such); None if no RAM entry holds them."""
        if not tokens:
            return None
        whole = prefix_hashes(tokens, self.salt)[-1]
        ram = [self._tiers["ram"][eid] for eid in self._by_hash.get(whole, ()) if eid in self._tiers["ram"]]
        ram = [e for e in ram if e.tokens[: len(tokens)] == tuple(tokens)]
        if not ram:
            return None
        e = min(ram, key=lambda e: len(e.tokens))
        e.pins += 1
        self._tiers["ram"].move_to_end(e.id)
        return e.id

    def unpin(self, entry: int) -> None:
        e = self._tiers["ram"].get(entry)
        if e is not None and e.pins:
            e.pins -= 1

    def offer(self, seq: Sequence[int]) -> list[PrefixEffect]:
        n = len(seq)
        nbytes = n * self.row_bytes
        if n < self.min_tokens or nbytes > self.capacity - self.pinned_bytes:
            return []
        hashes = prefix_hashes(seq, self.salt)[1:]
        for eid in self._by_hash.get(hashes[-1], ()):  # held in RAM already (a whole entry or a prefix of one)
            e = self._entry(eid)
            if e.tier == "ram" and e.tokens[:n] == tuple(seq):
                self._tiers["ram"].move_to_end(eid)
                return []
        out: list[PrefixEffect] = []
        for i in range(n):  # entries that are prefixes of seq (or seq itself, on disk) are superseded
            if hashes[i] not in self._by_hash:
                break  # prefix-closed: nothing longer is held either
            whole = self._by_full.get(hashes[i])
            if whole is not None and not self._entry(whole).pins and self._entry(whole).tokens == tuple(seq[: i + 1]):
                out.append(self._remove(whole))
        while self._used["ram"] + nbytes > self.capacity:  # fits beside the pinned bytes (checked above)
            out.extend(self._evict(next(eid for eid, e in self._tiers["ram"].items() if not e.pins)))
        eid = self._add(tuple(seq), hashes, "ram")
        out.append(Keep(eid, n))
        return out

    def adopt(self, tokens: Sequence[int]) -> tuple[int | None, list[PrefixEffect]]:
        """An entry found on disk at start (oldest first: each becomes the most recently used): its id
        (None: not taken: no disk tier, too short or big, or held already) and the ``Unlink`` of
        the entries it displaces."""
        n = len(tokens)
        nbytes = n * self.row_bytes
        if n < self.min_tokens or nbytes > self.disk_capacity:
            return None, []
        hashes = prefix_hashes(tokens, self.salt)[1:]
        if hashes[-1] in self._by_full:
            return None, []
        out = self._fit_disk(nbytes)
        return self._add(tuple(tokens), hashes, "disk"), out

    def forget(self, entry: int, n_tokens: int = 0) -> None:
        """The shell could not load ``entry`` (its file was corrupt or gone): it is no longer kept, and
        the hit of ``n_tokens`` that lookup counted for it is a miss."""
        tier = self.tier_of(entry)
        if tier is None:
            return
        self._remove(entry)
        self.stats.failed += 1
        if n_tokens:
            st = self.stats.tiers[tier]
            st.hits -= 1
            st.hit_tokens -= n_tokens
            st.hit_bytes -= n_tokens * self.row_bytes
            self.stats.misses += 1

    def _add(self, tokens: tuple[int, ...], hashes: list[bytes], tier: Tier) -> int:
        eid = self._next_id
        self._next_id += 1
        nbytes = len(tokens) * self.row_bytes
        self._tiers[tier][eid] = _Entry(eid, tokens, hashes, nbytes, tier)
        for h in hashes:
            self._by_hash.setdefault(h, {})[eid] = None
        self._by_full[hashes[-1]] = eid
        self._used[tier] += nbytes
        self.stats.tiers[tier].kept += 1
        return eid

    def _fit_disk(self, nbytes: int) -> list[PrefixEffect]:
        out: list[PrefixEffect] = []
        while self._used["disk"] + nbytes > self.disk_capacity:
            out.append(self._remove(next(iter(self._tiers["disk"]))))
        return out

    def _evict(self, eid: int) -> list[PrefixEffect]:
        """The RAM budget's victim: to disk if it fits there, else gone."""
        e = self._tiers["ram"][eid]
        if e.nbytes > self.disk_capacity:
            return [self._remove(eid)]
        out = self._fit_disk(e.nbytes)
        del self._tiers["ram"][eid]
        self._used["ram"] -= e.nbytes
        self.stats.tiers["ram"].dropped += 1
        e.tier = "disk"
        self._tiers["disk"][eid] = e
        self._used["disk"] += e.nbytes
        self.stats.tiers["disk"].kept += 1
        out.append(Spill(eid))
        return out

    def _remove(self, eid: int) -> Drop | Unlink:
        e = self._entry(eid)
        del self._tiers[e.tier][eid]
        for h in e.hashes:
            holders = self._by_hash[h]
            del holders[eid]
            if not holders:
                del self._by_hash[h]
        del self._by_full[e.hashes[-1]]
        self._used[e.tier] -= e.nbytes
        self.stats.tiers[e.tier].dropped += 1
        return Drop(eid) if e.tier == "ram" else Unlink(eid)
