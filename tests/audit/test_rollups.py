"""Hourly roll-ups (``Ledger.roll_up``, ``failover-ledger rollup``): the totals read from them
are the totals read from the attempts, whatever is written afterwards, on both databases."""

from __future__ import annotations

import json
import re
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger import Budget, InvalidArgument, Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.domain.bounds import MAX_FOLD_AFTER_S, MAX_LAG_S
from ledger.ops.audit import Audit, to_jsonable
from ledger.storage import audit as audit_queries
from ledger.storage.engine import normalize_url
from ledger.storage.hours import CARRIED_HOUR, hour_of
from tests.audit.generated import generated
from tests.storage.test_history_scales import HASH, ROUTE, _alembic, _history, _t

END = 1_700_000_000.0  # 22:13:20 UTC: the newest hour is not whole
HOUR = 3600.0
SPAN = 10 * HOUR
WINDOWS = [
    (None, None),
    (END - SPAN + 1234.5, END - 77.25),  # ragged at both ends
    (hour_of(END - 5 * HOUR) * HOUR, hour_of(END - 2 * HOUR) * HOUR),  # whole hours
    (END - 4 * HOUR - 0.5, None),
    (None, END - 6 * HOUR + 0.5),
    (hour_of(END - 3 * HOUR) * HOUR + 60, hour_of(END - 3 * HOUR) * HOUR + 1800),  # in one hour
]
KEYS = ("route", "group", "provider", "tenant", "label", "run")
_START = hour_of(END - SPAN) * HOUR
CHARTS = [  # (since, until, buckets, counted from the roll-ups)
    (_START, _START + 11 * HOUR, 11, True),  # the dashboard's: an hour a bucket
    (_START + HOUR, _START + 11 * HOUR, 5, True),  # two hours a bucket
    (_START, _START + 11 * HOUR, 22, False),  # half an hour a bucket
    (_START, _START + 11 * HOUR, 12, False),  # 55 minutes
    (END - SPAN + 1234.5, END - SPAN + 1234.5 + 11 * HOUR, 11, False),  # not on the hour
]


def _generated(url: str, attempts: int = 400) -> Ledger:
    return generated(url, start=END - SPAN, attempts=attempts, days=SPAN / 86400, end=END,
                     seed=7)


def _answers(led: Ledger) -> dict[str, Any]:
    audit = Audit(led)
    out = {f"{by} {since} {until}": to_jsonable(audit.costs(
        by=by, label="team" if by == "label" else None, since=since, until=until,
        limit=10_000).items) for by in KEYS for since, until in WINDOWS}
    out["by day"] = to_jsonable(audit.costs_by_day(days=2, now=END))
    out.update(_activity(audit))
    out.update(_spend(audit))
    out.update(_metrics(audit))
    return out


def _metrics(audit: Audit) -> dict[str, Any]:
    """``/metrics``' counters, each histogram's sum rounded: a sum of the hours' sums may
    differ from the sum of the attempts' times in the last bits of a float."""
    snap = to_jsonable(audit.metrics(now=END))
    for name in ("latency", "first_token", "first_byte", "queue_waits"):
        for h in snap[name].values():
            h["sum"] = round(h["sum"], 6)
    return {f"metrics {k}": v for k, v in snap.items()}


def _activity(audit: Audit) -> dict[str, Any]:
    """The activity chart over windows on the hour in buckets of whole hours (``rolled``: the
    roll-ups count them), and over a ragged window or in parts of hours (they cannot)."""
    out = {f"activity {since} {until} {n} {rolled}": to_jsonable(audit.activity(
        since=since, until=until, buckets=n)) for since, until, n, rolled in CHARTS}
    for since, until, n, rolled in CHARTS:
        series = to_jsonable(audit.route_series(since=since, until=until, buckets=n))
        for route in series:  # a mean of hourly sums: the last bits of a float may differ
            for p in route["points"]:
                p["latency_s"] = None if p["latency_s"] is None else round(p["latency_s"], 9)
        out[f"activity routes {since} {until} {n} {rolled}"] = series
    return out


def _spend(audit: Audit) -> dict[str, Any]:
    """Spend against budgets by tenant and by label over every window, and split in buckets
    of whole hours (counted from the roll-ups) and of half hours (not), from a window on the
    hour and a ragged one."""
    out = {f"spend {by} {since} {until}": to_jsonable(audit.spend(
        by=by, label="team" if by == "label" else None, since=since, until=until,
        limit=10_000).items) for by in ("tenant", "label") for since, until in WINDOWS}
    for since, every in ((_START, 3600.0), (_START, 7200.0), (_START, 1800.0),
                         (_START, 86400.0), (END - SPAN + 1234.5, 3600.0)):
        out[f"spend every {since} {every}"] = to_jsonable(audit.spend(
            by="tenant", since=since, until=END, every=every, limit=10_000).items)
    return out


