"""``swarm.failover.FailoverTransport``: which request goes to which replica (faults injected through
httpx's ``MockTransport``; the real sockets are in ``tests/integration/test_market_replica_faults.py``)."""

from __future__ import annotations

import httpx
import pytest
import trio

from swarm.failover import FailoverTransport, client_transport

A, B, C = "http://a.test:1/m", "http://b.test:2/m", "http://c.test:3/m"


def run(bases: list[str], behaviour: dict[str, str], calls: list[tuple[str, str, bytes]], n: int = 1,
        url: str = A + "/api/expert-volunteer") -> list[int | str]:
    """``behaviour``: host -> ``ok`` | ``refuse`` (connect error) | ``503`` | ``drop`` (read error: maybe sent)."""

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls.append((host, request.url.path, request.content))
        assert request.headers["host"] == request.url.netloc.decode()
        match behaviour.get(host, "ok"):
            case "refuse":
                raise httpx.ConnectError("refused", request=request)
            case "drop":
                raise httpx.ReadError("dropped", request=request)
            case "503":
                return httpx.Response(503, json={"error": {"code": "store_error"}})
        return httpx.Response(200, text=host)

    t = FailoverTransport(bases, httpx.MockTransport(handler))
    out: list[int | str] = []

    async def main() -> None:
        async with httpx.AsyncClient(transport=t) as client:
            for _ in range(n):
                try:
                    r = await client.post(url, content=b"signed body", headers={"x-moe-signature": "sig"})
                    out.append(r.text if r.status_code == 200 else r.status_code)
                except httpx.TransportError as exc:
                    out.append(type(exc).__name__)

    trio.run(main)
    return out


def test_a_refused_connection_fails_over_and_the_answering_replica_is_kept() -> None:
    calls: list[tuple[str, str, bytes]] = []
    assert run([A, B, C], {"a.test": "refuse"}, calls, n=2) == ["b.test", "b.test"]
    # the same path below the base and the same body (the signature holds) on the replica; then b first
    assert calls == [("a.test", "/m/api/expert-volunteer", b"signed body"), ("b.test", "/m/api/expert-volunteer",
                     b"signed body"), ("b.test", "/m/api/expert-volunteer", b"signed body")]


def test_a_503_goes_to_the_next_replica_but_the_last_one_s_503_is_answered() -> None:
    calls: list[tuple[str, str, bytes]] = []
    assert run([A, B], {"a.test": "503"}, calls) == ["b.test"]
    calls.clear()
    assert run([A, B], {"a.test": "503", "b.test": "503"}, calls) == [503]
    assert [h for h, _, _ in calls] == ["a.test", "b.test"]


def test_a_request_that_may_have_been_acted_on_is_not_resent_but_the_next_goes_elsewhere() -> None:
    calls: list[tuple[str, str, bytes]] = []
    assert run([A, B], {"a.test": "drop"}, calls, n=2) == ["ReadError", "b.test"]
    assert [h for h, _, _ in calls] == ["a.test", "b.test"]


def test_none_reachable_raises_the_connect_error_and_other_origins_pass_through() -> None:
    calls: list[tuple[str, str, bytes]] = []
    assert run([A, B], {"a.test": "refuse", "b.test": "refuse"}, calls) == ["ConnectError"]
    calls.clear()
    assert run([A, B], {"a.test": "refuse"}, calls, url="http://coordinator.test:9/v1/slices/x") == ["coordinator.test"]
    assert client_transport(A, []) is None
    with pytest.raises(ValueError):
        FailoverTransport([])
