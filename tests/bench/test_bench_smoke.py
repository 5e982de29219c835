"""The benchmark suite at tiny sizes: each report's structure and what it counts, never timings.

Benchmarks are scripts that report; these tests run each one on both backends with sizes that
finish in seconds and check that the report has the shape the docs describe, that its figures
are internally consistent (a ratio is the ratio of its columns), and that what a benchmark
counts or recovers is what it set up. No assertion reads a latency or a rate against a bound.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from benchmarks import ceiling, flat, queue, recover, retention, selector, turn, write
from benchmarks import floor as baseline
from benchmarks.cli import build_parser, main, parse_workers
from benchmarks.common import BenchError, Report, percentile
from benchmarks.txcount import PgTxCounter, SqliteTxCounter
from ledger.api.facade import Ledger
from ledger.domain.values import Budget
from ledger.errors import InvalidArgument
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, str]:
    if backend == "sqlite":
        return "sqlite", str(tmp_path / "bench.db")
    return "postgresql", str(request.getfixturevalue("pg_url"))


def _table_lines(report: Report) -> list[str]:
    lines = report.format_table().splitlines()
    assert lines[0].split()[0] == report.columns[0].header
    assert len(lines) >= 1 + len(report.rows)
    return lines


def _json(report: Report) -> dict[str, object]:
    data = json.loads(report.to_json())
    assert data["bench"] == report.bench
    assert data["machine"]["cpus"] >= 1 and len(data["machine"]["load_before"]) == 3
    return data  # type: ignore[no-any-return]


# -- write -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_write_reports_each_path_beside_the_floor(backend: str, tmp_path: Path,
                                                  request: pytest.FixtureRequest) -> None:
    name, url = _url(backend, tmp_path, request)
    report = write.run([(name, url)], workers=[1, 2], attempts=4, warmup=1)
    assert [(r.backend, r.workers, r.path) for r in report.rows] == [
        (name, w, p) for w in (1, 2) for p in ("begin+settle", "begin(event)+settle")]
    for r in report.rows:
        assert r.attempts == 4 and r.per_s > 0 and r.floor_per_s > 0
        assert r.ratio == pytest.approx(r.per_s / r.floor_per_s, rel=0.02, abs=0.002)
        assert r.meets_target == (r.ratio >= write.TARGET_RATIO)
        assert r.cpu_us > 0 and r.floor_cpu_us > 0
        assert r.floor_two_commit_ms == pytest.approx(r.workers * 1000 / r.floor_per_s,
                                                      rel=0.01)
    assert len(_table_lines(report)) == 1 + len(report.rows) + 2 + 1 + 1  # targets, notes, machine
    assert not baseline.table_exists(url)  # the floor's table is dropped afterwards
    # The ledger's attempts were really recorded and settled, by one run per worker.
    with Ledger.open(url) as led:
        page = led.attempts(route=write.BENCH_ROUTE.id, limit=1000)
    assert len(page.items) == 2 * ((4 + 1) + (4 + 2))  # 2 paths x (measured + warm-ups)
    assert {a.state.value for a in page.items} == {"succeeded"}
    assert len({a.run_id for a in page.items}) == 2 * (1 + 2)


# -- group-ceiling ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_group_ceiling_reports_one_group_beside_n_groups(backend: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    name, url = _url(backend, tmp_path, request)
    report = ceiling.run([(name, url)], workers=[1, 2], pairs=4, warmup=1)
    # The raw driver's rows beside the ledger's on PostgreSQL only (SQLite serializes writers).
    paths = ["ledger", *(ceiling.RAW_PATHS if name == "postgresql" else ())]
    assert [(r.backend, r.workers, r.path) for r in report.rows] == [
        (name, w, p) for w in (1, 2) for p in paths]
    for r in report.rows:
        assert r.pairs == 4 and r.one_per_s > 0 and r.many_per_s > 0
        assert r.ratio == pytest.approx(r.one_per_s / r.many_per_s, rel=0.02, abs=0.002)
        assert r.meets_target == (r.one_per_s >= ceiling.TARGET_PER_S)
        assert r.one_cpu_us > 0 and r.many_cpu_us > 0
    assert len(_table_lines(report)) == 1 + len(report.rows) + 1 + 2 + 1  # target, notes, machine
    if name == "postgresql":
        import psycopg

        with psycopg.connect(**baseline.pg_connect_args(url)) as pg:  # the raw tables are gone
            assert pg.execute("SELECT to_regclass(%s)", (ceiling.RAW_SLOTS,)).fetchone() == (
                None,)
    assert _json(report)["rows"][0]["workers"] == 1  # type: ignore[index]
    with Ledger.open(url) as led:
        groups = led.group_projections(None)
        atts = led.attempts(limit=1000).items
    # Each measurement's groups were limited, far above the workers, and left empty; the one
    # group took every worker of its measurement, the N groups one worker each.
    limited = {g: p for g, p in groups.items() if g.startswith("ceil-")}
    assert {p.limit for p in limited.values()} == {ceiling.LIMIT}
    assert all(p.in_flight == 0 for p in limited.values())
    assert sorted(g.rsplit("-", 1)[1] for g in limited) == ["g0", "g0", "g1", "one", "one"]
    # Every pair was a begin admitted by its group and settled: nothing refused or queued.
    assert len(atts) == 2 * ((4 + 1) + (4 + 2))  # 2 shapes x (measured + warm-ups)
    assert {a.state.value for a in atts} == {"succeeded"}


# -- queue -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_queue_serves_every_turn_and_counts_begins_and_cpu_per_turn(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    name, url = _url(backend, tmp_path, request)
    report = queue.run([(name, url)], sessions=5, turns=2, limit=2, delay_ms=5)
    [r] = report.rows
    assert (r.backend, r.sessions, r.turns, r.limit, r.served) == (name, 5, 2, 2, 10)
    assert r.floor_s == pytest.approx(0.005 * 10 / 2)
    assert r.x_floor == pytest.approx(r.wall_s / r.floor_s, rel=0.02)
    # Every turn begins at least once; a turn that queued at least twice (it queues, then is
    # admitted: usually by a third begin after registering for wake-ups, but the begin that
    # registers it is admitted itself when a slot came free in between). More sessions than
    # slots: some queued.
    assert 0 < r.queued <= 10
    assert r.begins >= 10 + r.queued
    assert r.begins_per_turn == pytest.approx(r.begins / 10, abs=0.01)
    assert r.tx_per_turn > r.begins_per_turn and r.cpu_ms_per_turn > 0
    assert len(_table_lines(report)) == 1 + 1 + len(report.notes) + 1
    assert _json(report)["rows"][0]["begins"] == r.begins  # type: ignore[index]
    with Ledger.open(url) as led:
        atts = led.attempts(route="bench-queue", limit=100).items
        group = led.group_projections([queue.GROUP])[queue.GROUP]
        rejected = led.attempts(state="rejected").items
    assert rejected == []  # a wait is no refusal
    assert len(atts) == 10 and {a.state.value for a in atts} == {"succeeded"}
    assert (group.limit, group.in_flight, group.waiting) == (2, 0, 0)


def test_write_measure_counts_every_attempt_of_every_worker(tmp_path: Path) -> None:
    url = str(tmp_path / "m.db")
    with write.prepared(url):
        m = write.measure(url, "floor", 2, 5, warmup=0)
    assert (m.mode, m.workers, m.attempts) == ("floor", 2, 5)
    assert m.seconds > 0 and m.per_second > 0 and m.cpu_s > 0


def test_write_worker_failure_is_a_bench_error(tmp_path: Path) -> None:
    url = str(tmp_path / "nothing-prepared.db")  # no ledger schema, no floor table
    sqlite3.connect(url).close()
    with pytest.raises(BenchError, match="worker"):
        write.measure(url, "floor", 1, 1, warmup=0)


# -- the floor and the transaction counters ----------------------------------------------------

def test_sqlite_counter_tells_reads_writes_and_autocommit_apart(tmp_path: Path) -> None:
    path = str(tmp_path / "c.db")
    other = str(tmp_path / "other.db")
    original = sqlite3.connect
    counter = SqliteTxCounter(path)
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        elsewhere = sqlite3.connect(other, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE t (x)")
        counter.start()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute("COMMIT")
        conn.execute("BEGIN")
        conn.execute("SELECT * FROM t").fetchall()
        conn.execute("COMMIT")
        conn.execute("UPDATE t SET x = 2")  # autocommit: a write transaction of its own
        conn.execute("SELECT count(*) FROM t").fetchall()  # a read of its own
        conn.execute("PRAGMA user_version")  # not a transaction
        elsewhere.execute("CREATE TABLE u (y)")  # another file: not counted
        got = counter.finish()
        conn.close()
        elsewhere.close()
    finally:
        counter.close()
    assert (got.transactions, got.reads, got.writes, got.connections) == (4, 2, 2, 0)
    assert sqlite3.connect is original  # the wrapper is gone with the counter


def test_sqlite_counter_says_unknown_when_it_saw_nothing(tmp_path: Path) -> None:
    counter = SqliteTxCounter(str(tmp_path / "never-opened.db"))
    try:
        counter.start()
        got = counter.finish()
    finally:
        counter.close()
    assert got.transactions is None and got.per(10) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_floor_costs_two_commits_per_attempt(backend: str, tmp_path: Path,
                                             request: pytest.FixtureRequest) -> None:
    name, url = _url(backend, tmp_path, request)
    Ledger.open(url).close()
    baseline.create_table(url)
    if name != "sqlite":
        # The migrations' DDL leaves the catalogs due for autovacuum, whose workers' commits
        # count in pg_stat_database too: vacuumed now, nothing is due inside the window.
        import psycopg

        with psycopg.connect(autocommit=True, **baseline.pg_connect_args(url)) as conn:
            conn.execute("VACUUM ANALYZE")
    counter = (SqliteTxCounter(baseline.sqlite_path(url)) if name == "sqlite"
               else PgTxCounter(url))
    try:
        counter.start()
        w = baseline.open_writer(url, "t")
        for i in range(10):
            w.attempt(f"a{i}", 1.0)
        w.close()
        got = counter.finish()
    finally:
        counter.close()
        baseline.drop_table(url)
    assert got.transactions is not None
    if name == "sqlite":
        assert (got.transactions, got.writes, got.connections) == (20, 20, 1)
    else:
        # The server also counts the connection's start and, in autocommit, each statement's
        # first (preparing) round trip: at most 1 + 2 beyond the 20 commits.
        assert got.connections == 1
        assert 20 <= got.transactions <= 23


# -- turn ------------------------------------------------------------------------------------

def _check_turn_rows(report: Report, name: str, drivers: list[str], conc: list[int],
                     counted: bool) -> None:
    keys = [(r.backend, r.driver, r.scenario, r.concurrency) for r in report.rows]
    assert keys == [(name, d, s, c) for d in drivers for s in turn.SCENARIOS for c in conc]
    for r in report.rows:
        assert r.calls >= 4 and r.p50_ms > 0 and r.raw_p50_ms > 0
        assert r.overhead_p50_ms == pytest.approx(r.p50_ms - r.raw_p50_ms, abs=0.01)
        assert r.ledger_cpu_ms == pytest.approx(r.cpu_ms - r.raw_cpu_ms, abs=0.01)
        # The report rounds the ratio to 3 decimals: under load a tiny ratio is mostly rounding.
        assert r.throughput_ratio == pytest.approx(r.calls_per_s / r.raw_calls_per_s, rel=0.02,
                                                   abs=0.0005)
        assert (r.target_overhead_ms is not None) == (r.concurrency == 1)
        if counted:
            assert r.tx_per_call is not None
            assert r.checks["tx"] == (r.tx_per_call <= turn.TX_TARGET[r.scenario])
            if r.backend == "sqlite" and r.driver == "async" and r.concurrency > 1:
                # Concurrent turns' transactions that queue on SQLite's thread commit as one
                # (ledger.storage.groupcommit): fewer transactions than attempts' commits.
                assert 0 < r.tx_per_call <= turn.TX_TARGET[r.scenario]
            else:
                # Otherwise an attempt is at least its begin and settle commits.
                assert r.tx_per_call >= (2 if r.scenario == "healthy" else 4)
        else:
            assert r.tx_per_call is None
    assert set(_json(report)["floor_two_commit_ms"]) == {name}  # type: ignore[arg-type]


def test_turn_on_sqlite_every_driver_scenario_and_concurrency(tmp_path: Path) -> None:
    url = str(tmp_path / "turn.db")
    report = turn.run([("sqlite", url)], concurrency=[1, 3], calls=6, count_calls=6, warmup=1,
                      floor_attempts=20, litellm=False)
    _check_turn_rows(report, "sqlite", ["async", "sync"], [1, 3], counted=True)
    for r in report.rows:
        assert r.tx_reads_per_call is not None and r.tx_writes_per_call is not None
        if r.driver == "async" and r.concurrency > 1:  # grouped: see _check_turn_rows
            assert 0 < r.tx_writes_per_call <= (2 if r.scenario == "healthy" else 4)
        else:
            assert r.tx_writes_per_call >= (2 if r.scenario == "healthy" else 4)
    _table_lines(report)


@pytest.mark.postgres
def test_turn_on_postgres_counts_server_transactions(pg_url: str) -> None:
    # One driver and one concurrency: each counted measurement waits ~11 s for the server's
    # statistics.
    report = turn.run([("postgresql", pg_url)], drivers=["async"], concurrency=[1], calls=4,
                      count_calls=4, warmup=1, floor_attempts=20, litellm=False)
    _check_turn_rows(report, "postgresql", ["async"], [1], counted=True)


@pytest.mark.postgres
def test_turn_on_postgres_both_drivers_uncounted(pg_url: str) -> None:
    report = turn.run([("postgresql", pg_url)], concurrency=[1, 2], calls=4, warmup=1,
                      count_tx=False, floor_attempts=20, litellm=False)
    _check_turn_rows(report, "postgresql", ["async", "sync"], [1, 2], counted=False)


def test_turn_reads_the_highest_concurrency_against_litellm_measured_in_the_same_run(
        tmp_path: Path) -> None:
    pytest.importorskip("litellm", reason="LiteLLM is optional: pip install litellm")
    report = turn.run([("sqlite", str(tmp_path / "turn.db"))], drivers=["async"],
                      scenarios=["healthy"], concurrency=[1, 2], calls=4, warmup=1,
                      count_tx=False, floor_attempts=20)
    ref = report.extra["litellm"]
    assert ref.concurrency == 2 and ref.calls == 4 and ref.calls_per_s > 0
    by_c = {r.concurrency: r for r in report.rows}
    assert "throughput" not in by_c[1].checks  # only the concurrency LiteLLM ran at
    assert by_c[2].checks["throughput"] == (by_c[2].calls_per_s >= 2 * ref.calls_per_s)
    assert any("LiteLLM Router's" in n and "c=2" in n for n in report.notes)
    assert _json(report)["litellm"]["calls_per_s"] == ref.calls_per_s


def test_turn_without_litellm_says_so_and_checks_no_throughput(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "litellm", None)  # as if it were not installed
    report = turn.run([("sqlite", str(tmp_path / "turn.db"))], drivers=["async"],
                      scenarios=["healthy"], concurrency=[2], calls=2, warmup=1,
                      count_tx=False, floor_attempts=20)
    assert "litellm" not in report.extra
    assert not any("throughput" in r.checks for r in report.rows)
    assert any("litellm is not installed" in n for n in report.notes)


def test_turn_failover_policy_moves_every_turn() -> None:
    pol = turn.failover_policy()
    assert pol.health.cooldown_categories == [] and pol.failover.new_turn == "first_entry"
    assert pol.failover.enabled


# -- turns-flat ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_turns_flat_grows_the_envelope_like_a_conversation(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    name, url = _url(backend, tmp_path, request)
    counted = name == "sqlite"  # PostgreSQL's count waits ~11 s per window: covered by turn
    report = flat.run([(name, url)], turns=6, window=2, count_tx=counted)
    (r,) = report.rows
    assert (r.backend, r.driver, r.turns, r.window) == (name, "async", 6, 2)
    assert r.last_parts == 2 * 6 - 1  # every earlier question and answer, then the question
    assert r.ratio == pytest.approx(r.last_mean_ms / r.first_mean_ms, rel=0.01)
    assert r.first_mean_ms > 0 and r.raw_first_mean_ms > 0 and r.last_body_bytes > 0
    if counted:
        assert r.tx_first is not None and r.tx_first >= 2
        assert r.tx_last is not None and r.tx_last >= 2
    else:
        assert r.tx_first is None
    with Ledger.open(url) as led:
        runs = [x for x in led.attempts(limit=100).items if x.route_id == "bench-healthy"]
    assert len(runs) == 6 and len({a.run_id for a in runs}) == 1
    _table_lines(report)


def test_turns_flat_sync_driver(tmp_path: Path) -> None:
    report = flat.run([("sqlite", str(tmp_path / "f.db"))], turns=4, window=2,
                      drivers=["sync"], count_tx=False)
    assert [r.driver for r in report.rows] == ["sync"]


# -- recover ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_recover_takes_exactly_the_dead_executors_work(backend: str, tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:
    name, url = _url(backend, tmp_path, request)
    report = recover.run([(name, url)], history=300, unknown=6, per_run=2, limit=2,
                         setup_workers=2, idle_repeat=2)
    (r,) = report.rows
    assert (r.backend, r.history_attempts, r.unknown_attempts, r.runs) == (name, 300, 6, 3)
    assert r.passes == 3  # 2 runs, 1 run, then a pass that finds nothing
    assert r.recover_s > 0 and r.idle_before_ms > 0 and r.idle_after_ms > 0
    assert r.per_unknown_ms == pytest.approx(r.recover_s / 6 * 1000, rel=0.01, abs=0.02)
    with Ledger.open(url) as led:
        unknown = led.attempts(route=recover.ROUTE.id, state="unknown", limit=100).items
    assert len(unknown) == 6  # never re-sent, never settled: unknown with their holds
    _table_lines(report)


def test_recover_scale_and_explicit_sizes() -> None:
    assert recover.scaled(1.0, None, None) == (1_000_000, 10_000)
    assert recover.scaled(0.01, None, None) == (10_000, 100)
    assert recover.scaled(0.01, 5, 7) == (5, 7)


# -- retention -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_retention_drops_the_generated_months_its_dry_run_planned(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    name, url = _url(backend, tmp_path, request)
    report = retention.run([(name, url)], attempts=400, months=2, repeat=2)
    (r,) = report.rows
    assert (r.backend, r.history_attempts, r.months) == (name, 400, 2)
    # Every attempt of the history went (its unknown ones settled first), and its events.
    assert r.dropped_attempts == 400 and r.dropped_events > 0 and r.kept_parts == 0
    assert r.dropped_parts == (4 if name == "postgresql" else 2)  # 2 months x 2 tables
    assert 0 < r.carry_s <= r.retention_s and r.dry_run_s > 0
    assert r.carry_share == pytest.approx(r.carry_s / r.retention_s, abs=0.002)
    with Ledger.open(url, migrate_schema=False) as led:
        assert led.attempts(limit=10).items == []
    _table_lines(report)
    assert _json(report)["rows"][0]["carry_share"] == r.carry_share  # type: ignore[index]


def test_retention_month_start_is_the_first_instant_of_the_utc_month() -> None:
    assert retention.month_start(1_780_000_000.0) == 1_777_593_600.0  # 2026-05-01T00:00:00Z


# -- select ----------------------------------------------------------------------------------

def test_select_cases_walk_what_they_claim() -> None:
    report = selector.run(iterations=20)
    names = [r.case for r in report.rows]
    assert names == [c.name for c in selector.cases()]
    deep = [r for r in report.rows if r.case.startswith("deep walk")]
    assert len(deep) == 3
    for r in deep:
        assert (r.candidates, r.skipped, r.chosen) == (10, 9, "r9")
        assert r.target_us == selector.DEEP_TARGET_US and r.ok == (r.p50_us < r.target_us)
    for r in report.rows:
        assert r.iterations == 20 and 0 < r.p50_us <= r.p95_us
    # Nine different causes in the failover walk (the reason codes repeat: the causes do not).
    (case,) = [c for c in selector.cases() if c.name == "deep walk, failover"]
    assert len(case.skips) == 9 and len({reason for _r, reason in case.skips}) == 6


def test_select_case_that_does_not_decide_as_claimed_is_an_error() -> None:
    case = selector.cases()[0]
    wrong = selector.Case(case.name, case.inp, "r8", case.skips, case.target_us)
    with pytest.raises(BenchError, match="chose 'r9'"):
        selector.time_case(wrong, 1)


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.95) == 5.0
    assert math.isnan(percentile([], 0.5))


# -- the command line ------------------------------------------------------------------------

def _cli_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_cli_every_bench_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "cli.db")
    data = _cli_json(capsys, ["write", "--db", db, "--attempts", "2", "--workers", "1",
                              "--paths", "ledger", "--json"])
    assert [(r["backend"], r["workers"], r["path"]) for r in data["rows"]] == [  # type: ignore[attr-defined]
        ("sqlite", 1, "begin+settle")]
    data = _cli_json(capsys, ["turn", "--db", db, "--calls", "2", "--count-calls",
                              "2", "--concurrency", "1", "--drivers", "async", "--scenarios",
                              "healthy", "--json"])
    assert len(data["rows"]) == 1  # type: ignore[arg-type]
    data = _cli_json(capsys, ["turns-flat", "--db", str(tmp_path / "f.db"), "--turns",
                              "4", "--window", "2", "--json"])
    assert data["bench"] == "turns-flat" and len(data["rows"]) == 1  # type: ignore[arg-type]
    data = _cli_json(capsys, ["recover", "--db", str(tmp_path / "r.db"), "--history",
                              "50", "--unknown", "2", "--json"])
    assert data["rows"][0]["unknown_attempts"] == 2  # type: ignore[index]
    data = _cli_json(capsys, ["group-ceiling", "--db", str(tmp_path / "c.db"), "--pairs",
                              "2", "--workers", "1", "--json"])
    assert data["bench"] == "group-ceiling" and len(data["rows"]) == 1  # type: ignore[arg-type]
    data = _cli_json(capsys, ["queue", "--db", str(tmp_path / "q.db"), "--sessions", "3",
                              "--turns", "1", "--limit", "1", "--delay-ms", "1", "--json"])
    assert data["bench"] == "queue" and data["rows"][0]["served"] == 3  # type: ignore[index]
    data = _cli_json(capsys, ["retention", "--db", str(tmp_path / "rt.db"), "--attempts",
                              "50", "--months", "1", "--repeat", "1", "--json"])
    assert data["bench"] == "retention" and data["rows"][0]["dropped_attempts"] == 50  # type: ignore[index]
    data = _cli_json(capsys, ["select", "--iterations", "5", "--json"])
    assert data["bench"] == "select" and data["targets"]


def test_cli_table_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["select", "--iterations", "3"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[0] == "case" and "target: deep walk" in out


def test_cli_bad_input_is_a_typed_error(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidArgument, match="workers"):
        parse_workers("1,x")
    with pytest.raises(InvalidArgument, match="workers"):
        parse_workers("0")
    db = str(tmp_path / "bad.db")
    cases = [
        (["write", "--db", db, "--attempts", "1", "--workers", "2"], "--attempts"),
        (["write", "--paths", "ledger,fast"], "--paths"),
        (["turn", "--no-sqlite"], "--no-sqlite"),
        (["turn", "--drivers", "threads"], "--drivers"),
        (["turns-flat", "--turns", "10", "--window", "6"], "--turns"),
        (["recover", "--scale", "0"], "--scale"),
        (["group-ceiling", "--db", db, "--pairs", "1", "--workers", "2"], "--pairs"),
        (["select", "--iterations", "0"], "--iterations"),
        (["generate", "--db", db, "--attempts", "0"], "--attempts"),
        # A slip of extra zeros would fill the disk before it ended. (With --days 0, checked
        # after it: were the count taken, this fails at once rather than loading for hours.)
        (["generate", "--db", db, "--attempts", "100000001", "--days", "0"],
         "--attempts 100000001 is more than 100,000,000"),
        (["generate", "--db", db, "--days", "0"], "--days"),
        (["audit", "--db", db, "--repeat", "0"], "--repeat"),
        (["deepen", "--db", db, "--copies", "0"], "--copies"),
        (["queue", "--db", db, "--sessions", "0"], "--sessions"),
        (["queue", "--db", db, "--limit", "0"], "--limit"),
        (["queue", "--db", db, "--delay-ms", "-1"], "--delay-ms"),
        (["retention", "--db", db, "--months", "0"], "--months"),
        (["retention", "--db", db, "--attempts", "0"], "--attempts"),
    ]
    for argv, word in cases:
        assert main(argv) == 2, argv
        assert word in capsys.readouterr().err
    assert not os.path.exists(db)


def test_parser_has_every_bench() -> None:
    p = build_parser()
    args = p.parse_args(["write", "--workers", "1,8", "--postgres"])
    assert args.workers == "1,8" and args.postgres and args.bench_db is None
    for name in ("group-ceiling", "turn", "turns-flat", "queue", "recover", "retention",
                 "select", "audit", "generate"):
        assert p.parse_args([name]).bench_command == name
    assert p.parse_args(["deepen", "--copies", "9"]).copies == 9


# -- python -m benchmarks, from the repository root (the documented command) -------------------

END = 1_700_000_000.0


def _bench(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LEDGER_URL", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bulk_generate_then_audit_through_python_dash_m(tmp_path: Path) -> None:
    db = str(tmp_path / "gen.db")
    made = _bench("generate", "--db", db, "--attempts", "600", "--days", "1", "--end",
                  str(END), "--json")
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout)
    assert summary["attempts"] == 600 and summary["runs"] > 100 and made.stderr == ""
    # Its own history again is accepted (the same seed too: test_a_second_bulk_load_...).
    more = _bench("generate", "--db", db, "--attempts", "50", "--days", "1", "--end",
                  str(END), "--seed", "2")
    assert more.returncode == 0, more.stderr
    assert more.stdout.startswith("generated 50 attempts in ")
    audit = _bench("audit", "--db", db, "--repeat", "1", "--json")
    assert audit.returncode == 0, audit.stderr
    doc = json.loads(audit.stdout)
    names = [r["query"] for r in doc["results"]]
    assert doc["backend"] == "sqlite"
    assert names[0] == "timeline (one run)" and "costs by tenant (1 day)" in names
    assert all(r["rows"] >= 0 and r["p50_ms"] >= 0 for r in doc["results"])
    assert all(r["floor_p50_ms"] > 0 and r["x_floor"] > 0 and r["statements"] >= 2
               for r in doc["results"])
    assert doc["machine"]["cpus"] >= 1
    with Ledger.open(db) as led:
        assert reconcile(led).violations == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_audit_floor_replays_what_each_read_sent(backend: str,
                                                      request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:
    """Each audit read is reported beside its floor: the same statements replayed through the
    raw driver (prepared on PostgreSQL), which fetch the rows the read's SQL answers, with the
    client CPU of both."""
    from sqlalchemy import func, select

    from benchmarks.audit import _recorded, _replay, _Sent, bench_audit
    from benchmarks.generate import generate
    from ledger.api.face import reads_of
    from ledger.storage import schema as s

    db = (str(tmp_path / "floor.db") if backend == "sqlite"
          else str(request.getfixturevalue("pg_url")))
    with Ledger.open(db) as led:
        generate(led, attempts=400, days=1, end=END, seed=5)
        audit = Audit(led)
        rows = bench_audit(audit, repeat=2)
        # The replay of one timeline fetches its Run, each of its attempts and events.
        engine = reads_of(led).context.engine
        run_id = next(r.run_id for r in audit.runs(limit=50).items if r.calls_used > 1)
        with _recorded(engine) as sent:
            tl = audit.timeline(run_id)
        with engine.connect() as conn:
            events = conn.execute(select(func.count()).select_from(s.events)
                                  .where(s.events.c.run_id == run_id)).scalar_one()
        assert events > 0 and _replay(engine, sent) == 1 + len(tl.attempts) + events
        # A read that wrote would not be replayed.
        before = audit.runs(limit=1000).items
        with pytest.raises(BenchError, match="reads only"):
            _replay(engine, [*sent, _Sent("DELETE FROM runs")])
        assert audit.runs(limit=1000).items == before
    names = [r.query for r in rows]
    assert "spend by tenant (7 days by day, the dashboard's)" in names
    assert "spend by label (1 day)" in names and "metrics (a /metrics scrape)" in names
    assert {"costs by route (the whole history)", "costs by tenant (the whole history)",
            "spend by tenant (the whole history)"} <= set(names)
    for r in rows:
        assert r.statements >= 1, r
        assert r.floor_p50_ms > 0 and r.ratio is not None and r.floor_cpu_ms >= 0, r
        assert r.cpu_ms > 0, r
        # What the read found, its statements found again (a page may fetch one row more).
        assert r.floor_rows >= r.rows, r


def test_bulk_generate_refuses_a_ledger_with_other_runs(tmp_path: Path) -> None:
    db = str(tmp_path / "real.db")
    with Ledger.open(db) as led:
        led.admit_run("mine", plan=[write.BENCH_ROUTE], budget=Budget(
            max_calls=1, max_retries=0, max_cost=Decimal(1)))
    refused = _bench("generate", "--db", db, "--attempts", "10")
    assert refused.returncode == 2
    assert "'mine'" in refused.stderr and "--into-existing" in refused.stderr
    with Ledger.open(db) as led:
        assert [r.run_id for r in Audit(led).runs().items] == ["mine"]
    empty = _bench("audit", "--db", db, "--repeat", "1")
    assert empty.returncode == 1 and "no attempts" in empty.stderr
    missing = _bench("audit", "--db", str(tmp_path / "none.db"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_bulk_load_of_one_seed_adds_the_same_history_under_ids_of_its_own(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A second ``generate`` with the seed of a load already in the ledger wrote the first's
    run ids again: a Conflict ("another writer recorded it first"), exit 1. It writes the
    seed's history again under a tag of its own, derived from the seed's and the loads there,
    so an empty ledger still gets the seed's own ids, and the two histories reconcile."""
    from benchmarks.generate import generate

    def load(db: str) -> dict[str, list[tuple[object, ...]]]:
        """The Runs of each load (by tag), each without its tag, oldest first."""
        with Ledger.open(db) as led:
            stats = generate(led, attempts=200, days=1, end=END, seed=4)
            assert stats.attempts == 200
            assert reconcile(led).violations == []
            by_tag: dict[str, list[tuple[object, ...]]] = {}
            for r in Audit(led).runs(limit=1000).items:
                _, tag, number = r.run_id.split("-")
                by_tag.setdefault(tag, []).append((number, r.created_at, r.status,
                                                   r.calls_used, r.selected_route))
        return {tag: sorted(runs) for tag, runs in by_tag.items()}

    db = (str(tmp_path / "twice.db") if backend == "sqlite"
          else str(request.getfixturevalue("pg_url")))
    first = load(db)
    assert len(first) == 1
    both = load(db)
    assert len(both) == 2 and set(first) < set(both)
    # The same history, under another tag.
    assert [both[tag] for tag in both] == [first[next(iter(first))]] * 2
    # From an empty ledger, the seed's own ids, as before.
    assert load(str(tmp_path / "again.db")) == first


