"""Regression tests for the py-libp2p 0.8.1 problems worked around in ``swarm.p2p.transport``.

(a) a listener refused every connection after its 250th inbound connection ever;
(b) every dial waited ~250 ms (the happy-eyeballs delay);
(c) a stream per call costs a multistream negotiation: the expert client keeps one stream;
plus: sockets and listeners leaked on shutdown, a failed dial blocked the peer for 60 s,
and the identity is persisted.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

import multiaddr
import numpy as np
import pytest
import torch
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network import swarm as libp2p_swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from swarm.errors import ConfigError, DialError
from swarm.p2p.identity import load_or_create_identity
from swarm.p2p.libp2p import Libp2pTransport, open_libp2p_transport
from swarm.p2p.patches import PINNED_LIBP2P, check_libp2p_version, installed_libp2p_version
from swarm.p2p.transport import Stream
from swarm.protocol.expert import PROTOCOL_ID, ExpertRequest, RequestId, make_hello, make_pairs
from swarm.rpc.client import open_expert_client
from swarm.rpc.server import expert_stream_handler

ECHO = "/test/echo/1"


async def echo(stream: Stream) -> None:
    while data := await stream.read(1 << 16):
        await stream.write(data)


async def roundtrip(client: Libp2pTransport, server: Libp2pTransport, msg: bytes) -> bytes:
    stream = await client.open_stream(server.peer_id, server.listen_addrs, ECHO)
    await stream.write(msg)
    got = await stream.read(len(msg))
    await stream.aclose()
    return got


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Poll library state that has no event to wait on."""
    with trio.fail_after(timeout):
        for _ in itertools.count():
            if predicate():
                return
            await trio.sleep(0.01)


def connections(transport: Libp2pTransport, peer_id: str) -> list[object]:
    return list(transport.host.get_network().get_connections(ID.from_base58(peer_id)))


async def test_a_listener_accepts_300_sequential_connections() -> None:
    async with open_libp2p_transport(key_path=None) as server, open_libp2p_transport(key_path=None) as client:
        server.set_stream_handler(ECHO, echo)
        seen: list[object] = []  # kept alive, so ids stay unique
        with trio.fail_after(45):
            for i in range(300):
                msg = f"cycle {i}".encode()
                assert await roundtrip(client, server, msg) == msg
                conns = connections(client, server.peer_id)
                live = [c for c in conns if not c.is_closed]  # type: ignore[attr-defined]
                assert len(live) == 1
                assert all(live[0] is not old for old in seen), "a connection was reused"
                seen.append(live[0])
                await client.disconnect(server.peer_id)
        assert len(seen) == 300
        # the listener's inbound slots come back as connections close (the library kept them until shutdown)
        limiter = server.host.get_network()._inbound_limiter
        await wait_until(lambda: limiter.borrowed_tokens <= 1)


