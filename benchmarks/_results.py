"""The one way a benchmark writes its DESIGN §11 JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` (its folder created), if a path was given (``--json OUT``)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
