"""On PostgreSQL, the audit queries use indexes: EXPLAIN shows no Seq Scan on attempts or events
(or on a partition of them holding rows, since migration 0008).

The ledger is filled by the benchmarks' bulk generator and deepener (5k attempts over the last 8
days, copied three times further back by the database itself: some 20k attempts over 32 days,
so one day is ~3% of the table, as in a long-lived ledger) and ANALYZEd. Every statement the
audit API actually sends is captured from the engine and EXPLAINed with its own parameters, so
the test checks the real queries, not copies of them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.deepen import deepen
from benchmarks.generate import generate
from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.ops.audit import Audit
from ledger.storage.partitions import is_partition_name
from tests.audit.sent import sent_selects
from tests.storage.helpers import sql_context

pytestmark = pytest.mark.postgres

END = 1_700_000_000.0
DAY = 86400.0


@pytest.fixture(scope="module")
def big(pg_server: Any) -> Iterator[Audit]:
    name = f"plans_{os.getpid()}"
    url = pg_server.create_database(name, template="ledger_template")
    led = Ledger.open(url, clock=ManualClock(END), migrate_schema=False)
    generate(led, attempts=5_000, days=7.5, end=END, seed=7)
    deepen(led, 3)  # ends with ANALYZE
    try:
        yield Audit(led)
    finally:
        led.close()


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _plans_of(audit: Audit, call: Any) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """Run ``call``; EXPLAIN every SELECT it sent; [(sql, [(node type, relation), ...])]."""
    sent = sent_selects(audit, call)
    engine = sql_context(audit.ledger).engine
    out = []
    with engine.connect() as conn:
        held = {str(r[0]) for r in conn.exec_driver_sql(
            "SELECT DISTINCT tableoid::regclass::text FROM attempts "
            "UNION SELECT DISTINCT tableoid::regclass::text FROM events")}
        for sql, params in sent:
            raw = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + sql, params).scalar()
            doc = raw if isinstance(raw, list) else json.loads(raw)
            out.append((sql, [(n["Node Type"], _table(n, held))
                              for n in _nodes(doc[0]["Plan"])]))
    return out


def _table(node: dict[str, Any], held: set[str]) -> str | None:
    """The table a plan node reads: a partition of the history (migration 0008) counts as its
    table, except an empty one (a month ahead, the default partition: scanning it reads no
    row, and the planner rightly scans an empty table), which counts as none."""
    rel = node.get("Relation Name")
    if rel is None or not is_partition_name(rel):
        return rel
    return rel.rsplit("_", 1)[0] if rel in held else None


def _assert_indexed(audit: Audit, call: Any) -> None:
    plans = _plans_of(audit, call)
    assert plans, "the call sent no SELECT"
    for sql, nodes in plans:
        seq = [rel for kind, rel in nodes if kind == "Seq Scan" and rel in ("attempts", "events")]
        assert not seq, f"Seq Scan on {seq} in:\n{sql}\nplan: {nodes}"
        if "FROM attempts" in sql or "FROM events" in sql:
            assert any("Index" in kind for kind, _ in nodes), f"no index used: {sql} {nodes}"


def test_timeline_uses_indexes(big: Audit) -> None:
    run_id = big.runs(limit=1, since=END - DAY).items[0].run_id
    _assert_indexed(big, lambda: big.timeline(run_id))


@pytest.mark.parametrize("by", ["route", "group", "provider", "run", "tenant", "label"])
def test_one_day_totals_use_indexes(big: Audit, by: str) -> None:
    _assert_indexed(big, lambda: big.costs(by=by, label="team", since=END - DAY, until=END))


def test_the_failovers_count_reads_only_the_marked_runs_index(big: Audit) -> None:
    # A day's count touches neither attempts nor events (nor every Run of the day): 0012.
    for since in (END - DAY, None):
        plans = _plans_of(big, lambda: big.count_failovers(since=since, until=END))  # noqa: B023
        [(sql, nodes)] = plans
        assert "attempts" not in sql and "events" not in sql, sql
        kinds = [kind for kind, rel in nodes if rel == "runs"]
        assert kinds and "Seq Scan" not in kinds, nodes  # the partial index, not every Run


def test_failovers_attempts_open_and_activity_use_indexes(big: Audit) -> None:
    window = {"since": END - DAY, "until": END}
    _assert_indexed(big, lambda: big.failovers(limit=50, **window))
    route = big.attempts(limit=1).items[0].route_id
    _assert_indexed(big, lambda: big.attempts(route=route, limit=100, **window))
    _assert_indexed(big, lambda: big.attempts(category="rate_limit", limit=100, **window))
    _assert_indexed(big, lambda: big.open_attempts(limit=100))
    _assert_indexed(big, lambda: big.activity(buckets=48, **window))
    _assert_indexed(big, lambda: big.runs(status="failed", limit=50))


def test_latency_percentiles_and_the_failover_count_use_indexes(big: Audit) -> None:
    window = {"since": END - DAY, "until": END}
    _assert_indexed(big, lambda: big.latency(**window))
    route = big.attempts(limit=1).items[0].route_id
    _assert_indexed(big, lambda: big.latency(route=route, state="succeeded", **window))
    _assert_indexed(big, lambda: big.latency(category="timeout", tenant="acme", **window))
    _assert_indexed(big, lambda: big.count_failovers(**window))


def test_spend_and_operator_actions_use_indexes(big: Audit) -> None:
    # Spend reads runs admitted in the window: through ix_runs_created_at, not every run.
    for kwargs in ({"by": "tenant"}, {"by": "label", "label": "team"},
                   {"by": "tenant", "every": 3600.0}):
        plans = _plans_of(big, lambda kw=kwargs: big.spend(since=END - DAY, until=END, **kw))
        assert plans
        for sql, nodes in plans:
            assert not [rel for kind, rel in nodes if kind == "Seq Scan"], (sql, nodes)
            assert any("Index" in kind for kind, _ in nodes), (sql, nodes)
    _assert_indexed(big, lambda: big.actions(limit=50))
    _assert_indexed(big, lambda: big.actions(since=END - DAY, kinds=["close"], limit=50))


def test_replay_reads_its_window_through_indexes(big: Audit) -> None:
    _assert_indexed(big, lambda: big.replay("failure-domain", since=END - DAY, until=END))
    run_id = big.runs(limit=1, since=END - DAY).items[0].run_id
    _assert_indexed(big, lambda: big.replay("failure-domain", run=run_id))


def test_the_aggregates_settings_last_their_transaction_only(big: Audit) -> None:
    # The audit's reads share the pool with the hot path: their work_mem and jit must not
    # stay set on a connection after their transaction.
    ctx = sql_context(big.ledger)
    with ctx.engine.connect() as conn:
        default = [conn.exec_driver_sql(f"SHOW {s}").scalar() for s in ("work_mem", "jit")]
        conn.rollback()
        with conn.begin():
            ctx.aggregating(conn)
            got = [conn.exec_driver_sql(f"SHOW {s}").scalar() for s in ("work_mem", "jit")]
            assert got == ["64MB", "off"] != default
        assert [conn.exec_driver_sql(f"SHOW {s}").scalar()
                for s in ("work_mem", "jit")] == default


@pytest.mark.parametrize("by", ["route", "group", "provider", "tenant", "label"])
def test_one_day_totals_over_rolled_hours_use_indexes(big: Audit, by: str) -> None:
    # Last in the module: the roll-up changes only what the totals read (docs/history.md).
    if not big.ledger.roll_up(lag=0).hours and by == "route":
        pytest.fail("nothing was rolled up: the test would check the plain totals again")
    window = {"since": END - DAY - 1800.5, "until": END - 900.25}  # ragged at both ends
    _assert_indexed(big, lambda: big.costs(by=by, label="team", **window))


def test_the_dashboards_chart_over_rolled_hours_uses_indexes(big: Audit) -> None:
    # After the totals' roll-up above (or its own): the hours of the day's chart are rolled.
    big.ledger.roll_up(lag=0)
    until = (math.floor(END / 3600) + 1) * 3600.0
    chart = lambda: big.activity(since=until - DAY, until=until, buckets=24)  # noqa: E731
    _assert_indexed(big, chart)
    assert any("attempt_rollups" in sql for sql, _ in _plans_of(big, chart))


def _assert_no_seq_scan_of(plans: Any, tables: tuple[str, ...]) -> None:
    """No plan of ``plans`` (``_plans_of``) reads one of ``tables`` whole."""
    for sql, nodes in plans:
        seq = [rel for kind, rel in nodes if kind == "Seq Scan" and rel in tables]
        assert not seq, f"Seq Scan on {seq} in:\n{sql}\nplan: {nodes}"


def test_metrics_and_the_routes_series_over_rolled_hours_use_indexes(big: Audit) -> None:
    # /metrics over a rolled-up history reads the attempts, moves and Runs the roll-ups do not
    # hold (hours not rolled, open attempts, live Runs) through indexes, never whole tables.
    big.ledger.roll_up(lag=0)
    plans = _plans_of(big, big.metrics)
    assert any("metric_rollups" in sql for sql, _ in plans)
    assert any("run_rollups" in sql for sql, _ in plans)
    _assert_no_seq_scan_of(plans, ("attempts", "events", "runs"))
    until = (math.floor(END / 3600) + 1) * 3600.0
    series = lambda: big.route_series(since=until - DAY, until=until, buckets=24)  # noqa: E731
    _assert_indexed(big, series)
    assert any("metric_rollups" in sql for sql, _ in _plans_of(big, series))


def test_spend_over_rolled_hours_uses_indexes(big: Audit) -> None:
    # Spend by tenant or label over a rolled-up window reads the Runs the roll-ups do not
    # hold (hours not rolled, live Runs) through ix_runs_created_at, and run_rollups for the
    # rest.
    big.ledger.roll_up(lag=0)
    for kwargs in ({"by": "tenant"}, {"by": "tenant", "every": 3600.0},
                   {"by": "tenant", "every": 86400.0}, {"by": "label", "label": "team"}):
        spend = lambda kw=kwargs: big.spend(  # noqa: E731
            since=END - DAY - 1800.5, until=END, **kw)
        plans = _plans_of(big, spend)
        assert any("run_rollups" in sql for sql, _ in plans), kwargs
        _assert_no_seq_scan_of(plans, ("runs",))


def test_the_activity_chart_in_any_buckets_reads_only_indexes(big: Audit) -> None:
    # Buckets that are not whole hours cannot use the roll-ups: the chart counts the window's
    # attempts from ix_attempts_created_at and the failed and unknown ones from
    # ix_attempts_state_created_at, never from the table's rows (docs/audit.md). An
    # index-only scan needs the visibility map, which VACUUM sets.
    with sql_context(big.ledger).engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM attempts")
    plans = _plans_of(big, lambda: big.activity(buckets=48, since=END - DAY, until=END))
    scans = [kind for sql, nodes in plans if "FROM attempts" in sql
             for kind, rel in nodes if rel == "attempts"]
    assert scans and set(scans) == {"Index Only Scan"}, plans
