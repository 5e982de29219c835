"""History that scales: time-ordered attempt ids, PostgreSQL's monthly partitions of the
history (migration 0008, converting an existing ledger), and retention on both backends."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger import Budget, Price, Route, faults
from ledger.api.facade import Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.domain import values
from ledger.domain.facts import Category, FailureFact, Phase
from ledger.domain.values import new_id
from ledger.errors import InvalidArgument
from ledger.ops.audit import Audit, to_jsonable
from ledger.ops.reconcile import reconcile
from ledger.storage import partitions
from ledger.storage.engine import normalize_url
from ledger.storage.migrate import alembic_config

from .helpers import lock_waits, until
from .test_schema import _diff

ROUTE = Route(id="a", provider="p", model="m", group="g", recipient="p", price=Price())
HASH = "sha256:" + "d" * 64
FACT = FailureFact(category=Category.SERVER_ERROR, status=500, phase=Phase.AFTER_HEADERS)


def _t(y: int, m: int, d: int = 10) -> float:
    return datetime(y, m, d, 12, tzinfo=UTC).timestamp()


# -- ids that sort by time ------------------------------------------------------------------


def test_attempt_ids_made_in_time_order_sort_in_time_order(monkeypatch: Any) -> None:
    made = [new_id("att") for _ in range(20_000)]
    assert made == sorted(made) and len(set(made)) == len(made)
    u = uuid.UUID(made[-1].removeprefix("att-"))
    assert u.version == 7 and u.variant == uuid.RFC_4122
    # Its first 48 bits are the wall clock's milliseconds.
    assert abs((u.int >> 80) / 1000 - datetime.now(UTC).timestamp()) < 60
    # A clock that steps back, or stands still, does not break the order within a process.
    steps = iter([2_000_000_000_000_000_000, 1_000_000_000_000_000_000,
                  1_000_000_000_000_000_000, 3_000_000_000_000_000_000])
    monkeypatch.setattr(values.time, "time_ns", lambda: next(steps))
    stepped = [new_id("att") for _ in range(4)]
    assert stepped == sorted(stepped) and len(set(stepped)) == 4
    assert made[-1] < stepped[0]


def test_attempts_the_ledger_names_sort_in_the_order_they_began(db_url: str) -> None:
    clock = ManualClock(_t(2026, 1))
    with Ledger.open(db_url, clock=clock) as led:
        led.admit_run("r", plan=[ROUTE], budget=Budget(max_calls=50, max_retries=0, max_cost=1))
        lease = led.acquire_lease("r", ttl_s=3600)
        for _ in range(30):
            att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.001")
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
        ids = [a.attempt_id for a in sorted(led.timeline("r"), key=lambda a: a.seq)]
    assert ids == sorted(ids) and all(i.startswith("att-") and len(i) == 36 for i in ids)


# -- a history to keep, convert and drop ---------------------------------------------------


def _history(led: Ledger, clock: ManualClock) -> None:
    """Runs in January (finished), February (finished, one Attempt unknown), March (still
    live) and July (finished); a January Run closed by an operator; a cooldown cleared."""
    budget = Budget(max_calls=9, max_retries=0, max_cost=1)

    def run(name: str, when: float, outcomes: list[str], finish: bool) -> Any:
        clock.set(when)
        led.admit_run(name, plan=[ROUTE], budget=budget)
        lease = led.acquire_lease(name, ttl_s=3600)
        for k, outcome in enumerate(outcomes):
            att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01",
                                    attempt_id=f"{name}-{k}")
            clock.advance(2.0)
            led.settle_attempt(lease, att.attempt_id, outcome=outcome,
                               fact=FACT if outcome == "failed" else None)
        if finish:
            led.finish_run(lease, "succeeded" if outcome == "succeeded" else "failed")
            led.release_lease(lease)
        return lease

    run("jan", _t(2026, 1), ["failed", "succeeded"], True)
    led.release_lease(run("jan-closed", _t(2026, 1, 12), ["failed"], False))  # left running
    clock.set(_t(2026, 1, 20))
    led.close_run("jan-closed", status="failed", reason="host gone", by="ops")
    run("feb-unknown", _t(2026, 2), ["failed", "unknown"], True)
    run("mar-live", _t(2026, 3), ["succeeded"], False)
    run("jul", _t(2026, 7), ["succeeded"], True)


def _count(url: str, sql: str) -> int:
    eng = create_engine(normalize_url(url))
    try:
        with eng.connect() as conn:
            return int(conn.execute(text(sql)).scalar_one())
    finally:
        eng.dispose()


def _dump(url: str) -> dict[str, list[tuple[Any, ...]]]:
    eng = create_engine(normalize_url(url))
    try:
        with eng.connect() as conn:
            # By column name: a column a migration adds comes last, one the schema
            # declares sits where it declares it. Without attempts.labels: a copy of the
            # Run's (0010), gone with a downgrade past 0010 and left NULL by its upgrade.
            return {t: [tuple(sorted((k, v) for k, v in r._mapping.items() if k != "labels"))
                        for r in conn.execute(text(
                f"SELECT * FROM {t} ORDER BY {k}")).all()]
                for t, k in (("attempts", "attempt_id"), ("events", "event_id"))}
    finally:
        eng.dispose()


def _answers(led: Ledger) -> dict[str, Any]:
    audit = Audit(led)
    runs = ["jan", "jan-closed", "feb-unknown", "mar-live", "jul"]
    return to_jsonable({
        "timelines": {r: audit.timeline(r) for r in runs},
        "attempts": audit.attempts(limit=1000),
        "costs": audit.costs(by="route", since=0.0),
        "actions": audit.actions(),
        "open": audit.open_attempts(),
        "latency": audit.latency(since=0.0),
        "runs": audit.runs(),
    })


def _alembic(url: str, verb: str, rev: str) -> None:
    from alembic import command

    eng = create_engine(normalize_url(url))
    try:
        with eng.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            getattr(command, verb)(cfg, rev)
    finally:
        eng.dispose()


def _relkind(url: str, table: str) -> str:
    eng = create_engine(normalize_url(url))
    try:
        with eng.connect() as conn:
            return str(conn.execute(text("SELECT relkind FROM pg_class WHERE relname = :t"),
                                    {"t": table}).scalar_one())
    finally:
        eng.dispose()


def _partition_of(url: str, table: str, key: str, value: Any) -> str:
    eng = create_engine(normalize_url(url))
    try:
        with eng.connect() as conn:
            return str(conn.execute(text(
                f"SELECT tableoid::regclass::text FROM {table} WHERE {key} = :v"),
                {"v": value}).scalar_one())
    finally:
        eng.dispose()


# -- migration 0008 on PostgreSQL ------------------------------------------------------------


@pytest.mark.postgres
def test_migration_0008_converts_a_ledger_with_history_keeping_every_row_and_answer(
        pg_empty_url: str) -> None:
    url = pg_empty_url
    clock = ManualClock(_t(2026, 1))
    # The history is written by this code at head (it writes the columns of every later
    # migration), then taken back to 0007: a ledger with that history in plain tables.
    with Ledger.open(url, clock=clock) as led:
        _history(led, clock)
        before = _answers(led)
    rows = _dump(url)
    assert len(rows["attempts"]) == 7 and len(rows["events"]) > 7
    _alembic(url, "downgrade", "0007")
    assert _relkind(url, "attempts") == "r"
    assert _count(url, "SELECT count(*) FROM attempts") == 7
    rows_0007 = _dump(url)

    with Ledger.open(url, clock=clock) as led:  # migrates to 0008, and on to head
        after = _answers(led)
    assert (_relkind(url, "attempts"), _relkind(url, "events")) == ("p", "p")
    assert _dump(url) == rows
    assert after == before
    assert _diff(url) == []
    # Each row sits in its month's partition.
    assert _partition_of(url, "attempts", "attempt_id", "jan-0") == "attempts_p202601"
    assert _partition_of(url, "attempts", "attempt_id", "jul-0") == "attempts_p202607"
    assert _count(url, "SELECT count(*) FROM events_p202602") > 0
    assert _count(url, "SELECT count(*) FROM attempts_default") == 0

    # Back to 0007 (plain tables, the old keys), rows unchanged, and up again.
    _alembic(url, "downgrade", "0007")
    assert _relkind(url, "attempts") == "r"
    assert _dump(url) == rows_0007
    _alembic(url, "upgrade", "head")
    assert _dump(url) == rows and _diff(url) == []
    with Ledger.open(url, clock=clock) as led:
        assert _answers(led) == before


@pytest.mark.postgres
def test_inserts_land_in_their_months_partition_and_never_fail_without_one(
        pg_url: str) -> None:
    clock = ManualClock(_t(2030, 5))
    with Ledger.open(pg_url, clock=clock) as led:  # makes May, June and July 2030
        engine = create_engine(normalize_url(pg_url))
        try:
            with engine.connect() as conn:  # the library's own view of the partitions
                have = {p.name for p in partitions.partitions(conn, "attempts")}
        finally:
            engine.dispose()
        assert {"attempts_p203005", "attempts_p203006", "attempts_p203007",
                "attempts_default"} <= have
        for name, when in (("may", _t(2030, 5)), ("july", _t(2030, 7, 31)),
                           # no partition made for November yet: the default one takes it
                           ("november", _t(2030, 11))):
            clock.set(when)
            led.admit_run(name, plan=[ROUTE],
                          budget=Budget(max_calls=9, max_retries=0, max_cost=1))
            lease = led.acquire_lease(name, ttl_s=3600)
            led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01",
                              attempt_id=name)
    assert _partition_of(pg_url, "attempts", "attempt_id", "may") == "attempts_p203005"
    assert _partition_of(pg_url, "attempts", "attempt_id", "july") == "attempts_p203007"
    assert _partition_of(pg_url, "attempts", "attempt_id", "november") == "attempts_default"
    # Opening in November makes its partition and moves the row out of the default one.
    with Ledger.open(pg_url, clock=clock) as led:
        assert [a.attempt_id for r in ("may", "july", "november")
                for a in led.timeline(r)] == ["may", "july", "november"]
    assert _partition_of(pg_url, "attempts", "attempt_id", "november") == "attempts_p203011"
    assert _count(pg_url, "SELECT count(*) FROM attempts_default") == 0


# -- retention --------------------------------------------------------------------------------


def _attempt_ids(led: Ledger) -> set[str]:
    return {a.attempt_id for r in ("jan", "jan-closed", "feb-unknown", "mar-live", "jul")
            for a in led.timeline(r)}


def test_retention_drops_old_finished_history_and_keeps_unknown_and_live_runs(
        db_url: str) -> None:
    clock = ManualClock(_t(2026, 1))
    pg = not db_url.endswith(".db")
    with Ledger.open(db_url, clock=clock) as led:
        _history(led, clock)
        events_before = _count(db_url, "SELECT count(*) FROM events")
    clock.set(_t(2026, 8, 5))  # 90 days back: 2026-05-07, after the ends of Jan..Apr
    with Ledger.open(db_url, clock=clock) as led:
        dry = led.drop_history(90 * 86400, by="alice", dry_run=True)
        assert dry.event is None and dry.dry_run
        assert _attempt_ids(led) == {"jan-0", "jan-1", "jan-closed-0", "feb-unknown-0",
                                     "feb-unknown-1", "mar-live-0", "jul-0"}
        assert _count(db_url, "SELECT count(*) FROM events") == events_before

        assert reconcile(led).ok and reconcile(led).trimmed_runs == 0
        jan = Audit(led).timeline("jan")
        assert jan.attempts and jan.total_cost > 0
        rep = led.drop_history(90 * 86400, by="alice", reason="keep 90 days")
        # The books still hold: the trimmed Runs' sums are not held against what is left.
        books = reconcile(led)
        assert books.ok, books.violations
        assert books.trimmed_runs == 2  # jan, jan-closed (feb-unknown holds an open attempt)
        assert rep.dropped == dry.dropped and rep.kept == dry.kept
        # January's finished Runs went; the unknown Attempt's Run, the live Run and July stay.
        assert _attempt_ids(led) == {"feb-unknown-0", "feb-unknown-1", "mar-live-0", "jul-0"}
        assert rep.rows("attempts") == 3
        assert led.timeline("jan") == [] and led.get_run("jan").status.value == "succeeded"
        # Its money stays with it (run show, the dashboard's run page): not the attempts left.
        kept_jan = Audit(led).timeline("jan")
        assert kept_jan.attempts == []
        assert (kept_jan.total_cost, kept_jan.held) == (jan.total_cost, jan.held)
        assert led.events("jan") == []
        assert len(led.events("feb-unknown")) > 0 and len(led.events("mar-live")) > 0
        if pg:
            assert [p.partition for p in rep.dropped] == ["attempts_p202601", "events_p202601"]
            kept = {p.partition: p.held for p in rep.kept}
            assert "open (unknown or dispatching) attempt" in kept["attempts_p202602"]
            assert "live run" in kept["attempts_p202603"]
            assert "open attempt" in kept["events_p202602"]
            assert "live run" in kept["events_p202603"]
            assert _relkind(db_url, "attempts_p202602") == "r"
            eng = create_engine(normalize_url(db_url))
            try:
                with eng.connect() as conn:
                    names = {p.name for p in partitions.partitions(conn, "attempts")}
            finally:
                eng.dispose()
            assert "attempts_p202601" not in names and "attempts_p202602" in names
            # The coming months were made first: August's row will land in its partition.
            assert "attempts_p202608" in names
        else:
            assert (rep.kept[0].table, rep.kept[0].rows) == ("attempts", 3)
            assert [p.table for p in rep.kept] == ["attempts", "events"]
        # The operator's close of a January Run outlives its history; the run is recorded.
        actions = Audit(led).actions().items
        assert [a.kind for a in actions] == ["retention", "close"]
        record = actions[0]
        assert record.by == "alice" and record.reason == "keep 90 days"
        assert record.data["cutoff"] == rep.cutoff == _t(2026, 8, 5) - 90 * 86400
        assert record.data["rows"]["attempts"] == 3
        assert record.data["rows"]["events"] == rep.rows("events") > 0
        assert record.data["actions_kept"] == 1
        # Again: nothing more goes, and the second run is recorded too.
        again = led.drop_history(90 * 86400, by="alice")
        assert again.dropped == [] and _attempt_ids(led) == {
            "feb-unknown-0", "feb-unknown-1", "mar-live-0", "jul-0"}
        assert [a.kind for a in Audit(led).actions().items] == ["retention", "retention",
                                                                  "close"]


def test_an_ended_run_whose_history_retention_dropped_is_not_resumed_and_nothing_is_written(
        db_url: str) -> None:
    """Resumed, a Run whose old Attempts retention dropped would number its next Attempt from
    what is left (seq 1 again) and reconcile would report its counters against the sum of
    the rest. A lease on it (a Run session, ``acquire_lease``) is refused, naming the Run,
    the retention and the fix; a Run admitted after the cut-off is resumed as before."""
    from ledger.errors import InvalidState

    clock = ManualClock(_t(2026, 1))
    budget = Budget(max_calls=9, max_retries=0, max_cost=1)

    def ended(name: str, when: float) -> None:
        clock.set(when)
        led.admit_run(name, plan=[ROUTE], budget=budget)
        lease = led.acquire_lease(name, ttl_s=3600)
        att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
        led.finish_run(lease, "succeeded")  # ended by its block, not closed: resumable
        led.release_lease(lease)

    with Ledger.open(db_url, clock=clock) as led:
        ended("jan", _t(2026, 1))
        ended("jul", _t(2026, 7))
    clock.set(_t(2026, 8, 5))
    with Ledger.open(db_url, clock=clock) as led:
        led.drop_history(90 * 86400, by="alice", reason="keep 90 days")
        assert led.timeline("jan") == []
        before, run = _dump(db_url), led.get_run("jan")
        with pytest.raises(InvalidState) as ei, led.run("jan", plan=[ROUTE], budget=budget):
            pass
        with pytest.raises(InvalidState) as low:
            led.acquire_lease("jan", ttl_s=60)
        for err in (ei.value, low.value):
            said = str(err)
            assert "run 'jan' ended succeeded and its history may be gone" in said
            assert "retention run by 'alice'" in said and "admit the work as a new Run" in said
            assert err.fields["run_id"] == "jan"
            assert err.fields["cutoff"] == _t(2026, 8, 5) - 90 * 86400
        assert _dump(db_url) == before and led.get_run("jan") == run
        books = reconcile(led)
        assert books.ok, books.violations
        # Admitted after the cut-off: its history is whole, and it is resumed as before.
        lease = led.acquire_lease("jul", ttl_s=60)
        assert led.begin_attempt(lease, route="a", envelope_hash=HASH,
                                 reserve="0.01").seq == 2


def test_retention_refuses_an_age_that_is_not_one_clearly_typed(db_url: str,
                                                                capsys: Any) -> None:
    with Ledger.open(db_url) as led:
        for bad in (3600, -1, float("nan"), "90d", True):
            with pytest.raises(InvalidArgument) as ei:
                led.drop_history(bad)  # type: ignore[arg-type]
            assert ei.value.field == "older_than"
        assert Audit(led).actions().items == []
    for bad in ("90", "3h", "0d", "ninety days", "12x"):
        assert main(["--db", db_url, "retention", "--older-than", bad]) == 2
        err = capsys.readouterr().err
        assert "--older-than" in err and "90d" in err
    with Ledger.open(db_url) as led:
        assert Audit(led).actions().items == []


def test_retention_refuses_an_age_over_36500_days_before_recording_anything(
        db_url: str, capsys: Any) -> None:
    with Ledger.open(db_url) as led:
        for bad in (36501 * 86400, 1e300, float("inf")):
            for dry_run in (True, False):
                with pytest.raises(InvalidArgument) as ei:
                    led.drop_history(bad, dry_run=dry_run)
                assert ei.value.field == "older_than" and "36500 days" in str(ei.value)
        assert led.drop_history(36500 * 86400, dry_run=True).dry_run
    for bad in ("9999999d", "36501d", "5300w"):
        assert main(["--db", db_url, "retention", "--older-than", bad, "--reason", "typo"]) == 2
        err = capsys.readouterr().err
        assert "--older-than" in err and "36500 days" in err
    with Ledger.open(db_url) as led:
        assert Audit(led).actions().items == []


def test_a_recorded_cutoff_no_date_can_show_still_lists_in_actions(db_url: str,
                                                                   capsys: Any) -> None:
    with Ledger.open(db_url) as led:
        led.drop_history(90 * 86400, reason="keep 90 days")
    # What an older ledger recorded for --older-than 9999999d.
    eng = create_engine(normalize_url(db_url))
    try:
        with eng.begin() as conn:
            conn.execute(text(
                "UPDATE events SET data = jsonb_set(data::jsonb, '{cutoff}', '-863999884800')::text"
                if conn.dialect.name == "postgresql" else
                "UPDATE events SET data = json_set(data, '$.cutoff', -863999884800)"))
    finally:
        eng.dispose()
    assert main(["--db", db_url, "actions"]) == 0
    assert "history before -8.64e+11 s since 1970" in capsys.readouterr().out


def test_retention_command_shows_then_drops_and_records(db_url: str, capsys: Any) -> None:
    clock = ManualClock(_t(2026, 1))
    with Ledger.open(db_url, clock=clock) as led:
        _history(led, clock)
    # The command's clock is the system's (after July 2026): a 90-day cut-off is past July.
    assert main(["--db", db_url, "retention", "--older-than", "90d", "--dry-run",
                 "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] is True and dry["event"] is None
    with Ledger.open(db_url) as led:
        assert Audit(led).actions(kinds=["retention"]).items == []
    assert main(["--db", db_url, "retention", "--older-than", "90d", "--by", "bob"]) == 0
    out = capsys.readouterr().out
    assert "dropped 4 attempt(s)" in out and "recorded as retention event" in out
    with Ledger.open(db_url) as led:
        assert _attempt_ids(led) == {"feb-unknown-0", "feb-unknown-1", "mar-live-0"}
        [rec] = Audit(led).actions(kinds=["retention"]).items
        assert rec.by == "bob"
    assert main(["--db", db_url, "actions", "--kind", "retention"]) == 0
    assert "history before" in capsys.readouterr().out


@pytest.mark.postgres
def test_retention_behind_a_long_lock_fails_typed_and_changes_nothing(
        pg_url: str, monkeypatch: Any) -> None:
    from ledger.errors import DatabaseUnavailable
    from ledger.storage import retention

    monkeypatch.setattr(retention, "LOCK_TIMEOUT", "300ms")  # the test's patience, not 10 s
    clock = ManualClock(_t(2026, 1))
    with Ledger.open(pg_url, clock=clock) as led:
        _history(led, clock)
    before = _dump(pg_url)
    clock.set(_t(2026, 8, 5))
    reader = create_engine(normalize_url(pg_url))
    try:
        with reader.connect() as conn:  # a long audit read holds the table
            conn.execute(text("SELECT count(*) FROM attempts")).scalar_one()
            with Ledger.open(pg_url, clock=clock) as led:
                with pytest.raises(DatabaseUnavailable) as ei:
                    led.drop_history(90 * 86400, by="alice")
                # Told as what it was: the server is up, a transaction held the table.
                assert ei.value.fields["contention"] == "55P03"
                assert "lock timeout" in str(ei.value) and "pg_stat_activity" in str(ei.value)
                assert Audit(led).actions(kinds=["retention"]).items == []
            assert _dump(pg_url) == before
            conn.rollback()
        with Ledger.open(pg_url, clock=clock) as led:  # the read ended: it goes through
            assert led.drop_history(90 * 86400, by="alice").rows("attempts") == 3
    finally:
        reader.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("in_default", [False, True], ids=["own_partition", "default_partition"])
def test_retention_and_writes_in_flight_wait_for_each_other_without_deadlock(
        pg_url: str, in_default: bool) -> None:
    """A write holding its Run's row (A, paused before its commit), retention waiting behind
    it, a second write (B) arriving meanwhile: once A commits, retention and B each wait for
    the other in turn; neither is a deadlock's victim. An old month kept in the default
    partition is split off (a new partition of attempts, which locks runs) first."""
    now = time.time()
    old = now - 200 * 86400
    clock = ManualClock(now if in_default else old)  # opened at ``old``: its months' partitions
    budget = Budget(max_calls=9, max_retries=0, max_cost=1)
    with Ledger.open(pg_url, clock=clock) as led:
        clock.set(old)
        led.admit_run("old", plan=[ROUTE], budget=budget)
        lease = led.acquire_lease("old", ttl_s=3600)
        att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
        led.finish_run(lease, "succeeded")
        led.release_lease(lease)
    month = time.strftime("%Y%m", time.gmtime(old))
    assert _partition_of(pg_url, "attempts", "run_id", "old") == (
        "attempts_default" if in_default else f"attempts_p{month}")
    leds = {k: Ledger.open(pg_url) for k in ("a", "b", "ret")}
    leases = {}
    for k in ("a", "b"):
        leds[k].admit_run(k, plan=[ROUTE], budget=budget)
        leases[k] = leds[k].acquire_lease(k, ttl_s=600)
    held, go = threading.Event(), threading.Event()

    def at_commit(_name: str) -> None:
        held.set()
        assert go.wait(60), "A was never let commit"

    def write(k: str) -> str:
        att = leds[k].begin_attempt(leases[k], route="a", envelope_hash=HASH, reserve="0.01")
        leds[k].settle_attempt(leases[k], att.attempt_id, outcome="succeeded")
        return att.attempt_id

    with lock_waits(pg_url) as waiting:
        pool = ThreadPoolExecutor(max_workers=3)
        try:
            faults.arm("begin.before_commit", at_commit)  # the first begin only: A's
            a = pool.submit(write, "a")
            until(lambda: held.is_set() or a.done(), "A never reached its commit")
            assert not a.done(), a.exception()
            ret = pool.submit(leds["ret"].drop_history, 60 * 86400, by="ops", reason="60 days")
            until(lambda: waiting() == 1 or ret.done(), "retention never waited for A")
            assert not ret.done(), ret.exception()
            b = pool.submit(write, "b")
            until(lambda: waiting() == 2 or b.done(), "B never waited")
            go.set()
            rep, a_id, b_id = ret.result(60), a.result(60), b.result(60)
        finally:
            faults.disarm()
            go.set()
            pool.shutdown(wait=True)
    try:
        assert rep.rows("attempts") == 1 and leds["ret"].timeline("old") == []
        assert [x.attempt_id for x in leds["a"].timeline("a")] == [a_id]
        assert [x.attempt_id for x in leds["b"].timeline("b")] == [b_id]
        books = reconcile(leds["ret"])
        assert books.ok, books.violations
    finally:
        for led in leds.values():
            led.close()


def test_primary_keys_are_the_declared_ones_on_each_backend(db_url: str) -> None:
    """Alembic's comparison skips primary keys: the schema declares PostgreSQL's partitioned
    keys (``PARTITIONED_KEYS``), SQLite keeps the tables' own."""
    from sqlalchemy import inspect

    from ledger.storage.schema import PARTITIONED_KEYS, metadata

    Ledger.open(db_url).close()
    eng = create_engine(normalize_url(db_url))
    try:
        with eng.connect() as conn:
            pg = conn.dialect.name == "postgresql"
            for table in ("attempts", "events"):
                got = tuple(inspect(conn).get_pk_constraint(table)["constrained_columns"])
                declared = tuple(c.name for c in metadata.tables[table].primary_key.columns)
                assert got == (PARTITIONED_KEYS[table] if pg else declared)
    finally:
        eng.dispose()


