"""``failover-ledger policy`` through the real entry point, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _ledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ledger.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def test_schema_prints_the_published_schema() -> None:
    r = _ledger("policy", "schema")
    assert r.returncode == 0, r.stderr
    schema = json.loads(r.stdout)
    assert schema["title"] == "Policy"
    assert r.stdout == (REPO / "docs" / "policy.schema.json").read_text(encoding="utf-8")


def test_check_good_files_and_presets() -> None:
    r = _ledger("policy", "check", str(REPO / "policies" / "fased.yaml"), "goclaw")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("ok: fased sha256:")
    assert lines[1].startswith("ok: goclaw sha256:")


def test_check_bad_file_names_file_field_and_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nsame_route_retry:\n  - categories: [overloaded]\n    max: 1\n"
        "    delays_s: [2]\n    jitter: 1.5\n",
        encoding="utf-8",
    )
    r = _ledger("policy", "check", str(bad))
    assert r.returncode == 2
    assert str(bad) in r.stderr
    assert "same_route_retry[0].jitter" in r.stderr
    assert "fix:" in r.stderr
    assert "Traceback" not in r.stderr


def test_check_unknown_preset() -> None:
    r = _ledger("policy", "check", "nosuch")
    assert r.returncode == 2
    assert "failure-domain" in r.stderr


def test_a_source_that_is_neither_a_preset_nor_a_file_is_not_called_a_file() -> None:
    r = _ledger("policy", "show", "nope")
    assert r.returncode == 2
    assert "'nope' is neither a preset nor a policy file" in r.stderr
    assert "file: nope" not in r.stderr


def test_show_prints_hash_and_policy() -> None:
    r = _ledger("policy", "show", "failure-domain")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["hash"].startswith("sha256:") and out["policy"]["name"] == "failure-domain"


def test_export_prints_the_preset_file_with_its_comments_and_it_loads_back(
        tmp_path: Path) -> None:
    """A user without the repository (an installed wheel) starts a policy of their own from a
    preset: the file as shipped, comments included, which loads to the preset's own hash."""
    from ledger.policy.load import policy_hash, preset

    r = _ledger("policy", "export", "failure-domain")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (REPO / "policies" / "failure-domain.yaml").read_text(encoding="utf-8")
    assert "\n#" in r.stdout or r.stdout.startswith("#")
    copy = tmp_path / "mine.yaml"
    copy.write_text(r.stdout, encoding="utf-8")
    check = _ledger("policy", "check", str(copy))
    assert check.returncode == 0, check.stderr
    assert check.stdout.split()[-1] == policy_hash(preset("failure-domain"))


def test_export_of_an_unknown_preset_lists_the_presets() -> None:
    r = _ledger("policy", "export", "nosuch")
    assert r.returncode == 2
    assert "goclaw" in r.stderr and "failure-domain" in r.stderr and "Traceback" not in r.stderr


def test_the_presets_and_docs_name_the_command_as_it_is_installed() -> None:
    """The preset files (which ``policy export`` prints) said to check a copy with ``ledger
    policy check FILE``: no such command is installed; it is ``failover-ledger``."""
    import argparse
    import re

    from ledger.cli.common import PROG
    from ledger.cli.main import build_parser

    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction)).choices
    named = re.compile(r"`(?:python -m )?ledger (" + "|".join(map(re.escape, commands)) + r")\b")
    texts = [*sorted((REPO / "policies").glob("*.yaml")), *sorted((REPO / "docs").rglob("*.md")),
             REPO / "README.md"]
    wrong = [(p.name, m[0]) for p in texts for m in named.finditer(p.read_text("utf-8"))]
    assert wrong == []
    for preset in ("failure-domain", "fased", "goclaw"):
        said = _ledger("policy", "export", preset).stdout
        assert f"`{PROG} policy check FILE`" in said, preset
