"""Replay over a history the ledger recorded itself (``replay_history``), on SQLite and PostgreSQL.

Every recorded decision is recomputed exactly from the ledger alone (its recorded inputs, the
Run's frozen plan, grant, role and policy, the failed Attempt's fact); a replay under the policy
the Runs were recorded under changes nothing; a replay under another policy finds, groups and
totals the differences, estimates the routes it tries that were not tried then from other
Runs' Attempts, and says so; a replay writes nothing; bad arguments are typed errors.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ledger import Ledger
from ledger.clock import ManualClock
from ledger.decide.inputs import parse_inputs, selection_input
from ledger.decide.retry import retry_decision
from ledger.decide.select import select
from ledger.errors import InvalidArgument, NotFound
from ledger.ops.audit import AsyncAudit, Audit, to_jsonable
from ledger.ops.replay import ReplayReport
from ledger.redaction import redact_data
from ledger.storage import schema
from tests.storage.helpers import sql_context

from .replay_history import END, START, record

NOW = START + 40 * 7200.0
SINCE = END - 2 * 86400.0


@pytest.fixture(scope="module",
                params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def history(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, dict[str, list[str]]]]:
    """(url, scenario runs by tenant): the recorded history, once per backend."""
    if request.param == "sqlite":
        url = str(tmp_path_factory.mktemp("replay") / "ledger.db")
    else:
        srv = request.getfixturevalue("pg_server")
        name = f"replay_{os.getpid()}"
        url = srv.create_database(name, template="ledger_template")
    clock = ManualClock(END - 86400.0)
    with Ledger.open(url, clock=clock) as led:
        runs = record(led, clock)
    yield url, runs


@pytest.fixture
def audit(history: tuple[str, Any]) -> Iterator[Audit]:
    led = Ledger.open(history[0], clock=ManualClock(NOW), migrate_schema=False)
    try:
        yield Audit(led)
    finally:
        led.close()


def _replay(audit: Audit, policy: str, **kw: Any) -> ReplayReport:
    return audit.replay(policy, **{"since": SINCE, "until": NOW, **kw})


def _finding(rep: ReplayReport, key: str) -> list[Any]:
    return [f for f in rep.findings if f.key == key]


# -- 1. every recorded decision is recomputed from the ledger alone ---------------------------


def test_every_recorded_decision_is_recomputed_exactly_from_the_ledger_alone(
        audit: Audit) -> None:
    """Through the public API only: each ``select`` and ``stop`` event's inputs, with the Run's
    frozen plan, grant, role and policy and the failed Attempt's recorded fact, give the
    recorded decision under the Run's own policy."""
    led = audit.ledger
    checked: dict[str, int] = {}
    runs = audit.runs(since=SINCE, limit=10_000).items
    assert len(runs) > 150
    for summary in runs:
        frozen, policy = led.frozen_run(summary.run_id), led.run_policy(summary.run_id)
        facts = {a.attempt_id: a for a in led.timeline(summary.run_id)}
        retries = {e.attempt_id: e.data["n"] for e in led.events(summary.run_id, ["retry"])}
        for ev in led.events(summary.run_id, ["select", "stop"]):
            data = ev.data
            if ev.kind == "select" or "decision" in data or "inputs" in data:
                assert "inputs" in data, f"{summary.run_id}: {ev.kind} without its inputs"
            if "inputs" not in data:
                continue  # a stop no decision led to (the host's own, say)
            rec = parse_inputs(data["inputs"], plan=frozen.plan, policy=policy)
            failed = facts[rec.failed] if rec.failed else None
            fact = failed.fact if failed is not None else None
            kind = f"{ev.kind}/{rec.by}/{rec.on}"
            checked[kind] = checked.get(kind, 0) + 1
            if rec.by == "retry":
                assert failed is not None and fact is not None
                assert retry_decision(fact, policy, retries.get(rec.failed, 0),
                                      random.Random(0)).retry
                assert data["route"] == failed.route_id
                continue
            if rec.by == "after_rejection":
                assert policy.failover.after_rejection == "stop"
                assert data["reason"] == "rejected_before_dispatch"
                continue
            got = redact_data(select(selection_input(
                rec, plan=frozen.plan, policy=policy, role=frozen.role, grant=frozen.grant,
                failure=fact)).to_json())
            made = data if ev.kind == "select" else {**data["decision"], "skipped": (
                data["skipped"] if data["decision"]["kind"] == "stop" else
                data["decision"]["skipped"])}
            want = {k: made.get(k) for k in got}
            assert got == want, f"{summary.run_id} {ev.kind} at {ev.created_at}"
    # The history holds every kind of decision point.
    for kind in ("select/select/new_turn", "select/select/failure", "select/retry/failure",
                 "stop/select/failure", "stop/after_rejection/rejection",
                 "select/select/rejection"):
        assert checked.get(kind, 0) > 0, (kind, checked)
    assert sum(checked.values()) > 300


