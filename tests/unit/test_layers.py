"""The import layers (DESIGN §1 and "Code layout" in docs/architecture.md), checked over every module's imports.

Rules, each a test below (the checker itself is tested on a planted tree of each violation):
1. No module of ``swarm`` imports a role (``coordinator``, ``market``, ``volunteer``, ``relay``), the
   application layer (``swarm/cli.py``, ``swarm/demo.py``, ``swarm/tools/``) included: ``swarm.cli``
   finds the roles' commands through entry points (``moe_swarm.roles``), by name, at run time.
2. A role never imports another role: roles meet only in ``swarm`` (``swarm.protocol`` for the
   contracts between processes).
3. A ``core/`` module is pure: everything it imports, directly or through project modules, is on an
   allow-list of pure foreign modules (``PURE``: no I/O, no clock, no torch, no global randomness). A
   new dependency is refused until someone decides it is pure -- a deny-list misses what it never named.
4. Torch stays where it is needed, transitively: only ``TORCH_ALLOWED`` (the model and the expert RPC
   layers, the application layer, the coordinator and volunteer roles) may import it; every other
   module is checked -- the foundations, ``swarm.core``, ``swarm.protocol``, ``swarm.p2p``,
   ``swarm.text``, the market and the relay, and any module added later.
5. No import cycle between modules (function-local imports count: they only hide a cycle).

``sim`` (``moe-swarm simulate``) is checked too: it is no role, so it may import the roles' cores, and it is
outside ``TORCH_ALLOWED``, so it stays torch-free.

Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first: rules 3 and 4 follow those
parent-package imports too (rule 5 does not: a package importing its own submodules is no cycle).
Imports under ``if TYPE_CHECKING:`` are ignored (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("coordinator", "market", "volunteer", "relay", "gateway")
# ``sim`` (the simulator) is application layer like ``swarm/cli.py``: it drives the roles' cores, no role imports it
PACKAGES = ("swarm", *ROLES, "sim")
# foreign modules a core may use: the standard library's pure parts and msgspec (typed data)
PURE = frozenset({
    "__future__", "abc", "bisect", "collections", "copy", "dataclasses", "enum", "fractions", "functools", "hashlib",
    "heapq", "ipaddress", "itertools", "math", "msgspec", "numbers", "operator", "re", "statistics", "string", "struct",
    "types", "typing",
})
# the only modules that may import torch, directly or not (prefixes)
TORCH_ALLOWED = ("swarm.model", "swarm.rpc", "swarm.demo", "swarm.tools", "coordinator", "volunteer")


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    project: dict[str, set[str]] = field(default_factory=dict)  # module -> project modules it imports
    external: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level foreign packages
    parents: dict[str, set[str]] = field(default_factory=dict)  # module -> packages whose __init__ run first

    def resolve(self, name: str) -> str | None:
        """The project module ``name`` refers to: itself, or its nearest enclosing project module."""
        while name:
            if name in self.modules:
                return name
            name = name.rpartition(".")[0]
        return None

    def closure(self, start: str) -> dict[str, list[str]]:
        """Every project module that runs when ``start`` is imported -- what it imports and the parent
        packages of each (their ``__init__``) -- each with one import chain leading to it."""
        chains = {start: [start]}
        todo = [start]
        while todo:
            m = todo.pop()
            for dep in sorted(self.project[m] | self.parents[m]):
                if dep not in chains:
                    chains[dep] = [*chains[m], dep]
                    todo.append(dep)
        return chains


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST, module: str, is_pkg: bool) -> Iterable[str]:
    """Dotted names imported at run time."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_pkg else 0)
                base = ".".join([*parts[:keep], *([base] if base else [])])
            # ``from a import b``: the module ``a.b`` if there is one, else ``a`` (``Graph.resolve``)
            yield from (f"{base}.{a.name}" if a.name != "*" else base for a in node.names)
        stack.extend(ast.iter_child_nodes(node))


