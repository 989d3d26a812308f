"""What a volunteer is told to do with each slice it reports (pure: no I/O, no clock; ``now`` is given).

The heartbeat answer (``SliceDirective``) for one reported slice is decided here, from the facts
the market holds about it; the shell only copies the answer onto the wire.

Rules (DESIGN §6 age-out):
- A slice the market cannot place is released at once, with the reason: ``unknown_model`` when
  no registered model has its id, ``bad_slice_range`` when its expert range is empty or its
  layer or experts lie outside the model (``slice_refusal``). An empty range is refused first,
  whatever the model.
- A holding the market has not retired is kept (reason ``held``).
- A retired holding (``retiring_since`` set by age-out) is in its cooldown while
  ``now < retiring_since + cooldown_s`` (``in_cooldown``): it drains, told the time left in
  ``release_in_s``; after the cooldown it is released. Both carry the reason ``surplus``.
- The cooldown is this one rule: age-out restores only holdings still in it, and the dashboard
  names a retired holding ``retiring`` in it and ``released`` after it.
- On the wire a kept slice carries no reason (``""``); every other answer carries its reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from swarm.protocol.market import SliceDirective

__all__ = ["Action", "Directive", "Reason", "directive", "in_cooldown", "slice_refusal", "wire_directive"]


class Action(enum.StrEnum):
    KEEP = "keep"  # carry on serving (dispatched or not)
    DRAIN = "drain"  # no longer dispatched: answer what is in flight, release in ``release_in_s``
    RELEASE = "release"  # drop it now


class Reason(enum.StrEnum):
    HELD = "held"  # not retired: the market still wants it
    SURPLUS = "surplus"  # retired by age-out: its experts keep their target without it
    UNKNOWN_MODEL = "unknown_model"  # no registered model has this id
    BAD_SLICE_RANGE = "bad_slice_range"  # empty range, or outside the model's layers / experts
    NOT_ASSIGNED = "not_assigned"  # no lease of the market gave this volunteer the slice (DESIGN §12)
    UNPROVEN = "unproven"  # served for a grace period without any coordinator seeing proof that it holds it
    OVERDUE = "download_overdue"  # reported loading past its download deadline (the slice's size at a floor rate)


@dataclass(frozen=True)
class Directive:
    action: Action
    reason: Reason
    release_in_s: float | None = None  # set for ``drain`` only: the cooldown left

    @property
    def wire_reason(self) -> str:
        return "" if self.action is Action.KEEP else self.reason.value


def slice_refusal(shape: tuple[int, int] | None, layer: int, lo: int, hi: int) -> Reason | None:
    """Why a reported slice cannot be held, or ``None``; ``shape`` is the model's ``(n_layer,
    n_expert)``, ``None`` when no such model is registered."""
    if lo >= hi:
        return Reason.BAD_SLICE_RANGE
    if shape is None:
        return Reason.UNKNOWN_MODEL
    n_layer, n_expert = shape
    if not (0 <= layer < n_layer and 0 <= lo and hi <= n_expert):
        return Reason.BAD_SLICE_RANGE
    return None


def in_cooldown(retiring_since: float | None, now: float, cooldown_s: float) -> bool:
    """Whether a retired holding is still draining (not yet to be released)."""
    return retiring_since is not None and now < retiring_since + cooldown_s


def directive(
    retiring_since: float | None, now: float, cooldown_s: float, refusal: Reason | None = None
) -> Directive:
    """The answer for one reported slice (see the rules); ``refusal`` comes from ``slice_refusal``."""
    if refusal is not None:
        return Directive(Action.RELEASE, refusal)
    if retiring_since is None:
        return Directive(Action.KEEP, Reason.HELD)
    if in_cooldown(retiring_since, now, cooldown_s):
        return Directive(Action.DRAIN, Reason.SURPLUS, retiring_since + cooldown_s - now)
    return Directive(Action.RELEASE, Reason.SURPLUS)


class _SliceLike(Protocol):
    @property
    def model_id(self) -> str: ...
    @property
    def layer(self) -> int: ...
    @property
    def lo(self) -> int: ...
    @property
    def hi(self) -> int: ...


_WIRE_ACTION: Final[dict[Action, Literal["keep", "drain", "release"]]] = {
    Action.KEEP: "keep",
    Action.DRAIN: "drain",
    Action.RELEASE: "release",
}


def wire_directive(h: _SliceLike, d: Directive, dispatched: bool = False) -> SliceDirective:
    """A ``Directive`` for slice ``h`` on the wire (the heartbeat answer)."""
    return SliceDirective(h.model_id, h.layer, h.lo, h.hi, _WIRE_ACTION[d.action], dispatched=dispatched,
                          release_in_s=d.release_in_s, reason=d.wire_reason)
