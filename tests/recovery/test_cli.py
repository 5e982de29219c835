"""``ledger recover`` and ``ledger reconcile`` on the command line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ledger.api.facade import Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from tests.storage.helpers import budget, grant, routes


def test_recover_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "l.db")
    # A run leased an hour ago whose executor died mid-call.
    led = Ledger.open(db, clock=ManualClock(time.time() - 3600))
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    lease = led.acquire_lease("r1", ttl_s=30)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1")
    led.close()
    assert main(["--db", db, "recover", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["recovered"] == 1 and rep["newly_unknown"] == 1
    run = rep["runs"][0]
    assert run["run_id"] == "r1" and run["route"] == "a" and run["lease"] is None
    assert run["unknown"][0]["attempt_id"] == att.attempt_id
    assert run["fence"] == lease.fence + 1
    assert main(["--db", db, "recover"]) == 0  # idempotent: nothing left
    assert "recovered 0 run(s)" in capsys.readouterr().out
    assert main(["--db", db, "reconcile", "--json"]) == 0
    figs = json.loads(capsys.readouterr().out)
    assert figs["violations"] == [] and figs["recoveries"] == 1 and figs["attempts"] == 1


@pytest.mark.parametrize("command", [["recover"], ["recover", "--json"], ["reconcile"]])
def test_recover_and_reconcile_never_make_a_ledger_where_there_is_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    # A mistyped --db (or LEDGER_URL) in a cron job must fail, not report a clean, empty
    # ledger forever.
    absent = tmp_path / "typo.db"
    assert main(["--db", str(absent), *command]) == 2  # a set-up problem, not an outage
    err = capsys.readouterr().err
    assert "no ledger at" in err and "does not exist" in err
    assert not absent.exists()


def test_recover_help_states_the_library_defaults() -> None:
    from ledger.cli import recover_cmd
    from ledger.ops.recovery import DEFAULT_BATCH, DEFAULT_LIMIT, DEFAULT_RECOVERY_TTL_S

    assert (recover_cmd.HELP_TTL_S, recover_cmd.HELP_LIMIT, recover_cmd.HELP_BATCH) == (
        DEFAULT_RECOVERY_TTL_S, DEFAULT_LIMIT, DEFAULT_BATCH)


@pytest.mark.parametrize("as_json", [False, True])
def test_recover_counts_and_lists_the_orphans_it_marked_unknown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    db = str(tmp_path / "l.db")
    # An hour ago a worker died mid-call; another re-acquired the Run directly and still holds
    # it: its Attempt is an orphan, marked unknown without taking the Run over.
    clock = ManualClock(time.time() - 3600)
    led = Ledger.open(db, clock=clock)
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    old = led.acquire_lease("r1", ttl_s=5)
    att = led.begin_attempt(old, route="a", envelope_hash="sha256:e", reserve="0.1")
    clock.advance(6)
    led.acquire_lease("r1", ttl_s=86400, executor_id="worker-2")
    led.close()
    assert main(["--db", db, "recover", *(["--json"] if as_json else [])]) == 0
    out = capsys.readouterr().out
    if as_json:
        rep = json.loads(out)
        assert rep["recovered"] == 0 and rep["newly_unknown"] == 1
        assert rep["orphans"] == {"r1": [att.attempt_id]}
    else:
        assert "recovered 0 run(s), 1 attempt(s) newly unknown" in out
        assert f"r1: 1 orphan(s) newly unknown, the run left to its current executor: " \
               f"{att.attempt_id}" in out


@pytest.mark.parametrize("as_json", [False, True])
def test_recover_refuses_run_ids_no_run_has_and_takes_nothing_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    db = str(tmp_path / "l.db")
    # r1's executor died an hour ago mid-call; r2 is admitted and needs nothing.
    led = Ledger.open(db, clock=ManualClock(time.time() - 3600))
    for run_id in ("r1", "r2"):
        led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
    lease = led.acquire_lease("r1", ttl_s=30)
    led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.1")
    led.close()
    flags = ["--json"] if as_json else []
    assert main(["--db", db, "recover", "--run", "r1", "--run", "r-1", "--run", "nope",
                 *flags]) == 1
    captured = capsys.readouterr()
    assert "unknown run id(s) 'r-1', 'nope'; nothing was recovered" in captured.err
    assert captured.out == ""
    with Ledger.open(db) as led:
        assert led.get_run("r1").fence == lease.fence  # a typo beside it: r1 left as it was
    assert main(["--db", db, "recover", "--run", "r2", *flags]) == 0  # known, needs nothing
    out = capsys.readouterr().out
    assert (json.loads(out)["recovered"] == 0) if as_json else ("recovered 0 run(s)" in out)