async def test_b_a_dial_does_not_wait_out_the_happy_eyeballs_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library waits ``_HAPPY_EYEBALLS_DELAY`` after a dial unless the first success ends the wait
    (max_connections_per_peer=1). Stretched to 60 s, a dial that waited for it could not finish in 20."""
    monkeypatch.setattr(libp2p_swarm, "_HAPPY_EYEBALLS_DELAY", 60.0)
    async with open_libp2p_transport(key_path=None) as server, open_libp2p_transport(key_path=None) as client:
        server.set_stream_handler(ECHO, echo)
        with trio.fail_after(20):
            for _ in range(5):
                assert await roundtrip(client, server, b"x") == b"x"  # connect + Noise + Yamux + stream
                await client.disconnect(server.peer_id)
                await wait_until(lambda: not connections(client, server.peer_id))


async def test_b_canary_the_unconfigured_library_still_waits_out_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """When this fails, py-libp2p fixed its dial delay and the max_connections_per_peer=1 setting can go."""
    monkeypatch.setattr(libp2p_swarm, "_HAPPY_EYEBALLS_DELAY", 1.0)
    a, b = new_host(key_pair=create_new_key_pair()), new_host(key_pair=create_new_key_pair())
    loopback = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    async with a.run(loopback), b.run(loopback):
        t0 = time.perf_counter()
        await a.connect(PeerInfo(b.get_id(), b.get_addrs()))
        elapsed = time.perf_counter() - t0
        await a.close()
        await b.close()
    assert elapsed >= 1.0  # a lower bound: load can only add to it


async def test_c_expert_calls_share_one_stream() -> None:
    streams = 0
    serve = expert_stream_handler(lambda req, rows, pairs: _double(rows), hello=make_hello(kernel_id="k"))

    async def counting(stream: Stream) -> None:
        nonlocal streams
        streams += 1
        await serve(stream)

    async with open_libp2p_transport(key_path=None) as server, open_libp2p_transport(key_path=None) as me:
        server.set_stream_handler(PROTOCOL_ID, counting)
        async with open_expert_client(me, server.peer_id, server.listen_addrs) as client:
            rows = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
            for rid in range(30):
                req = ExpertRequest(
                    request_id=RequestId(rid),
                    attempt=0,
                    model_id="m",
                    layer=0,
                    lo=0,
                    hi=2,
                    n_rows=8,
                    d_model=4,
                    n_pairs=8,
                    dtype="float32",
                )
                pairs = make_pairs(np.arange(8), np.zeros(8), np.ones(8))
                assert torch.equal(await client.call(req, rows, pairs, timeout=5), rows * 2)
            assert client.sessions_opened == 1
    assert streams == 1


async def _double(rows: torch.Tensor) -> torch.Tensor:
    return rows * 2


async def test_a_failed_dial_does_not_block_the_peer_afterwards(tmp_path: Path) -> None:
    """The library's negative dial cache refused a peer for 60 s after one failed dial."""
    key = tmp_path / "peer.key"
    async with open_libp2p_transport(key_path=None) as client:
        async with open_libp2p_transport(key_path=key) as server:
            peer_id, addrs = server.peer_id, server.listen_addrs
        with pytest.raises(DialError):
            await client.open_stream(peer_id, addrs, ECHO)
        port = addrs[0].split("/tcp/")[1].split("/")[0]
        async with open_libp2p_transport(key_path=key, listen_addrs=[f"/ip4/127.0.0.1/tcp/{port}"]) as server:
            server.set_stream_handler(ECHO, echo)
            with trio.fail_after(5):
                assert await roundtrip(client, server, b"back") == b"back"


async def test_shutdown_releases_the_port_for_a_restart_on_it() -> None:
    """The library left the listening socket open (SO_REUSEPORT) and connection sockets unclosed."""
    async with open_libp2p_transport(key_path=None) as client:
        async with open_libp2p_transport(key_path=None) as first:
            first.set_stream_handler(ECHO, echo)
            assert await roundtrip(client, first, b"1") == b"1"
            port = first.listen_addrs[0].split("/tcp/")[1].split("/")[0]
        async with open_libp2p_transport(
            key_path=None, listen_addrs=[f"/ip4/127.0.0.1/tcp/{port}"]
        ) as second:
            second.set_stream_handler(ECHO, echo)
            for i in range(10):  # a leaked listener on the port would take some of these
                assert await roundtrip(client, second, bytes([i])) == bytes([i])
                await client.disconnect(second.peer_id)


def test_identity_is_created_once_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "identity.key"
    first = load_or_create_identity(path)
    assert path.exists()
    assert (path.stat().st_mode & 0o777) == 0o600
    again = load_or_create_identity(path)
    assert ID.from_pubkey(again.public_key) == ID.from_pubkey(first.public_key)
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp files left


def test_identity_corrupt_or_wrong_type_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(os.urandom(40))
    with pytest.raises(ConfigError, match="corrupt"):
        load_or_create_identity(path)


async def test_persisted_identity_gives_the_same_peer_id(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    async with open_libp2p_transport(key_path=path) as t:
        first = t.peer_id
    async with open_libp2p_transport(key_path=path) as t:
        assert t.peer_id == first
    async with open_libp2p_transport(key_path=None) as t:
        assert t.peer_id != first


def test_the_patches_refuse_any_libp2p_but_the_pinned_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarm.p2p.patches as patches

    check_libp2p_version()
    assert installed_libp2p_version() == PINNED_LIBP2P == "0.8.1"
    for other in ("0.8.2", "0.9.0", "0.8"):
        with pytest.raises(ConfigError, match=f"py-libp2p {other} is installed.*written for exactly 0.8.1"):
            check_libp2p_version(other)
    monkeypatch.setattr(patches, "installed_libp2p_version", lambda: None)
    with pytest.raises(ConfigError, match="py-libp2p is not installed"):
        check_libp2p_version()


async def test_a_host_is_not_built_on_another_libp2p_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarm.p2p.patches as patches

    monkeypatch.setattr(patches, "installed_libp2p_version", lambda: "0.9.0")
    with pytest.raises(ConfigError, match="py-libp2p 0.9.0 is installed"):
        async with open_libp2p_transport(key_path=None):
            pass