def test_the_report_recomputes_every_decision_under_its_own_policy(audit: Audit) -> None:
    rep = _replay(audit, "fased")
    assert rep.check.decisions == rep.decisions > 300
    assert rep.check.agree == rep.check.decisions and rep.check.disagree == []
    assert rep.coverage.decisions_without_inputs == 0 and rep.coverage.malformed == 0


# -- 2. replay under another policy --------------------------------------------------------------


def test_replay_under_the_recorded_rules_changes_nothing(audit: Audit) -> None:
    # The generated Runs froze goclaw under another name: the same rules decide alike.
    rep = _replay(audit, "goclaw", until=END + 1)
    assert rep.recorded == ["goclaw-generated"] and rep.decisions > 250
    assert rep.differing == 0 and rep.findings == []
    assert rep.replayed == rep.baseline and rep.estimates.share == 0
    assert rep.coverage.world == ["Runs under goclaw-generated: goclaw reads recorded health "
                                  "and recorded group projections"]


def test_failure_domain_stops_where_goclaw_moved_on_after_a_401(audit: Audit) -> None:
    rep = _replay(audit, "failure-domain", tenant="auth")
    [stopped] = _finding(rep, "stopped")
    assert stopped.count == 3 and stopped.subject == "auth (HTTP 401): not_eligible_failure"
    assert stopped.text == ("would have stopped (not_eligible_failure) after 3 auth (HTTP 401) "
                            "failures")
    [runs] = _finding(rep, "stopped_runs")
    assert runs.text == "would have stopped 3 Runs that succeeded"
    assert {e.run_id for e in runs.examples} == {"auth-0", "auth-1", "auth-2"}
    assert runs.examples[0].command == "failover-ledger run show " + runs.examples[0].run_id
    b, o = rep.baseline, rep.replayed
    assert (b.attempts, b.served, b.stopped, b.runs_stopped) == (6, 3, 0, 0)
    assert (o.attempts, o.served, o.stopped, o.runs_stopped) == (3, 0, 3, 3)
    assert o.cost < b.cost and rep.estimates.share == 0  # nothing rests on estimates


def test_goclaw_moves_on_after_a_401_with_its_outcome_estimated(audit: Audit) -> None:
    rep = _replay(audit, "goclaw", tenant="fd-stop")
    [moved] = _finding(rep, "moved_on")
    assert moved.text == "would have moved on after 3 auth (HTTP 401) failures"
    assert moved.examples[0].replayed.startswith("route b2")
    # b2 served all five fd-ok Runs: the estimate of a call on it, without the Run's own.
    [served] = _finding(rep, "served_runs")
    assert served.count == 3 and served.estimated
    est = rep.estimates
    assert est.decisions == 3 and est.runs == 3 and est.attempts == 3 and est.no_evidence == 0
    assert est.share == pytest.approx(0.5)  # 3 of the 6 replayed attempts
    assert rep.replayed.served == pytest.approx(3) and rep.replayed.stopped == 0
    assert rep.baseline.stopped == 3