@pytest.mark.postgres
def test_ledgers_opening_at_once_make_each_missing_partition_once(pg_url: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ledger.storage.partitions import ensure_partitions
    from tests.storage.helpers import sql_context

    with Ledger.open(pg_url) as led:
        ctx = sql_context(led)
        when = _t(2031, 3)
        with ThreadPoolExecutor(8) as pool:
            made = list(pool.map(lambda _: ensure_partitions(ctx, when), range(8)))
    # Three months (March to May) for each table, each made by exactly one of the callers.
    every = sorted(n for m in made for n in m)
    assert every == sorted(f"{t}_p2031{m:02d}" for t in ("attempts", "events")
                           for m in (3, 4, 5))


# -- a long Run's turn -----------------------------------------------------------------------


def test_a_turns_statements_cost_the_same_at_a_runs_thousandth_attempt_as_at_its_tenth(
        tmp_path: Any) -> None:
    """SQLite (no statistics) once read a turn's unreceipted Attempts through the Run's whole
    (run_id, seq) index, so every turn of a long Run walked all its earlier Attempts. The work
    SQLite's engine does for a turn (its virtual machine's steps, counted: deterministic, not
    timed) must not grow with the Run's history."""
    from decimal import Decimal

    from ledger import Budget as B
    from ledger.api.face import storage_of
    from ledger.api.turn import SendResult, execute
    from ledger.domain.envelope import Envelope, Part

    ok = SendResult(ok=True, output="answer", prompt_tokens=1, completion_tokens=1,
                    cost=Decimal(0), model_reported="m")
    with Ledger.open(f"sqlite:///{tmp_path / 'l.db'}") as led:
        led.admit_run("long", plan=[ROUTE], budget=B(max_calls=10_000, max_retries=0,
                                                     max_cost=Decimal(1)))
        lease = led.acquire_lease("long", ttl_s=3600)
        steps = [0]

        def counted() -> int:
            steps[0] += 1
            return 0

        def turns(first: int, n: int) -> int:
            conn = storage_of(led).driver.connection()  # the sync path runs on this thread
            steps[0] = 0
            conn.set_progress_handler(counted, 50)
            try:
                for i in range(first, first + n):
                    execute(led, lease, Envelope(parts=[Part(content=f"q{i}")]),
                            lambda _d: ok)
            finally:
                conn.set_progress_handler(None, 0)
            return steps[0]

        turns(0, 10)
        early = turns(10, 10)
        turns(20, 980)
        late = turns(1000, 10)
    assert late < early * 1.5, (early, late)
