"""Expert slices: cut, serve, load and describe (shell: reads the model with ``pread``).

A slice is ``(model_id, layer, lo, hi)``: experts ``lo .. hi-1`` of one MoE layer (DESIGN §3, §11).
Its file is safetensors holding the raw GGUF bytes of ``blk.{layer}.ffn_{gate,up,down}_exps.weight``
rows ``lo:hi`` as uint8 tensors named ``gate``, ``up``, ``down``.

Rules:
- Byte-deterministic: the same slice of the same GGUF gives the same bytes on every machine, process
  and run. The safetensors header is written here, canonically: compact JSON with sorted keys, padded
  with spaces to a multiple of 8 bytes, data in the order gate, up, down. All slice metadata lives in
  ONE ``__metadata__`` key (``METADATA_KEY``) whose value is canonical JSON (sorted keys, no spaces)
  of ``SliceMeta``. The slice id is the sha256 hex of the file.
- Quantised blocks stay quantised: each tensor is ``uint8[hi-lo, rows, bytes_per_row]`` and the
  metadata carries its ggml type name and logical shape, so a loaded slice dequantises per use with
  the very code the coordinator uses (``swarm.model.gguf.ExpertStack``): results are bit-identical.
- A slice file comes from a peer: everything in it is validated and every defect is a
  ``SliceError`` naming what is wrong, never an assert.
- The coordinator keeps no copies: ``SliceCache`` serves a slice file as its header plus byte
  ranges of the GGUF and remembers only each slice's sha256 (an index file written atomically).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import tempfile
import threading
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import gguf
import msgspec
import numpy as np
import safetensors
import safetensors.torch

from swarm.errors import ModelError, SliceError
from swarm.ids import SliceKey, parse_slice_arg
from swarm.model.gguf import (
    SUPPORTED_TYPES,
    ExpertStack,
    GGUFModel,
    ModelConfig,
    QTensor,
    pread_chunks,
)
from swarm.protocol.manifest import (
    BIAS_KINDS,
    DEFAULT_ACTIVATION,
    SLICE_FORMAT,
    SLICE_FORMAT_ACTIVATION,
    ModelManifest,
    slice_kinds,
)

__all__ = [
    "EXPERT_KINDS",
    "METADATA_KEY",
    "SLICE_FORMAT",
    "LoadedSlice",
    "SliceCache",
    "SliceFile",
    "SliceFileSpans",
    "SliceKey",
    "SliceMeta",
    "SlicePlan",
    "TensorInfo",
    "build_manifest",
    "expert_digests",
    "plan_slice",
    "slice_file_spans",
    "slice_header",
    "check_activation",
    "check_slice_range",
    "cut_slice",
    "hold_digest",
    "hold_digest_from_file",
    "load_slice",
    "parse_slice_arg",
]

log = logging.getLogger(__name__)

METADATA_KEY: Final = "moe_swarm_slice"
EXPERT_KINDS: Final = ("gate", "up", "down")
_MAX_HEADER: Final = 1 << 20  # three tensors and a small metadata blob: anything larger is hostile

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]


# -- identity ---------------------------------------------------------------------------------


def check_slice_range(config: ModelConfig, layer: int, lo: int, hi: int) -> None:
    """``SliceError`` (code ``bad_slice_range``) unless the slice exists in a model of ``config``."""
    _check_range(config.n_moe_layer, config.n_expert, layer, lo, hi)


def _check_range(n_layer: int, n_expert: int, layer: int, lo: int, hi: int) -> None:
    if not 0 <= layer < n_layer:
        raise SliceError(f"layer {layer} out of range: the model has layers 0..{n_layer - 1}", code="bad_slice_range")
    if not 0 <= lo < hi <= n_expert:
        raise SliceError(f"expert range {lo}-{hi} invalid: need 0 <= lo < hi <= {n_expert} (half-open)",
                         code="bad_slice_range")


# -- metadata ---------------------------------------------------------------------------------


class TensorInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: str  # ggml type name, e.g. "Q8_0"
    shape: tuple[int, ...]  # logical shape (numpy order): (n_expert, rows, cols)


class SliceMeta(msgspec.Struct, frozen=True, kw_only=True):
    """The one JSON object stored under ``__metadata__[METADATA_KEY]``."""

    model_id: str
    arch: str
    layer: NonNeg
    lo: NonNeg
    hi: Positive
    d_model: Positive
    d_expert: Positive
    tensors: dict[str, TensorInfo]
    format: int = SLICE_FORMAT
    # set (with format 2) only for experts whose activation is not the default: the bytes of every
    # SiLU slice stay what they always were
    activation: str | msgspec.UnsetType = msgspec.UNSET

    @property
    def key(self) -> SliceKey:
        return SliceKey(self.model_id, self.layer, self.lo, self.hi)


_meta_decoder = msgspec.json.Decoder(SliceMeta)


def check_activation(activation: str) -> None:
    """``SliceError`` (``unsupported_activation``) unless the expert kernels compute ``activation``."""
    from swarm.model.kernels import EXPERT_ACTIVATIONS

    if activation not in EXPERT_ACTIVATIONS:
        raise SliceError(f"experts with activation {activation[:64]!r} cannot be computed here; this version "
                         f"computes {', '.join(EXPERT_ACTIVATIONS)}", code="unsupported_activation")


def _activation_fields(activation: str) -> dict[str, Any]:
    """``SliceMeta`` fields for experts of ``activation`` (none for the default: unchanged bytes)."""
    if activation == DEFAULT_ACTIVATION:
        return {}
    return {"activation": activation, "format": SLICE_FORMAT_ACTIVATION}


def _canonical_json(obj: Any) -> bytes:
    return msgspec.json.encode(obj, order="sorted")


def _bytes_per_row(qtype: gguf.GGMLQuantizationType, cols: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols <= 0 or cols % block:
        raise SliceError(f"a {qtype.name} row must be a positive multiple of {block} elements, got {cols}")
    return cols // block * size


# -- cutting ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """A slice file as parts: the header bytes, then the raw arrays (zero-copy views of the model) and
    where they lie in the model's file (``spans``)."""

    header: bytes
    arrays: tuple[np.ndarray[Any, np.dtype[np.uint8]], ...]
    path: Path
    spans: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(int(a.nbytes) for a in self.arrays)

    def chunks(self) -> Iterable[bytes | memoryview]:
        """The file's bytes in bounded pieces, the tensor data read from the GGUF with ``pread`` (never
        through its memory map: cutting and hashing every slice of a 17 GB model leaves the
        coordinator's RSS where it was, and the pieces are dropped from the page cache)."""
        yield memoryview(self.header)
        yield from pread_chunks(self.path, self.spans)

    def sha256(self) -> str:
        h = hashlib.sha256()
        for c in self.chunks():
            h.update(c)
        return h.hexdigest()