def test_failure_domain_skips_the_group_a_trusted_429_closed(audit: Audit) -> None:
    rep = _replay(audit, "failure-domain", tenant="go")
    [group] = _finding(rep, "skipped_group")
    assert group.subject == "go" and group.count == 3
    assert group.text == "would have skipped group `go` 3 times"
    [moved] = _finding(rep, "other_route")
    assert moved.count == 3 and moved.examples[0].recorded.startswith("route go-glm")
    assert moved.examples[0].replayed.startswith("route official")
    # official served the "official" tenant's Runs: the estimate says it would have served.
    assert rep.replayed.served == pytest.approx(3) and rep.estimates.decisions == 3


def test_the_report_totals_both_policies_and_says_how_it_read_the_world(audit: Audit) -> None:
    rep = _replay(audit, "failure-domain")
    assert rep.recorded == ["failure-domain", "fased", "goclaw", "goclaw-generated"]
    assert rep.runs > 150 and rep.decisions > rep.differing > 0
    assert rep.baseline.turns == rep.turns
    assert any(w.startswith("Runs under goclaw: failure-domain reads its own health")
               for w in rep.coverage.world)
    assert any("failure-domain reads recorded health and recorded group projections" in w
               for w in rep.coverage.world)
    assert rep.findings == sorted(rep.findings, key=lambda f: (-f.count, f.key, f.subject))
    doc = json.loads(json.dumps(to_jsonable(rep)))
    assert doc["policy"] == "failure-domain" and doc["replayed"]["cost"] == str(
        rep.replayed.cost)
    assert {"decisions", "differing", "baseline", "replayed", "findings", "estimates", "check",
            "coverage"} <= set(doc)


def test_one_run_replays_alone(audit: Audit) -> None:
    rep = audit.replay("failure-domain", run="auth-1")
    assert rep.runs == 1 and rep.turns == 1 and rep.decisions == 2
    assert [f.key for f in rep.findings] == ["stopped", "stopped_runs"]


def test_replaying_an_unknown_run_is_not_found_as_run_show_says(audit: Audit) -> None:
    """A mistyped run id read "0 decisions, all agree": it is the error ``run show`` gives
    (``Audit.timeline``)."""
    with pytest.raises(NotFound) as shown:
        audit.timeline("auth-l")
    with pytest.raises(NotFound) as replayed:
        audit.replay("failure-domain", run="auth-l")
    assert str(replayed.value) == str(shown.value) == (
        "unknown run id 'auth-l'; list runs with `failover-ledger runs`")
    assert replayed.value.fields["run_id"] == "auth-l"
    with pytest.raises(NotFound):  # a window does not make it known
        audit.replay("failure-domain", run="auth-l", since=SINCE, until=NOW)


def test_one_run_replays_whenever_it_was_admitted_even_after_the_readers_clock(
        history: tuple[str, Any]) -> None:
    """A reader whose clock is behind the host that admitted the Run (clock skew) replays it
    all the same: with ``run``, ``until`` is unbounded, as ``since`` is."""
    with Ledger.open(history[0], clock=ManualClock(START - 3600.0),
                     migrate_schema=False) as led:
        rep = Audit(led).replay("failure-domain", run="auth-1")
    assert rep.runs == 1 and rep.turns == 1 and rep.decisions == 2
    assert [f.key for f in rep.findings] == ["stopped", "stopped_runs"]
    assert rep.until > START  # the report's window holds the Run


def test_async_audit_replays_the_same(audit: Audit) -> None:
    import asyncio

    rep = asyncio.run(AsyncAudit(audit).replay("failure-domain", since=SINCE, until=NOW,
                                               tenant="auth"))
    assert rep == _replay(audit, "failure-domain", tenant="auth")


# -- nothing written, bad input -----------------------------------------------------------------


