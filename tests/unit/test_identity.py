"""Peer ids and signed bodies (``swarm.p2p.identity``): round trip, tampering, wrong key, bad ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import base58
import msgspec
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.secp256k1 import create_new_key_pair as create_secp256k1_key_pair
from libp2p.peer.id import ID

from swarm.errors import IdentityError
from swarm.p2p.identity import (
    check_peer_id,
    peer_id_of,
    public_key_from_peer_id,
    sign_body,
    signing_bytes,
    verify_body,
)


class Inner(msgspec.Struct):
    a: int
    b: str = "x"


class Body(msgspec.Struct, forbid_unknown_fields=True):
    peer_id: str
    sequence: int
    items: list[Inner] = []
    load: float = 0.0
    signature: bytes = b""


class LaterBody(msgspec.Struct):
    signed_when_set: ClassVar[frozenset[str]] = frozenset({"versions"})
    peer_id: str
    versions: list[int] = msgspec.field(default_factory=lambda: [1])
    signature: bytes = b""


class CoverageLikeBody(msgspec.Struct, forbid_unknown_fields=True):
    """``Body`` with a field added after it shipped (like ``CoverageHeartbeat.protocols``)."""

    signed_when_set: ClassVar[frozenset[str]] = frozenset({"versions"})
    peer_id: str
    sequence: int
    items: list[Inner] = []
    load: float = 0.0
    signature: bytes = b""
    versions: list[int] = msgspec.field(default_factory=lambda: [1])


class OmittingBody(msgspec.Struct, omit_defaults=True):
    signature: bytes = b""
    peer_id: str = ""
    n: int = 0


SEED_A = bytes(range(32))
SEED_B = bytes(range(1, 33))


@pytest.fixture(scope="module")
def key_a() -> KeyPair:
    return create_new_key_pair(SEED_A)


@pytest.fixture(scope="module")
def key_b() -> KeyPair:
    return create_new_key_pair(SEED_B)


def test_peer_id_matches_libp2p_and_inlines_the_key(key_a: KeyPair) -> None:
    pid = peer_id_of(key_a)
    assert pid == ID.from_pubkey(key_a.public_key).to_base58()
    assert pid.startswith("12D3KooW")  # identity-multihash Ed25519 ids always look like this
    assert public_key_from_peer_id(pid).to_bytes() == key_a.public_key.to_bytes()
    assert check_peer_id(pid) == pid


def test_sign_verify_round_trip(key_a: KeyPair) -> None:
    pid = peer_id_of(key_a)
    body = Body(pid, 7, [Inner(1), Inner(2, "y")], 0.5)
    sig = sign_body(key_a, body)
    assert len(sig) == 64
    verify_body(pid, body, sig)
    # the signature field is not signed: a body carrying its signature verifies the same way
    signed = msgspec.structs.replace(body, signature=sig)
    verify_body(pid, signed, sig)
    # and survives a JSON round trip (what the market does with an HTTP body)
    decoded = msgspec.json.decode(msgspec.json.encode(signed), type=Body)
    verify_body(pid, decoded, decoded.signature)


def test_signing_bytes_are_the_documented_canonical_form() -> None:
    body = Body("p", 3, [Inner(1)], 0.25, signature=b"zzz")
    expected = msgspec.msgpack.encode({"peer_id": "p", "sequence": 3, "items": [{"a": 1, "b": "x"}], "load": 0.25})
    assert signing_bytes(body) == expected
    # defaults are included even when the Struct omits them on the wire
    assert signing_bytes(OmittingBody()) == msgspec.msgpack.encode({"peer_id": "", "n": 0})
    # ... except fields added later (``signed_when_set``): signed only when not their default, so a
    # body from a sender that predates them, decoded with the default, still verifies
    assert signing_bytes(LaterBody("p")) == msgspec.msgpack.encode({"peer_id": "p"})
    assert signing_bytes(LaterBody("p", versions=[2])) == msgspec.msgpack.encode({"peer_id": "p", "versions": [2]})


def test_a_body_from_before_a_field_was_added_still_verifies(key_a: KeyPair) -> None:
    pid = peer_id_of(key_a)
    old = Body(pid, 7, [Inner(1)], 0.5)
    sig = sign_body(key_a, old)
    raw = msgspec.json.encode(msgspec.structs.replace(old, signature=sig))
    newer = msgspec.json.decode(raw, type=CoverageLikeBody)  # the receiver knows one field more
    assert newer.versions == [1]
    verify_body(pid, newer, newer.signature)
    with pytest.raises(IdentityError):  # but a changed value of the new field is signed
        verify_body(pid, msgspec.structs.replace(newer, versions=[2]), newer.signature)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda b: msgspec.structs.replace(b, sequence=b.sequence + 1),
        lambda b: msgspec.structs.replace(b, load=0.5000001),
        lambda b: msgspec.structs.replace(b, items=[Inner(1), Inner(2, "z")]),
        lambda b: msgspec.structs.replace(b, items=[Inner(2, "y"), Inner(1)]),
        lambda b: msgspec.structs.replace(b, items=[]),
    ],
    ids=["sequence", "float", "nested", "reordered", "dropped"],
)
def test_tampered_body_is_rejected(key_a: KeyPair, tamper: Callable[[Body], Body]) -> None:
    pid = peer_id_of(key_a)
    body = Body(pid, 7, [Inner(1), Inner(2, "y")], 0.5)
    sig = sign_body(key_a, body)
    with pytest.raises(IdentityError) as ei:
        verify_body(pid, tamper(body), sig)
    assert ei.value.code == "bad_signature"
    assert ei.value.status == 401


def test_another_peers_key_is_rejected(key_a: KeyPair, key_b: KeyPair) -> None:
    victim = peer_id_of(key_a)
    body = Body(victim, 1)
    forged = sign_body(key_b, body)  # signed by b, claims to be a
    with pytest.raises(IdentityError) as ei:
        verify_body(victim, body, forged)
    assert ei.value.code == "bad_signature"
    verify_body(peer_id_of(key_b), body, forged)  # the same signature is fine for its real signer


@pytest.mark.parametrize("sig", [b"", b"\x00" * 63, b"\x00" * 65, b"\x00" * 64])
def test_malformed_signature_is_rejected(key_a: KeyPair, sig: bytes) -> None:
    with pytest.raises(IdentityError) as ei:
        verify_body(peer_id_of(key_a), Body("x", 1), sig)
    assert ei.value.code == "bad_signature"


def _sha256_peer_id() -> str:
    return "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a hashed (RSA-style) id: no key inside


def _secp_peer_id() -> str:
    return ID.from_pubkey(create_secp256k1_key_pair(b"\x01" * 32).public_key).to_base58()


@pytest.mark.parametrize(
    "peer_id",
    [
        "",
        "not base58 0OIl",
        "12D3KooW",  # truncated
        "x" * 500,
        _sha256_peer_id(),
        _secp_peer_id(),
        base58.b58encode(b"\x00\x05hello").decode(),  # identity multihash of garbage
    ],
    ids=["empty", "alphabet", "truncated", "huge", "sha256", "secp256k1", "garbage-key"],
)
def test_malformed_peer_id_is_rejected(peer_id: str) -> None:
    with pytest.raises(IdentityError) as ei:
        public_key_from_peer_id(peer_id)
    assert ei.value.code == "bad_peer_id"
    assert ei.value.status == 400
    with pytest.raises(IdentityError):
        verify_body(peer_id, Body("x", 1), b"\x00" * 64)


def test_mutated_peer_id_does_not_verify(key_a: KeyPair) -> None:
    real = peer_id_of(key_a)
    body = Body(real, 1)
    sig = sign_body(key_a, body)
    for i in (len(real) - 1, len(real) // 2, 9):
        mutated = real[:i] + ("a" if real[i] != "a" else "b") + real[i + 1 :]
        # a one-character change either breaks the key encoding or names another key: both fail
        with pytest.raises(IdentityError):
            verify_body(mutated, body, sig)


def test_sign_rejects_non_struct(key_a: KeyPair) -> None:
    with pytest.raises(TypeError):
        sign_body(key_a, {"a": 1})  # type: ignore[arg-type]
