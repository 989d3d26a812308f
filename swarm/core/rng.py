"""The randomness a core may use (pure: a Protocol, no generator of its own).

Cores never import ``random``: they are handed an object with these methods (in practice a
seeded ``random.Random``), so every random choice is reproducible from a seed.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Rng"]


class Rng(Protocol):
    def randrange(self, start: int, stop: int | None = ..., step: int = ...) -> int: ...

    def uniform(self, a: float, b: float) -> float: ...

    def getrandbits(self, k: int, /) -> int: ...