def _sql(url: str, sql: str, args: dict[str, Any] | None = None) -> list[Any]:
    eng = create_engine(normalize_url(url))
    try:
        with eng.begin() as conn:
            res = conn.execute(text(sql), args or {})
            return list(res) if res.returns_rows else []
    finally:
        eng.dispose()


def _rolled(url: str) -> set[int]:
    return {int(r[0]) for r in _sql(url, "SELECT hour FROM rollup_hours")}


def _read_from_attempts(led: Ledger, url: str) -> dict[str, Any]:
    """The answers with every roll-up gone: what the attempts alone say."""
    _unroll_all(url)
    return _answers(led)


def _unroll_all(url: str) -> None:
    """Every hour's roll-up gone; not the rows retention carried over for the history it
    dropped, which no table holds any more (:data:`~ledger.storage.hours.CARRIED_HOUR`)."""
    for table in ("attempt_rollups", "metric_rollups", "move_rollups", "wait_rollups",
                  "run_rollups", "rollup_hours"):
        _sql(url, f"DELETE FROM {table} WHERE hour <> :carried", {"carried": CARRIED_HOUR})
    _sql(url, "DELETE FROM rollup_days")


def test_totals_read_from_rollups_are_the_totals_read_from_attempts(db_url: str) -> None:
    led = _generated(db_url)
    try:
        before = _answers(led)
        rep = led.roll_up(lag=0)
        # Every whole hour behind the clock, none of the one still going.
        assert rep.hours == 10 and rep.pending == 0 and rep.rows > 10
        assert rep.until == hour_of(END) * HOUR
        rolled = _rolled(db_url)
        assert hour_of(END) not in rolled and hour_of(END) - 1 in rolled
        # The rolled hours hold unknown attempts, which they count, with what they hold.
        unknown = [r for r in _sql(db_url, "SELECT created_at, reserved_micros FROM attempts "
                                           "WHERE state = 'unknown'") if hour_of(r[0]) in rolled]
        assert unknown
        assert _sql(db_url, "SELECT SUM(unknown), SUM(held_micros) FROM attempt_rollups")[0] \
            == (len(unknown), sum(r[1] for r in unknown))
        assert _sql(db_url, "SELECT SUM(n) FROM metric_rollups WHERE state = 'unknown'")[0][0] \
            == len(unknown)
        assert _answers(led) == before
        # And the totals and the chart do read the roll-ups: a roll-up row changed shows in
        # them, the chart's buckets of whole hours only.
        _sql(db_url, "UPDATE attempt_rollups SET attempts = attempts + 1000")
        after = _answers(led)
        changed = {k for k in before if after[k] != before[k]}
        charts = {k for k in before if k.startswith("activity ") and k.endswith("True")
                  and not k.startswith("activity routes")}
        assert {k for k in changed if k.startswith("activity")} == charts
        assert any(k.startswith("route") for k in changed)
        assert not any(k.startswith("metrics") for k in changed)
        # So do the metrics and the routes' series (off metric_rollups, its buckets of whole
        # hours only): counts of attempts, and of failovers, changed in their roll-ups show.
        _sql(db_url, "UPDATE metric_rollups SET n = n + 1000")
        _sql(db_url, "UPDATE move_rollups SET n = n + 1000")
        again = _answers(led)
        assert {k for k in again if k.startswith("activity routes") and again[k] != after[k]} \
            == {k for k in before if k.startswith("activity routes") and k.endswith("True")}
        assert again["metrics attempts"] != before["metrics attempts"]
        assert again["metrics failovers"] > before["metrics failovers"] + 999
        # And spend by tenant and by label reads run_rollups, its buckets of whole hours only.
        _sql(db_url, "UPDATE run_rollups SET budget_micros = budget_micros + 1000")
        third = _answers(led)
        spent = {k for k in before if k.startswith("spend") and third[k] != again[k]}
        assert {k for k in spent if not k.startswith("spend every")} == {
            f"spend {by} {since} {until}" for by in ("tenant", "label")
            for since, until in WINDOWS if until is None or until - (since or 0) > 2 * HOUR}
        assert {k for k in spent if k.startswith("spend every")} == {
            k for k in before if k.startswith("spend every")}  # the totals of each key
        points = {k for k in spent if k.startswith("spend every")
                  and [x["points"] for x in third[k]] != [x["points"] for x in again[k]]}
        assert points == {k for k in spent if k.startswith("spend every")
                          and not k.endswith(" 1800.0")}
    finally:
        led.close()


