"""The dashboard's operator views (issue 27, items 5 and 6), on SQLite and PostgreSQL: spend
against budgets (the index and ``/budgets``, the same figures as ``Audit.spend``), and the
operator's actions, served only when the dashboard is started with actions *and* a token.

What each test protects: without the flag no route writes (a POST is refused by routing, and
nothing is recorded); with it, an action needs the token in a header or a form field (never a
cookie alone), from the dashboard's own origin, else 403 and nothing recorded; bad input is the
ledger's typed error (400 naming the field, 404, 409) and records nothing; each action is
recorded with who and why. The pages are checked in headless chromium, which also plays the
attacker: a page of another origin that posts the form, token included, is refused.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from ledger.api.facade import Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.errors import InvalidArgument
from ledger.ops.audit import Audit, to_jsonable
from ledger.storage import schema as s
from tests.pgroles import reader_role
from tests.storage.helpers import as_an_earlier_version, sql_context

from .seed import T0, seed

starlette = pytest.importorskip("starlette", reason="the dashboard extra is not installed")

from starlette.testclient import TestClient  # noqa: E402

from ledger.dashboard.app import create_app  # noqa: E402

from .test_dashboard import REQUIRE, _browse, _chromium, _serving  # noqa: E402

NOW = T0 + 600
TOKEN = "op-token-7c1e0b5d2f9a4e36"
HEADER = {"X-Ledger-Token": TOKEN}
ACTION_PATHS = ["/actions/clear-cooldown", "/actions/runs/r4/close",
                "/actions/attempts/r4-a1/settle", "/api/actions/clear-cooldown",
                "/api/actions/runs/r4/close", "/api/actions/attempts/r4-a1/settle"]


def _client(url: str, **kw: Any) -> TestClient:
    return TestClient(create_app(url, clock=ManualClock(NOW), **kw), base_url="http://127.0.0.1")


@pytest.fixture
def written(db_url: str) -> str:
    """A fresh copy of the seed history (these tests write), once per backend."""
    seed(db_url)
    return db_url


def _recorded(url: str) -> tuple[Any, ...]:
    """Everything an action could change: events, runs, attempts, debits, health, groups."""
    led = Ledger.open(url, clock=ManualClock(NOW), migrate_schema=False)
    try:
        with sql_context(led).engine.connect() as conn:
            return tuple(
                sorted(tuple(map(str, row)) for row in conn.execute(select(table)).all())
                for table in (s.events, s.runs, s.attempts, s.debits, s.health,
                              s.capacity_groups))
    finally:
        led.close()


# -- spend against budgets -----------------------------------------------------------------------


def test_spend_against_budgets_on_the_index_and_the_budgets_page(seeded_url: str) -> None:
    led = Ledger.open(seeded_url, clock=ManualClock(NOW), migrate_schema=False)
    try:
        audit = Audit(led)
        by_tenant = audit.spend(by="tenant", since=NOW - NOW % 86400 - 6 * 86400, until=NOW,
                                every=86400.0)
        by_team = audit.spend(by="label", label="team", since=T0 - 1, until=NOW)
    finally:
        led.close()
    with _client(seeded_url) as c:
        index = c.get("/").text
        page = c.get("/budgets", params={"by": "label", "label": "team", "days": 2}).text
        api = c.get("/api/budgets", params={"by": "tenant", "since": NOW - NOW % 86400
                                            - 6 * 86400, "until": NOW, "every": 86400}).json()
        labels = c.get("/api/budgets", params={"by": "label", "label": "team",
                                               "since": T0 - 1, "until": NOW}).json()
        assert c.get("/api/budgets", params={"by": "route"}).status_code == 400
        assert c.get("/budgets", params={"days": 0}).status_code == 400
    assert api == to_jsonable(by_tenant) and labels == to_jsonable(by_team)
    section = index.split('id="spend"', 1)[1].split("</section>", 1)[0]
    rows = section.split("<tbody>", 1)[1].split("<tr>")[1:]
    cells = [[c.split(">", 1)[1] for c in r.split("</td>")[:7]] for r in rows]
    assert cells == [[(t.key or "(none)"), str(t.runs), f"{t.budget:.6f}", f"{t.posted:.6f}",
                      f"{t.held:.6f}", f"{t.left:.6f}",
                      f"{100 * (t.posted + t.held) / t.budget:.1f}%"] for t in by_tenant.items]
    assert [c[0] for c in cells] == ["(none)", "t1", "t2"]
    assert section.count('<svg id="spend-table-bars-') == 3
    # The unknown attempt's hold shows as held in its day's bar, with the exact figures.
    assert "2023-11-14 t2: 2 runs admitted, budget 2, charged 0.003, held 0.02" in section
    team = page.split('id="spend"', 1)[1].split("</section>", 1)[0]
    assert "Spend against budgets by team" in team
    assert [r.split("</td>", 1)[0].split(">", 1)[1] for r in
            team.split("<tbody>", 1)[1].split("<tr>")[1:]] == ["search", "(none)", "eval"]
    assert "<script" not in index + page


# -- actions: off unless deliberately on -----------------------------------------------------------


def test_without_the_flag_no_route_writes(written: str) -> None:
    before = _recorded(written)
    with _client(written) as c:
        assert 'id="mode">read-only<' in c.get("/").text
        for path in ACTION_PATHS:
            res = c.post(path, data={"key": "g3", "group": "1", "by": "x", "reason": "y",
                                     "token": TOKEN, "status": "failed",
                                     "outcome": "failed"}, headers=HEADER)
            assert res.status_code == 404, path  # as ledger.dashboard.actions says
        assert "<form" not in c.get("/runs/r4").text.split("</header>", 1)[1]
        assert 'id="clear-cooldown"' not in c.get("/").text
    assert _recorded(written) == before


def test_actions_need_both_the_flag_and_a_good_token(seeded_url: str) -> None:
    for kwargs, field in (({"actions": True}, "token"), ({"token": TOKEN}, "actions"),
                          ({"actions": True, "token": "short"}, "token"),
                          ({"actions": True, "token": "has a space in it!!"}, "token"),
                          # A header is read as Latin-1: such a token would match in the form
                          # and never in X-Ledger-Token or Authorization.
                          ({"actions": True, "token": "\u00f1" * 20}, "token")):
        with pytest.raises(InvalidArgument) as ei:
            create_app(seeded_url, **kwargs)
        assert ei.value.field == field


def test_the_command_line_refuses_actions_without_a_token(
        seeded_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEDGER_DASHBOARD_TOKEN", raising=False)
    assert main(["--db", seeded_url, "dashboard", "--allow-actions"]) == 2
    assert "--allow-actions needs a token" in capsys.readouterr().err
    short = tmp_path / "token"
    short.write_text("abc\n")
    assert main(["--db", seeded_url, "dashboard", "--allow-actions", "--token-file",
                 str(short)]) == 2
    assert "16 to 1024 printable ASCII characters" in capsys.readouterr().err
    assert main(["--db", seeded_url, "dashboard", "--token-file", str(short)]) == 2
    assert "without --allow-actions" in capsys.readouterr().err
    assert main(["--db", seeded_url, "dashboard", "--allow-actions", "--token-file",
                 str(tmp_path / "absent")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    monkeypatch.setenv("LEDGER_DASHBOARD_TOKEN", "tiny")
    assert main(["--db", seeded_url, "dashboard", "--allow-actions"]) == 2


def test_a_port_out_of_range_is_a_bad_argument_in_one_line_and_nothing_is_announced(
        seeded_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    for port in ("99999", "-1"):
        assert main(["--db", seeded_url, "dashboard", "--port", port]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.count("\n") == 1 and "--port" in err and "65535" in err, err


@pytest.mark.parametrize("host", ["127.0.0.999", "no spaces.example", "-lead.example", ""])
def test_a_host_that_is_neither_an_address_nor_a_name_is_refused_before_it_is_resolved(
        seeded_url: str, capsys: pytest.CaptureFixture[str], host: str) -> None:
    assert main(["--db", seeded_url, "dashboard", f"--host={host}", "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "--host" in err and "neither an IP address" in err, err


def test_a_port_in_use_is_one_line_naming_the_address_and_nothing_is_announced(
        seeded_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["--db", seeded_url, "dashboard", "--port", str(port)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "in use" in err


def test_the_served_line_comes_once_it_listens_and_answers_its_names_only(
        seeded_url: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ledger", "--db", seeded_url, "dashboard", "--port", "0",
         "--allowed-host", "dash.internal"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("failover-ledger dashboard on http://127.0.0.1:"), line
        port = int(line.split("127.0.0.1:", 1)[1].split("/", 1)[0])
        assert port != 0

        def status(host: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                conn.request("GET", "/api/runs", headers={"Host": host})
                return conn.getresponse().status
            finally:
                conn.close()

        # Listening when announced: the first request is answered, no retry.
        assert status(f"127.0.0.1:{port}") == 200
        assert status("dash.internal") == 200
        assert status(f"evil.example:{port}") == 400
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("how", ["missing", "wrong", "cookie-only", "other-origin",
                                 "cross-site-fetch", "null-origin"])
def test_a_request_without_the_token_from_this_origin_is_forbidden_and_changes_nothing(
        written: str, how: str) -> None:
    before = _recorded(written)
    form: dict[str, str] = {"key": "g3", "group": "1", "by": "mallory", "reason": "csrf"}
    headers: dict[str, str] = {}
    cookies: dict[str, str] = {}
    if how == "wrong":
        form["token"] = TOKEN[:-1] + "x"
    elif how == "cookie-only":
        cookies["token"] = TOKEN
        cookies["X-Ledger-Token"] = TOKEN
    elif how == "other-origin":
        form["token"] = TOKEN
        headers["Origin"] = "http://evil.example"
    elif how == "cross-site-fetch":
        headers.update(HEADER)
        headers["Sec-Fetch-Site"] = "cross-site"
    elif how == "null-origin":
        form["token"] = TOKEN
        headers["Origin"] = "null"
    with _client(written, actions=True, token=TOKEN) as c:
        c.cookies.update(cookies)
        res = c.post("/actions/clear-cooldown", data=form, headers=headers)
        assert res.status_code == 403 and "nothing was changed" in res.text
        api = c.post("/api/actions/runs/r4/close", data={**form, "status": "failed"},
                     headers=headers)
        assert api.status_code == 403 and api.json()["ok"] is False
    assert _recorded(written) == before


@pytest.mark.parametrize("host", ["evil.example:8765", "evil.example", "127.0.0.1.evil.example",
                                  "localhost.evil.example:8765", "[::2]:8765", "", "a:b:c"])
def test_a_request_for_another_host_name_is_refused_so_a_rebound_name_reads_and_changes_nothing(
        written: str, host: str) -> None:
    """DNS rebinding: a page whose own name now points at 127.0.0.1 is same-origin to the
    browser, and its requests carry that name in Host: none is answered, none acts."""
    before = _recorded(written)
    with _client(written, actions=True, token=TOKEN) as c:
        for path in ("/", "/api/runs", "/api/health", "/runs/r4", "/metrics", "/budgets"):
            res = c.get(path, headers={"Host": host})
            assert res.status_code == 400, path
            assert "is not a name this dashboard is served as" in res.text
            assert "r4" not in res.text
        for path in ACTION_PATHS:
            res = c.post(path, data={"key": "g3", "group": "1", "by": "x", "reason": "y",
                                     "token": TOKEN, "status": "failed", "outcome": "failed"},
                         headers={**HEADER, "Host": host, "Origin": f"http://{host}"})
            assert res.status_code == 400, path
    assert _recorded(written) == before


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8765", "localhost:8765",
                                  "LOCALHOST", "[::1]:8765", "[0:0::1]", "dash.internal:80"])
def test_the_names_it_is_served_as_are_answered(seeded_url: str, host: str) -> None:
    with _client(seeded_url, allowed_hosts=["dash.internal"]) as c:
        assert c.get("/api/runs", headers={"Host": host}).status_code == 200
        assert c.get("/", headers={"Host": host}).status_code == 200


def test_an_unknown_action_kind_is_refused_naming_kind_and_its_choices_not_an_empty_list(
        seeded_url: str) -> None:
    with _client(seeded_url) as c:
        for query in ({"kind": "bogus"}, [("kind", "close"), ("kind", "closed")]):
            res = c.get("/api/actions", params=query)
            assert res.status_code == 400 and res.json()["field"] == "kind"
            assert "clear_cooldown, close, late_receipt, retention" in res.json()["error"]


def test_each_action_with_the_token_is_recorded_with_who_and_why(written: str) -> None:
    with _client(written, actions=True, token=TOKEN) as c:
        index = c.get("/").text
        assert 'id="mode">operator actions enabled<' in index
        assert 'id="clear-group-form"' in index and 'type="password"' in index
        run = c.get("/runs/r4").text
        assert 'id="close-form"' in run and 'action="/actions/attempts/r4-a1/settle"' in run
        # A Run its block ended is not closed yet: closed with the status it ended with only.
        ended = c.get("/runs/r2").text.split('id="close-form"', 1)[1].split("</form>", 1)[0]
        assert '<option value="succeeded">' in ended and ended.count("<option") == 1
        # A form, as the browser sends it (the token in a field, from this origin).
        res = c.post("/actions/clear-cooldown", data={
            "key": "g3", "group": "1", "by": "alice", "reason": "provider confirmed",
            "token": TOKEN}, headers={"Origin": "http://127.0.0.1"})
        assert res.status_code == 200, res.text
        assert "cleared group g3 by alice: provider confirmed" in res.text
        # JSON with the token in the header; and with a bearer token.
        res = c.post("/api/actions/runs/r4/close", json={
            "status": "failed", "by": "bob", "reason": "nobody resumes"}, headers=HEADER)
        assert res.status_code == 200 and res.json()["previous_status"] == "running"
        res = c.post("/api/actions/attempts/r4-a1/settle", json={
            "outcome": "succeeded", "prompt_tokens": 100, "completion_tokens": 50,
            "by": "carol", "reason": "console req 7a1"},
            headers={"Authorization": f"Bearer {TOKEN}"})
        assert res.status_code == 200, res.text
        assert res.json()["state"] == "succeeded" and res.json()["debit_state"] == "posted"
        actions = c.get("/api/actions").json()["items"]
        # ?kind= filters as the command's --kind does (repeatable).
        only = c.get("/api/actions", params=[("kind", "close"), ("kind", "late_receipt")])
        assert [a["kind"] for a in only.json()["items"]] == ["late_receipt", "close"]
        page = c.get("/").text
        r4 = c.get("/runs/r4").text
    assert [(a["kind"], a["by"], a["reason"]) for a in actions] == [
        ("late_receipt", "carol", "console req 7a1"), ("close", "bob", "nobody resumes"),
        ("clear_cooldown", "alice", "provider confirmed")]
    recent = page.split('id="actions-table"', 1)[1].split("</table>", 1)[0]
    assert recent.count("<tr>") == 4 and "alice" in recent and "provider confirmed" in recent
    assert "by <b>bob</b>: nobody resumes" in r4 and 'id="close-form"' not in r4
    led = Ledger.open(written, clock=ManualClock(NOW), migrate_schema=False)
    try:
        assert led.group_projections(["g3"])["g3"].mode.value == "open"
        assert led.get_run("r4").status.value == "failed"
        # Priced at the route's frozen price (C is free): posted 0, the hold released.
        assert led.get_run("r4").reserved == Decimal(0)
    finally:
        led.close()


def test_closing_a_run_its_block_ended_is_reported_as_a_close(written: str) -> None:
    with _client(written, actions=True, token=TOKEN) as c:
        form = {"status": "succeeded", "by": "bob", "reason": "final"}
        first = c.post("/api/actions/runs/r2/close", json=form, headers=HEADER).json()
        again = c.post("/api/actions/runs/r2/close", json=form, headers=HEADER).json()
        page = c.get("/runs/r2").text
    assert first["changed"] is True and again["changed"] is False, (first, again)
    assert "by <b>bob</b>: final" in page and 'id="close-form"' not in page


@pytest.mark.parametrize(("path", "form", "status", "says"), [
    ("/api/actions/clear-cooldown", {"key": "g3", "group": "1", "reason": "x"}, 400, "by"),
    ("/api/actions/clear-cooldown", {"key": "g3", "group": "1", "by": "a", "reason": " "},
     400, "reason"),
    ("/api/actions/clear-cooldown", {"key": "g3", "group": "maybe", "by": "a", "reason": "x"},
     400, "group"),
    ("/api/actions/clear-cooldown", {"key": "nope", "by": "a", "reason": "x"}, 404,
     "no health is recorded"),
    ("/api/actions/clear-cooldown", {"key": "A", "by": "a", "reason": "x"}, 409,
     "nothing to clear"),
    ("/api/actions/runs/r4/close", {"status": "running", "by": "a", "reason": "x"}, 400,
     "status"),
    ("/api/actions/runs/r2/close", {"status": "failed", "by": "a", "reason": "x"}, 409,
     "already ended"),
    ("/api/actions/runs/nope/close", {"status": "failed", "by": "a", "reason": "x"}, 404,
     "unknown run id"),
    ("/api/actions/attempts/r2-a1/settle", {"outcome": "failed", "by": "a", "reason": "x"},
     409, "not unknown"),
    ("/api/actions/attempts/r4-a1/settle", {"outcome": "failed", "prompt_tokens": "many",
                                             "by": "a", "reason": "x"}, 400, "prompt_tokens"),
    ("/api/actions/attempts/r4-a1/settle", {"outcome": "maybe", "by": "a", "reason": "x"},
     400, "outcome"),
], ids=["no-by", "blank-reason", "bad-group", "unknown-key", "nothing-to-clear", "bad-status",
        "ended-run", "unknown-run", "settled-attempt", "bad-tokens", "bad-outcome"])
def test_bad_input_is_the_ledgers_typed_error_and_records_nothing(
        written: str, path: str, form: dict[str, str], status: int, says: str) -> None:
    before = _recorded(written)
    with _client(written, actions=True, token=TOKEN) as c:
        res = c.post(path, data=form, headers=HEADER)
        html = c.post(path.removeprefix("/api"), data={**form, "token": TOKEN})
    assert res.status_code == status and says in res.json()["error"] + res.json().get(
        "field", "")
    assert html.status_code == status and "refused" in html.text
    assert _recorded(written) == before


@pytest.mark.postgres
@pytest.mark.parametrize("read_only_sessions", [True, False],
                         ids=["read_only_sessions", "select_only"])
def test_a_dashboard_on_a_readers_role_warns_at_start_and_refuses_each_action_403_with_the_fix(
        pg_server: Any, pg_url: str, caplog: pytest.LogCaptureFixture,
        read_only_sessions: bool) -> None:
    # Not 503 ("unavailable": clients retry): the role can never write. Nothing is recorded.
    seed(pg_url)
    ro_url = reader_role(pg_server, pg_url, read_only_sessions=read_only_sessions)
    role = ro_url.split("://", 1)[1].split("@", 1)[0]
    before = _recorded(pg_url)
    with caplog.at_level(logging.WARNING, logger="ledger.dashboard.app"), \
            _client(ro_url, actions=True, token=TOKEN) as c:
        warned = [r.getMessage() for r in caplog.records if r.name == "ledger.dashboard.app"]
        for path, good in GOOD_JSON.items():
            res = c.post(path, json=good, headers=HEADER)
            assert res.status_code == 403, (path, res.text)
            doc = res.json()
            assert doc["ok"] is False and set(doc) == {"ok", "error"}, doc
            assert f'role "{role}"' in doc["error"] and "without --allow-actions" in doc["error"]
            assert "retrying will not help" in doc["error"]
            form = {k: str(v) for k, v in good.items()} | {"token": TOKEN}
            page = c.post(path.removeprefix("/api"), data=form)
            assert page.status_code == 403 and "refused" in page.text
        assert c.get("/").status_code == 200  # reading is what the role is for
    assert _recorded(pg_url) == before
    assert len(warned) == 1 and role in warned[0] and "--allow-actions" in warned[0], warned
    assert ("read-only" if read_only_sessions else "lacks INSERT on events") in warned[0]
    # The writing role's dashboard says nothing.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ledger.dashboard.app"), \
            _client(pg_url, actions=True, token=TOKEN):
        pass
    assert [r for r in caplog.records if r.name == "ledger.dashboard.app"] == []


# Each JSON action with its good fields, and which of them take what but text.
GOOD_JSON = {
    "/api/actions/clear-cooldown": {"key": "g3", "group": True, "by": "ana", "reason": "ok"},
    "/api/actions/runs/r4/close": {"status": "failed", "by": "ana", "reason": "ok"},
    "/api/actions/attempts/r4-a1/settle": {"outcome": "succeeded", "prompt_tokens": 1,
                                           "completion_tokens": 1, "cost": "0.1",
                                           "by": "ana", "reason": "ok"},
}
NOT_TEXT: list[Any] = [["ana", {"x": 1}], {"name": "ana"}, 5, 1.5, True]
# A count takes a whole number, an amount any number, a flag true or false.
TYPED_RIGHT = [("prompt_tokens", 5), ("completion_tokens", 5), ("cost", 5), ("cost", 1.5),
               ("group", True)]


def test_a_json_field_of_the_wrong_type_is_refused_naming_it_and_never_recorded_as_its_repr(
        written: str) -> None:
    before = _recorded(written)
    with _client(written, actions=True, token=TOKEN) as c:
        for path, good in GOOD_JSON.items():
            for name in good:
                for value in NOT_TEXT:
                    if (name, value) in TYPED_RIGHT:
                        continue
                    res = c.post(path, json={**good, name: value}, headers=HEADER)
                    assert res.status_code == 400, (path, name, value, res.text)
                    assert res.json()["field"] == name, (path, name, value)
    assert _recorded(written) == before
    # A JSON number is an amount, read exactly as written.
    with _client(written, actions=True, token=TOKEN) as c:
        res = c.post("/api/actions/attempts/r4-a1/settle", headers=HEADER, json={
            **GOOD_JSON["/api/actions/attempts/r4-a1/settle"], "cost": 0.1})
        assert res.status_code == 200, res.text
        [settled] = c.get("/api/actions").json()["items"][:1]
    assert (settled["by"], settled["reason"], settled["data"]["cost"]) == ("ana", "ok", "0.1")


# -- ids in links and form actions ---------------------------------------------------------------

# r1 is a seeded Run: "r%31" decoded once more is it. "?" and "#" end a path, "/" splits it.
ODD_IDS = ["r%31", "a?b#c", "a/b c", "r%2531/close"]


def _seed_odd_runs(url: str) -> None:
    """One Run per odd id, each holding an unknown Attempt with an odd id of its own."""
    from .seed import BUDGET, ENV, A, B

    led = Ledger.open(url, clock=ManualClock(NOW), migrate_schema=False)
    try:
        for rid in [*ODD_IDS, ".."]:
            # A Run may no longer be admitted as "..": one an earlier version admitted is still
            # shown.
            as_an_earlier_version(led, "admit_run", rid, plan=[B, A], budget=BUDGET)
            lease = led.acquire_lease(rid, ttl_s=1000)
            att = led.begin_attempt(lease, route="B", envelope_hash=ENV, reserve="0.01",
                                    attempt_id=f"{rid} a%31?#/")
            led.settle_attempt(lease, att.attempt_id, outcome="unknown")
            led.release_lease(lease)
    finally:
        led.close()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _post_form(url: str, form: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(url, data=urllib.parse.urlencode(form).encode(),
                                 headers={"Origin": url.split("/actions/", 1)[0]})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _hrefs(page: str, attr: str, text: str | None = None) -> list[str]:
    import html
    import re

    after = f">{re.escape(html.escape(text))}</a>" if text is not None else ""
    return [html.unescape(m) for m in re.findall(f'{attr}="([^"]*)"{after}', page)]


def _is_page_of(page: str, rid: str) -> bool:
    import html

    return f"<h2>Run <code>{html.escape(rid)}</code></h2>" in page


def test_links_and_forms_reach_the_run_and_attempt_whose_id_they_show(written: str) -> None:
    """Served by uvicorn (the test client decodes a path twice, a server once): every link and
    form action a page hands out reaches the Run or Attempt whose id it shows, whatever the
    id holds, and an action posted from a Run's page acts on that Run alone."""
    _seed_odd_runs(written)
    with _serving_actions(written) as base:
        runs = _get(base + "/runs")
        for rid in [*ODD_IDS, ".."]:
            [href] = _hrefs(runs, "href", rid)
            assert _is_page_of(_get(base + href), rid), (rid, href)
        for rid in ODD_IDS:
            page = _get(base + _hrefs(runs, "href", rid)[0])
            [settle] = _hrefs(page.split('class="settle-form"', 1)[1], "action")[:1]
            status, done = _post_form(base + settle, {
                "outcome": "not_sent", "by": "ops", "reason": f"console for {rid}",
                "token": TOKEN})
            assert status == 200, done
            [back] = _hrefs(done, "href", "back")
            page = _get(base + back)
            assert _is_page_of(page, rid)
            [close] = _hrefs(page.split('id="close-form"', 1)[1], "action")[:1]
            status, done = _post_form(base + close, {
                "status": "failed", "by": "ops", "reason": f"close {rid}", "token": TOKEN})
            assert status == 200, done
            assert _is_page_of(_get(base + _hrefs(done, "href", "back")[0]), rid)
        recent = _get(base + "/").split('id="actions-table"', 1)[1].split("</table>", 1)[0]
        targets = _hrefs(recent, "href")
        assert [t for t in targets if _is_page_of(_get(base + t), "r1")] == []
        assert len(targets) == 2 * len(ODD_IDS)
    led = Ledger.open(written, clock=ManualClock(NOW), migrate_schema=False)
    try:
        done = Audit(led).actions(kinds=["close", "late_receipt"], limit=50).items
        assert sorted((a.kind, a.run_id, a.attempt_id, a.reason) for a in done) == sorted(
            [("close", rid, None, f"close {rid}") for rid in ODD_IDS]
            + [("late_receipt", rid, f"{rid} a%31?#/", f"console for {rid}")
               for rid in ODD_IDS])
        assert led.get_run("r1").status.value == "succeeded"
        assert {led.get_run(rid).status.value for rid in ODD_IDS} == {"failed"}
    finally:
        led.close()


