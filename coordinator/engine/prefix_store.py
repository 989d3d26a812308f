"""Kept prefixes' KV rows (shell, engine thread only): in RAM, and as files of the disk tier.

Rules:
- Only the engine thread uses a store: it performs the scheduler's KV ops in their order (``apply``);
  the decisions are ``coordinator.core.prefixes``', and the ops carry what the store needs (it never
  reads the index, which the trio thread may change meanwhile: a cancelled request's offer).
- A file is ``DIR/<hex of the entry's whole-sequence chain hash>.kv``, written as a temporary file
  in DIR and renamed over (atomic: a reader sees a whole file or none); nothing is written outside
  DIR, and a name is only ever hex digits.
- A file: ``MAGIC``, the header's length (4 bytes little-endian), a JSON header (the salt's digest:
  model id, file hash, kernels and KV type; the tokens; K's and V's shapes and dtype; the blake2b
  of the payload), then K's bytes and V's bytes.
- A file is loaded only if every check holds: magic, header, this model's salt, a name that is the
  chain hash of its tokens, this cache's shapes and dtype, the exact file size, the payload's
  checksum. Otherwise it is never loaded: one warning for the file, and the request prefills its
  whole prompt (``apply`` returns the failed loads).
- At start (``scan``) DIR's ``*.kv`` files are read (headers, oldest first) and this model's are
  adopted by the index; another model's, and corrupt or cut-short ones, are left alone, one warning each.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path
from typing import BinaryIO

import msgspec
import numpy as np
import torch

from coordinator.core.prefixes import PrefixIndex, prefix_hashes
from coordinator.core.scheduler import FreeRows, KvOp, LoadRows, SaveRows, SpillRows, UnlinkRows
from coordinator.engine.model import KVCache

__all__ = ["MAGIC", "PrefixStore"]

log = logging.getLogger(__name__)

MAGIC = b"MSWKV01\n"
MAX_HEADER = 64 << 20  # bytes: a header's token list for any context
_DTYPES = {torch.float16: "f16", torch.float32: "f32"}


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    salt: str  # blake2b hex of the index's salt
    tokens: list[int]
    k_shape: list[int]
    v_shape: list[int]
    dtype: str
    checksum: str  # blake2b-256 hex of K's bytes then V's


class _Unusable(Exception):
    """A file that must not be loaded (the message says why)."""


_decode_header = msgspec.json.Decoder(_Header)


class PrefixStore:
    def __init__(self, caches: list[KVCache], index: PrefixIndex, directory: Path | None) -> None:
        self.caches = caches
        self.index = index
        self.dir = directory
        self.ram: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.files: dict[int, Path] = {}
        self.salt = hashlib.blake2b(index.salt).hexdigest()
        c = caches[0]
        self.dtype = c.k.dtype
        self._k_rest, self._v_rest = list(c.k.shape[2:]), list(c.v.shape[1:3])
        self.n_layer = c.k.shape[0]
        self._warned: set[str] = set()

    # -- ops -----------------------------------------------------------------------------------------
    def apply(self, ops: list[KvOp]) -> list[LoadRows]:
        """Perform ``ops`` in order; the loads that could not be made."""
        failed: list[LoadRows] = []
        for op in ops:
            match op:
                case SaveRows(slot, entry, n):
                    self.ram[entry] = self.caches[slot].copy_rows(n)
                case FreeRows(entry):
                    self.ram.pop(entry, None)
                case SpillRows(entry, tokens):
                    rows = self.ram.pop(entry, None)
                    if rows is not None and self.dir is not None:
                        self._write(entry, tokens, *rows)
                case UnlinkRows(entry):
                    path = self.files.pop(entry, None)
                    if path is not None:
                        path.unlink(missing_ok=True)
                case LoadRows(slot, entry, n, tokens):
                    if not self._load(slot, entry, n, tokens):
                        failed.append(op)
        return failed

    def _load(self, slot: int, entry: int, n: int, tokens: tuple[int, ...]) -> bool:
        rows = self.ram.get(entry)
        if rows is None:
            path = self.files.pop(entry, None)
            if path is None:
                return False
            try:
                rows = self._read(path, tokens)
            except _Unusable as exc:
                self._warn(path, str(exc))
                path.unlink(missing_ok=True)  # ours (adopted or written here), and broken
                return False
            self.files[entry] = path
        self.caches[slot].load_rows(rows[0], rows[1], n)
        return True

    # -- files -----------------------------------------------------------------------------------------
    def _name(self, tokens: tuple[int, ...] | list[int]) -> str:
        return prefix_hashes(tokens, self.index.salt)[-1].hex() + ".kv"

    def _write(self, entry: int, tokens: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.dir is not None
        kn, vn = np.ascontiguousarray(k.numpy()), np.ascontiguousarray(v.numpy())
        h = hashlib.blake2b()
        h.update(kn.data)
        h.update(vn.data)
        head = msgspec.json.encode(_Header(self.salt, list(tokens), list(kn.shape), list(vn.shape),
                                           _DTYPES[self.dtype], h.hexdigest()))
        path = self.dir / self._name(tokens)
        tmp = self.dir / f".{path.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head)
                f.write(kn.data)
                f.write(vn.data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._warn(path, f"cannot write it: {exc}")
            return
        self.files[entry] = path

    def _header(self, f: BinaryIO, path: Path) -> tuple[_Header, int]:
        """The header of an open file, checked against this model and the file's size; the payload's offset."""
        lead = f.read(len(MAGIC) + 4)
        if len(lead) < len(MAGIC) + 4 or lead[: len(MAGIC)] != MAGIC:
            raise _Unusable("not a kept-prefix file")
        (n_head,) = struct.unpack("<I", lead[len(MAGIC):])
        if n_head > MAX_HEADER:
            raise _Unusable("its header is too big")
        raw = f.read(n_head)
        try:
            head = _decode_header.decode(raw)
        except msgspec.DecodeError as exc:
            raise _Unusable(f"its header is corrupt ({exc})") from None
        if head.salt != self.salt:
            raise _Unusable("it belongs to another model (or kernels, or KV type)")
        n = len(head.tokens)
        if (head.dtype != _DTYPES[self.dtype] or head.k_shape != [self.n_layer, n, *self._k_rest]
                or head.v_shape != [self.n_layer, *self._v_rest, n]):
            raise _Unusable("its shapes are not this cache's")
        if path.name != self._name(head.tokens):
            raise _Unusable("its name is not the hash of its tokens")
        offset = len(MAGIC) + 4 + n_head
        if path.stat().st_size != offset + self._payload_bytes(n):
            raise _Unusable("it is cut short (or too long)")
        return head, offset

    def _row_elems(self) -> int:
        return int(np.prod(self._k_rest)) + int(np.prod(self._v_rest))

    def _payload_bytes(self, n: int) -> int:
        return self.n_layer * n * self._row_elems() * torch.tensor([], dtype=self.dtype).element_size()

    def _read(self, path: Path, tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            with open(path, "rb") as f:
                head, _ = self._header(f, path)
                if tuple(head.tokens) != tokens:
                    raise _Unusable("its tokens are not the entry's")
                payload = bytearray(self._payload_bytes(len(tokens)))
                if f.readinto(payload) != len(payload):
                    raise _Unusable("it is cut short")
        except OSError as exc:
            raise _Unusable(f"cannot read it: {exc}") from None
        if hashlib.blake2b(payload).hexdigest() != head.checksum:
            raise _Unusable("its rows do not match their checksum")
        np_dtype = np.float16 if self.dtype == torch.float16 else np.float32
        k_n = int(np.prod(head.k_shape))
        flat = np.frombuffer(payload, dtype=np_dtype)
        k = torch.from_numpy(flat[:k_n].reshape(head.k_shape))
        v = torch.from_numpy(flat[k_n:].reshape(head.v_shape))
        return k, v

    def scan(self) -> list[tuple[tuple[int, ...], Path]]:
        """This model's usable-looking files in DIR, oldest first (headers and sizes checked; the
        payload's checksum is checked when one is loaded)."""
        if self.dir is None:
            return []
        found = []
        paths = sorted((p for p in self.dir.glob("*.kv") if p.is_file()), key=lambda p: p.stat().st_mtime)
        for path in paths:
            try:
                with open(path, "rb") as f:
                    head, _ = self._header(f, path)
            except _Unusable as exc:
                self._warn(path, str(exc))
                continue
            except OSError as exc:
                self._warn(path, f"cannot read it: {exc}")
                continue
            found.append((tuple(head.tokens), path))
        return found

    def _warn(self, path: Path, why: str) -> None:
        if path.name not in self._warned:
            self._warned.add(path.name)
            log.warning("prefix cache file %s is not used: %s", path, why)