@pytest.mark.parametrize("ids_per_statement", [500, 3])
def test_the_totals_by_run_page_by_page_are_every_runs_own_sums_most_expensive_first(
        db_url: str, ids_per_statement: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The totals by run choose a page's Runs on their cost, then sum only those (their ids
    bound a few hundred to a statement; here also 3, so a page of 7 takes three): read in
    pages of 7, over the whole history and a ragged window, they are every Run's sums read
    straight off its attempts (and its money off the Run's own counters), costliest first,
    ties by run id, none missing or repeated."""
    monkeypatch.setattr(audit_queries, "_IDS_PER_STATEMENT", ids_per_statement)
    led = _generated(db_url)
    try:
        audit = Audit(led)
        for since, until in ((None, None), WINDOWS[1]):
            pages, cursor = [], None
            while True:
                page = audit.costs(by="run", since=since, until=until, limit=7, cursor=cursor)
                pages.extend(page.items)
                if page.next_cursor is None:
                    break
                cursor = page.next_cursor
            got = [(t.key, t.attempts, t.succeeded, t.failed, t.unknown, t.prompt_tokens,
                    t.completion_tokens, t.cost) for t in pages]
            lo, hi = since or 0.0, until or 1e12
            rows = _sql(db_url, "SELECT run_id, count(*), "
                        "sum(CASE WHEN state = 'succeeded' THEN 1 ELSE 0 END), "
                        "sum(CASE WHEN state = 'failed' THEN 1 ELSE 0 END), "
                        "sum(CASE WHEN state = 'unknown' THEN 1 ELSE 0 END), "
                        "coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0) "
                        "FROM attempts WHERE created_at >= :lo AND created_at < :hi "
                        "GROUP BY run_id", {"lo": lo, "hi": hi})
            counts = {str(r[0]): tuple(int(x) for x in r[1:]) for r in rows}
            costs = {t[0]: t[7] for t in got}
            assert sorted(t[0] for t in got) == sorted(counts)  # every Run once
            assert {t[0]: t[1:7] for t in got} == counts
            assert [t[0] for t in got] == sorted(costs, key=lambda k: (-costs[k], k))
            assert len(set(costs.values())) < len(costs)  # ties there were, ordered by id
            if since is None:
                # A Run's own counters: what its attempts were charged, over its whole life.
                assert all(led.get_run(k).posted == c for k, c in costs.items())
    finally:
        led.close()


def _clock(led: Ledger) -> ManualClock:
    clock = led.clock
    assert isinstance(clock, ManualClock)
    return clock


def _late_attempt(led: Ledger) -> int:
    """A succeeded attempt begun by a clock behind the others' (8 hours before the end, in
    an hour rolled already); the hour it went into."""
    late = hour_of(END - 8 * HOUR)
    _clock(led).set(late * HOUR + 600)
    led.admit_run("late", plan=[ROUTE], budget=Budget(max_calls=2, max_retries=0,
                                                      max_cost=1))
    lease = led.acquire_lease("late", ttl_s=3600)
    att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
    return late


def test_idle_months_are_rolled_and_folded_in_statements_per_batch_not_per_hour(
        db_url: str) -> None:
    """A ledger idle for four months after its history (2,880 empty hours, 120 empty days) is
    rolled up and folded by reading from each written hour to the next: a few statements per
    batch of hours or days, where a probe of every hour took three per hour (over 8,000), and
    the answers stay the attempts' own."""
    from sqlalchemy import event

    from tests.storage.helpers import sql_context

    _generated(db_url).close()
    later = END + 120 * 86400
    with Ledger.open(db_url, clock=ManualClock(later), migrate_schema=False) as led:
        audit = Audit(led)

        def answers() -> dict[str, Any]:
            return {"route": to_jsonable(audit.costs(by="route", limit=10_000).items),
                    **_metrics(audit)}

        want = answers()
        statements = [0]

        def count(*_: Any) -> None:
            statements[0] += 1

        engine = sql_context(led).engine
        event.listen(engine, "before_cursor_execute", count)
        try:
            report = led.roll_up(lag=0)
        finally:
            event.remove(engine, "before_cursor_execute", count)
        assert report.pending == 0
        assert report.hours == hour_of(later) - hour_of(END - SPAN)  # every hour, empty or not
        # Every day ended 8 days ago (the default fold_after) but the history's first, which
        # began before it (its first hours are no hours of the ledger's, never rolled).
        assert report.days == hour_of(later - 8 * 86400) // 24 - hour_of(END - SPAN) // 24 - 1
        assert statements[0] < 1_000, statements[0]
        assert answers() == want


def test_a_late_write_to_a_rolled_hour_undoes_that_hours_rollup_only(db_url: str) -> None:
    led = _generated(db_url)
    try:
        led.roll_up(lag=0)
        rolled = _rolled(db_url)
        unknown = sorted((r[1], r[0]) for r in _sql(
            db_url, "SELECT attempt_id, created_at FROM attempts WHERE state = 'unknown'")
            if hour_of(r[1]) in rolled)
        when, attempt_id = unknown[0]
        # An operator's late receipt for an unknown attempt of a rolled hour.
        led.settle_unknown(attempt_id, outcome="succeeded", cost="0.001", note="billing export",
                           by="ops")
        # A begin whose clock is behind the others', into another rolled hour.
        late = _late_attempt(led)
        assert late != hour_of(when) and late in rolled
        assert _rolled(db_url) == rolled - {hour_of(when), late}
        assert not _sql(db_url, "SELECT 1 FROM attempt_rollups WHERE hour IN (:a, :b)",
                        {"a": hour_of(when), "b": late})
        with_rollups = _answers(led)
        _clock(led).set(END)
        assert led.roll_up(lag=0).hours == 2  # the next roll-up redoes just those two
        redone = _answers(led)
        assert with_rollups == redone == _read_from_attempts(led, db_url)
    finally:
        led.close()