# -- a real browser ----------------------------------------------------------------------------


def _need_chromium() -> str:
    chromium = _chromium()
    if chromium is None:
        msg = "chromium is not installed (apt-get install chromium); browser test cannot run"
        if REQUIRE:
            pytest.fail(msg + " and LEDGER_REQUIRE_POSTGRES=1")
        pytest.skip(msg)
    return chromium


def _artifacts() -> Path:
    path = Path(os.environ.get("LEDGER_ARTIFACTS", "test-artifacts")).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.browser
def test_budgets_in_headless_chromium(seeded_url: str) -> None:
    chromium = _need_chromium()
    backend = "postgres" if seeded_url.startswith("postgresql") else "sqlite"
    with _serving(seeded_url, ManualClock(NOW)) as base:
        dom = _browse(chromium, "--dump-dom", base + "/")
        assert dom.returncode == 0, dom.stderr[-2000:]
        spend = dom.stdout.split('id="spend"', 1)[1].split("</section>", 1)[0]
        assert "<td>t2</td>" in spend and "1.977000" in spend  # 2 - 0.003 - 0.02
        assert 'id="mode">read-only<' in dom.stdout and 'id="clear-cooldown"' not in dom.stdout
        dom = _browse(chromium, "--dump-dom", base + "/budgets?by=label&label=team&days=2")
        assert dom.returncode == 0 and 'id="spend-table"' in dom.stdout
        shot = _artifacts() / f"dashboard-budgets-{backend}.png"
        shot.unlink(missing_ok=True)
        res = _browse(chromium, f"--screenshot={shot}", "--window-size=1400,700",
                      base + "/budgets?days=3")
        assert res.returncode == 0 and shot.stat().st_size > 10_000


