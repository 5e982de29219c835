"""The storage port holds: both implementations are the port, member for member, and nothing
outside ``ledger/storage`` is typed against anything but the port.

A method added to one implementation and used by the facade, or a signature changed on one
side only, fails here (and in mypy, since the implementations subclass the port explicitly).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.api.facade import AsyncLedger, Ledger, storage_of
from ledger.errors import InvalidArgument
from ledger.storage import open_store
from ledger.storage.port import StoragePort
from ledger.storage.postgres import PostgresStore
from ledger.storage.sqlite import SqliteStore
from ledger.storage.store import SqlStore

PKG = Path(__file__).resolve().parents[2] / "ledger"
IMPLEMENTATIONS = [SqliteStore, PostgresStore]


def _port_members() -> dict[str, Any]:
    """Every member the port declares: its methods and its annotated attributes."""
    members: dict[str, Any] = {
        name: value for name, value in vars(StoragePort).items()
        if inspect.isfunction(value) and not name.startswith("_")}
    members.update({name: "attribute" for name in StoragePort.__annotations__})
    return members


def test_the_port_declares_what_the_facade_ops_and_tools_use() -> None:
    members = _port_members()
    # A sample of each family, so that an emptied Protocol cannot pass the checks below.
    for name in ("begin_attempt", "settle_attempt", "turn_snapshot", "acquire_lease", "admit",
                 "take_over", "reconcile_figures", "audit_timeline", "metrics_totals",
                 "first_run_other_than", "backend", "lease_margin_s", "runner"):
        assert name in members, name
    for name, value in members.items():
        if value != "attribute":
            assert inspect.getdoc(value), f"StoragePort.{name} has no docstring"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_port_member_exists_on_each_implementation_with_the_same_signature(
        impl: type[SqlStore]) -> None:
    for name, declared in _port_members().items():
        if declared == "attribute":
            continue  # an instance's: checked on open stores below
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        got = getattr(impl, name)
        assert got is not declared, f"{impl.__name__}.{name} is the port's empty body"
        assert inspect.signature(got) == inspect.signature(declared), (
            f"{impl.__name__}.{name}{inspect.signature(got)} differs from the port's "
            f"{inspect.signature(declared)}")
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(declared), name


@pytest.fixture
def store(db_url: str) -> Iterator[StoragePort]:
    port = open_store(db_url)
    try:
        yield port
    finally:
        port.close()


def test_the_factory_opens_the_implementation_of_the_url(store: StoragePort,
                                                          db_url: str) -> None:
    assert isinstance(store, StoragePort)  # runtime_checkable: every member is present
    for name in _port_members():
        assert hasattr(store, name), name
    expected = SqliteStore if "://" not in db_url else PostgresStore
    assert type(store) is expected
    assert store.backend == ("sqlite" if expected is SqliteStore else "postgresql")
    assert store.schema_present()
    assert "secret" not in store.where


def test_a_ledger_has_no_public_store_and_reaches_its_port_deliberately(db_url: str) -> None:
    with Ledger.open(db_url, lease_margin_s=0.25) as led:
        assert not hasattr(led, "store")
        port = storage_of(led)
        assert isinstance(port, StoragePort)
        assert storage_of(AsyncLedger(led)) is port
        assert led.lease_margin_s == AsyncLedger(led).lease_margin_s == 0.25
        assert led.backend == port.backend
    with pytest.raises(InvalidArgument, match="ledger"):
        storage_of("ledger.db")  # type: ignore[arg-type]


def _imports_of(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from module import name`` and ``import module``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names]
    return out


# What only storage may name: its implementations, and the engine and connection they own.
_CONCRETE_MODULES = ("ledger.storage.store", "ledger.storage.sqlite", "ledger.storage.postgres",
                     "ledger.storage.driver", "ledger.storage.hot", "ledger.storage.recovery",
                     "ledger.storage.audit", "ledger.storage.series",
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
    assert not wrong, "typed against more than the storage port:\n" + "\n".join(wrong)


def _string_comparisons(path: Path) -> list[int]:
    """Lines comparing something with the literal name of a backend."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in ("sqlite", "postgresql"):
                    lines.append(node.lineno)
    return lines


def test_no_storage_code_asks_which_database_it_runs_on() -> None:
    # Differences are the implementations' (a subclass, a class attribute, the driver they
    # own); the one choice is open_store's, by URL.
    found = {p.name: _string_comparisons(p) for p in sorted((PKG / "storage").glob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines} == {}
    for path in (PKG / "storage").glob("*.py"):
        assert not re.search(r"\.dialect\b", path.read_text()), path.name