def _dump(url: str) -> dict[str, Any]:
    """Every row of every table, in key order; and a SQLite file's bytes' hash."""
    out: dict[str, Any] = {}
    with Ledger.open(url, migrate_schema=False) as led:
        engine = sql_context(led).engine
        with engine.connect() as conn:
            for name, table in schema.metadata.tables.items():
                keys = [c.name for c in table.primary_key.columns] or [
                    c.name for c in table.columns]
                rows = conn.execute(text(f"SELECT * FROM {name} ORDER BY "
                                         + ", ".join(keys))).all()
                out[name] = [tuple(r) for r in rows]
    if "://" not in url:
        out["file"] = hashlib.sha256(Path(url).read_bytes()).hexdigest()
    return out


def test_a_replay_writes_nothing(history: tuple[str, Any]) -> None:
    url = history[0]
    before = _dump(url)
    led = Ledger.open(url, clock=ManualClock(NOW), migrate_schema=False)
    try:
        for policy in ("failure-domain", "goclaw", "fased"):
            _replay(Audit(led), policy)
    finally:
        led.close()
    after = _dump(url)
    assert after == before
    assert sum(len(v) for k, v in before.items() if k != "file") > 1000


@pytest.mark.parametrize(("kw", "field"), [
    ({"policy": "lenient"}, "policy"),
    ({"policy": 7}, "policy"),
    ({"policy": "failure-domain", "since": NOW, "until": NOW - 1}, "since"),
    ({"policy": "failure-domain", "until": float("nan")}, "until"),
    ({"policy": "failure-domain", "run": ""}, "run"),
    ({"policy": "failure-domain", "tenant": "x" * 500}, "tenant"),
])
def test_bad_arguments_are_typed_errors_naming_the_field(audit: Audit, kw: dict[str, Any],
                                                          field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        audit.replay(**kw)
    assert e.value.fields["field"] == field


def test_a_policy_file_that_does_not_load_names_its_problem(audit: Audit,
                                                            tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("failover:\n  enabled: maybe\n")
    with pytest.raises(InvalidArgument) as e:
        audit.replay(str(bad))
    assert e.value.fields["field"] == "policy" and "enabled" in str(e.value)
    good = tmp_path / "fd.yaml"
    good.write_text(Path("policies/failure-domain.yaml").read_text())
    assert _replay(audit, str(good), tenant="auth").findings[0].key == "stopped"


def test_a_window_without_runs_is_an_empty_report(audit: Audit) -> None:
    rep = audit.replay("failure-domain", since=NOW + 10, until=NOW + 20)
    assert (rep.runs, rep.turns, rep.decisions, rep.findings) == (0, 0, 0, [])
    assert rep.baseline.latency_s is None and rep.replayed.attempts == 0


# -- the command ----------------------------------------------------------------------------


def _cli(url: str, *args: str) -> tuple[int, str]:
    from ledger.cli.main import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["--db", url, *args])
    return rc, out.getvalue()


def test_the_replay_command_prints_the_report_and_its_json(history: tuple[str, Any]) -> None:
    url = history[0]
    window = ["--since", str(SINCE), "--until", str(NOW)]
    rc, out = _cli(url, "replay", "--policy", "failure-domain", "--tenant", "auth", *window)
    assert rc == 0
    assert "would have stopped (not_eligible_failure) after 3 auth (HTTP 401) failures" in out
    assert "e.g. failover-ledger run show auth-" in out
    assert "recorded decisions recomputed exactly" in out
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()
             if ln.startswith(("attempts ", "served "))}
    assert lines["attempts"] == ["6", "3"] and lines["served"] == ["3", "0"]
    rc, out = _cli(url, "replay", "--policy", "failure-domain", "--tenant", "auth", "--json",
                   *window)
    doc = json.loads(out)
    assert rc == 0 and doc["baseline"]["attempts"] == 6 and doc["replayed"]["attempts"] == 3
    assert doc["findings"][0]["examples"][0]["run_id"].startswith("auth-")


def test_the_replay_command_names_the_one_run_it_replays_never_an_admission_in_1970(
        history: tuple[str, Any]) -> None:
    """With --run the window is unbounded: its start, 0, printed as "admitted
    1970-01-01T00:00:00Z to ..."."""
    rc, out = _cli(history[0], "replay", "--policy", "failure-domain", "--run", "auth-1")
    assert rc == 0
    assert out.splitlines()[0].startswith("replay of failure-domain (sha256:")
    assert "over run auth-1, recorded under goclaw" in out.splitlines()[0]
    assert "1970" not in out and "2 decisions replayed" in out


