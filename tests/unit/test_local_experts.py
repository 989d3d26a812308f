"""``--local-experts SPEC`` (DESIGN §11): the syntax, overrides, and the errors naming the item."""

from __future__ import annotations

import pytest

from coordinator.core.local_experts import parse_local_experts
from swarm.errors import ConfigError


def test_all_none_and_items_with_later_ones_overriding() -> None:
    a = parse_local_experts("all", 4, 8)
    assert a.all and not a.none and a.held(3, 0, 8) and a.held_experts() == 32
    n = parse_local_experts("none", 4, 8)
    assert n.none and not n.held(0, 0, 1) and n.ranges() == []
    s = parse_local_experts("0-4:all,2:none,3:2-6", 4, 8)  # layers 0, 1 all; 2 none; 3 experts 2-5
    assert s.layers == ((0, 8), (0, 8), (0, 0), (2, 6))
    assert s.held(1, 0, 8) and not s.held(2, 0, 1) and s.held(3, 2, 6) and s.held(3, 3, 4)
    assert not s.held(3, 1, 6) and not s.held(3, 2, 7)  # a range is held only when all of it is
    assert not s.held(9, 0, 1) and s.ranges() == [(0, 0, 8), (1, 0, 8), (3, 2, 6)]
    assert parse_local_experts("1:0-4", 4, 8).layers == ((0, 0), (0, 4), (0, 0), (0, 0))  # unnamed: none


@pytest.mark.parametrize(("spec", "says"), [
    ("0-9:all", "outside the model's 4 layers"),
    ("0:4-9", "outside the model's 8 experts"),
    ("2-2:all", "empty layer range"),
    ("0:5-3", "empty expert range"),
    ("0:x-3", "is not a number"),
    ("0-4", "expected LAYERS:EXPERTS"),
    ("0:hot:2", "hot:K is not supported yet"),
    ("", "expected all, none"),
])
def test_a_bad_item_is_a_config_error_naming_it(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        parse_local_experts(spec, 4, 8)
    assert info.value.code == "bad_local_experts"
