"""The docs name only files and modules that exist (a moved module leaves no stale path)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([*REPO.glob("docs/**/*.md"), REPO / "README.md", REPO / "CHANGELOG.md"])


def _named(pattern: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for m in re.finditer(pattern, page.read_text()):
            found.append((page.relative_to(REPO).as_posix(), m.group(1)))
    return found


def test_every_file_path_in_the_docs_exists() -> None:
    # The changelog names the old paths on purpose (where a moved file came from).
    named = _named(r"`((?:ledger|tests|benchmarks)/[\w/]+\.py)")
    missing = [(page, path) for page, path in named
               if not (REPO / path).exists() and page != "CHANGELOG.md"]
    assert not missing


# Module names the package had before its rooms, which must not come back in the docs.
OLD = frozenset({"core", "model", "records", "run", "session", "lease", "recovery", "reconcile",
                 "audit", "benchmarks", "generate", "demo", "pricing", "effects",
                 "turn_effects", "bounds", "validation", "timefmt", "audit_bench"})


def stale_modules(text: str) -> list[str]:
    """Dotted ``ledger.x[.y]`` module paths in ``text`` that do not import. A call such as
    ``ledger.run(...)`` (a method of a variable named ``ledger``) and attribute names such as
    ``ledger.failure.category`` are not module paths."""
    stale = set()
    for m in re.finditer(r"(?<![\w.])ledger((?:\.[a-z_]+)+)(?![\w(])", text):
        parts = m.group(1).lstrip(".").split(".")
        first = parts[0]
        if first not in OLD and not (REPO / "ledger" / first).is_dir():
            continue
        name = f"ledger.{first}"
        if importlib.util.find_spec(name) is None:
            stale.add(m.group(0))
            continue
        if len(parts) > 1 and (REPO / "ledger" / first).is_dir():
            sub = f"{name}.{parts[1]}"
            if importlib.util.find_spec(sub) is None and not hasattr(
                    importlib.import_module(name), parts[1]):
                stale.add(m.group(0))
    return sorted(stale)


def test_the_stale_path_check_finds_old_paths() -> None:
    text = "see ledger.run.execute, ledger.core.select and ledger.api.nowhere; with ledger.run(x)"
    assert stale_modules(text) == ["ledger.api.nowhere", "ledger.core.select",
                                   "ledger.run.execute"]


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in PAGES
                                  if p.name != "CHANGELOG.md"])
def test_every_module_path_in_the_docs_imports(page: str) -> None:
    # The changelog names the old paths on purpose.
    stale = stale_modules((REPO / page).read_text())
    assert not stale, f"{page} names modules that do not exist: {stale}"