def test_an_attempt_in_flight_in_a_rolled_hour_is_read_from_attempts_until_settled(
        db_url: str) -> None:
    led = _generated(db_url)
    try:
        led.roll_up(lag=0)
        # A begin by a clock behind the others' into a rolled hour: the hour is undone, and
        # rolled again while the attempt is still in flight, which the roll-up leaves out.
        hour = hour_of(END - 7 * HOUR)
        _clock(led).set(hour * HOUR + 300)
        led.admit_run("slow", plan=[ROUTE], tenant="acme",
                      budget=Budget(max_calls=2, max_retries=0, max_cost=1))
        lease = led.acquire_lease("slow", ttl_s=86400)
        att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.03")
        assert hour not in _rolled(db_url)
        _clock(led).set(END)
        assert led.roll_up(lag=0).hours == 1 and hour in _rolled(db_url)
        assert not _sql(db_url, "SELECT 1 FROM metric_rollups WHERE state = 'dispatching'")
        in_flight = _answers(led)
        assert in_flight["metrics reserved"]["acme"] != "0"
        assert in_flight == _read_from_attempts(led, db_url)
        led.roll_up(lag=0)
        # Its settle, an unknown one, undoes the hour; rolled again, the hour counts it.
        led.settle_attempt(lease, att.attempt_id, outcome="unknown")
        assert hour not in _rolled(db_url)
        led.roll_up(lag=0)
        assert _sql(db_url, "SELECT SUM(unknown) FROM attempt_rollups WHERE hour = :h",
                    {"h": hour})[0][0] >= 1
        assert _answers(led) == _read_from_attempts(led, db_url)
    finally:
        led.close()


def test_one_audit_scrapes_metrics_by_the_hours_rolled_now_not_when_it_first_scraped(
        db_url: str) -> None:
    """An Audit keeps /metrics' statements for the rolled hours it read them for; a scrape
    after a late write undid a rolled hour (and after the next roll-up) counts that hour as
    it is now, as a fresh Audit and the attempts alone do."""
    led = _generated(db_url)
    try:
        audit = Audit(led)  # one object, as the dashboard keeps one
        led.roll_up(lag=0)
        rolled = _rolled(db_url)
        first = _metrics(audit)
        late = _late_attempt(led)
        assert late in rolled and late not in _rolled(db_url)
        undone = _metrics(audit)
        assert undone != first  # the late attempt is counted
        assert undone == _metrics(Audit(led))
        _clock(led).set(END)
        assert led.roll_up(lag=0).hours == 1
        assert _metrics(audit) == undone  # the hour rolled again
        _unroll_all(db_url)
        assert _metrics(audit) == undone  # every hour read from the tables again
    finally:
        led.close()


def test_retention_takes_the_rollups_of_the_history_it_drops(db_url: str) -> None:
    clock = ManualClock(_t(2026, 1))
    with Ledger.open(db_url, clock=clock) as led:
        _history(led, clock)
        clock.set(_t(2026, 8, 5))
        led.roll_up(lag=0)
        jan = {hour_of(r[0]) for r in _sql(db_url, "SELECT created_at FROM attempts WHERE "
                                                   "run_id IN ('jan', 'jan-closed')")}
        jul = {hour_of(r[0]) for r in _sql(db_url, "SELECT created_at FROM attempts WHERE "
                                                   "run_id = 'jul'")}
        assert jan | jul <= _rolled(db_url)
        audit = Audit(led)
        led.drop_history(90 * 86400, by="alice")
        left = _rolled(db_url)
        assert not jan & left and jul <= left
        costs = to_jsonable(audit.costs(by="route", since=0.0).items)
        metrics = to_jsonable(audit.metrics())
        _unroll_all(db_url)
        assert costs == to_jsonable(audit.costs(by="route", since=0.0).items)
        assert metrics == to_jsonable(audit.metrics())
        assert costs[0]["attempts"] == 4  # feb-unknown's two, mar-live's, jul's