@pytest.mark.browser
def test_actions_in_headless_chromium_and_a_forged_form_is_refused(written: str) -> None:
    chromium = _need_chromium()
    with _serving_actions(written) as base:
        dom = _browse(chromium, "--dump-dom", base + "/runs/r4")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert 'id="close-form"' in dom.stdout and 'name="token"' in dom.stdout
        assert 'type="password"' in dom.stdout
        before = _recorded(written)
        # Another site's page posts the dashboard's form, token and all: refused.
        with tempfile.TemporaryDirectory() as tmp:
            evil = Path(tmp) / "evil.html"
            evil.write_text(
                '<html><body onload="document.forms[0].submit()"><form method="post" '
                f'action="{base}/actions/clear-cooldown"><input name="key" value="g3">'
                '<input name="group" value="1"><input name="by" value="mallory">'
                f'<input name="reason" value="csrf"><input name="token" value="{TOKEN}">'
                "</form></body></html>")
            res = _browse(chromium, "--virtual-time-budget=5000", "--dump-dom",
                          evil.as_uri())
        assert res.returncode == 0, res.stderr[-2000:]
        assert "<title>refused</title>" in res.stdout and "nothing was changed" in res.stdout
        assert _recorded(written) == before
        # The same form from the dashboard's own origin (as its page submits it) acts.
        body = urllib.parse.urlencode({"key": "g3", "group": "1", "by": "alice",
                                       "reason": "provider confirmed", "token": TOKEN})
        req = urllib.request.Request(base + "/actions/clear-cooldown", data=body.encode(),
                                     headers={"Origin": base, "Sec-Fetch-Site": "same-origin",
                                              "Content-Type":
                                              "application/x-www-form-urlencoded"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        dom = _browse(chromium, "--dump-dom", base + "/")
        recent = dom.stdout.split('id="actions-table"', 1)[1].split("</table>", 1)[0]
        assert "alice" in recent and "provider confirmed" in recent and "mallory" not in recent
        groups = dom.stdout.split('id="groups-table"', 1)[1].split("</table>", 1)[0]
        assert '<span class="unavailable">' not in groups  # g3 is open now
        shot = _artifacts() / "dashboard-actions.png"
        shot.unlink(missing_ok=True)
        res = _browse(chromium, f"--screenshot={shot}", "--window-size=1400,900",
                      base + "/runs/r4")
        assert res.returncode == 0 and shot.stat().st_size > 10_000


def _serving_actions(url: str) -> Any:
    """The dashboard with actions on, on a free loopback port (as :func:`_serving`)."""
    import contextlib
    import threading

    import uvicorn

    from ledger.testing.pgserver import free_port

    @contextlib.contextmanager
    def serving() -> Iterator[str]:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(
            create_app(url, clock=ManualClock(NOW), actions=True, token=TOKEN),
            host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        base = f"http://127.0.0.1:{port}"
        ready = threading.Event()
        for _ in range(500):  # bounded readiness poll, no fixed sleep
            if not thread.is_alive():
                break
            try:
                with urllib.request.urlopen(base + "/api/health", timeout=2) as r:
                    if r.status == 200:
                        ready.set()
                        break
            except (OSError, urllib.error.URLError):
                ready.wait(0.02)
        assert ready.is_set(), "dashboard did not start"
        try:
            yield base
        finally:
            server.should_exit = True
            thread.join(timeout=10)

    return serving()


# -- the body: bounded before it is read -----------------------------------------------------------


def _post_asgi(url: str, headers: dict[str, str], chunks: int, size: int = 64 * 1024
               ) -> tuple[int, int]:
    """POST to an action route straight through ASGI, the body ``chunks`` pieces of ``size``
    bytes: (the answer's status, how many pieces the app pulled). What the app pulls is what
    it holds in memory, which no test client shows."""
    import asyncio

    app = create_app(url, clock=ManualClock(NOW), actions=True, token=TOKEN)
    piece = b"a" * size
    pulled = 0
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        if pulled == chunks:
            return {"type": "http.disconnect"}
        pulled += 1
        return {"type": "http.request", "body": piece, "more_body": pulled < chunks}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/api/actions/clear-cooldown",
             "raw_path": b"/api/actions/clear-cooldown", "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in
                         {"host": "127.0.0.1:8765",
                          "content-type": "application/x-www-form-urlencoded",
                          **headers}.items()],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8765)}
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    return statuses[0], pulled


