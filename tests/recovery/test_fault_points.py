"""Fault points are armed only as asked: a point name, an ``@N`` or an action that could never
fire is a typed error naming it and the fix, in-process (``faults.arm``) and through
``LEDGER_FAULTS`` (when it is read, naming the variable). A misspelt point would otherwise be
armed and never reached, and a crash test would pass without crashing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger import faults
from ledger.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _nothing_armed() -> Iterator[None]:
    faults.disarm()
    yield
    faults.disarm()


@pytest.mark.parametrize(("kwargs", "field", "says"), [
    ({"name": "begin.before_comit"}, "name", "did you mean 'begin.before_commit'?"),
    ({"name": "nowhere"}, "name", "the points are begin.before_commit"),
    ({"name": "settle.after_commit", "action": "explode"}, "action", "'explode' does nothing"),
    ({"name": "settle.after_commit", "on_hit": 0}, "on_hit", "at least 1"),
    ({"name": "settle.after_commit", "on_hit": True}, "on_hit", "at least 1"),
    ({"name": "settle.after_commit", "on_hit": "2"}, "on_hit", "at least 1"),
], ids=["misspelt", "unknown", "action", "zero", "bool", "text"])
def test_a_point_that_could_never_fire_is_refused_and_nothing_is_armed(
        kwargs: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says) as ei:
        faults.arm(**kwargs)
    assert ei.value.field == field
    assert faults.armed() == {}


def test_every_known_point_arms_and_fires() -> None:
    for name in faults.KNOWN_POINTS:
        faults.arm(name, "raise", on_hit=2)
        faults.point(name)
        with pytest.raises(faults.FaultInjected):
            faults.point(name)
    fired: list[str] = []
    faults.arm("probe.before_claim", fired.append)
    faults.point("probe.before_claim")
    assert fired == ["probe.before_claim"]


def _child(code: str, value: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_URL"}
    env.update(PYTHONPATH=str(REPO), LEDGER_FAULTS=value)
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120)


@pytest.mark.parametrize(("value", "says"), [
    ("begin.before_comit", "'begin.before_comit' is not a fault point; did you mean "
                           "'begin.before_commit'?"),
    ("settle.after_commit@x", "'@x' is not when the point fires"),
    ("settle.after_commit@0", "'@0' is not when the point fires"),
    ("settle.after_commit@", "'@' is not when the point fires"),
    ("settle.after_commit@2,recover.befor_commit", "'recover.befor_commit' is not a fault point"),
], ids=["misspelt", "not-a-number", "zero", "empty", "one-of-two"])
def test_a_bad_ledger_faults_is_refused_when_read_naming_the_variable(
        value: str, says: str, tmp_path: Path) -> None:
    res = _child("import ledger.faults", value)
    assert res.returncode != 0
    assert "ledger.errors.InvalidArgument: LEDGER_FAULTS=" in res.stderr and says in res.stderr
    # A command says it in one line and exits 2, as for any bad input.
    res = _child("", value, "-m", "ledger.cli.main", "--db", str(tmp_path / "l.db"), "recover")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"failover-ledger: error: LEDGER_FAULTS={value!r}: ")
    assert says in res.stderr


def test_a_good_ledger_faults_kills_at_each_points_hit() -> None:
    res = _child("from ledger import faults\n"
                 "faults.point('settle.after_commit'); print('first settle', flush=True)\n"
                 "faults.point('recover.before_commit'); print('recovered', flush=True)",
                 " settle.after_commit@2, recover.before_commit ")
    assert res.returncode == -9, res.stderr  # SIGKILL at the recover point's first hit
    assert res.stdout.splitlines() == ["first settle"]