@pytest.mark.postgres
def test_a_rollup_waits_for_a_write_in_flight_to_its_hour_and_counts_it(pg_url: str) -> None:
    led = _generated(pg_url, attempts=120)
    eng = create_engine(normalize_url(pg_url))
    try:
        hour = hour_of(END - 3 * HOUR)
        # A writer's transaction, open: it changes a settled attempt of that hour.
        writer = eng.connect()
        tx = writer.begin()
        changed = writer.execute(text(
            "UPDATE attempts SET prompt_tokens = prompt_tokens + 1000 WHERE attempt_id = ("
            "SELECT attempt_id FROM attempts WHERE created_at >= :lo AND created_at < :hi "
            "AND state = 'succeeded' AND prompt_tokens IS NOT NULL ORDER BY attempt_id "
            "LIMIT 1)"), {"lo": hour * HOUR, "hi": hour * HOUR + HOUR}).rowcount
        assert changed == 1
        done: list[Any] = []
        job = threading.Thread(target=lambda: done.append(led.roll_up(lag=0)))
        job.start()
        with eng.connect() as watch:
            for _ in range(600):  # until the roll-up waits on that hour's lock
                waiting = watch.execute(text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND classid = 7894 AND objid = :h"), {"h": hour}).scalar_one()
                if waiting:
                    break
                job.join(0.05)
            assert waiting and not done
        tx.commit()
        writer.close()
        job.join(60)
        assert done and done[0].hours == 10
        assert hour in _rolled(pg_url)
        # The roll-up read the hour after the write committed: it counts the change.
        counted = _sql(pg_url, "SELECT sum(prompt_tokens) FROM attempt_rollups WHERE "
                               "hour = :h", {"h": hour})[0][0]
        settled = _sql(pg_url, "SELECT sum(prompt_tokens) FROM attempts WHERE created_at >= "
                               ":lo AND created_at < :hi AND state NOT IN ('unknown', "
                               "'dispatching')", {"lo": hour * HOUR, "hi": hour * HOUR + HOUR}
                       )[0][0]
        assert counted == settled
    finally:
        eng.dispose()
        led.close()


def test_a_rollup_of_an_empty_ledger_or_one_rolled_already_does_nothing(
        tmp_path: Any) -> None:
    with Ledger.open(str(tmp_path / "l.db"), clock=ManualClock(END)) as led:
        assert led.roll_up().hours == 0
    led = _generated(str(tmp_path / "g.db"), attempts=60)
    try:
        first = led.roll_up(lag=0, max_hours=3)
        assert first.hours == 3 and first.pending >= 6
        rest = led.roll_up(lag=0)
        assert (rest.hours, rest.pending) == (first.pending, 0)
        assert led.roll_up(lag=0).hours == 0
    finally:
        led.close()


@pytest.mark.parametrize(("kwargs", "field"), [({"lag": -1}, "lag"),
                                               ({"lag": float("nan")}, "lag"),
                                               ({"lag": 1e20}, "lag"),
                                               ({"max_hours": 0}, "max_hours"),
                                               ({"max_hours": 1.5}, "max_hours"),
                                               ({"fold_after": -1}, "fold_after"),
                                               ({"fold_after": "soon"}, "fold_after")])
def test_a_rollup_refuses_bad_arguments_by_name(tmp_path: Any, kwargs: dict[str, Any],
                                                field: str) -> None:
    with Ledger.open(str(tmp_path / "l.db"), clock=ManualClock(END)) as led:
        with pytest.raises(InvalidArgument) as err:
            led.roll_up(**kwargs)
        assert err.value.fields.get("field") == field


def test_roll_up_refuses_past_the_rollup_commands_bounds_on_both_databases(
        db_url: str) -> None:
    """``roll_up(lag=36500 days)`` and any ``fold_after`` were taken where ``rollup --lag``
    stops at a week and ``--fold-after`` at 366 days: the library keeps the same bounds (one
    definition), refused by name with the fix in seconds, before anything is written."""
    led = _generated(db_url)
    try:
        for kwargs, fix in (
                ({"lag": MAX_LAG_S + 1}, "pass seconds from 0 to 604800 (7 days)"),
                ({"lag": 36_500 * 86_400.0}, "pass seconds from 0 to 604800 (7 days)"),
                ({"lag": 3_600_000}, "pass seconds from 0 to 604800 (7 days)"),  # 1 h in ms
                ({"fold_after": MAX_FOLD_AFTER_S + 1},
                 "pass seconds from 0 to 31622400 (366 days)"),
                ({"fold_after": 691_200_000}, "or None to fold nothing")):  # 8 days in ms
            with pytest.raises(InvalidArgument) as err:
                led.roll_up(**kwargs)
            field = next(iter(kwargs))
            assert err.value.field == field, (kwargs, err.value)
            assert str(err.value).startswith(f"invalid {field}: ") and fix in str(err.value), \
                (kwargs, str(err.value))
        assert _rolled(db_url) == set()
        # The bounds themselves are taken: a week's lag leaves these ten hours for later.
        assert led.roll_up(lag=MAX_LAG_S, fold_after=MAX_FOLD_AFTER_S).hours == 0
        assert led.roll_up(lag=0, fold_after=MAX_FOLD_AFTER_S).hours >= 10
    finally:
        led.close()


def test_the_rollup_command_reports_what_it_did(tmp_path: Any, capsys: Any) -> None:
    # The command rolls up to the wall clock: a history of twelve hours up to now (one ending
    # years ago left every hour since to roll, a little more each day the suite ran).
    db, now = str(tmp_path / "g.db"), time.time()
    generated(db, start=now - 12 * HOUR, attempts=60, days=0.5, end=now, seed=7).close()
    assert main(["rollup", "--db", db, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["hours"] >= 10 and rep["pending"] == 0 and rep["rows"] > 0
    assert main(["rollup", "--db", db]) == 0
    # Nothing more is due (one hour at most, had the clock's hour ended in between).
    assert re.match(r"rolled up [01] hour\(s\)", capsys.readouterr().out)
    assert main(["rollup", "--db", db, "--lag", "soon"]) == 2
    assert "--lag 'soon' is not a span of time" in capsys.readouterr().err


def test_a_lag_longer_than_a_week_is_refused_naming_the_flag_and_its_bound(
        tmp_path: Any, capsys: Any) -> None:
    """``--lag 1e20`` rolled the hours ending by ``-1e+20 s since 1970`` and exited 0, and
    ``--lag 36500d`` (a hundred years: nothing ever rolled, nor folded) was taken. A lag is
    minutes; past a week it is refused with its bound, before the ledger is written."""
    db = str(tmp_path / "g.db")
    generated(db, start=END - 12 * HOUR, attempts=20, days=0.5, end=END, seed=7).close()
    before = Path(db).read_bytes()
    for lag in ("1e20", "36500d", "8d", "604801", "inf", "nan", "-300"):
        assert main(["rollup", "--db", db, "--lag", lag]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert f"--lag '{lag}' is not a span from 0 to 7 days, the longest lag rollup takes: " \
            "pass a span such as 5m (the default), 1h, 2d or seconds" in captured.err, captured
    assert Path(db).read_bytes() == before
    for lag in ("7d", "604800", "0"):
        assert main(["rollup", "--db", db, "--lag", lag, "--json"]) == 0, lag
        assert json.loads(capsys.readouterr().out)["pending"] == 0


def test_migration_0011_downgrade_leaves_no_trigger_behind(db_url: str) -> None:
    led = _generated(db_url, attempts=40)
    led.roll_up(lag=0)
    led.close()
    _alembic(db_url, "downgrade", "0010")
    # Writes to attempts work on the older schema (as that package's would make them): no
    # trigger is left to find its dropped tables.
    _sql(db_url, "UPDATE attempts SET settled_at = created_at + 1 WHERE state = 'succeeded'")
    _sql(db_url, "DELETE FROM attempts WHERE state = 'not_sent'")
    _alembic(db_url, "upgrade", "head")
    assert _rolled(db_url) == set()


def test_the_async_ledger_rolls_up_the_same_hours(db_url: str) -> None:
    import asyncio

    from ledger import AsyncLedger

    led = _generated(db_url, attempts=60)
    before = _answers(led)

    async def roll() -> Any:
        async with AsyncLedger.open(db_url, clock=ManualClock(END),
                                    migrate_schema=False) as aled:
            return await aled.roll_up(lag=0, max_hours=4)

    try:
        rep = asyncio.run(roll())
        assert rep.hours == 4 and len(_rolled(db_url)) == 4
        assert _answers(led) == before
    finally:
        led.close()


def test_the_triggers_that_keep_rollups_exact_exist_at_head(db_url: str) -> None:
    # Alembic compares tables, not triggers: a later migration that rebuilt `attempts` (SQLite's
    # batch mode copies a table and drops its triggers) would leave the roll-ups stale, silently.
    Ledger.open(db_url, clock=ManualClock(END)).close()
    if db_url.endswith(".db"):
        names = {(r[0], r[1]) for r in _sql(db_url, "SELECT tbl_name, name FROM sqlite_master "
                                                    "WHERE type = 'trigger' AND tbl_name IN "
                                                    "('attempts', 'events', 'runs')")}
        assert names == {("attempts", "attempts_unroll_insert"),
                         ("attempts", "attempts_unroll_update"),
                         ("attempts", "attempts_unroll_moved"),
                         ("attempts", "attempts_unroll_delete"),
                         ("events", "events_unroll_insert"), ("events", "events_unroll_delete"),
                         ("runs", "runs_unroll_insert"), ("runs", "runs_unroll_update"),
                         ("runs", "runs_unroll_moved"), ("runs", "runs_unroll_delete")}
        # Each clears every roll-up of its hour (0013 added two tables), and of its day when
        # the day is folded (0016).
        bodies = [r[0] for r in _sql(db_url, "SELECT sql FROM sqlite_master WHERE "
                                             "type = 'trigger' AND name LIKE '%unroll%'")]
        assert all("wait_rollups" in b and "run_rollups" in b and "rollup_days" in b
                   for b in bodies)
    else:
        rows = _sql(db_url, "SELECT tgrelid::regclass::text, tgname, tgtype FROM pg_trigger "
                            "WHERE NOT tgisinternal AND tgparentid = 0 AND tgrelid IN "
                            "('attempts'::regclass, 'events'::regclass, 'runs'::regclass) "
                            "ORDER BY 1, 2")
        # A row trigger for INSERT, UPDATE and DELETE (tgtype bits 1, 4, 8, 16); on events one
        # for INSERT and one for DELETE, of moves only.
        assert [(table, name, tgtype & 29) for table, name, tgtype in rows] == [
            ("attempts", "attempts_unroll", 29), ("events", "events_unroll_delete", 9),
            ("events", "events_unroll_insert", 5), ("runs", "runs_unroll_delete", 9),
            ("runs", "runs_unroll_insert", 5), ("runs", "runs_unroll_update", 17)]
        body = _sql(db_url, "SELECT prosrc FROM pg_proc WHERE proname = "
                            "'ledger_attempts_unroll'")[0][0]
        assert all(t in body for t in ("metric_rollups", "move_rollups", "wait_rollups",
                                       "run_rollups", "rollup_days"))


def test_a_hosts_own_move_undoes_its_rolled_hour_and_is_counted(db_url: str) -> None:
    # A host records a move by itself (no attempt written with it): into an hour rolled
    # already, and into an hour that held nothing else.
    led = _generated(db_url, attempts=120)
    try:
        clock = led.clock
        assert isinstance(clock, ManualClock)
        clock.set(END - 12 * HOUR)  # before the generated history: an hour of its own
        led.admit_run("host", plan=[ROUTE], budget=Budget(max_calls=2, max_retries=0,
                                                          max_cost=1))
        lease = led.acquire_lease("host", ttl_s=86400)
        clock.set(END - 12 * HOUR + 100)
        led.append_event(lease, "move", {"from_route": "a", "to_route": "elsewhere",
                                         "cause": {"category": "overloaded"}})
        led.append_event(lease, "capacity_wait", {"group": "g", "outcome": "timed_out",
                                                  "waited_s": 2.5})
        clock.set(END)
        led.roll_up(lag=0)
        lone = hour_of(END - 12 * HOUR + 100)
        assert lone in _rolled(db_url)  # its move is rolled up, not the hour marked empty
        assert _sql(db_url, "SELECT n FROM move_rollups WHERE hour = :h", {"h": lone}) == [(1,)]
        assert _sql(db_url, "SELECT group_id, outcome, waited_s_n, waited_s_sum FROM "
                            "wait_rollups WHERE hour = :h", {"h": lone}) == [
            ("g", "timed_out", 1, 2.5)]
        before = _answers(led)
        rolled = _rolled(db_url)
        late = hour_of(END - 4 * HOUR)
        assert late in rolled
        clock.set(late * HOUR + 60)
        led.append_event(lease, "move", {"from_route": "a", "to_route": "elsewhere",
                                         "cause": {"category": "overloaded"}})
        led.append_event(lease, "note", {"text": "not a move: leaves the roll-ups"})
        assert _rolled(db_url) == rolled - {late}
        after = _metrics(Audit(led))
        key = str(("a", "elsewhere", "overloaded"))
        assert after["metrics failovers_by"][key] == before["metrics failovers_by"][key] + 1
        clock.set(END)
        assert led.roll_up(lag=0).hours == 1
        # A turn's wait in a full group's queue, recorded into another rolled hour, too.
        other = hour_of(END - 3 * HOUR)
        clock.set(other * HOUR + 60)
        led.append_event(lease, "capacity_wait", {"group": "g", "outcome": "admitted",
                                                  "waited_s": 0.3})
        assert other not in _rolled(db_url)
        waits = _metrics(Audit(led))["metrics queue_waits"]
        assert waits[str(("g", "admitted"))]["count"] == 1
        clock.set(END)
        assert led.roll_up(lag=0).hours == 1
        assert _answers(led) == _read_from_attempts(led, db_url)
    finally:
        led.close()


def test_a_run_ending_after_its_hour_was_rolled_undoes_that_hour_its_live_writes_do_not(
        db_url: str) -> None:
    led = _generated(db_url, attempts=120)
    try:
        clock = led.clock
        assert isinstance(clock, ManualClock)
        admitted = hour_of(END - 6 * HOUR)
        clock.set(admitted * HOUR + 120)
        led.admit_run("long", plan=[ROUTE], tenant="acme",
                      budget=Budget(max_calls=3, max_retries=0, max_cost=1))
        clock.set(END)
        led.roll_up(lag=0)
        rolled = _rolled(db_url)
        assert admitted in rolled
        # Its calls, in the hour still going: they change its money, and it is still live.
        lease = led.acquire_lease("long", ttl_s=600)
        att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.05")
        led.settle_attempt(lease, att.attempt_id, outcome="unknown")
        assert _rolled(db_url) == rolled
        live = _metrics(Audit(led))
        assert live["metrics reserved"]["acme"] == "0.05"
        # It ends: its hour now counts it differently, so it is read from the Runs again.
        led.finish_run(lease, "failed")
        led.release_lease(lease)
        assert _rolled(db_url) == rolled - {admitted}
        assert led.roll_up(lag=0).hours == 1
        assert _rolled(db_url) == rolled
        # Its budget (what it carved) or its labels change: its hour is undone, each counts
        # in spend.
        for change in ("carved_micros = carved_micros + 1", """labels = '{"team": "late"}'"""):
            _sql(db_url, f"UPDATE runs SET {change} WHERE run_id = 'long'")
            assert _rolled(db_url) == rolled - {admitted}
            assert _answers(led) == _read_from_attempts(led, db_url)
            led.roll_up(lag=0)
        _sql(db_url, "UPDATE runs SET carved_micros = carved_micros - 1 WHERE run_id = 'long'")
        led.roll_up(lag=0)
        # An operator's receipt moves an ended Run's money: its hour is undone again.
        led.settle_unknown(att.attempt_id, outcome="succeeded", cost="0.02", note="invoice",
                           by="ops")
        assert admitted not in _rolled(db_url)
        after = _metrics(Audit(led))
        assert (after["metrics posted"]["acme"], after["metrics reserved"]["acme"]) == (
            str(Decimal(live["metrics posted"]["acme"]) + Decimal("0.02")), "0")
        led.roll_up(lag=0)
        assert _answers(led) == _read_from_attempts(led, db_url)
    finally:
        led.close()


def test_migration_0013_redoes_the_rolled_hours_and_its_downgrade_keeps_0011s(
        db_url: str) -> None:
    led = _generated(db_url, attempts=40)
    led.roll_up(lag=0)
    before = _answers(led)
    led.close()
    _alembic(db_url, "downgrade", "0012")
    # 0011's roll-ups still work under 0011's trigger: a late write undoes its hour.
    assert _rolled(db_url)
    _sql(db_url, "UPDATE attempts SET settled_at = created_at + 1 WHERE state = 'succeeded'")
    assert not _rolled(db_url)
    _sql(db_url, "INSERT INTO rollup_hours (hour, rolled_at) VALUES (1, 0)")
    _alembic(db_url, "upgrade", "head")
    # The upgrade unmarks what was rolled (the new tables have no rows of it).
    assert _rolled(db_url) == set()
    led = Ledger.open(db_url, clock=ManualClock(END))
    try:
        led.roll_up(lag=0)
        assert _answers(led) == before
    finally:
        led.close()


def test_the_metric_rollups_keep_the_buckets_metrics_exposes() -> None:
    # The roll-ups count each time into METRIC_BOUNDS; /metrics reads them only when its
    # buckets are those, so buckets changed in one place alone would silently read every
    # scrape from the attempts again.
    from ledger.storage.schema import METRIC_BOUNDS, METRIC_TIMES, metric_rollups
    from ledger.telemetry import DURATION_BUCKETS

    assert DURATION_BUCKETS == METRIC_BOUNDS
    assert {f"{m}_le{len(METRIC_BOUNDS) - 1}" for m in METRIC_TIMES} <= set(metric_rollups.c.keys())


def test_migration_0015_redoes_only_the_rolled_hours_holding_unknown_attempts(
        db_url: str) -> None:
    led = _generated(db_url)
    led.roll_up(lag=0)
    before = _answers(led)
    led.close()
    rolled = _rolled(db_url)
    unknown = {hour_of(r[0]) for r in _sql(
        db_url, "SELECT created_at FROM attempts WHERE state = 'unknown'")} & rolled
    assert unknown and rolled - unknown
    # 0014's readers take the unknown attempts from attempts: the hours counting them are
    # unmarked, the others kept.
    _alembic(db_url, "downgrade", "0014")
    assert _rolled(db_url) == rolled - unknown
    # An hour rolled by 0014 (its unknown attempts left out): the upgrade unmarks it.
    redo = min(unknown)
    _sql(db_url, "INSERT INTO rollup_hours (hour, rolled_at) VALUES (:h, 0)", {"h": redo})
    _alembic(db_url, "upgrade", "head")
    assert _rolled(db_url) == rolled - unknown
    led = Ledger.open(db_url, clock=ManualClock(END))
    try:
        assert led.roll_up(lag=0).hours == len(unknown)
        assert _rolled(db_url) == rolled
        assert _answers(led) == before
    finally:
        led.close()


def test_after_0015_an_older_packages_rollup_fails_on_postgresql_rather_than_miscounts(
        pg_url: str) -> None:
    from sqlalchemy.exc import IntegrityError

    led = _generated(pg_url, attempts=40)
    try:
        led.roll_up(lag=0)
    finally:
        led.close()
    # What a roll-up of 0014's package inserts: the hour's sums, without the unknown ones.
    old = ("INSERT INTO attempt_rollups (hour, route_id, group_id, provider, tenant, labels, "
           "attempts, succeeded, failed, prompt_tokens, completion_tokens, cost_micros) "
           "VALUES (1, 'a', 'g', 'p', NULL, NULL, 1, 1, 0, 0, 0, 0)")
    with pytest.raises(IntegrityError, match="unknown"):
        _sql(pg_url, old)
    assert not _sql(pg_url, "SELECT 1 FROM attempt_rollups WHERE hour = 1")