def build_graph(root: Path, packages: Iterable[str] = PACKAGES) -> Graph:
    g = Graph()
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            g.modules[".".join(parts)] = path
    for name, path in g.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        project: set[str] = set()
        external: set[str] = set()
        for imported in _runtime_imports(tree, name, path.name == "__init__.py"):
            target = g.resolve(imported)
            if target is not None:
                if target != name:
                    project.add(target)
            elif imported.split(".")[0] not in packages:
                external.add(imported.split(".")[0])
        g.project[name], g.external[name] = project, external
        parts = name.split(".")
        g.parents[name] = {p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in g.modules}
    return g


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _role(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in ROLES else None


def library_importing_roles(g: Graph) -> list[str]:
    return [f"{m} imports {d}" for m in g.modules if _within(m, ["swarm"])
            for d in sorted(g.project[m]) if _role(d)]


def roles_importing_roles(g: Graph) -> list[str]:
    return [f"{m} imports {d}" for m in g.modules if _role(m)
            for d in sorted(g.project[m]) if _role(d) not in (None, _role(m))]


def impure_cores(g: Graph) -> list[str]:
    out = []
    for m in sorted(g.modules):
        if "core" not in m.split(".")[1:]:
            continue
        for dep, chain in sorted(g.closure(m).items()):
            for ext in sorted(g.external[dep] - PURE):
                out.append(f"{' -> '.join(chain)} imports {ext}")
    return out


def torch_in_torch_free_layers(g: Graph) -> list[str]:
    out = []
    for m in sorted(g.modules):
        if _within(m, TORCH_ALLOWED):
            continue
        for dep, chain in sorted(g.closure(m).items()):
            if "torch" in g.external[dep]:
                out.append(f"{' -> '.join(chain)} imports torch")
    return out


def cycles(g: Graph) -> list[str]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(g.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(g.project[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, deps = work[-1]
            advanced = False
            for dep in deps:
                if dep not in index:
                    index[dep] = low[dep] = counter
                    counter += 1
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(g.project[dep]))))
                    advanced = True
                    break
                if dep in on_stack:
                    low[node] = min(low[node], index[dep])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return [" <-> ".join(c) for c in sorted(found)]


RULES = {
    "library imports a role": library_importing_roles,
    "role imports another role": roles_importing_roles,
    "impure core": impure_cores,
    "torch in a torch-free layer": torch_in_torch_free_layers,
    "import cycle": cycles,
}


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(ROOT)


def test_the_graph_sees_the_project(graph: Graph) -> None:
    assert {"swarm.protocol.expert", "swarm.p2p.nat.service", "market.core.assign", "coordinator.cli"} <= set(graph.modules)
    assert "swarm.protocol.expert" in graph.project["swarm.rpc.client"]
    assert "torch" in graph.external["swarm.rpc.tensors"]
    assert any(".core." in m for m in graph.modules)
    assert graph.parents["market.core.assign"] == {"market", "market.core"}
    assert "swarm.p2p.nat" in graph.closure("swarm.p2p.nat.addrs")  # a parent package's __init__ runs first
    # the torch rule covers every module outside the allowed layers, not a named few
    checked = [m for m in graph.modules if not _within(m, TORCH_ALLOWED)]
    assert {"swarm.errors", "swarm.safe_paths", "swarm.p2p.memory", "relay.hop", "market.api", "swarm.text.chat"} <= set(checked)


@pytest.mark.parametrize("rule", RULES)
def test_layer_rule(graph: Graph, rule: str) -> None:
    found = RULES[rule](graph)
    assert not found, f"{rule}:\n  " + "\n  ".join(found)


# -- the checker catches each violation (a planted tree) ---------------------------------------------

PLANTED = {
    "swarm/__init__.py": "",
    "swarm/errors.py": "",
    "swarm/protocol/__init__.py": "",
    "swarm/protocol/wire.py": "from swarm.model import tensors\n",
    "swarm/model/__init__.py": "",
    "swarm/model/tensors.py": "import torch\n",
    "swarm/lib.py": "def f():\n    from market import api\n",
    "swarm/cli.py": "import market.api\nimport coordinator.cli\n",
    "swarm/core/__init__.py": "",
    "swarm/core/machine.py": "from swarm import helper\n",
    "swarm/helper.py": "import time\n",
    "swarm/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import market.api\n",
    "market/__init__.py": "",
    "market/api.py": "from coordinator import cli\n",
    "coordinator/__init__.py": "",
    "coordinator/cli.py": "from coordinator import a\n",
    "coordinator/a.py": "def g():\n    import coordinator.b\n",
    "coordinator/b.py": "from coordinator.a import g\n",
    "volunteer/__init__.py": "",
    "relay/__init__.py": "",
    # seen only through a parent package's __init__, and a foreign module no deny-list would name
    "market/core/__init__.py": "",
    "market/core/pkg/__init__.py": "import socket\n",
    "market/core/pkg/leaf.py": "",
    "market/core/odd.py": "import yaml\n",
    # torch outside the allowed layers, through a parent package; inside them it is fine
    "relay/sub/__init__.py": "from swarm.model import tensors\n",
    "relay/sub/leaf.py": "",
    "swarm/model/uses_torch.py": "import torch\n",
}


def test_the_checker_reports_every_planted_violation(tmp_path: Path) -> None:
    for rel, text in PLANTED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = build_graph(tmp_path)
    # the application layer included; not under TYPE_CHECKING
    assert library_importing_roles(g) == ["swarm.cli imports coordinator.cli", "swarm.cli imports market.api",
                                          "swarm.lib imports market.api"]
    assert roles_importing_roles(g) == ["market.api imports coordinator.cli"]
    assert impure_cores(g) == [
        "market.core.odd imports yaml",
        "market.core.pkg imports socket",
        "market.core.pkg.leaf -> market.core.pkg imports socket",
        "swarm.core.machine -> swarm.helper imports time",
    ]
    assert torch_in_torch_free_layers(g) == [
        "relay.sub -> swarm.model.tensors imports torch",
        "relay.sub.leaf -> relay.sub -> swarm.model.tensors imports torch",
        "swarm.protocol.wire -> swarm.model.tensors imports torch",
    ]
    assert cycles(g) == ["coordinator.a <-> coordinator.b"]
