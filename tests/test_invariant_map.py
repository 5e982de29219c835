"""The invariant map names real tests, and every invariant is tested on both backends."""

from __future__ import annotations

import ast
import pathlib

from tests.invariants import INVARIANTS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tests_in(path: str) -> dict[str, list[str]]:
    tree = ast.parse((ROOT / path).read_text())
    return {n.name: [a.arg for a in n.args.args]
            for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and n.name.startswith("test_")}


def test_every_mapped_name_is_a_test_and_every_invariant_runs_on_a_database() -> None:
    assert sorted(INVARIANTS) == list(range(1, 10))
    for n, names in INVARIANTS.items():
        on_db = False
        for nodeid in names:
            path, _, name = nodeid.partition("::")
            tests = _tests_in(path)
            assert name in tests, f"invariant {n}: {nodeid} is not a test"
            # db_url runs a test on SQLite and PostgreSQL; other fixtures built on it (led, ...)
            # are defined per module, so read the module for them too.
            source = (ROOT / path).read_text()
            on_db = on_db or "db_url" in tests[name] or "db_url" in source
        assert on_db, f"invariant {n} has no test against a database"