def test_a_replay_of_no_decision_says_nothing_was_replayed_and_why_never_that_all_agree(
        history: tuple[str, Any], tmp_path: Path) -> None:
    from benchmarks.generate import generate as bulk_generate

    agree = "decides every replayed decision as recorded"
    # The bulk generator's Runs carry a marker, not a policy: none of them can be replayed.
    bulk = str(tmp_path / "bulk.db")
    with Ledger.open(bulk, clock=ManualClock(END)) as led:
        runs = bulk_generate(led, attempts=30, days=1, end=END).runs
    rc, out = _cli(bulk, "replay", "--policy", "goclaw", "--since", str(END - 86400.0),
                   "--until", str(END + 1))
    assert rc == 0 and "0 decisions replayed" in out and agree not in out
    assert (f"nothing was replayed: {runs} of the {runs} runs have no frozen policy that "
            "reads") in out
    # A Run outside the window given, and a window without Runs.
    rc, out = _cli(history[0], "replay", "--policy", "failure-domain", "--run", "auth-1",
                   "--until", str(START))
    assert rc == 0 and agree not in out
    assert "nothing was replayed: run auth-1 was not admitted between --since and --until" in out
    rc, out = _cli(history[0], "replay", "--policy", "failure-domain", "--since", str(NOW + 10),
                   "--until", str(NOW + 20))
    assert rc == 0 and agree not in out
    assert "nothing was replayed: no run was admitted in the window" in out
    # The tenant that kept the Runs out is named, and a window nobody gave is not.
    rc, out = _cli(history[0], "replay", "--policy", "failure-domain", "--run", "auth-1",
                   "--tenant", "nosuch")
    assert rc == 0
    assert "nothing was replayed: run auth-1 was not admitted for tenant 'nosuch'\n" in out
    rc, out = _cli(history[0], "replay", "--policy", "failure-domain", "--tenant", "nosuch")
    assert rc == 0 and "no run was admitted for tenant 'nosuch' in the window" in out
    # Where decisions were replayed, the verdict stands.
    rc, out = _cli(history[0], "replay", "--policy", "goclaw", "--tenant", "official",
                   "--since", str(SINCE), "--until", str(NOW))
    assert rc == 0 and f"goclaw {agree}" in out and "nothing was replayed" not in out


def test_the_replay_command_exits_1_on_an_unknown_run_as_run_show_does(
        history: tuple[str, Any], capsys: Any) -> None:
    shown, out = _cli(history[0], "run", "show", "auth-l")
    shown_err = capsys.readouterr().err
    rc, out = _cli(history[0], "replay", "--policy", "failure-domain", "--run", "auth-l")
    err = capsys.readouterr().err
    assert (rc, out) == (shown, "") == (1, "")
    assert "unknown run id 'auth-l'; list runs with `failover-ledger runs`" in err
    assert err == shown_err


def test_the_replay_command_refuses_a_policy_it_cannot_load(history: tuple[str, Any],
                                                            capsys: Any) -> None:
    rc, out = _cli(history[0], "replay", "--policy", "nonesuch")
    assert rc == 2 and out == ""
    assert "nonesuch" in capsys.readouterr().err


# -- the dashboard ----------------------------------------------------------------------------


