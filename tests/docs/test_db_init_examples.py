"""The ``db init`` outputs docs/postgresql.md shows are what the command prints, whatever the
package's head revision (the page writes it ``NNNN``, so a new migration leaves it right)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ledger.cli.main import main
from ledger.storage.migrate import head_revision

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "postgresql.md"


def test_the_db_init_outputs_on_the_postgresql_page_are_what_it_prints_at_head(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = PAGE.read_text()
    assert re.findall(r"revision \d{4}", page) == []  # no revision that a migration outdates
    shown = [line.replace("NNNN", head_revision()) for line in (
        *re.findall(r"^created the ledger schema \(revision NNNN\)$", page, re.M),
        *re.findall(r"`(the schema is already at the ledger's revision NNNN: nothing to do)`",
                    page))]
    assert len(shown) == 3, shown
    db = str(tmp_path / "ledger.db")
    printed = []
    for _ in range(2):  # created, then current
        assert main(["db", "init", db]) == 0
        printed.append(capsys.readouterr().out.splitlines()[-1])
    assert set(shown) == set(printed), (shown, printed)
    upgraded = re.search(r"`(upgraded the schema from\s+revision OLD to NNNN)`", page)
    assert upgraded is not None