def slice_header(meta: SliceMeta) -> bytes:
    """The exact header bytes (u64 length + canonical JSON, space-padded to 8) of the slice file that
    ``meta`` describes: the one header builder, for cutting (``cut_slice``) and for rebuilding a file
    from a manifest (``plan_slice``). ``SliceError`` for a tensor whose rows do not fit its type."""
    header: dict[str, Any] = {"__metadata__": {METADATA_KEY: _canonical_json(meta).decode()}}
    offset = 0
    kinds = slice_kinds(meta.tensors)
    if kinds is None:
        raise SliceError(f"a slice holds the tensors {', '.join(EXPERT_KINDS)} (and their biases), "
                         f"not {sorted(meta.tensors)}")
    for kind in kinds:
        shape = _byte_shape(meta.tensors[kind])
        nbytes = math.prod(shape)
        header[kind] = {"dtype": "U8", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = _canonical_json(header)
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def _byte_shape(info: TensorInfo) -> list[int]:
    """How a tensor of ``info`` is stored in a slice file: ``uint8[*shape[:-1], bytes_per_row]``."""
    try:
        qtype = gguf.GGMLQuantizationType[info.type]
    except KeyError:
        raise SliceError(f"tensor type {info.type!r} is not a ggml type") from None
    return [*info.shape[:-1], _bytes_per_row(qtype, info.shape[-1])]


def _layout(model: GGUFModel, layer: int, lo: int, hi: int) -> _Layout:
    cfg = model.config
    check_slice_range(cfg, layer, lo, hi)
    stack = model.expert_stack(layer, lo, hi)
    tensors = stack.tensors()
    meta = SliceMeta(
        model_id=model.model_id,
        arch=cfg.arch,
        layer=layer,
        lo=lo,
        hi=hi,
        d_model=stack.d_model,
        d_expert=stack.d_expert,
        tensors={k: TensorInfo(t.qtype.name, tuple(t.shape)) for k, t in tensors.items()},
        **_activation_fields(cfg.spec.expert_activation),
    )
    for kind, info in meta.tensors.items():
        if _byte_shape(info) != list(tensors[kind].raw.shape):
            raise ModelError(f"{tensors[kind].name}: stored as {list(tensors[kind].raw.shape)} bytes, "
                             f"its type and shape say {_byte_shape(info)}")
    arrays = tuple(t.raw for t in tensors.values())
    return _Layout(slice_header(meta), arrays, model.path, tuple(model.file_span(a) for a in arrays))


def cut_slice(model: GGUFModel, layer: int, lo: int, hi: int) -> bytes:
    """The slice file's bytes (byte-deterministic); ``SliceError`` for a slice the model lacks."""
    return b"".join(_layout(model, layer, lo, hi).chunks())


# -- proof of holding -------------------------------------------------------------------------


def _window_parts(sizes: list[int], windows: Iterable[tuple[int, int]]) -> Iterable[tuple[int, int, int]]:
    """``(part, start, end)`` pieces of each window over parts of ``sizes`` bytes laid end to end;
    ``SliceError`` for a window outside them."""
    total = sum(sizes)
    for off, n in windows:
        if off < 0 or n <= 0 or off + n > total:
            raise SliceError(f"hold window {off}+{n} lies outside the slice's {total} data bytes", code="bad_shape")
        start = 0
        for i, size in enumerate(sizes):
            lo, hi = max(off, start), min(off + n, start + size)
            if lo < hi:
                yield i, lo - start, hi - start
            start += size


def hold_digest_from_file(path: Path, spans: tuple[tuple[int, int], ...], nonce: bytes,
                          windows: Iterable[tuple[int, int]]) -> bytes:
    """``hold_digest`` of a slice whose tensor data lies at ``spans`` of ``path`` (the coordinator's
    GGUF: ``GGUFModel.file_span``), read with ``pread_chunks`` so the model's pages are never mapped in
    and what the windows (and the kernel's readahead past them) brought into the page cache is dropped."""
    h = hashlib.sha256(nonce)
    reads = [(spans[i][0] + lo, hi - lo) for i, lo, hi in _window_parts([n for _, n in spans], windows)]
    for block in pread_chunks(path, reads):
        h.update(block)
    return h.digest()


def hold_digest(stack: ExpertStack, nonce: bytes, windows: Iterable[tuple[int, int]]) -> bytes:
    """``sha256(nonce || data[o:o+n] for each window)`` over a slice's tensor data (the slice file
    after its header: its tensors' raw bytes in storage order, gate, up, down and, for biased
    experts, their biases), as ``HoldChallenge`` asks. The same on the coordinator (views of its
    GGUF) and on a volunteer (views of its slice file): no copy of the whole slice is made.
    ``SliceError`` for a window outside the data."""
    arrays = [np.ascontiguousarray(t.raw).reshape(-1) for t in stack.tensors().values()]
    h = hashlib.sha256(nonce)
    for i, lo, hi in _window_parts([int(a.nbytes) for a in arrays], windows):
        h.update(arrays[i].data[lo:hi])
    return h.digest()


# -- cache ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SliceFile:
    """A slice file without a copy on disk: its header bytes and where its tensor data lies in the
    model's GGUF (``spans``), read with ``pread`` when it is sent."""

    path: Path  # the GGUF
    header: bytes
    spans: tuple[tuple[int, int], ...]
    sha256: str
    size: int

    def read(self, start: int, end: int, piece: int = 1 << 20) -> Generator[bytes, None, None]:
        """Bytes ``[start, end)`` of the slice file, at most ``piece`` at a time (blocking: run it in a
        worker thread), the GGUF's pages dropped from the page cache as they are read."""
        if not 0 <= start <= end <= self.size:
            raise SliceError(f"range {start}-{end} outside the slice file's {self.size} bytes")
        n_head = len(self.header)
        if start < n_head:
            yield self.header[start:min(end, n_head)]
        parts: list[tuple[int, int]] = []
        at = n_head
        for off, length in self.spans:
            lo, hi = max(start, at), min(end, at + length)
            if lo < hi:
                parts.append((off + lo - at, hi - lo))
            at += length
        yield from pread_chunks(self.path, parts, piece)


class SliceCache:
    """Describes the slices of one model and serves them straight from its GGUF (DESIGN §11).

    A slice file is its canonical header followed by byte ranges of the GGUF, so nothing is written:
    ``get`` returns a ``SliceFile`` whose bytes are read with ``pread`` when sent (the coordinator's
    disk holds the model once, and its RSS does not grow with what it serves). What ``get`` must
    compute is the file's sha256 (its ``ETag``): one ``pread`` pass over the slice, done once per
    slice and remembered, in memory and in ``cache_dir/<model_id>/sha256.json`` (so a restart does
    not hash again; an entry is trusted only for the same GGUF, by its content hash).

    ``get`` blocks (it reads the model): call it from a worker thread. It is thread-safe; concurrent
    calls for one slice hash it once. Bounded: at most ``max_entries`` digests are remembered (the
    least recently asked-for are forgotten first) -- any ``(layer, lo, hi)`` may be asked for, about
    n_expert^2 / 2 per layer, so a stranger's requests cost hashing time (two worker threads in the
    HTTP shell), never disk or unbounded memory.
    """

    def __init__(self, model: GGUFModel, cache_dir: str | Path, *, max_entries: int = 65536) -> None:
        self.model = model
        self.dir = Path(cache_dir) / model.model_id
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[int, int, int], threading.Lock] = {}
        self._sha: dict[tuple[int, int, int], str] = {}  # insertion order = recency (LRU first)
        self._dirty = False
        self.hashed = 0  # slices hashed by this process (the rest came from the index)
        index = self._load_index()
        for k, v in index.items():
            self._sha[k] = v
        # an earlier release kept a copy of every slice it served here: give that disk back
        old = sorted(self.dir.glob("*.safetensors")) if self.dir.is_dir() else []
        for f in old:
            f.unlink(missing_ok=True)
        if old:
            log.info("removed %d slice copies an earlier release left in %s (slices are served from the GGUF now)",
                     len(old), self.dir)

    @property
    def index_path(self) -> Path:
        return self.dir / "sha256.json"

    def _load_index(self) -> dict[tuple[int, int, int], str]:
        try:
            raw = msgspec.json.decode(self.index_path.read_bytes())
        except (OSError, msgspec.DecodeError):
            return {}
        if not isinstance(raw, dict) or raw.get("gguf_sha256") != self.model.sha256 or not self.model.sha256:
            return {}
        out: dict[tuple[int, int, int], str] = {}
        for key, digest in (raw.get("slices") or {}).items():
            parts = str(key).split("-")
            if (len(parts) == 3 and all(x.isdigit() and len(x) < 10 for x in parts) and isinstance(digest, str)
                    and len(digest) == 64 and len(out) < self.max_entries):
                out[(int(parts[0]), int(parts[1]), int(parts[2]))] = digest
        return out

    def save(self) -> None:
        """Write the digests to the index (atomically; a no-op when nothing changed). ``get`` calls it."""
        with self._lock:
            if not self._dirty or not self.model.sha256:
                return
            body = msgspec.json.encode({"gguf_sha256": self.model.sha256,
                                        "slices": {f"{a}-{b}-{c}": d for (a, b, c), d in self._sha.items()}})
            self._dirty = False
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".sha256.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, self.index_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def key(self, layer: int, lo: int, hi: int) -> SliceKey:
        return SliceKey(self.model.model_id, layer, lo, hi)

    def get(self, layer: int, lo: int, hi: int) -> SliceFile:
        check_slice_range(self.model.config, layer, lo, hi)
        layout = _layout(self.model, layer, lo, hi)
        k = (layer, lo, hi)
        with self._lock:
            key_lock = self._key_locks.setdefault(k, threading.Lock())
        with key_lock:
            with self._lock:
                digest = self._sha.pop(k, None)
                if digest is not None:
                    self._sha[k] = digest  # most recently used
            if digest is None:
                digest = layout.sha256()
                self.hashed += 1
                with self._lock:
                    self._sha[k] = digest
                    while len(self._sha) > self.max_entries:
                        self._sha.pop(next(iter(self._sha)))
                    self._dirty = True
                    self._key_locks.pop(k, None)
                self.save()
        return SliceFile(layout.path, layout.header, layout.spans, digest, layout.size)