def test_a_body_declared_over_the_limit_is_refused_before_a_byte_of_it_is_read(
        seeded_url: str) -> None:
    """A 200 MB POST was read whole into memory before the 64 KiB limit applied."""
    status, pulled = _post_asgi(seeded_url, {"content-length": str(160 * 64 * 1024), **HEADER},
                                chunks=160)
    assert (status, pulled) == (413, 0)


def test_a_body_without_a_length_is_read_only_up_to_the_limit(seeded_url: str) -> None:
    status, pulled = _post_asgi(seeded_url, HEADER, chunks=160)
    assert status == 413 and pulled <= 2, pulled  # 64 KiB is the limit: the 2nd piece passes it


@pytest.mark.parametrize("headers", [{"X-Ledger-Token": "wrong-token-0123456789"},
                                     {"Authorization": "Bearer wrong-token-0123456789"},
                                     {**HEADER, "Origin": "http://evil.example"},
                                     {**HEADER, "Sec-Fetch-Site": "cross-site"}])
def test_what_the_headers_refuse_is_refused_before_the_body_is_read(
        seeded_url: str, headers: dict[str, str]) -> None:
    status, pulled = _post_asgi(seeded_url, {"content-length": "1024", **headers}, chunks=1,
                                size=1024)
    assert (status, pulled) == (403, 0)


