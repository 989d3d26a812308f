"""Explicit prefixes (pure core): named, pinned prefixes a client creates, forks and releases
(``/v1/prefixes``; seed 002 §3-4). The rows live in the prefix index (``coordinator.core.prefixes``),
pinned; this pool names them and keeps their tree.

Rules:
- A prefix's id is ``pfx-`` and the first 24 hex digits of its tokens' chain hash: the same tokens
  give the same id, so creating one again returns the existing prefix (and pins nothing twice).
- A fork names its parent and a position ``fork_at`` (D): ``1 <= D <= len(parent)`` and
  ``D <= len(child)`` (else ``invalid_fork``, 400), and the child's first D tokens must have the
  parent's chain hash at D (else ``prefix_mismatch``, 409). An unknown parent or id: ``prefix_not_found``, 404.
- Ownership: a root owns all of its rows; a child owns its rows from D on (the first D are its
  parent's). ``subtree`` bytes are a prefix's own plus its children's subtrees: every row is
  attributed to exactly one prefix, never counted twice.
- Releasing a prefix whose children are still there is refused (``prefix_has_children``, 409): a
  child's first rows are attributed to it. Released, its pin goes (its rows become an ordinary kept
  prefix, evicted when the least recently used).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.core.prefixes import prefix_hashes

__all__ = ["PoolError", "PrefixPool", "PrefixView"]


class PoolError(Exception):
    """A refused pool request: ``code`` and HTTP ``status`` for the API."""

    def __init__(self, message: str, *, code: str, status: int, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.param = param


@dataclass(frozen=True)
class PrefixView:
    id: str
    n_tokens: int
    parent: str | None
    fork_at: int | None
    children: tuple[str, ...]
    own_kv_bytes: int
    subtree_kv_bytes: int


@dataclass
class _Prefix:
    id: str
    tokens: tuple[int, ...]
    hashes: list[bytes]  # h[0..n]
    parent: str | None
    fork_at: int | None
    entry: int  # the pinned index entry holding the rows
    children: list[str] = field(default_factory=list)


@dataclass
class PrefixPool:
    salt: bytes
    row_bytes: int
    _prefixes: dict[str, _Prefix] = field(default_factory=dict)

    def id_for(self, tokens: Sequence[int]) -> str:
        return "pfx-" + prefix_hashes(tokens, self.salt)[-1].hex()[:24]

    def get(self, pid: str) -> _Prefix:
        p = self._prefixes.get(pid)
        if p is None:
            raise PoolError(f"no prefix {pid!r} here", code="prefix_not_found", status=404)
        return p

    def check(self, tokens: Sequence[int], parent: str | None, fork_at: int | None) -> str:
        """The id ``tokens`` would get, once the fork (if any) is checked; raises ``PoolError``."""
        if parent is None:
            if fork_at is not None:
                raise PoolError("'fork_at' needs a 'parent'", code="invalid_fork", status=400, param="fork_at")
            return self.id_for(tokens)
        par = self.get(parent)
        if fork_at is None or not 1 <= fork_at <= len(par.tokens) or fork_at > len(tokens):
            raise PoolError(f"'fork_at' must be within the parent ({len(par.tokens)} tokens) and the child "
                            f"({len(tokens)} tokens), from 1", code="invalid_fork", status=400, param="fork_at")
        if prefix_hashes(tokens, self.salt, limit=fork_at)[-1] != par.hashes[fork_at]:
            raise PoolError(f"the child's first {fork_at} tokens are not the parent's", code="prefix_mismatch",
                            status=409, param="tokens")
        return self.id_for(tokens)

    def add(self, tokens: Sequence[int], parent: str | None, fork_at: int | None, entry: int) -> PrefixView:
        """Record a prefix whose rows ``entry`` holds, pinned (``check`` passed)."""
        pid = self.id_for(tokens)
        p = _Prefix(pid, tuple(tokens), prefix_hashes(tokens, self.salt), parent, fork_at, entry)
        self._prefixes[pid] = p
        if parent is not None:
            self._prefixes[parent].children.append(pid)
        return self.view(pid)

    def has(self, pid: str) -> bool:
        return pid in self._prefixes

    def release(self, pid: str) -> int:
        """Forget ``pid``; the entry whose pin the shell must release."""
        p = self.get(pid)
        if p.children:
            raise PoolError(f"prefix {pid!r} has forks ({', '.join(p.children)}): release them first",
                            code="prefix_has_children", status=409)
        if p.parent is not None:
            self._prefixes[p.parent].children.remove(pid)
        del self._prefixes[pid]
        return p.entry

    def _own(self, p: _Prefix) -> int:
        return (len(p.tokens) - (p.fork_at or 0)) * self.row_bytes

    def _subtree(self, p: _Prefix) -> int:
        return self._own(p) + sum(self._subtree(self._prefixes[c]) for c in p.children)

    def view(self, pid: str) -> PrefixView:
        p = self.get(pid)
        return PrefixView(p.id, len(p.tokens), p.parent, p.fork_at, tuple(p.children), self._own(p), self._subtree(p))

    def views(self) -> list[PrefixView]:
        return [self.view(pid) for pid in self._prefixes]