def test_the_dashboard_replays_a_preset_on_request(history: tuple[str, Any],
                                                   audit: Audit) -> None:
    pytest.importorskip("starlette", reason="the dashboard extra is not installed")
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    window = {"since": SINCE, "until": NOW, "tenant": "auth"}
    with TestClient(create_app(history[0], clock=ManualClock(NOW)),
                    base_url="http://127.0.0.1") as c:
        form = c.get("/replay")
        assert form.status_code == 200 and 'id="replay-form"' in form.text
        assert 'id="replay-summary"' not in form.text  # nothing is replayed unasked
        assert '<a href="/replay">replay</a>' in c.get("/").text
        page = c.get("/replay", params={"policy": "failure-domain", **window})
        assert page.status_code == 200 and "<script" not in page.text
        findings = page.text.split('id="replay-findings-table"', 1)[1].split("</table>", 1)[0]
        assert ("would have stopped (not_eligible_failure) after 3 auth (HTTP 401) failures"
                in findings)
        assert '<a href="/runs/auth-0">auth-0</a>' in findings
        totals = page.text.split('id="replay-totals-table"', 1)[1].split("</table>", 1)[0]
        assert "<td>attempts</td>" in totals and '<td class="num">6</td>' in totals
        api = c.get("/api/replay", params={"policy": "failure-domain", **window})
        assert api.json() == json.loads(json.dumps(to_jsonable(
            audit.replay("failure-domain", **window))))
        # One run whenever it was admitted, though the form always sends ?hours=; an unknown
        # run is a 404, as /runs/ID is.
        one = c.get("/api/replay", params={"policy": "failure-domain", "run": "auth-1",
                                           "hours": 1})
        assert one.status_code == 200 and one.json() == json.loads(json.dumps(to_jsonable(
            audit.replay("failure-domain", run="auth-1"))))
        assert one.json()["runs"] == 1 and one.json()["decisions"] == 2
        assert c.get("/api/replay", params={"policy": "failure-domain", "run": "auth-1",
                                            "until": str(START)}).json()["runs"] == 0
        # A replay of no decision says so and why, never that the policy agrees.
        empty = c.get("/replay", params={"policy": "failure-domain", "since": NOW + 10,
                                         "until": NOW + 20})
        assert empty.status_code == 200
        assert "Nothing was replayed: no run was admitted in the window" in empty.text
        assert "decides every replayed decision as recorded" not in empty.text
        typo = {"policy": "failure-domain", "run": "auth-l", "hours": 24}
        missing = c.get("/api/replay", params=typo)
        assert missing.status_code == 404 and missing.json() == {
            "error": "unknown run id 'auth-l'; list runs with `failover-ledger runs`"}
        page = c.get("/replay", params=typo)
        assert page.status_code == 404 and "unknown run id &#x27;auth-l&#x27;" in page.text
        # Presets only: the dashboard never opens a file a request names.
        assert c.get("/replay", params={"policy": "policies/goclaw.yaml"}).status_code == 400
        assert c.get("/api/replay", params={"policy": "fased", "hours": -1}).status_code == 400
        assert c.post("/api/replay", params={"policy": "fased"}).status_code == 405


@pytest.mark.browser
def test_the_replay_page_in_headless_chromium(history: tuple[str, Any]) -> None:
    pytest.importorskip("uvicorn", reason="the dashboard extra is not installed")
    from .test_dashboard import REQUIRE, _browse, _chromium, _serving

    chromium = _chromium()
    if chromium is None:
        if REQUIRE:
            pytest.fail("chromium is not installed and LEDGER_REQUIRE_POSTGRES=1")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    backend = "postgres" if history[0].startswith("postgresql") else "sqlite"
    query = f"/replay?policy=failure-domain&since={SINCE}&until={NOW}"
    with _serving(history[0], ManualClock(NOW)) as base:
        dom = _browse(chromium, "--dump-dom", base + query)
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        assert 'id="replay-policy-name">failure-domain<' in html
        findings = html.split('id="replay-findings-table"', 1)[1].split("</table>", 1)[0]
        assert "would have skipped group `go` 3 times" in findings
        assert "Runs that succeeded" in findings and "failures" in findings
        assert 'href="/runs/' in findings
        artifacts = Path(os.environ.get("LEDGER_ARTIFACTS", "test-artifacts")).resolve()
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / f"dashboard-replay-{backend}.png"
        shot.unlink(missing_ok=True)
        res = _browse(chromium, f"--screenshot={shot}", "--window-size=1400,2400", base + query)
        assert res.returncode == 0 and shot.stat().st_size > 10_000