def test_a_large_upload_over_http_is_refused_at_once_without_a_token(written: str) -> None:
    """Over real HTTP (uvicorn): a declared 200 MB body is answered 413 before it is sent;
    the server never waits for, nor holds, the bytes."""
    with _serving_actions(written) as base:
        host, port = urllib.parse.urlsplit(base).hostname, urllib.parse.urlsplit(base).port
        assert host is not None and port is not None
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(b"POST /api/actions/clear-cooldown HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\n"
                         b"Content-Length: 200000000\r\n\r\n")
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 413"), head[:100]


# -- a body the parser cannot read -----------------------------------------------------------------


@pytest.mark.parametrize("token", ["header", "none"])
def test_json_nested_deeper_than_the_parser_reads_is_the_400_body_is_not_json(
        written: str, token: str) -> None:
    """60 KB of nested arrays (under the size limit) was a 500 with a RecursionError."""
    before = _recorded(written)
    deep = "[" * 30000 + "]" * 30000
    with _client(written, actions=True, token=TOKEN) as c:
        res = c.post("/api/actions/clear-cooldown", content=deep,
                     headers={"Content-Type": "application/json",
                              **(HEADER if token == "header" else {})})
        assert res.status_code == 400, res.text
        assert res.json() == {"ok": False, "error": "the body is not JSON (nothing was changed)"}
        page = c.post("/actions/runs/r4/close", content='{"a":' * 10000 + "1" + "}" * 10000,
                      headers={"Content-Type": "application/json", **HEADER})
        assert page.status_code == 400 and "the body is not JSON" in page.text
    assert _recorded(written) == before


