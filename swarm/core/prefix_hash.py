"""The chain hash that names a token sequence's prefixes (pure; a contract between coordinators, which
advertise the prefixes they keep, and the gateway, which routes a prompt to the longest one).

Rules: ``h[0] = blake2b(salt)``, ``h[i+1] = blake2b(h[i] || token_i)`` (16-byte digests, tokens as 4 bytes
little-endian); ``h[i]`` names ``tokens[0:i]`` and nothing else. The salt names the model and its KV layout,
so two models' hashes never meet and advertised hashes can be compared as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["HASH_BYTES", "prefix_hashes"]

HASH_BYTES = 16


def prefix_hashes(tokens: Sequence[int], salt: bytes, *, limit: int | None = None) -> list[bytes]:
    """``h[0..n]`` of ``tokens`` (``n = min(len(tokens), limit)``): ``h[i]`` names ``tokens[0:i]``."""
    n = len(tokens) if limit is None else min(limit, len(tokens))
    h = hashlib.blake2b(salt, digest_size=HASH_BYTES).digest()
    out = [h]
    for t in tokens[:n]:
        h = hashlib.blake2b(h + int(t).to_bytes(4, "little"), digest_size=HASH_BYTES).digest()
        out.append(h)
    return out
