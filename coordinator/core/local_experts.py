"""Which routed experts a coordinator holds and computes itself: ``--local-experts SPEC`` (pure).

DESIGN §11: ``SPEC`` = ``all`` | ``none`` | comma-separated ``LAYERS:EXPERTS`` items; ``LAYERS`` =
``L`` or ``L0-L1`` (half-open); ``EXPERTS`` = ``LO-HI`` (half-open) | ``all`` | ``none``. Later
items override earlier ones for the layers they name; layers no item names hold ``none``. An item
that is malformed, empty (``4-4``, ``5-3``) or outside the model is a ``ConfigError`` naming it.
(``hot:K``, holding a layer's K most-routed experts, is not supported yet: refused by name.)

A range ``[lo, hi)`` of a layer is *held* when the layer's held experts contain all of it: only
then may the dispatcher compute it here in normal operation (the capacity issue's backbone
coordinator holds ``none`` and leaves every routed expert to volunteers).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.errors import ConfigError

__all__ = ["LocalExperts", "parse_local_experts"]


@dataclass(frozen=True)
class LocalExperts:
    """Per layer, the held experts as one half-open range (``(0, 0)``: none)."""

    n_layer: int
    n_expert: int
    layers: tuple[tuple[int, int], ...]
    spec: str = "all"

    def held(self, layer: int, lo: int, hi: int) -> bool:
        if not 0 <= layer < self.n_layer:
            return False
        a, b = self.layers[layer]
        return a <= lo and hi <= b and lo < hi

    @property
    def all(self) -> bool:
        return all(r == (0, self.n_expert) for r in self.layers)

    @property
    def none(self) -> bool:
        return all(a >= b for a, b in self.layers)

    def held_experts(self) -> int:
        return sum(max(0, b - a) for a, b in self.layers)

    def ranges(self) -> list[tuple[int, int, int]]:
        """``(layer, lo, hi)`` of every layer holding any expert."""
        return [(L, a, b) for L, (a, b) in enumerate(self.layers) if a < b]


def _int(text: str, item: str) -> int:
    if not text.isdigit() or len(text) > 9:
        raise ConfigError(f"--local-experts item {item!r}: {text!r} is not a number", code="bad_local_experts")
    return int(text)


def _span(text: str, item: str, limit: int, what: str) -> tuple[int, int]:
    if "-" in text:
        a_s, _, b_s = text.partition("-")
        a, b = _int(a_s, item), _int(b_s, item)
    else:
        a = _int(text, item)
        b = a + 1
    if a >= b:
        raise ConfigError(f"--local-experts item {item!r}: empty {what} range {text!r} (half-open: LO-HI with LO < HI)",
                          code="bad_local_experts")
    if b > limit:
        raise ConfigError(f"--local-experts item {item!r}: {what} {text!r} outside the model's {limit} {what}s",
                          code="bad_local_experts")
    return a, b


def parse_local_experts(spec: str, n_layer: int, n_expert: int) -> LocalExperts:
    text = spec.strip()
    if text == "all":
        return LocalExperts(n_layer, n_expert, ((0, n_expert),) * n_layer, "all")
    layers: list[tuple[int, int]] = [(0, 0)] * n_layer
    if text == "none":
        return LocalExperts(n_layer, n_expert, tuple(layers), "none")
    if not text or len(text) > 65536:
        raise ConfigError(f"--local-experts {spec[:80]!r}: expected all, none or LAYERS:EXPERTS items",
                          code="bad_local_experts")
    for item in text.split(","):
        item = item.strip()
        head, sep, tail = item.partition(":")
        if not sep:
            raise ConfigError(f"--local-experts item {item!r}: expected LAYERS:EXPERTS (e.g. 0-8:all)",
                              code="bad_local_experts")
        la, lb = _span(head, item, n_layer, "layer")
        if tail == "all":
            held = (0, n_expert)
        elif tail == "none":
            held = (0, 0)
        elif tail.startswith("hot:"):
            raise ConfigError(f"--local-experts item {item!r}: hot:K is not supported yet (use LO-HI, all or none)",
                              code="bad_local_experts")
        else:
            held = _span(tail, item, n_expert, "expert")
        for L in range(la, lb):
            layers[L] = held
    return LocalExperts(n_layer, n_expert, tuple(layers), text)