# -- behind a TLS proxy ----------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "origin", "status"), [
    ("dash.internal:443", "https://dash.internal", 200),
    ("dash.internal", "https://dash.internal:443", 200),
    ("DASH.internal:443", "https://dash.internal", 200),
    ("dash.internal:443", "http://dash.internal", 403),
    ("dash.internal", "https://dash.internal:8443", 403),
    ("dash.internal:443", "https://dash.internal:443/", 403)])
def test_an_origin_and_a_host_differing_only_by_the_schemes_default_port_are_one_origin(
        written: str, host: str, origin: str, status: int) -> None:
    """A proxy that writes Host as name:443 made every browser action a 403."""
    app = create_app(written, clock=ManualClock(NOW), actions=True, token=TOKEN,
                     allowed_hosts=["dash.internal"])
    with TestClient(app, base_url="https://dash.internal") as c:
        res = c.post("/api/actions/clear-cooldown", headers={
            **HEADER, "Host": host, "Origin": origin},
            data={"key": "g3", "group": "1", "by": "alice", "reason": "proxy"})
        assert res.status_code == status, res.text


def _trusted_proxy_dashboard(url: str, tmp_path: Path, *extra: str) -> tuple[Any, int]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ledger", "--db", url, "dashboard", "--port", "0",
         "--allowed-host", "dash.internal", "--allow-actions", "--token-file", str(token_file),
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("failover-ledger dashboard on http://127.0.0.1:"):
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the dashboard did not start: {line!r} {err!r}")
    return proc, int(line.split("127.0.0.1:", 1)[1].split("/", 1)[0])


