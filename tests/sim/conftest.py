"""Fixtures of the virtual-time scenarios."""

from __future__ import annotations

import pytest
import trio
import trio.testing


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)
