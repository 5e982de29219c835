"""Storage keeps its shape: a narrow store of flows for the hot path, query objects for the
rest, one context per database, and nothing outside ``ledger/storage`` that names a driver, an
engine, a connection or a database's own module.

A member added to the store, or a query that forwards to another object, fails here.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.face import storage_of
from ledger.errors import InvalidArgument
from ledger.storage import open_store
from ledger.storage.audit import AuditQueries
from ledger.storage.context import SqlContext
from ledger.storage.postgres import PostgresContext
from ledger.storage.recovery import RecoveryQueries
from ledger.storage.runs import RunQueries
from ledger.storage.series import SeriesQueries
from ledger.storage.sqlite import SqliteContext
from ledger.storage.store import Store
from tests.astparse import parse_file, parse_source

PKG = Path(__file__).resolve().parents[2] / "ledger"

#: The hot path's operations: what the turn, leases, provenance and events need, and no more.
STORE_FLOWS = {
    "turn_snapshot", "begin_attempt", "leave_queue", "settle_attempt", "mark_unknown",
    "attempt", "acquire_lease", "renew_lease", "release_lease", "finish_run", "reserve_retry",
    "record_provenance", "append_event", "claim_probe", "record_compaction",
    # What the process left unresolved (ledger.decide.resolve), resolved before the Run's next
    # write, by the lease keeper and on close().
    "resolve_begin", "resolve_run", "settle_pending",
    # An admission: a Child's is a write for its parent (the parent's unresolved writes come
    # first), and one whose COMMIT's outcome stays unknown is remembered with them.
    "admit",
    # A closing ledger's waiters give up their places in capacity queues.
    "leave_queues",
}
QUERY_OBJECTS = [RunQueries, RecoveryQueries, AuditQueries, SeriesQueries]


def _public_methods(cls: type) -> dict[str, object]:
    return {name: value for name, value in vars(cls).items()
            if inspect.isfunction(value) and not name.startswith("_")}


def test_the_store_is_the_hot_paths_flows_and_nothing_else() -> None:
    methods = _public_methods(Store)
    assert set(methods) - {"close"} == STORE_FLOWS
    for name in STORE_FLOWS:
        fn = methods[name]
        assert inspect.isgeneratorfunction(fn), f"Store.{name} is not a flow"
        assert inspect.getdoc(fn), f"Store.{name} has no docstring"


@pytest.mark.parametrize("cls", QUERY_OBJECTS, ids=lambda c: c.__name__)
def test_query_objects_are_built_on_a_context_and_do_their_own_sql(cls: type) -> None:
    assert list(inspect.signature(cls).parameters) == ["ctx"]
    for name, fn in _public_methods(cls).items():
        assert inspect.getdoc(fn), f"{cls.__name__}.{name} has no docstring"
        tree = parse_source(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
        func = tree.body[0]
        assert isinstance(func, ast.FunctionDef)
        # A method that only hands its arguments to another object is a forwarding layer.
        body = [n for n in func.body
                if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert not (len(body) == 1 and isinstance(body[0], ast.Return)
                    and isinstance(body[0].value, ast.Call)
                    and isinstance(body[0].value.func, ast.Attribute)
                    and ast.unparse(body[0].value.func).startswith("self.ctx.")), (
            f"{cls.__name__}.{name} forwards to the context")


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    opened = open_store(db_url)
    try:
        yield opened
    finally:
        opened.close()


def test_the_factory_opens_the_context_of_the_url(store: Store, db_url: str) -> None:
    expected = SqliteContext if "://" not in db_url else PostgresContext
    assert type(store.context) is expected
    assert isinstance(store.context, SqlContext)
    assert store.backend == store.context.backend == (
        "sqlite" if expected is SqliteContext else "postgresql")
    assert AuditQueries(store.context).schema_present()
    assert "secret" not in store.where
    assert store.where == store.context.where


def test_a_ledger_has_no_public_store_and_reaches_it_deliberately(db_url: str) -> None:
    with Ledger.open(db_url, lease_margin_s=0.25) as led:
        assert not hasattr(led, "store")
        store = storage_of(led)
        assert isinstance(store, Store)
        assert storage_of(AsyncLedger(led)) is store
        assert led.lease_margin_s == AsyncLedger(led).lease_margin_s == 0.25
        assert store.context.lease_margin_s == 0.25
        assert led.backend == store.backend
    with pytest.raises(InvalidArgument, match="ledger"):
        storage_of("ledger.db")  # type: ignore[arg-type]


def _imports_of(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from module import name`` and ``import module``."""
    out = []
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names]
    return out


# What only storage may name: each database's context, the drivers, the statements and the
# tables, and the engine and connection they own. The store and the query objects are its face.
_CONCRETE_MODULES = ("ledger.storage.sqlite", "ledger.storage.postgres", "ledger.storage.context",
                     "ledger.storage.driver", "ledger.storage.hot",
                     "ledger.storage.migrate", "ledger.storage.schema")
_CONCRETE_NAMES = ("Engine", "Connection", "AsyncConnection", "Row")


def test_nothing_outside_storage_names_an_implementation_an_engine_or_a_connection() -> None:
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent)
        if rel.parts[1] == "storage":
            continue
        for line, module, name in _imports_of(path):
            driver = module.split(".")[0] in ("sqlalchemy", "psycopg", "sqlite3")
            if module in _CONCRETE_MODULES or (driver and name in _CONCRETE_NAMES) or (
                    module.startswith("sqlalchemy") and rel.parts[1] != "tools"):
                wrong.append(f"{rel}:{line}: {module} {name}".strip())
    assert not wrong, "reaches past storage's face:\n" + "\n".join(wrong)


def _string_comparisons(path: Path) -> list[str]:
    """The innermost functions (``<module>`` outside any) that compare something with the
    literal name of a backend, one entry per comparison."""
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = node.name
        if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Constant) and side.value in ("sqlite", "postgresql")
                for side in (node.left, *node.comparators)):
            found.append(scope)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(parse_file(path), "<module>")
    return found


def test_no_storage_code_asks_which_database_it_runs_on() -> None:
    # Differences are the contexts' (a subclass, a class attribute, the driver they open);
    # the one choice is context_class's, by URL, and it is made nowhere else.
    found = {p.name: _string_comparisons(p) for p in sorted((PKG / "storage").glob("*.py"))}
    assert {name: funcs for name, funcs in found.items() if funcs} == {
        "__init__.py": ["context_class"]}
    for path in (PKG / "storage").glob("*.py"):
        assert not re.search(r"\.dialect\b", path.read_text()), path.name