def _browser_post_via_proxy(port: int, proxy: str) -> tuple[int, str]:
    """What a TLS proxy at address ``proxy`` forwards of a browser's form POST to
    https://dash.internal: its Host, its Origin, X-Forwarded-Proto https."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(proxy, 0))
    try:
        conn.request("POST", "/api/actions/runs/r4/close", body=urllib.parse.urlencode(
            {"status": "failed", "by": "alice", "reason": "via proxy", "token": TOKEN}),
            headers={"Host": "dash.internal", "Origin": "https://dash.internal",
                     "X-Forwarded-Proto": "https",
                     "Content-Type": "application/x-www-form-urlencoded"})
        res = conn.getresponse()
        return res.status, res.read().decode()
    finally:
        conn.close()


def test_behind_a_tls_proxy_it_is_told_to_trust_a_browsers_action_is_same_origin(
        written: str, tmp_path: Path) -> None:
    """A proxy not on 127.0.0.1 (here 127.0.0.2): its X-Forwarded-Proto was never trusted, the
    request stayed http, and the browser's https Origin was refused; nothing could say
    otherwise. --forwarded-allow-ips names the proxy; another address is still not trusted."""
    proc, port = _trusted_proxy_dashboard(written, tmp_path, "--forwarded-allow-ips",
                                          "127.0.0.2")
    try:
        status, body = _browser_post_via_proxy(port, "127.0.0.2")
        assert status == 200 and '"previous_status":"running"' in body, body
        status, body = _browser_post_via_proxy(port, "127.0.0.3")
        assert status == 403 and "X-Forwarded-Proto" in body, body
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("value", ["nope", "10.0.0.5/24", "", "10.0.0.1,", "dash.internal"])
def test_forwarded_allow_ips_must_be_addresses_or_networks(
        seeded_url: str, capsys: pytest.CaptureFixture[str], value: str) -> None:
    """uvicorn takes any word for a literal no client address ever equals: refused at start."""
    assert main(["--db", seeded_url, "dashboard", "--port", "0",
                 f"--forwarded-allow-ips={value}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "--forwarded-allow-ips" in err and "10.0.0.0/24" in err, err


def test_forwarded_allow_ips_takes_addresses_networks_and_any() -> None:
    from ledger.dashboard.app import check_forwarded_allow_ips

    assert check_forwarded_allow_ips("10.0.0.5, 10.1.0.0/16,::1") == ["10.0.0.5", "10.1.0.0/16",
                                                                      "::1"]
    assert check_forwarded_allow_ips(["*"]) == ["*"]
    assert check_forwarded_allow_ips(None) is None


# -- the names it answers to -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dash.internal:443", "https://dash.internal", "*", "",
                                  "a b", "*.internal", "dash.internal/"])
def test_an_allowed_host_that_no_host_header_could_name_is_refused_at_start(
        seeded_url: str, capsys: pytest.CaptureFixture[str], name: str) -> None:
    """Each was accepted and silently never matched (every request by that name a 400)."""
    with pytest.raises(InvalidArgument) as ei:
        create_app(seeded_url, allowed_hosts=[name])
    assert ei.value.field == "allowed_hosts" and "no scheme, no port" in str(ei.value)
    assert main(["--db", seeded_url, "dashboard", "--port", "0",
                 f"--allowed-host={name}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "--allowed-host" in err and "the name alone" in err, err


@pytest.mark.parametrize(("name", "host"), [("dash.internal", "dash.internal:8765"),
                                            ("DASH.internal.", "dash.internal"),
                                            ("10.0.0.5", "10.0.0.5:80"), ("fd00::5", "[fd00::5]"),
                                            ("[fd00::5]", "[fd00::5]:8765")])
def test_an_allowed_host_name_or_address_is_answered(seeded_url: str, name: str,
                                                      host: str) -> None:
    with _client(seeded_url, allowed_hosts=[name]) as c:
        assert c.get("/api/health", headers={"Host": host}).status_code == 200
