"""Paths under a data directory built from strings that came over the network (shell: resolves
paths on the local filesystem, creates nothing).

A model id, a slice or a file name a market, a coordinator or a peer sent is never trusted as a path.

Rules:
- A name is one plain path component: 1 to 200 ASCII letters, digits, ``.``, ``_`` or ``-``,
  starting with a letter or a digit -- so never empty, ``.``, ``..``, absolute, a separator (``/``,
  ``\\``), an encoded one (``%2f``), a NUL, a newline or a unicode lookalike (``safe_name``). The
  wire checks ids the same way (``swarm.protocol.manifest.MODEL_ID_PATTERN``); this is the second
  gate, where the path is made.
- ``inside(root, *names)`` joins checked names under ``root`` and resolves the result (symlinks
  followed): it must stay inside ``root`` resolved, else ``UnsafePath``. Nothing is created either
  way; the caller creates directories only under a path this returned.
- ``slice_file`` is the one place a volunteer's slice file path is made:
  ``DATA_DIR/slices/<model_id>/<layer>-<lo>-<hi>.safetensors`` (non-negative ints, ``lo < hi``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from swarm.errors import UnsafePath

__all__ = ["MAX_NAME", "inside", "safe_name", "slice_file"]

MAX_NAME: Final = 200
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def safe_name(name: str, what: str = "name") -> str:
    """``name`` if it is one plain path component (the rules), else ``UnsafePath`` naming ``what``."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        shown = repr(name[:80]) + ("..." if isinstance(name, str) and len(name) > 80 else "")
        raise UnsafePath(f"{what} {shown} is not a plain file name (1-{MAX_NAME} of A-Z a-z 0-9 . _ -, "
                         f"starting with a letter or digit)")
    return name


def inside(root: str | Path, *names: str, what: str = "name") -> Path:
    """``root/names...`` resolved, checked to stay inside ``root`` (``UnsafePath`` otherwise)."""
    for n in names:
        safe_name(n, what)
    base = Path(root).resolve()
    path = base.joinpath(*names).resolve()
    if path != base and base not in path.parents:
        raise UnsafePath(f"{'/'.join(names)[:200]!r} resolves to {str(path)[:200]!r}, outside {str(base)[:200]!r}")
    return path


def slice_file(data_dir: str | Path, model_id: str, layer: int, lo: int, hi: int) -> Path:
    """Where a volunteer keeps slice ``(model_id, layer, lo, hi)``: checked (module rules)."""
    if not all(isinstance(v, int) and v >= 0 for v in (layer, lo, hi)) or lo >= hi:
        raise UnsafePath(f"slice {layer}:{lo}-{hi} is not a slice (non-negative layer, lo < hi)")
    safe_name(model_id, "model id")
    return inside(data_dir, "slices", model_id, f"{layer}-{lo}-{hi}.safetensors")
