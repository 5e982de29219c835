"""The demo through the real entry point: three scenarios, written to a new ledger or after the
earlier demo runs of one (re-runnable in the same folder, or on the same PostgreSQL database),
and the stopped run's reasons in ``run show``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState
from ledger.domain.values import Budget, Price, Route
from ledger.errors import InvalidArgument
from ledger.storage.audit import AuditQueries
from ledger.tools.demo import run_demo

REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_offline_and_writes_the_ledger(tmp_path: Path) -> None:
    env = dict(os.environ, LEDGER_URL=str(tmp_path / "ledger.db"))
    res = subprocess.run([sys.executable, "-m", "ledger.cli.main", "demo"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "answered by go-glm" in out  # scenario 1: next model, same healthy group
    # The answer whole (it was cut at 48 characters, mid-word, with no sign of the cut).
    assert "answered by go-glm: 'Hello from the fake provider, streaming in pieces.'" in out
    assert "answered by official-deepseek" in out  # scenario 2: independent group
    assert "skipped go-glm: same_group_unavailable" in out
    assert "stopped: no_candidate" in out and "official-deepseek: disclosure" in out
    # Each attempt line shows its own debit, as the operator commands will name it.
    debits = re.findall(r"debit=(\S+)", out)
    assert len(debits) >= 6 and len(set(debits)) == len(debits), debits
    with Ledger.open(str(tmp_path / "ledger.db")) as led:
        runs = sorted({a.run_id for a in led.attempts(limit=100).items})
        assert len(runs) == 3
        served = [led.get_run(r).current_route for r in runs]
        assert served == ["go-glm", "official-deepseek", "go-deepseek"]
        for r in runs:
            states = [a.state for a in led.timeline(r)]
            assert states[0] is AttemptState.SUCCEEDED and AttemptState.FAILED in states


def _demo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LEDGER_URL"}
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def _story(out: str) -> str:
    out = re.sub(r"demo-\d{8}-\d{6}-[0-9a-f]{4}", "RUN", out)
    out = re.sub(r"d-att-\.\.[0-9a-f]{8}", "DEBIT", out)
    out = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "TIME", out)
    return "\n".join(line for line in out.splitlines()
                     if not line.startswith("(the ledger holds earlier demo runs"))


def _runs_of(out: str) -> list[str]:
    return sorted(set(re.findall(r"demo-\d{8}-\d{6}-[0-9a-f]{4}-\d", out)))


def test_demo_rerun_in_the_same_folder_tells_the_same_story(tmp_path: Path) -> None:
    first = _demo(tmp_path, "demo")
    assert first.returncode == 0, first.stderr
    second = _demo(tmp_path, "demo")
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("(the ledger holds earlier demo runs: they stay")
    assert _story(second.stdout) == _story(first.stdout)
    # Its ledger holds both demos' runs, and no time reads like an epoch float.
    assert not re.search(r"\b1\d{9}\.\d", second.stdout)
    with Ledger.open(str(tmp_path / "ledger.db")) as led:
        runs = {a.run_id for a in led.attempts(limit=100).items}
    assert runs == set(_runs_of(first.stdout)) | set(_runs_of(second.stdout)) and len(runs) == 6


def test_demo_run_again_on_a_ledger_of_earlier_demos_adds_new_runs_telling_the_same_story(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """On either backend alike (a PostgreSQL database holding earlier demo runs was refused):
    the earlier runs stay, the new ones have ids of their own and come after them in time (so
    no cooldown the earlier demo left is still on), and the inspect line names the new run."""
    assert main(["demo", "--db", db_url]) == 0
    first = capsys.readouterr().out
    assert main(["demo", "--db", db_url]) == 0
    second = capsys.readouterr().out
    assert _story(second) == _story(first)
    old, new = _runs_of(first), _runs_of(second)
    assert len(old) == len(new) == 3 and not set(old) & set(new)
    assert second.rstrip().endswith(f"run show {new[-1]}")
    with Ledger.open(db_url) as led:
        assert {a.run_id for a in led.attempts(limit=100).items} == set(old) | set(new)
        last_old = max(a.created_at for r in old for a in led.timeline(r))
        assert all(a.created_at > last_old for r in new for a in led.timeline(r))
        # Still before the real "now" the operator commands read with (a second demo fits).
        assert all((a.settled_at or 0) < time.time() for r in new for a in led.timeline(r))
    # A third in quick succession still records before the real "now", and inside the last
    # 24 hours the reading commands show by default (it was stamped two hours ahead).
    assert main(["demo", "--db", db_url]) == 0
    third = _runs_of(capsys.readouterr().out)
    with Ledger.open(db_url) as led:
        stamps = [t for r in third for a in led.timeline(r)
                  for t in (a.created_at, a.settled_at) if t is not None]
    assert stamps and all(time.time() - 24 * 3600 < t < time.time() for t in stamps)


def _latest(url: str) -> float | None:
    with Ledger.open(url, migrate_schema=False) as led:
        return AuditQueries(storage_of(led).context).latest_instant()


def test_demos_run_again_any_number_of_times_never_record_past_the_real_now(
        db_url: str) -> None:
    """Each demo starts where the earlier ones end, about 3.25 hours on: from the seventh in
    quick succession on, a demo recorded past the real now (``health`` told of a failure "in
    28 s"). However many are run at one real instant, nothing the ledger holds (a write, or a
    cooldown it leaves) lies past it: the demos that fit tell the same story, the others are
    refused naming --db and when one fits again, writing nothing; at that time one runs."""
    real = ManualClock(1_800_000_000.0)  # demos run back to back: no real time passes
    stories: list[str] = []
    refused: list[str] = []
    for _ in range(9):
        before = _latest(db_url)
        out = io.StringIO()
        try:
            run_demo(db_url, out, wall=real)
        except InvalidArgument as e:
            assert e.field == "db" and "--db" in str(e), str(e)
            assert _latest(db_url) == before  # nothing written
            refused.append(str(e))
        else:
            stories.append(_story(out.getvalue()))
        latest = _latest(db_url)
        assert latest is not None and latest <= real.now(), (len(stories), latest)
    assert len(stories) >= 3 and len(set(stories)) == 1, stories
    assert len(refused) == 9 - len(stories)
    when = re.search(r"run it again after (\S+), or pass --db ", refused[-1])
    assert when, refused[-1]
    real.set(datetime.fromisoformat(when[1]).timestamp())
    out = io.StringIO()
    run_demo(db_url, out, wall=real)
    assert _story(out.getvalue()) == stories[0]
    latest = _latest(db_url)
    assert latest is not None and latest <= real.now()


def test_demo_into_a_ledger_db_init_just_made_replaces_nothing(tmp_path: Path) -> None:
    """A ledger with no run (``db init`` made it) is written into as it is: nothing earlier
    was there to keep, so the demo does not say it kept earlier demo runs."""
    made = _demo(tmp_path, "db", "init", str(tmp_path / "ledger.db"))
    assert made.returncode == 0, made.stderr
    res = _demo(tmp_path, "demo")
    assert res.returncode == 0, res.stderr
    assert "earlier demo runs" not in res.stdout


def test_run_show_says_why_the_demo_run_stopped(tmp_path: Path) -> None:
    res = _demo(tmp_path, "demo")
    assert res.returncode == 0, res.stderr
    stopped = re.findall(r"demo-\d{8}-\d{6}-[0-9a-f]{4}-3", res.stdout)[0]
    show = _demo(tmp_path, "run", "show", stopped)
    assert show.returncode == 0, show.stderr
    lines = show.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stopped "))
    assert lines[at].endswith(": no_candidate: every remaining candidate was eliminated")
    # One line per candidate: how it failed, or why it was skipped and the fix.
    after = lines[at + 1:]
    assert any(line.startswith("  go-deepseek: failed: go/deepseek-v4: rate_limit (HTTP 429, "
                               "code rate_limit_exceeded): Rate limit reached for requests per "
                               "min. [attempt ") for line in after)
    assert "  go-glm: skipped (same_group_unavailable): provider 429 on 'go-deepseek' " \
           "established group 'go' unavailable" in after
    assert "  official-deepseek: skipped (disclosure): recipient 'deepseek' is not approved " \
           "for: model_derived — fix: add model_derived to Grant.recipients['deepseek']" in after
    doc = json.loads(_demo(tmp_path, "run", "show", stopped, "--json").stdout)
    (stop,) = doc["stops"]
    assert stop["reason"] == "no_candidate"
    assert {s["route"]: s["reason"] for s in stop["skipped"]}["official-deepseek"] == "disclosure"


def test_demo_refuses_a_ledger_holding_other_runs(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    with Ledger.open(str(db)) as led:
        led.admit_run("real-1", plan=[Route(id="a", provider="p", model="m", group="g",
                                            recipient="x", price=Price())],
                      budget=Budget(max_calls=1, max_retries=0, max_cost=0))
    res = _demo(tmp_path, "demo")
    assert res.returncode == 2
    assert "holds runs other than the demo's (e.g. 'real-1')" in res.stderr
    assert "--db" in res.stderr
    with Ledger.open(str(db)) as led:
        assert led.get_run("real-1").run_id == "real-1"  # untouched
    other = tmp_path / "notes.db"
    other.write_text("not a database")
    res = _demo(tmp_path, "demo", "--db", str(other))
    assert res.returncode == 2 and other.read_text() == "not a database"


def test_demo_refuses_what_is_not_its_ledger_in_one_sentence_with_the_right_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Another application's file (here with a table named like the ledger's), or no database
    # at all: refused, untouched, once, with the one fix that works (not db init, which
    # refuses such a file too).
    app = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(app)) as conn:
        conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY)")
        conn.commit()
    notes = tmp_path / "notes.db"
    notes.write_text("not a database")
    for path, why in ((app, "it holds another application's tables and no ledger schema"),
                      (notes, "it is not a SQLite database")):
        before = path.read_bytes()
        for argv in (["--db", str(path), "demo"], ["demo", "--db", str(path)]):
            assert main(argv) == 2
            assert capsys.readouterr().err == (
                f"failover-ledger: error: the demo will not write into {path}: {why}; pass "
                "--db a new file, e.g. --db demo.db\n")
        assert path.read_bytes() == before
    # An empty file is as good as a new one: the demo makes it its ledger.
    empty = tmp_path / "empty.db"
    empty.touch()
    assert main(["demo", "--db", str(empty)]) == 0
    assert "answered by official-deepseek" in capsys.readouterr().out
    with Ledger.open(str(empty), migrate_schema=False) as led:
        assert len(led.attempts(limit=100).items) >= 6
