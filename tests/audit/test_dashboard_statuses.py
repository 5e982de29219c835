"""The dashboard's JSON routes say what a client may do about a refusal: 400 for a query
parameter the route does not take (it was ignored: ``?tenat=acme`` answered for every tenant),
503 only for a database that is away or busy (retry), 403 for a role that may not read, and
500 for a set-up error, where a retry will not help (both answered 503, "retry later")."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock

from ..pgroles import reader_role
from ..storage.helpers import sqlite_held

pytest.importorskip("starlette", reason="the dashboard extra is not installed")

from starlette.testclient import TestClient

from ledger.dashboard.app import API_PARAMETERS, create_app

DOCS = Path(__file__).resolve().parents[2] / "docs" / "audit.md"


def _client(url: str) -> TestClient:
    return TestClient(create_app(url, clock=ManualClock(1.8e9)), base_url="http://127.0.0.1")


def _concrete(path: str) -> str:
    return path.replace("{run_id:path}", "r-1")


def test_a_query_parameter_a_json_route_does_not_take_is_refused_naming_it(
        tmp_path: Path) -> None:
    url = str(tmp_path / "ledger.db")
    Ledger.open(url).close()
    with _client(url) as c:
        for path, takes in API_PARAMETERS.items():
            got = c.get(_concrete(path), params={"tenat": "acme"})
            assert got.status_code == 400, (path, got.text)
            doc = got.json()
            assert doc["field"] == "tenat", doc
            assert "unknown query parameter 'tenat'" in doc["error"], doc
            for name in takes:
                assert name in doc["error"], (path, name, doc)
        # Each route still answers with what it takes (a known parameter is never refused as
        # unknown; a bad value of one is its own 400).
        for path, takes in API_PARAMETERS.items():
            for name in takes:
                got = c.get(_concrete(path), params={name: "x"})
                assert "unknown query parameter" not in got.text, (path, name, got.text)


def test_the_docs_list_each_json_routes_parameters_as_the_dashboard_takes_them() -> None:
    table = DOCS.read_text()
    rows = dict(re.findall(r"^\| `(/api/[^`]+)` \| ([^|]*) \|", table, re.M))
    documented = {path: frozenset(re.findall(r"`([a-z_]+)`", cell)) for path, cell in rows.items()}
    assert documented == {path.replace(":path", ""): takes
                          for path, takes in API_PARAMETERS.items()}


def test_a_busy_database_is_503_a_ledger_without_its_tables_is_500_never_retry(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    Ledger.open(str(path)).close()
    # Another process's lock that outlasts the busy timeout: away for now, retry.
    with sqlite_held(path) as holder, _client(f"sqlite:///{path}?timeout=0.2") as c:
        got = c.get("/api/runs")
        assert got.status_code == 503, got.text
        assert "unavailable" in got.json()["error"]
        holder.execute("COMMIT")
        holder.close()
        assert c.get("/api/runs").status_code == 200
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("ALTER TABLE runs RENAME TO runs_elsewhere")
        other.close()
        # A ledger whose tables are gone: no retry brings them back.
        got = c.get("/api/runs")
        assert got.status_code == 500, got.text
        page = c.get("/runs?id=r-1")
        assert page.status_code == 500 and "server error" in page.text
    # An operator's action on it alike: 500, not "retry later".
    token = "op-token-7c1e0b5d2f9a4e36"
    app = create_app(str(path), clock=ManualClock(1.8e9), actions=True, token=token)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        got = c.post("/api/actions/runs/r-1/close", json={"status": "failed"},
                     headers={"X-Ledger-Token": token})
        assert got.status_code == 500, got.text


@pytest.mark.postgres
def test_a_role_that_may_not_read_is_403_not_503(pg_server: Any, pg_url: str) -> None:
    reader = reader_role(pg_server, pg_url)
    with _client(reader) as c:
        assert c.get("/api/runs").status_code == 200
        pg_server.psql(f"REVOKE SELECT ON runs FROM {reader_name(reader)}",
                       pg_url.rsplit("/", 1)[1])
        got = c.get("/api/runs")
        assert got.status_code == 403, got.text


def reader_name(url: str) -> str:
    return url.split("://", 1)[1].split("@", 1)[0]