def test_the_cli_defaults_are_the_benchmarks_own() -> None:
    from benchmarks import defaults, flat, recover, retention, selector, turn, write
    from ledger.ops.recovery import DEFAULT_LIMIT

    assert defaults.RECOVER_LIMIT == DEFAULT_LIMIT
    assert (write.DEFAULT_ATTEMPTS, turn.DEFAULT_CALLS, flat.DEFAULT_TURNS,
            recover.DEFAULT_PER_RUN, selector.DEFAULT_ITERATIONS) == (
        defaults.WRITE_ATTEMPTS, defaults.TURN_CALLS, defaults.FLAT_TURNS,
        defaults.RECOVER_PER_RUN, defaults.SELECT_ITERATIONS)
    assert (retention.DEFAULT_ATTEMPTS, retention.DEFAULT_MONTHS, retention.DEFAULT_REPEAT) \
        == (300_000, 4, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepened_history_is_whole_copies_that_reconcile(backend: str,
                                                         request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    """``bench deepen`` adds exact copies of the finished Runs, one span further back each:
    every copy reconciles, tells the same story as its original (routes, states, costs, events
    in order), and the newest day the audit benchmark reads is left as it was."""
    from benchmarks.deepen import FINISHED, deepen
    from benchmarks.generate import generate

    db = (str(tmp_path / "deep.db") if backend == "sqlite"
          else str(request.getfixturevalue("pg_url")))
    with Ledger.open(db) as led:
        generate(led, attempts=300, days=1, end=END, seed=3)
        audit = Audit(led)
        day = audit.costs(by="route", since=END - 86_400, until=END + 1)
        before = audit.runs(limit=1000).items
        rep = deepen(led, 2)
        assert rep.span_s == 86_400.0 and rep.copies == 2
        finished = [r for r in before if r.status in FINISHED]
        assert 0 < len(finished) < len(before) or len(finished) == len(before)
        assert rep.rows["runs"] == 2 * len(finished)
        assert rep.rows["attempts"] > 0 and rep.rows["events"] > 0
        assert reconcile(led).violations == []
        # The newest day reads as before.
        assert audit.costs(by="route", since=END - 86_400, until=END + 1) == day
        # Each copy is its original, moved back: same attempts and events, in order.
        orig = next(r for r in finished if r.calls_used > 1) if any(
            r.calls_used > 1 for r in finished) else finished[0]
        a = audit.timeline(orig.run_id)
        for k in (1, 2):
            c = audit.timeline(f"{orig.run_id}~d{k}")
            assert c.run.created_at == pytest.approx(a.run.created_at - k * 86_400.0)
            assert [(x.route_id, x.state, x.cost, x.posted, x.seq) for x in c.attempts] == \
                [(x.route_id, x.state, x.cost, x.posted, x.seq) for x in a.attempts]
            assert [x.attempt_id for x in c.attempts] == \
                [f"{x.attempt_id}~d{k}" for x in a.attempts]
            assert [e.kind for e in c.run_events] == [e.kind for e in a.run_events]
            assert (c.failed_over, c.total_cost, c.served_route) == \
                (a.failed_over, a.total_cost, a.served_route)
