"""Is a GGUF file whole? (shell: reads the file's header only; no torch, no tensor data).

Rules:
- The header (GGUF v2/v3: magic, counts, key/values, tensor infos) says where every tensor's data
  starts and how long it is; a file shorter than the end of its last tensor was cut short -- most
  often an interrupted download -- and is named as such, before anything tries to map it.
- ``check_gguf_file`` turns each way a model path can be wrong (missing, a directory, not GGUF, cut
  short in its header or its data) into one ``ConfigError`` naming the flag; the loader
  (``swarm.model.gguf``) still checks everything else.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Final

from swarm.errors import ConfigError

__all__ = ["check_gguf_file", "expected_size"]

_MAGIC: Final = b"GGUF"
# fixed-size GGUF value types: type id -> struct format
_SCALARS: Final = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING: Final = 8
_ARRAY: Final = 9
_DEFAULT_ALIGNMENT: Final = 32


class _Short(Exception):
    """The file ended inside its header."""


class _NotGguf(Exception):
    pass


def _read(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) < n:
        raise _Short
    return b


def _u32(f: BinaryIO) -> int:
    return int(struct.unpack("<I", _read(f, 4))[0])


def _u64(f: BinaryIO) -> int:
    return int(struct.unpack("<Q", _read(f, 8))[0])


def _skip_string(f: BinaryIO) -> bytes:
    return _read(f, _u64(f))


def _value(f: BinaryIO, vtype: int) -> object:
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return _skip_string(f)
    if vtype == _ARRAY:
        itype, count = _u32(f), _u64(f)
        if itype in _SCALARS:
            _read(f, struct.calcsize("<" + _SCALARS[itype]) * count)
        else:
            for _ in range(count):
                _value(f, itype)
        return None
    raise _NotGguf(f"unknown value type {vtype}")


def expected_size(path: Path) -> int:
    """The bytes a whole ``path`` has: the end of its last tensor's data (``_Short``, ``_NotGguf``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != _MAGIC:
            raise _Short if len(magic) < 4 and _MAGIC.startswith(magic) else _NotGguf(f"it starts with {magic!r}, not b'GGUF'")
        version = _u32(f)
        if version not in (2, 3):
            raise _NotGguf(f"GGUF version {version}")
        n_tensors, n_kv = _u64(f), _u64(f)
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = _skip_string(f)
            value = _value(f, _u32(f))
            if key == b"general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        end = 0
        for _ in range(n_tensors):
            _skip_string(f)
            dims = [_u64(f) for _ in range(_u32(f))]
            ttype, offset = _u32(f), _u64(f)
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise _NotGguf(f"unknown tensor type {ttype}") from None
            n = 1
            for d in dims:
                n *= d
            end = max(end, offset + n // block * type_size)
        start = -(-f.tell() // alignment) * alignment
    return start + end


def check_gguf_file(path: str | Path, flag: str) -> None:
    """A ``ConfigError`` naming ``flag`` unless ``path`` is a whole GGUF file."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path}: no such file", code="model_not_found") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})", code="model_not_found") from None
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory, not a GGUF file", code="not_gguf")
    try:
        want = expected_size(p)
    except _Short:
        raise ConfigError(f"{flag} {path}: the file ends inside its GGUF header ({size:,} bytes): incomplete download?",
                          code="truncated_gguf") from None
    except _NotGguf as exc:
        raise ConfigError(f"{flag} {path}: not a GGUF file we can read ({exc})", code="not_gguf") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})", code="model_not_found") from None
    if size < want:
        raise ConfigError(f"{flag} {path}: the file is truncated ({size:,} of {want:,} bytes): incomplete download?",
                          code="truncated_gguf")
