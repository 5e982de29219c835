"""The package's rooms and the one-way imports between them (``docs/concepts.md``, "Layers").

Every ``import`` in ``ledger/`` counts: module level, inside functions and under
``TYPE_CHECKING``, because a lazy import is still a dependency. A room may import itself and the
rooms listed for it; nothing else. Adding an arrow means changing :data:`MAY_IMPORT` here and the
drawing in the docs, on purpose.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.astparse import parse_file

PKG = Path(__file__).resolve().parents[1] / "ledger"

# Module prefix -> room. The longest matching prefix wins.
ROOMS: dict[str, str] = {
    "ledger.errors": "base",
    "ledger.redaction": "base",
    "ledger.faults": "base",
    "ledger.clock": "base",
    "ledger.readiness": "base",
    "ledger.forking": "base",
    "ledger.domain": "domain",
    "ledger.policy": "policy",
    "ledger.decide": "decide",
    "ledger.storage": "storage",
    "ledger.adapters": "adapters",
    "ledger.api": "api",
    "ledger.telemetry": "api",
    "ledger.ops": "ops",
    "ledger.integrations": "integrations",
    "ledger.dashboard": "dashboard",
    "ledger.testing": "testing",
    "ledger.cli": "cli",
    "ledger.tools": "tools",
    "ledger.__main__": "cli",
}

_LIBRARY = ("base", "domain", "policy", "decide", "storage", "adapters", "api", "ops")

# Room -> the other rooms it may import. Arrows point from the user to the thing used.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "domain": frozenset({"base"}),
    "policy": frozenset({"base", "domain"}),
    "decide": frozenset({"base", "domain", "policy"}),
    # The store applies the pure settle rules to rows as locked (ledger.decide.settle), so the
    # same function decides a hold inside and outside the transaction.
    "storage": frozenset({"base", "domain", "policy", "decide"}),
    "adapters": frozenset({"base", "domain", "policy", "decide"}),
    "api": frozenset({"base", "domain", "policy", "decide", "storage", "adapters"}),
    "ops": frozenset({"base", "domain", "policy", "decide", "storage", "api"}),
    "integrations": frozenset({"base", "domain", "policy", "decide", "adapters", "api"}),
    "dashboard": frozenset({"base", "domain", "policy", "api", "ops"}),
    "testing": frozenset({"base", "domain", "policy", "decide", "storage", "adapters"}),
    # The demo and generate, which run Runs through the library (the demo on the fake provider).
    "tools": frozenset(_LIBRARY) | {"testing"},
    "cli": frozenset(_LIBRARY) | {"tools", "dashboard", "testing"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    best = max((p for p in ROOMS if module == p or module.startswith(p + ".")), key=len,
               default=None)
    return ROOMS[best] if best else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every ledger module ``path`` imports, with the line; ``from ledger import x`` names the
    submodule ``ledger.x`` (or the root itself for a name defined there)."""
    tree = parse_file(path)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("ledger")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ledger":
                # The root's own ``__version__`` is the one name it defines; it imports nothing.
                found += [(node.lineno, f"ledger.{a.name}") for a in node.names
                          if a.name != "__version__"]
            elif node.module.startswith("ledger."):
                found.append((node.lineno, node.module))
    return found


def _edges() -> list[tuple[str, int, str, str, str]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        src = _module_name(path)
        if src == "ledger":
            continue  # the lazy root serves the public names of every room
        src_room = room_of(src)
        assert src_room is not None, f"{src} belongs to no room: add it to ROOMS"
        for line, target in _imports(path):
            out.append((src, line, target, src_room, room_of(target) or "root"))
    return out


def test_every_module_belongs_to_a_room() -> None:
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        assert name == "ledger" or room_of(name) is not None, name


def violations(edges: list[tuple[str, int, str, str, str]]) -> list[str]:
    return [f"{src}:{line} imports {target} ({src_room} -> {dst_room})"
            for src, line, target, src_room, dst_room in edges
            if dst_room != src_room and dst_room not in MAY_IMPORT[src_room]]


def test_imports_between_rooms_go_one_way() -> None:
    wrong = violations(_edges())
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_an_upward_import_is_reported() -> None:
    # The check itself: the pure core reaching for the store, or the domain for a policy.
    edges = [("ledger.decide.select", 1, "ledger.storage.store", "decide", "storage"),
             ("ledger.domain.values", 2, "ledger.policy.model", "domain", "policy"),
             ("ledger.api.facade", 3, "ledger", "api", "root")]
    assert len(violations(edges)) == 3
    assert room_of("ledger.storage.hot") == "storage" and room_of("ledger.stor") is None


def test_the_allowed_arrows_form_no_cycle() -> None:
    # A cycle among rooms would let two rooms depend on each other through a third.
    state: dict[str, int] = {}

    def visit(room: str, path: tuple[str, ...]) -> None:
        assert state.get(room) != 1, f"cycle: {' -> '.join((*path, room))}"
        if state.get(room) == 2:
            return
        state[room] = 1
        for nxt in MAY_IMPORT[room]:
            visit(nxt, (*path, room))
        state[room] = 2

    for room in MAY_IMPORT:
        visit(room, ())


def test_nothing_in_the_library_reaches_the_tools_or_the_command_line() -> None:
    for src, line, target, src_room, dst_room in _edges():
        if src_room in _LIBRARY:
            assert dst_room not in ("tools", "cli", "dashboard", "testing"), (src, line, target)


def test_nothing_in_the_package_imports_the_benchmarks() -> None:
    # benchmarks/ lives beside the package and is not in the wheel: an import of it from
    # ledger/ would work in a checkout and fail in every installation.
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(parse_file(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.relative_to(PKG.parent)}:{node.lineno} imports {n}"
                      for n in names if n == "benchmarks" or n.startswith("benchmarks.")]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", ["ledger.decide.select", "ledger.decide.classify",
                                    "ledger.decide.settle", "ledger.policy.load",
                                    "ledger.domain.envelope"])
def test_the_pure_core_imports_without_the_storage_or_http_stack(module: str) -> None:
    code = (f"import {module}, sys, json\n"
            "print(json.dumps(sorted(m for m in ('sqlalchemy', 'alembic', 'psycopg', 'sqlite3',"
            " 'httpx', 'ledger.storage', 'ledger.adapters', 'ledger.api')"
            " if m in sys.modules)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PKG.parent, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"{module} loads {res.stdout.strip()}"


def _module_graph() -> dict[str, set[str]]:
    """Module -> the ledger modules it imports, ``from pkg import mod`` read as the submodule.

    The lazy root is left out: it names every public class without importing any of them, and
    ``__version__`` is the one name it defines.
    """
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == "ledger":
            continue
        targets: set[str] = set()
        for node in ast.walk(parse_file(path)):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = targets - {name, "ledger"}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_two_modules_import_each_other_even_through_others() -> None:
    # Every import counts, lazy and TYPE_CHECKING ones too: a circle hidden in a function is
    # still two modules that cannot be read, typed or moved apart.
    cycles = import_cycles(_module_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_an_import_circle_through_a_third_module_is_reported() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