# -- loading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedSlice:
    """A validated slice file; ``experts`` satisfies ``swarm.model.experts.ExpertWeights``."""

    key: SliceKey
    meta: SliceMeta
    experts: ExpertStack

    @property
    def nbytes(self) -> int:
        return self.experts.nbytes


def _parse_header(head: bytes, total: int) -> tuple[dict[str, Any], SliceMeta]:
    """Validate a slice file's safetensors header (``head`` = its first bytes, ``total`` = file size)."""
    if total < 8 or len(head) < 8:
        raise SliceError(f"not a slice file: {total} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > _MAX_HEADER or 8 + n > total or 8 + n > len(head):
        raise SliceError(f"not a slice file: safetensors header length {n} does not fit a {total}-byte file")
    try:
        header = json.loads(head[8 : 8 + n])
    except (UnicodeDecodeError, ValueError) as exc:
        raise SliceError(f"not a slice file: the safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SliceError("not a slice file: the safetensors header is not a JSON object")
    extra = header.get("__metadata__")
    if not isinstance(extra, dict) or not isinstance(extra.get(METADATA_KEY), str):
        raise SliceError(f"not a slice file: __metadata__[{METADATA_KEY!r}] is missing")
    try:
        meta = _meta_decoder.decode(extra[METADATA_KEY])
    except msgspec.DecodeError as exc:
        raise SliceError(f"bad slice metadata: {exc}") from exc
    if meta.format not in (SLICE_FORMAT, SLICE_FORMAT_ACTIVATION):
        raise SliceError(f"slice format {meta.format} is not supported (this version reads "
                         f"{SLICE_FORMAT} and {SLICE_FORMAT_ACTIVATION})")
    act = meta.activation if isinstance(meta.activation, str) else DEFAULT_ACTIVATION
    if (meta.format == SLICE_FORMAT_ACTIVATION) != isinstance(meta.activation, str):
        raise SliceError(f"bad slice metadata: format {meta.format} with activation {meta.activation!r}")
    check_activation(act)
    if meta.lo >= meta.hi:
        raise SliceError(f"bad slice metadata: empty expert range {meta.lo}-{meta.hi}")
    kinds = slice_kinds(meta.tensors)
    if kinds is None or set(header) != {"__metadata__", *kinds}:
        raise SliceError(f"a slice holds exactly the tensors {', '.join(EXPERT_KINDS)} (and their biases "
                         f"{', '.join(BIAS_KINDS)}); metadata lists {sorted(meta.tensors)}, the file "
                         f"{sorted(k for k in header if k[:2] != '__')}")
    n_exp = meta.hi - meta.lo
    want = {"gate": (n_exp, meta.d_expert, meta.d_model), "up": (n_exp, meta.d_expert, meta.d_model),
            "down": (n_exp, meta.d_model, meta.d_expert), "gate_b": (n_exp, meta.d_expert),
            "up_b": (n_exp, meta.d_expert), "down_b": (n_exp, meta.d_model)}
    end = 0
    for kind in kinds:
        info = meta.tensors[kind]
        if kind in BIAS_KINDS and info.type != "F32":
            raise SliceError(f"tensor {kind}: expert biases are F32, not {info.type}")
        if info.type not in SUPPORTED_TYPES:
            raise SliceError(f"tensor {kind}: type {info.type!r} is not supported ({', '.join(SUPPORTED_TYPES)})")
        if info.shape != want[kind]:
            raise SliceError(f"tensor {kind}: logical shape {list(info.shape)} in the metadata should be "
                             f"{list(want[kind])} for experts {meta.lo}-{meta.hi}, d_model {meta.d_model}, "
                             f"d_expert {meta.d_expert}")
        qtype = gguf.GGMLQuantizationType[info.type]
        byte_shape = [*info.shape[:-1], _bytes_per_row(qtype, info.shape[-1])]
        entry = header[kind]
        if not isinstance(entry, dict) or entry.get("dtype") != "U8" or entry.get("shape") != byte_shape:
            got = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else entry
            raise SliceError(f"tensor {kind}: stored as {got}, but a {info.type} tensor of logical shape "
                             f"{list(info.shape)} must be U8 {byte_shape}")
        nbytes = math.prod(byte_shape)
        if entry.get("data_offsets") != [end, end + nbytes]:
            raise SliceError(f"tensor {kind}: data_offsets {entry.get('data_offsets')} should be "
                             f"{[end, end + nbytes]}")
        end += nbytes
    if 8 + n + end != total:
        raise SliceError(f"slice file is {total} bytes, its header describes {8 + n + end}: truncated or padded")
    return header, meta


@dataclass(frozen=True)
class SliceFileSpans:
    """Where a slice file keeps each kind's data: ``start[kind]`` (absolute offset in the file of the
    kind's first expert) and ``kind_bytes[kind]`` (bytes of one expert)."""

    key: SliceKey
    start: dict[str, int]
    kind_bytes: dict[str, int]


def _read_head(path: Path) -> tuple[bytes, int]:
    """A slice file's first bytes (room for the largest header we accept) and its size."""
    try:
        total = path.stat().st_size
        with open(path, "rb") as f:
            return f.read(8 + _MAX_HEADER), total
    except OSError as exc:
        raise SliceError(f"cannot read slice file {path}: {exc}") from exc


def slice_file_spans(path: str | Path) -> SliceFileSpans:
    """Read and validate a slice file's header only (``SliceError`` for anything wrong)."""
    head, total = _read_head(Path(path))
    header, meta = _parse_header(head, total)
    (n,) = struct.unpack("<Q", head[:8])
    n_exp = meta.hi - meta.lo
    kinds = slice_kinds(meta.tensors) or EXPERT_KINDS
    start = {k: 8 + n + int(header[k]["data_offsets"][0]) for k in kinds}
    per = {k: (int(header[k]["data_offsets"][1]) - int(header[k]["data_offsets"][0])) // n_exp for k in kinds}
    return SliceFileSpans(meta.key, start, per)


def load_slice(source: str | Path | bytes | bytearray | memoryview) -> LoadedSlice:
    """Validate and load a slice file (a path: memory-mapped, zero-copy) or its bytes."""
    try:
        if isinstance(source, bytes | bytearray | memoryview):
            data = bytes(source)
            _, meta = _parse_header(data, len(data))
            tensors = safetensors.torch.load(data)
        else:
            path = Path(source)
            head, total = _read_head(path)
            _, meta = _parse_header(head, total)
            # framework="pt" maps the file (copy-on-write) and hands out views of the map
            with safetensors.safe_open(str(path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except safetensors.SafetensorError as exc:
        raise SliceError(f"not a valid safetensors file: {exc}") from exc
    parts = {}
    for kind in slice_kinds(meta.tensors) or EXPERT_KINDS:
        info = meta.tensors[kind]
        raw = tensors[kind].numpy()
        name = (f"blk.{meta.layer}.ffn_{kind[:-2]}_exps.bias" if kind in BIAS_KINDS
                else f"blk.{meta.layer}.ffn_{kind}_exps.weight")
        parts[kind] = QTensor(name, gguf.GGMLQuantizationType[info.type], tuple(info.shape), raw)
    biases = (parts["gate_b"], parts["up_b"], parts["down_b"]) if "gate_b" in parts else None
    act = meta.activation if isinstance(meta.activation, str) else DEFAULT_ACTIVATION
    return LoadedSlice(meta.key, meta, ExpertStack(parts["gate"], parts["up"], parts["down"], biases=biases,
                                                   activation=act))


# -- manifest ---------------------------------------------------------------------------------


class _ExpertFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``build_manifest`` caches per GGUF (keyed by its sha256): the costly per-expert hashes."""

    gguf_sha256: str
    kind_bytes: list[dict[str, int]]
    tensor_offsets: list[dict[str, int]]
    expert_sha256: list[list[str]]
    version: int = 1


_facts_decoder = msgspec.json.Decoder(_ExpertFacts)


def expert_digests(model: GGUFModel, layer: int) -> list[str]:
    """Per expert of ``layer``: the sha256 hex of its raw ``gate || up || down`` bytes, read from the
    GGUF with ``pread`` in bounded pieces (never through the memory map; dropped from the page cache
    as they are hashed, so hashing a 17 GB model leaves the coordinator's RSS and page cache where
    they were). Each kind's stacked tensor is read once, front to back."""
    stack = model.expert_stack(layer)
    n = stack.n_expert
    hashes = [hashlib.sha256() for _ in range(n)]
    for t in stack.tensors().values():
        offset, length = model.file_span(t.raw)
        per = length // n
        pos = 0
        for block in pread_chunks(model.path, [(offset, length)], piece=4 << 20):
            view = memoryview(block)
            at = 0
            while at < len(view):
                e = pos // per
                take = min(len(view) - at, (e + 1) * per - pos)
                hashes[e].update(view[at : at + take])
                at += take
                pos += take
    return [h.hexdigest() for h in hashes]


def _expert_facts(model: GGUFModel) -> _ExpertFacts:
    kind_bytes: list[dict[str, int]] = []
    offsets: list[dict[str, int]] = []
    digests: list[list[str]] = []
    for layer in range(model.config.n_moe_layer):
        stack = model.expert_stack(layer)
        kinds = stack.tensors()
        kind_bytes.append({k: t.nbytes // stack.n_expert for k, t in kinds.items()})
        offsets.append({k: model.file_span(t.raw)[0] for k, t in kinds.items()})
        digests.append(expert_digests(model, layer))
    return _ExpertFacts(model.sha256, kind_bytes, offsets, digests)


def _cached_facts(model: GGUFModel, cache_dir: Path | None) -> _ExpertFacts:
    """``_expert_facts``, from ``cache_dir/<gguf sha256>.experts.json`` when an earlier run left it
    (a restart is free); written atomically after computing. A file that does not fit the model is
    computed again."""
    cfg = model.config
    path = cache_dir / f"{model.sha256}.experts.json" if cache_dir is not None and model.sha256 else None
    if path is not None and path.is_file():
        try:
            facts = _facts_decoder.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("ignoring the expert hash cache %s: %s", path, exc)
        else:
            if (facts.gguf_sha256 == model.sha256 and len(facts.expert_sha256) == cfg.n_moe_layer
                    and all(len(row) == cfg.n_expert for row in facts.expert_sha256)):
                return facts
            log.warning("the expert hash cache %s does not fit the model; computing it again", path)
    facts = _expert_facts(model)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(facts))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return facts


def build_manifest(model: GGUFModel, *, origins: Iterable[str] = (), cache_dir: str | Path | None = None) -> ModelManifest:
    """The model's manifest (``swarm.protocol.manifest``), with the per-expert hashes and file offsets a
    download from peers and mirrors needs. Hashing every expert reads the experts once (about 10-20 s
    for a 17 GB model): with ``cache_dir`` the result is kept there, keyed by the GGUF's sha256.
    Blocking: call it from a worker thread in a service. ``origins``: mirror URLs of the GGUF file."""
    cfg = model.config
    types: list[dict[str, str]] = []
    per_expert: list[int] = []
    for layer in range(cfg.n_moe_layer):
        stack = model.expert_stack(layer)
        types.append({k: t.qtype.name for k, t in stack.tensors().items()})
        per_expert.append(stack.nbytes // stack.n_expert)
    facts = _cached_facts(model, Path(cache_dir) if cache_dir is not None else None)
    manifest = ModelManifest(
        model_id=model.model_id,
        arch=cfg.arch,
        n_layer=cfg.n_moe_layer,
        n_expert=cfg.n_expert,
        n_expert_used=cfg.n_expert_used,
        d_model=cfg.d_model,
        d_expert=cfg.d_expert,
        tensor_types=types,
        bytes_per_expert=per_expert,
        gguf_sha256=model.sha256,
        kind_bytes=facts.kind_bytes,
        tensor_offsets=facts.tensor_offsets,
        expert_sha256=facts.expert_sha256,
        origins=list(dict.fromkeys(origins)),
        expert_activation=cfg.spec.expert_activation,
    )
    # the invariant a download from peers and mirrors rests on: the manifest alone rebuilds the header
    # cut_slice writes (a model whose expert tensors disagree with its metadata would break it)
    for layer in range(cfg.n_moe_layer):
        try:
            same = plan_slice(manifest, layer, 0, 1).header == _layout(model, layer, 0, 1).header
        except SliceError:
            same = False
        if not same:
            log.warning("%s: layer %d's slice header cannot be rebuilt from the manifest; volunteers will "
                        "download from coordinators only", model.model_id, layer)
            return msgspec.structs.replace(manifest, kind_bytes=[], tensor_offsets=[], expert_sha256=[], origins=[])
    return manifest


# -- a slice file from a manifest alone ----------------------------------------------------------


@dataclass(frozen=True)
class SlicePlan:
    """The canonical file of slice ``key`` as its manifest describes it: ``header``, then the gate,
    up and down bytes of experts ``lo .. hi-1``, ``kind_bytes[kind]`` bytes an expert. Where each
    expert lies in the file (``file_offset``) and in the model's GGUF (``gguf_offset``; None when the
    manifest has no ``tensor_offsets``), and the sha256 of each expert's ``gate || up || down``
    (``expert_sha256``, empty when the manifest predates them)."""

    key: SliceKey
    header: bytes
    kind_bytes: dict[str, int]
    expert_sha256: tuple[str, ...]
    gguf_offsets: dict[str, int] | None

    @property
    def lo(self) -> int:
        return self.key.lo

    @property
    def hi(self) -> int:
        return self.key.hi

    @property
    def kinds(self) -> tuple[str, ...]:
        """The slice's tensor kinds in storage order (the weights, then their biases if any)."""
        return slice_kinds(self.kind_bytes) or EXPERT_KINDS

    @property
    def bytes_per_expert(self) -> int:
        return sum(self.kind_bytes.values())

    @property
    def size(self) -> int:
        return len(self.header) + self.key.n_expert * self.bytes_per_expert

    def kind_start(self, kind: str) -> int:
        """Where ``kind``'s tensor data begins in the slice file."""
        at = len(self.header)
        for k in self.kinds:
            if k == kind:
                return at
            at += self.key.n_expert * self.kind_bytes[k]
        raise SliceError(f"no expert tensor kind {kind!r}")

    def file_offset(self, kind: str, e: int) -> int:
        """Offset in the slice file of expert ``e``'s (absolute index) ``kind`` bytes."""
        return self.kind_start(kind) + (e - self.key.lo) * self.kind_bytes[kind]

    def gguf_offset(self, kind: str, e: int) -> int | None:
        """Offset in the model's GGUF file of expert ``e``'s ``kind`` bytes (None: not in the manifest)."""
        if self.gguf_offsets is None:
            return None
        return self.gguf_offsets[kind] + e * self.kind_bytes[kind]

    def groups(self, max_bytes: int) -> list[tuple[int, int]]:
        """Runs of consecutive experts ``[e_lo, e_hi)`` of at most ``max_bytes`` (all kinds together), at
        least one expert each, covering the slice in order."""
        per = max(1, max_bytes // self.bytes_per_expert)
        return [(e, min(e + per, self.key.hi)) for e in range(self.key.lo, self.key.hi, per)]


def plan_slice(manifest: ModelManifest, layer: int, lo: int, hi: int) -> SlicePlan:
    """The plan of slice ``(manifest.model_id, layer, lo, hi)`` from the manifest alone; its header is
    byte-identical to the one ``cut_slice`` writes. ``SliceError`` for a slice outside the model
    (``bad_slice_range``) or a manifest that contradicts itself (``bad_manifest``)."""
    _check_range(manifest.n_layer, manifest.n_expert, layer, lo, hi)
    problems = manifest.problems()
    if problems:
        raise SliceError(f"manifest of {manifest.model_id}: {'; '.join(problems)}", code="bad_manifest")
    kinds = slice_kinds(manifest.tensor_types[layer]) if len(manifest.tensor_types) == manifest.n_layer else None
    if kinds is None:
        raise SliceError(f"manifest of {manifest.model_id} lists no tensor types for layer {layer}", code="bad_manifest")
    n, d, f = hi - lo, manifest.d_model, manifest.d_expert
    shapes = {"gate": (n, f, d), "up": (n, f, d), "down": (n, d, f), "gate_b": (n, f), "up_b": (n, f), "down_b": (n, d)}
    types = manifest.tensor_types[layer]
    meta = SliceMeta(model_id=manifest.model_id, arch=manifest.arch, layer=layer, lo=lo, hi=hi, d_model=d, d_expert=f,
                     tensors={k: TensorInfo(types[k], shapes[k]) for k in kinds},
                     **_activation_fields(manifest.expert_activation))
    kind_bytes = {k: math.prod(_byte_shape(meta.tensors[k])) // n for k in kinds}
    if manifest.kind_bytes and manifest.kind_bytes[layer] != kind_bytes:
        raise SliceError(f"manifest of {manifest.model_id}: layer {layer}'s kind_bytes {manifest.kind_bytes[layer]} "
                         f"contradict its tensor types and dimensions ({kind_bytes})", code="bad_manifest")
    if sum(kind_bytes.values()) != manifest.bytes_per_expert[layer]:
        raise SliceError(f"manifest of {manifest.model_id}: layer {layer}'s bytes_per_expert "
                         f"{manifest.bytes_per_expert[layer]} contradict its tensor types ({kind_bytes})",
                         code="bad_manifest")
    digests = tuple(manifest.expert_sha256[layer][lo:hi]) if manifest.expert_sha256 else ()
    offsets = dict(manifest.tensor_offsets[layer]) if manifest.tensor_offsets else None
    if offsets is not None and set(offsets) != set(kinds):
        raise SliceError(f"manifest of {manifest.model_id}: layer {layer}'s tensor_offsets name {sorted(offsets)}, "
                         f"its tensor types {sorted(kinds)}", code="bad_manifest")
    return SlicePlan(SliceKey(manifest.model_id, layer, lo, hi), slice_header(meta), kind_bytes, digests, offsets)
