"""Every ``<package>/core/`` module is sans-IO: it imports nothing that does I/O, reads a clock,
touches torch or uses global randomness (STYLE.md, "Pure core, thin shell")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "trio", "anyio", "asyncio", "socket", "ssl", "select", "selectors", "threading", "multiprocessing",
    "subprocess", "os", "io", "time", "datetime", "random", "secrets", "torch", "numpy", "httpx", "sqlite3",
    "libp2p", "starlette", "hypercorn", "urllib", "http", "shutil", "tempfile", "pathlib", "logging",
}
CORE_FILES = sorted(p for pkg in ("swarm", "coordinator", "volunteer", "relay", "market") for p in (ROOT / pkg / "core").glob("*.py"))


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_there_are_core_modules() -> None:
    assert any(p.name == "scheduler.py" for p in CORE_FILES)


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_is_pure(path: Path) -> None:
    bad = imported_roots(path) & FORBIDDEN
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    p = tmp_path / "x.py"
    p.write_text("import time\nfrom trio import sleep\nimport random as r\n")
    assert imported_roots(p) & FORBIDDEN == {"time", "trio", "random"}
