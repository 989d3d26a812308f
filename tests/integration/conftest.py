"""Fixtures of the integration tests."""

from __future__ import annotations

from typing import Any

import pytest

from swarm.p2p.libp2p import open_libp2p_transport


@pytest.fixture
async def coord_transport() -> Any:
    async with open_libp2p_transport(key_path=None) as t:
        yield t
