"""Peer identities, their storage and signed bodies (pure apart from the crypto and the key file).

A peer id is the libp2p base58 peer id of an Ed25519 key. Ed25519 public keys are small, so
libp2p inlines them: the peer id is ``base58(multihash(identity, protobuf(PublicKey)))`` and the
public key can be recovered from the id alone. That is what lets the market check who signed a
heartbeat without any key exchange: ``verify_body(peer_id, body, signature)``.

The signed bytes (``signing_bytes``), exactly — the volunteer and the market both use this
module, but another implementation must produce the same bytes:

1. Take the msgspec Struct's fields in declaration order (``msgspec.structs.fields``), leaving
   out the field named ``signature`` (wherever it is declared).
2. Build a map ``{encode_name: value}`` in that order. Every field is included, also when it
   equals its default, whatever the Struct's ``omit_defaults`` says -- except the fields the
   Struct names in its class variable ``signed_when_set`` (fields added after the body shipped):
   those are included only when they differ from their default, so the body of a sender that
   predates them (which the receiver decodes with that default) still verifies.
3. Encode that map with ``msgspec.msgpack.encode`` (default settings). Nested values follow
   msgspec's default msgpack rules: a nested Struct is a map of its fields in declaration order
   (so nested Structs must not use ``omit_defaults`` or ``array_like``), lists are arrays,
   ``bytes`` are bin, floats are float64, ints use the smallest msgpack int that holds them.

The signature is the 64-byte Ed25519 signature of those bytes by the peer's libp2p private key.

Rules:
- A signature only says "the holder of this peer id's key sent exactly these field values".
  Freshness (epoch / sequence) is the receiver's business (``market.core.registry``).
- Both sides must decode the body with the same schema: a field the receiver does not know is
  not part of what it re-encodes, so the signature will not verify. Signed bodies are decoded
  with ``forbid_unknown_fields``.
- Malformed peer ids, non-Ed25519 keys (RSA / secp256k1 ids hash the key, it cannot be
  recovered) and bad signatures raise ``IdentityError`` (a ``RequestError``: HTTP 4xx), never a
  library exception or an assert.
"""

from __future__ import annotations

import base64
import functools
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from swarm.errors import ConfigError, IdentityError

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair, PublicKey

__all__ = [
    "load_or_create_identity",
    "SIGNATURE_FIELD",
    "SIGNATURE_HEADER",
    "request_signing_bytes",
    "sign_request",
    "verify_request",
    "IdentityError",
    "check_peer_id",
    "peer_id_of",
    "public_key_from_peer_id",
    "sign_body",
    "signing_bytes",
    "verify_body",
]

SIGNATURE_FIELD = "signature"
_MAX_PEER_ID_LEN = 128  # an Ed25519 id is 52 base58 characters; anything far longer is garbage
_ED25519_SIGNATURE_LEN = 64


def peer_id_of(key_pair: KeyPair) -> str:
    """The base58 libp2p peer id of ``key_pair`` (what the libp2p host announces)."""
    from libp2p.peer.id import ID

    return ID.from_pubkey(key_pair.public_key).to_base58()


def public_key_from_peer_id(peer_id: str) -> PublicKey:
    """The Ed25519 public key inlined in ``peer_id``; ``IdentityError`` (``bad_peer_id``) otherwise."""
    from libp2p.crypto.keys import KeyType
    from libp2p.peer.id import ID

    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_LEN:
        raise IdentityError("peer id must be a non-empty base58 string")
    try:
        pid = ID.from_base58(peer_id)
    except Exception as exc:  # base58 raises ValueError; be robust to other library errors
        raise IdentityError(f"peer id {peer_id[:60]!r} is not base58") from exc
    if pid.to_base58() != peer_id:
        raise IdentityError(f"peer id {peer_id[:60]!r} is not in canonical base58")
    key = pid.extract_public_key()  # None unless an identity multihash of a known key type
    if key is None:
        raise IdentityError(f"peer id {peer_id[:60]!r} does not inline a public key (need an Ed25519 libp2p id)")
    if key.get_type() != KeyType.Ed25519:
        raise IdentityError(f"peer id {peer_id[:60]!r} is not an Ed25519 id")
    if ID.from_pubkey(key).to_base58() != peer_id:
        raise IdentityError(f"peer id {peer_id[:60]!r} does not round-trip through its key")
    return key


def check_peer_id(peer_id: str) -> str:
    """``peer_id`` if it is a well-formed Ed25519 libp2p id, else ``IdentityError``."""
    public_key_from_peer_id(peer_id)
    return peer_id


def signing_bytes(body: msgspec.Struct) -> bytes:
    """The canonical bytes a signature covers (see the module docstring)."""
    if not isinstance(body, msgspec.Struct):
        raise TypeError(f"can only sign msgspec Structs, not {type(body).__name__}")
    out: dict[str, object] = {}
    for name, enc, later, default in _signed_fields(type(body)):  # later: in ``signed_when_set``
        value = getattr(body, name)
        if later and value == default():
            continue
        out[enc] = value
    return msgspec.msgpack.encode(out)


def _no_default() -> object:
    return _NO_DEFAULT


_NO_DEFAULT = object()


