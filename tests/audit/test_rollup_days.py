"""Folded days (``Ledger.roll_up(fold_after=...)``, migration 0016): an old day's hours summed
into one set of roll-up rows answer every read as the attempts do, on both databases, and a
write to any attempt of the day undoes the whole day."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger import Budget, Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.ops.audit import Audit, to_jsonable
from ledger.storage.engine import normalize_url
from ledger.storage.hours import hour_of
from ledger.tools.generate import generate
from tests.audit.generated import generated
from tests.audit.test_rollups import _metrics, _rolled, _sql, _unroll_all
from tests.storage.test_history_scales import HASH, ROUTE, _alembic

END = 1_700_000_000.0  # 22:13:20 UTC on day 19675
DAY = 86400.0
HOUR = 3600.0
TODAY = 19675
FULL = (TODAY - 2, TODAY - 1)  # the history's whole days; the first and today are partial
MID = (TODAY - 1) * DAY  # midnight between the two whole days
FIRST = hour_of(END - 3.4 * DAY) * HOUR  # an hour of the first, partial, day
WINDOWS = [
    (None, None),
    (FULL[0] * DAY, FULL[1] * DAY),  # exactly one folded day
    (FULL[0] * DAY + 5 * HOUR, MID + 21 * HOUR),  # each folded day cut
    (END - 2.5 * DAY + 123.4, None),  # ragged
    (FULL[0] * DAY, END),
]
CHARTS = [  # (since, until, buckets): each folded day whole in one bucket, or not
    (FIRST, hour_of(END) * HOUR, int((hour_of(END) * HOUR - FIRST) / HOUR)),  # hours
    (FULL[0] * DAY, TODAY * DAY, 2),  # days from midnight: read the folded rows
    (FULL[0] * DAY - 2 * DAY, TODAY * DAY + 2 * DAY, 3),  # two days a bucket
    (FULL[0] * DAY + 6 * HOUR, TODAY * DAY + 6 * HOUR, 2),  # days from 06:00: straddle
]


def _generated(url: str) -> Ledger:
    return generated(url, start=END - 4 * DAY, attempts=250, days=3.5, end=END, seed=11)


def _answers(led: Ledger) -> dict[str, Any]:
    audit = Audit(led)
    out: dict[str, Any] = {}
    for since, until in WINDOWS:
        for by in ("route", "tenant", "label"):
            out[f"costs {by} {since} {until}"] = to_jsonable(audit.costs(
                by=by, label="team" if by == "label" else None, since=since, until=until,
                limit=10_000).items)
        out[f"spend {since} {until}"] = to_jsonable(audit.spend(
            by="tenant", since=since, until=until, limit=10_000).items)
    for since, until, n in CHARTS:
        out[f"activity {since} {n}"] = to_jsonable(audit.activity(
            since=since, until=until, buckets=n))
        series = to_jsonable(audit.route_series(since=since, until=until, buckets=n))
        for route in series:  # a mean of summed sums: the last bits of a float may differ
            for p in route["points"]:
                p["latency_s"] = None if p["latency_s"] is None else round(p["latency_s"], 9)
        out[f"routes {since} {n}"] = series
    out["by day"] = to_jsonable(audit.costs_by_day(days=5, now=END))
    for since, every in ((FULL[0] * DAY, DAY), (FULL[0] * DAY + 6 * HOUR, DAY),
                         (FIRST, HOUR), (FIRST, 2 * HOUR)):
        out[f"spend every {since} {every}"] = to_jsonable(audit.spend(
            by="tenant", since=since, until=END, every=every, limit=10_000).items)
    out.update(_metrics(audit))
    return out


def _folded(url: str) -> set[int]:
    return {int(r[0]) for r in _sql(url, "SELECT day FROM rollup_days")}


def _hours(day: int) -> set[int]:
    return set(range(day * 24, day * 24 + 24))


def test_reads_of_folded_days_are_the_reads_of_the_attempts(db_url: str) -> None:
    led = _generated(db_url)
    try:
        before = _answers(led)
        hourly = led.roll_up(lag=0, fold_after=None)
        assert hourly.days == 0 and not _folded(db_url)
        rows = _sql(db_url, "SELECT COUNT(*) FROM metric_rollups")[0][0]
        assert _answers(led) == before
        # The whole days only (the first and today are partial); the rows of each are one
        # set, at the day's first hour, and the day's hours stay marked.
        rep = led.roll_up(lag=0, fold_after=0)
        assert (rep.hours, rep.days) == (0, 2) and _folded(db_url) == set(FULL)
        assert _hours(FULL[0]) | _hours(FULL[1]) <= _rolled(db_url)
        for day in FULL:
            assert {int(r[0]) for r in _sql(
                db_url, "SELECT DISTINCT hour FROM attempt_rollups WHERE hour BETWEEN :a AND :b",
                {"a": day * 24, "b": day * 24 + 23})} == {day * 24}
        assert _sql(db_url, "SELECT COUNT(*) FROM metric_rollups")[0][0] < rows
        assert led.roll_up(lag=0, fold_after=0).days == 0  # nothing left to fold
        assert _answers(led) == before
        # And the reads that hold a folded day whole do read its rows; the others do not.
        _sql(db_url, "UPDATE attempt_rollups SET attempts = attempts + 1000 WHERE hour = :h",
             {"h": FULL[0] * 24})
        after = _answers(led)
        changed = {k for k in before if k.startswith(("costs", "activity"))
                   and after[k] != before[k]}
        assert changed == {
            *(f"costs {by} {since} {until}" for by in ("route", "tenant", "label")
              for since, until in WINDOWS
              if (since or 0) <= FULL[0] * DAY and (until or END) >= FULL[1] * DAY),
            f"activity {FULL[0] * DAY} 2", f"activity {FULL[0] * DAY - 2 * DAY} 3"}
        _unroll_all(db_url)
        assert _answers(led) == before
    finally:
        led.close()


def _late_attempt(led: Ledger, when: float) -> None:
    clock = led.clock
    assert isinstance(clock, ManualClock)
    clock.set(when)
    led.admit_run("late", plan=[ROUTE], tenant="acme",
                  budget=Budget(max_calls=2, max_retries=0, max_cost=1))
    lease = led.acquire_lease("late", ttl_s=3600)
    att = led.begin_attempt(lease, route="a", envelope_hash=HASH, reserve="0.01")
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.002")
    clock.set(END)


def test_a_write_to_a_folded_day_undoes_the_whole_day_and_the_next_rollup_redoes_it(
        db_url: str) -> None:
    led = _generated(db_url)
    try:
        led.roll_up(lag=0, fold_after=0)
        rolled = _rolled(db_url)
        before = _answers(led)
        # A begin by a clock behind the others', into the second folded day.
        _late_attempt(led, MID + 5 * HOUR + 17)
        assert _folded(db_url) == {FULL[0]}
        assert _rolled(db_url) == rolled - _hours(FULL[1])
        assert not _sql(db_url, "SELECT 1 FROM metric_rollups WHERE hour BETWEEN :a AND :b",
                        {"a": FULL[1] * 24, "b": FULL[1] * 24 + 23})
        undone = _answers(led)
        assert undone["costs tenant None None"] != before["costs tenant None None"]
        rep = led.roll_up(lag=0, fold_after=0)
        assert (rep.hours, rep.days) == (24, 1) and _folded(db_url) == set(FULL)
        assert _answers(led) == undone
        _unroll_all(db_url)
        assert _answers(led) == undone
    finally:
        led.close()


@pytest.mark.postgres
def test_a_fold_leaves_a_day_whose_hour_a_writer_holds_and_never_waits_for_it(
        pg_url: str) -> None:
    led = _generated(pg_url)
    held = threading.Event()
    done = threading.Event()
    eng = create_engine(normalize_url(pg_url))

    def writer() -> None:  # what the trigger of a write to an attempt of that hour takes
        with eng.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock_shared(7894, :h)"),
                         {"h": FULL[1] * 24 + 7})
            held.set()
            done.wait(60)

    thread = threading.Thread(target=writer)
    try:
        led.roll_up(lag=0, fold_after=None)
        thread.start()
        assert held.wait(60)
        # Waiting here would hold the first day's locks while the writer may want one.
        assert led.roll_up(lag=0, fold_after=0).days == 1
        assert _folded(pg_url) == {FULL[0]}
        done.set()
        thread.join(60)
        assert led.roll_up(lag=0, fold_after=0).days == 1
        assert _folded(pg_url) == set(FULL)
    finally:
        done.set()
        thread.join(60)
        eng.dispose()
        led.close()


def test_migration_0016_downgrade_unfolds_the_days_and_the_upgrade_folds_again(
        db_url: str) -> None:
    led = _generated(db_url)
    led.roll_up(lag=0, fold_after=0)
    before = _answers(led)
    rolled = _rolled(db_url)
    led.close()
    _alembic(db_url, "downgrade", "0015")
    # 0015's readers would take a folded day's rows for its first hour's: the days are gone,
    # the other hours kept, and the triggers are 0015's again.
    assert _rolled(db_url) == rolled - _hours(FULL[0]) - _hours(FULL[1])
    if db_url.endswith(".db"):
        bodies = [r[0] for r in _sql(db_url, "SELECT sql FROM sqlite_master WHERE "
                                             "type = 'trigger' AND name LIKE '%unroll%'")]
    else:
        bodies = [r[0] for r in _sql(db_url, "SELECT prosrc FROM pg_proc WHERE "
                                             "proname = 'ledger_attempts_unroll'")]
    assert bodies and not any("rollup_days" in b for b in bodies)
    _alembic(db_url, "upgrade", "head")
    led = Ledger.open(db_url, clock=ManualClock(END))
    try:
        rep = led.roll_up(lag=0, fold_after=0)
        assert (rep.hours, rep.days) == (48, 2)
        assert _answers(led) == before
    finally:
        led.close()


def test_the_rollup_command_folds_after_its_span_or_never(tmp_path: Any, capsys: Any) -> None:
    # The command's clock is the system's: a history that ended 16 days before it.
    db = str(tmp_path / "g.db")
    end = (time.time() // DAY - 16) * DAY + 13 * HOUR
    with Ledger.open(db, clock=ManualClock(end - 2 * DAY)) as led:
        generate(led, attempts=60, days=1.5, end=end, seed=3)

    def folded(*args: str) -> int:
        assert main(["rollup", "--db", db, *args]) == 0
        said = re.search(r"folded (\d+) day\(s\)", capsys.readouterr().out)
        assert said is not None
        return int(said.group(1))

    assert folded("--fold-after", "never") == 0 and not _folded(db)
    # By default the days that ended 8 days ago: the history's last (its first began at
    # 01:00), and the empty ones after it.
    first = folded()
    assert first == len(_folded(db)) >= 2 and min(_folded(db)) == end // DAY
    assert max(_folded(db)) + 1 <= (time.time() - 8 * DAY) // DAY
    # Then every day that ended an hour ago.
    assert folded("--fold-after", "1h") > 0
    assert max(_folded(db)) == (time.time() - 3600) // DAY - 1
    assert main(["rollup", "--db", db, "--fold-after", "later"]) == 2
    assert "--fold-after 'later' is not a span of time" in capsys.readouterr().err


def test_a_fold_after_past_a_year_is_refused_naming_the_flag_and_its_bound(
        tmp_path: Any, capsys: Any) -> None:
    """``--fold-after 1e20`` was taken (a fold in three trillion years: never, which 'never'
    says), as was the default 8 days written in milliseconds. Past 366 days it is refused with
    its bound and 'never', before the ledger is written; up to it, and 'never', are taken."""
    db = str(tmp_path / "g.db")
    assert main(["db", "init", db]) == 0
    capsys.readouterr()
    before = Path(db).read_bytes()
    for span in ("1e20", "691200000", "367d", "inf", "nan", "-1"):
        assert main(["rollup", "--db", db, "--fold-after", span]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert f"--fold-after '{span}' is not a span from 0 to 366 days, the longest " \
            "fold-after rollup takes: pass a span such as 8d (the default), 30d or seconds, " \
            "or 'never' to fold nothing" in captured.err, captured
    assert Path(db).read_bytes() == before
    for span in ("366d", "31622400", "0", "never"):
        assert main(["rollup", "--db", db, "--fold-after", span]) == 0, span
        assert "folded 0 day(s)" in capsys.readouterr().out


def test_a_fold_keeps_every_roll_up_tables_keys_and_sums_every_other_column() -> None:
    # A column added to a roll-up later must be a key of FOLDED or a number the fold can sum;
    # a table added must be folded too, or a folded day would lose its rows.
    from sqlalchemy import BigInteger, Float

    from ledger.storage import schema as s
    from ledger.storage.rollups import FOLDED

    rollups = {t.name for t in s.metadata.sorted_tables if t.name.endswith("_rollups")}
    assert {t.name for t, _ in FOLDED} == rollups
    for table, keys in FOLDED:
        assert set(keys) <= set(table.c.keys()), table.name
        for col in table.c:
            if col.name == "hour" or col.name in keys:
                continue
            assert isinstance(col.type, BigInteger | Float), (table.name, col.name)


def test_stretches_less_the_cut_days_are_the_hours_left() -> None:
    # The folded days a read cannot take whole are cut out of its stretches of rolled hours:
    # what is left is exactly the hours of the stretches outside every cut, as stretches.
    import random
    from itertools import pairwise

    from ledger.storage.hours import _without

    rng = random.Random(5)
    for _ in range(500):
        hours = sorted(rng.sample(range(24 * 12), rng.randint(0, 200)))
        stretches: list[tuple[int, int]] = []
        for x in hours:
            if stretches and stretches[-1][1] == x:
                stretches[-1] = (stretches[-1][0], x + 1)
            else:
                stretches.append((x, x + 1))
        days = sorted(rng.sample(range(12), rng.randint(0, 6)))
        cuts = [(d * 24, d * 24 + 24) for d in days]
        left = _without(stretches, cuts)
        assert {x for lo, hi in left for x in range(lo, hi)} == {
            x for x in hours if x // 24 not in days}
        assert all(lo < hi for lo, hi in left)
        assert all(a[1] <= b[0] for a, b in pairwise(left))
