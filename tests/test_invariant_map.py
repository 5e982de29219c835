"""The invariant map names real tests, and every invariant is tested on both backends."""

from __future__ import annotations

import ast
import pathlib
import re

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


def test_the_concepts_page_lists_exactly_the_mapped_tests() -> None:
    rows: dict[int, set[str]] = {}
    for line in (ROOT / "docs" / "concepts.md").read_text().splitlines():
        head = line.split(" | ", 1)[0].removeprefix("| ")
        if line.startswith("| ") and head[:1].isdigit() and head[1:3] == ". ":
            rows[int(head[0])] = set(re.findall(r"`([^`]+::[^`]+)`", line.rsplit(" | ", 1)[1]))
    assert sorted(rows) == sorted(INVARIANTS)
    for n, names in INVARIANTS.items():
        assert rows[n] == {x.removeprefix("tests/") for x in names}, f"invariant {n}"