@functools.lru_cache(maxsize=256)
def _signed_fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, str, bool, Callable[[], object]], ...]:
    # msgspec.structs.fields evaluates the annotations on every call (about a millisecond)
    out: list[tuple[str, str, bool, Callable[[], object]]] = []
    added_later = frozenset(getattr(cls, "signed_when_set", ()))
    for f in msgspec.structs.fields(cls):
        if f.name == SIGNATURE_FIELD:
            continue
        later = f.name in added_later
        if f.default is not msgspec.NODEFAULT:
            default: Callable[[], object] = functools.partial(lambda v: v, f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory
        else:
            default = _no_default
        out.append((f.name, f.encode_name, later, default))
    return tuple(out)


def sign_body(key_pair: KeyPair, body: msgspec.Struct) -> bytes:
    """Ed25519 signature of ``signing_bytes(body)`` by ``key_pair`` (any ``signature`` field is ignored)."""
    from libp2p.crypto.keys import KeyType

    if key_pair.private_key.get_type() != KeyType.Ed25519:
        raise IdentityError("only Ed25519 identities can sign bodies", code="bad_key_type")
    return bytes(key_pair.private_key.sign(signing_bytes(body)))


def verify_body(peer_id: str, body: msgspec.Struct, signature: bytes) -> None:
    """Return if ``signature`` is ``peer_id``'s signature of ``body``; raise ``IdentityError`` otherwise.

    Codes: ``bad_peer_id`` (malformed id), ``bad_signature`` (401: wrong length, wrong key or a
    body that is not the one signed).
    """
    key = public_key_from_peer_id(peer_id)
    if not isinstance(signature, bytes | bytearray) or len(signature) != _ED25519_SIGNATURE_LEN:
        raise IdentityError("signature must be 64 bytes (Ed25519)", code="bad_signature", status=401)
    try:
        ok = key.verify(signing_bytes(body), bytes(signature))
    except Exception as exc:  # nacl may raise on malformed input rather than return False
        raise IdentityError("signature does not verify", code="bad_signature", status=401) from exc
    if not ok:
        raise IdentityError(f"signature does not verify for peer {peer_id}", code="bad_signature", status=401)


# -- signed HTTP requests (DESIGN §11): one scheme for every volunteer request -------------------

SIGNATURE_HEADER = "x-moe-signature"
_REQUEST_SIG_PREFIX = b"moe-swarm-sig/1\n"


def request_signing_bytes(method: str, path: str, body: bytes) -> bytes:
    """``moe-swarm-sig/1\n`` + METHOD + `` `` + PATH + ``\n`` + the raw body: what a request signature covers."""
    return _REQUEST_SIG_PREFIX + method.upper().encode() + b" " + path.encode() + b"\n" + body


def sign_request(key_pair: KeyPair, method: str, path: str, body: bytes) -> str:
    """The ``X-Moe-Signature`` header value (base64) for a request with this raw ``body``."""
    from libp2p.crypto.keys import KeyType

    if key_pair.private_key.get_type() != KeyType.Ed25519:
        raise IdentityError("only Ed25519 identities can sign requests", code="bad_key_type")
    return base64.b64encode(bytes(key_pair.private_key.sign(request_signing_bytes(method, path, body)))).decode()


def verify_request(peer_id: str, method: str, path: str, body: bytes, header: str) -> None:
    """Return if ``header`` is ``peer_id``'s signature of this request; ``IdentityError`` (401
    ``bad_signature``) otherwise."""
    key = public_key_from_peer_id(peer_id)
    try:
        sig = base64.b64decode(header.strip(), validate=True)
    except (ValueError, TypeError) as exc:
        raise IdentityError("X-Moe-Signature is not base64", code="bad_signature", status=401) from exc
    if len(sig) != _ED25519_SIGNATURE_LEN:
        raise IdentityError("X-Moe-Signature must hold 64 bytes (Ed25519)", code="bad_signature", status=401)
    try:
        ok = key.verify(request_signing_bytes(method, path, body), sig)
    except Exception as exc:  # nacl may raise on malformed input rather than return False
        raise IdentityError("request signature does not verify", code="bad_signature", status=401) from exc
    if not ok:
        raise IdentityError(f"request signature does not verify for peer {peer_id}", code="bad_signature", status=401)


def load_or_create_identity(path: Path) -> KeyPair:
    """The Ed25519 identity stored at ``path`` (libp2p protobuf encoding); created on first use.

    Creation is atomic and safe against a concurrent creator: the key is written to a private
    temporary file (mode 0600), fsynced and hard-linked into place; if another process linked first,
    its key wins and is returned.
    """
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.keys import KeyPair, KeyType
    from libp2p.crypto.serialization import deserialize_private_key

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        key_pair = create_new_key_pair()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{random.SystemRandom().getrandbits(32):08x}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key_pair.private_key.serialize())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return load_or_create_identity(path)
        finally:
            tmp.unlink(missing_ok=True)
        return key_pair
    except OSError as exc:
        raise ConfigError(f"cannot read identity key {path}: {exc}") from exc
    try:
        private_key = deserialize_private_key(data)
    except Exception as exc:
        raise ConfigError(
            f"identity key {path} is corrupt ({exc}); move it away to create a new identity"
        ) from exc
    if private_key.get_type() != KeyType.Ed25519:
        raise ConfigError(f"identity key {path} is {private_key.get_type().name}, expected Ed25519")
    return KeyPair(private_key, private_key.get_public_key())
