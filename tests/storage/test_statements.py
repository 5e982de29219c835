"""The hot path's statements are built from the schema with SQLAlchemy Core and compiled once per
database: every one compiles on both, none carries a parameter the transactions do not pass,
a healthy turn's transactions compile nothing, and PostgreSQL's fused writes keep each write's
own parameters."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import bindparam, select
from sqlalchemy.sql.elements import ClauseElement

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.storage import schema as s
from ledger.storage import statements as st
from ledger.storage.driver import Q
from ledger.storage.engine import normalize_url

from .helpers import budget, grant, routes

T0 = 1_700_000_000.0
NAMES = sorted(n for n, v in vars(st.Statements).items() if isinstance(v, st._stmt))


@pytest.mark.parametrize("sql", [st.SQLITE, st.postgres()], ids=["sqlite", "postgres"])
def test_every_statement_compiles_with_only_the_parameters_the_transactions_pass(
        sql: st.Statements) -> None:
    for name in NAMES:
        stmt = getattr(sql, name)
        assert stmt.text and stmt is getattr(sql, name), name  # compiled once, then kept
    # Positional on psycopg (the order the text takes them), named on sqlite3.
    assert (st.postgres().begin_run.names == ("status", "calls", "retries", "reserve",
                                            "reserve_tokens", "moved", "now", "run_id"))
    assert st.SQLITE.begin_run.names == () and ":reserve_tokens" in st.SQLITE.begin_run.text
    # The columns a statement returns are the schema's, by name.
    assert st.SQLITE.attempt.columns[:len(s.attempts.c)] == tuple(s.attempts.c.keys())


def test_a_constant_that_would_become_a_parameter_is_refused_when_compiled() -> None:
    stray = select(s.runs.c.run_id).where(s.runs.c.status == "running",
                                          s.runs.c.run_id == bindparam("run_id"))
    with pytest.raises(TypeError, match="status"):
        st.compile_stmt("stray", stray, st.SQLITE_SPELLING.target)
    ok = select(s.runs.c.run_id).where(s.runs.c.status == st.lit("running"),
                                       s.runs.c.run_id == bindparam("run_id"))
    assert "'running'" in st.compile_stmt("ok", ok, st.postgres_spelling().target).text


def test_the_databases_differ_only_where_their_dialects_do() -> None:
    assert st.postgres().lock_run.text.endswith("FOR UPDATE")
    assert "FOR UPDATE" not in st.SQLITE.lock_run.text  # BEGIN IMMEDIATE serializes writers
    assert "= ANY(%s)" in st.postgres().health.text
    assert "IN (SELECT value FROM json_each(:keys))" in st.SQLITE.health.text
    assert "greatest(" in st.postgres().group_fact.text and "MAX(" in st.SQLITE.group_fact.text
    assert "SKIP LOCKED" in st.postgres().forget_probes.text
    assert st.SQLITE.NOTIFY_QUEUE is None and st.postgres().NOTIFY_QUEUE is not None
    items = [Q(st.SQLITE.renew, {}), Q(st.SQLITE.finish, {})]
    assert st.SQLITE.writes(items) == tuple(items)  # no round trips to save on SQLite


def test_the_hot_path_compiles_nothing_after_a_statements_first_use(db_url: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def attempt(led: Ledger, lease: Any) -> None:
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.001")
        led.renew_lease(lease, ttl_s=30)
        led.get_attempt(att.attempt_id)

    with Ledger.open(db_url, clock=ManualClock(T0)) as led:
        led.configure_group("g", max_in_flight=None)
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=30)
        attempt(led, lease)  # the first use of each statement compiles it
        compiled: list[str] = []
        original = ClauseElement.compile

        def counted(self: ClauseElement, *args: Any, **kw: Any) -> Any:
            compiled.append(type(self).__name__)
            return original(self, *args, **kw)

        monkeypatch.setattr(ClauseElement, "compile", counted)
        for _ in range(3):
            attempt(led, lease)
        assert compiled == []
        monkeypatch.undo()
        assert len(led.timeline("r1")) == 4


@pytest.mark.postgres
def test_fused_writes_keep_each_writes_own_parameters_and_row_order(pg_url: str) -> None:
    import psycopg

    sql = st.postgres()
    event = {"run_id": "r1", "attempt_id": None, "kind": "k", "data": "{}"}
    items = [
        Q(sql.insert_event, [{**event, "kind": "first", "created_at": 1.0},
                             {**event, "kind": "second", "created_at": 2.0}], many=True),
        Q(sql.ensure_group, {"group": "g1", "now": 3.0}),
        Q(sql.insert_provenance, {"run_id": "r1", "ref": "a1", "content_hash": "h",
                                  "kind": "model_output", "now": 4.0}),
        Q(sql.insert_event, [], many=True),  # a batch of no rows writes nothing
    ]
    [fused] = sql.writes(items)
    assert isinstance(fused.stmt, st.Fused) and fused.stmt.text.startswith("WITH")
    assert sql.writes(items)[0].stmt is fused.stmt  # compiled once per shape
    conninfo = normalize_url(pg_url).replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo) as conn:
        conn.execute(fused.stmt.text, fused.stmt.args(fused.params))
        assert conn.execute("SELECT kind, created_at FROM events ORDER BY event_id").fetchall() \
            == [("first", 1.0), ("second", 2.0)]
        assert conn.execute("SELECT updated_at FROM capacity_groups WHERE group_id = 'g1'"
                            ).fetchall() == [(3.0,)]
        assert conn.execute("SELECT created_at FROM provenance").fetchall() == [(4.0,)]
        conn.rollback()
