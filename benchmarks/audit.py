"""Latency of each audit query on a (generated) ledger: ``python -m benchmarks audit``.

Each query runs ``repeat`` times over the newest day of history (the aggregates' target window)
after one untimed warm-up; the report gives the median, p95 and worst wall time in milliseconds.
Health is read at the end of that day (not at the clock's now), so its one-day latency
percentiles cover the same day however long after the generation the benchmark runs.
Targets from issue 24 (on PostgreSQL): a Run's timeline under 5 ms, every one-day aggregate and
every page under 100 ms (issue 8's were 10 and 500 ms).

**The floor.** The warm-up records the statements the read sends, exactly as its driver
receives them (SQLAlchemy's ``before_cursor_execute``: the SQL text and the bound values, the
transaction's settings included, and its ``BEGIN`` on SQLite, where the ledger sends it; psycopg
opens PostgreSQL's itself, on both sides alike), and the transaction's ends. Only reads are
replayed: a recorded statement that is not one stops the benchmark. Each repetition then also
replays them on a
connection of the same pool through the raw driver (psycopg with ``prepare=True``; sqlite3,
whose statement cache prepares), fetching every row and ending the transaction, interleaved
with the read itself. That is what the database's answer costs with nothing of the library
around it; ``x floor`` is the read's median over the floor's, and the client CPU per read
(``time.process_time``, every thread) is reported beside both. The floor replays the values the
warm-up bound, so a read whose second statement depends on the first's answer is replayed as it
was answered then.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event

from benchmarks.bulk import history_bounds, sample_route, sample_runs
from benchmarks.common import BenchError, cpu_now
from ledger.api.face import reads_of
from ledger.dashboard.charts import chart_window
from ledger.dashboard.spend import window
from ledger.errors import NotFound
from ledger.ops.audit import Audit

DAY = 86400.0
TIMELINE_TARGET_MS = 5.0
AGGREGATE_TARGET_MS = 100.0


@dataclass(frozen=True)
class BenchRow:
    """One query's times (ms of wall time over the repetitions) beside its floor's."""

    query: str
    p50_ms: float
    p95_ms: float
    max_ms: float
    rows: int
    target_ms: float | None
    #: The median of the raw driver's replay of the same statements.
    floor_p50_ms: float = 0.0
    #: Client CPU per read (median, ms): the ledger's, and the raw replay's.
    cpu_ms: float = 0.0
    floor_cpu_ms: float = 0.0
    #: How many statements the read sent (its transaction's settings included, and on SQLite
    #: its ``BEGIN``; not the driver's commits).
    statements: int = 0
    #: The rows the floor's replay fetched (what the read's statements answered).
    floor_rows: int = 0

    @property
    def ok(self) -> bool | None:
        return None if self.target_ms is None else self.p50_ms <= self.target_ms

    @property
    def ratio(self) -> float | None:
        """The read's median over its floor's (how much the library adds around the SQL);
        ``None`` for a floor too quick to measure."""
        return self.p50_ms / self.floor_p50_ms if self.floor_p50_ms > 0 else None


@dataclass(frozen=True)
class _Sent:
    """One statement as the driver received it, or the end of a transaction (``end``: the
    driver's ``commit`` or ``rollback``, which sends no statement through a cursor)."""

    sql: str = ""
    params: Any = None
    many: bool = False
    end: str | None = None


@contextmanager
def _recorded(engine: Engine) -> Iterator[list[_Sent]]:
    """The statements and transaction ends sent through ``engine`` while the block runs."""
    sent: list[_Sent] = []

    def statement(conn: Any, cursor: Any, sql: str, parameters: Any, context: Any,
                  executemany: bool) -> None:
        sent.append(_Sent(sql, parameters, executemany))

    hooks: list[tuple[str, Callable[..., None]]] = [
        ("before_cursor_execute", statement),
        ("commit", lambda conn: sent.append(_Sent(end="commit"))),
        ("rollback", lambda conn: sent.append(_Sent(end="rollback")))]
    for name, fn in hooks:
        event.listen(engine, name, fn)
    try:
        yield sent
    finally:
        for name, fn in hooks:
            event.remove(engine, name, fn)


# What a read sends; the floor replays nothing else, so a case that wrote could not write
# again through it.
_READ = re.compile(r"\s*(SELECT|WITH|BEGIN|SET|SHOW)\b", re.IGNORECASE)


def _replay(engine: Engine, sent: list[_Sent]) -> int:
    """``sent`` again on a pooled connection through the raw driver; the rows it fetched.

    Raises:
        BenchError: ``sent`` holds a statement that is not a read.
    """
    wrote = next((q.sql for q in sent if q.end is None and not _READ.match(q.sql)), None)
    if wrote is not None:
        raise BenchError(f"the floor replays reads only; the read sent {wrote[:80]!r}")
    fetched = 0
    pooled = engine.raw_connection()
    try:
        raw = pooled.driver_connection
        prepared = {"prepare": True} if engine.dialect.name == "postgresql" else {}
        cur = raw.cursor()  # type: ignore[union-attr]
        try:
            for q in sent:
                if q.end is not None:
                    getattr(raw, q.end)()
                elif q.many:
                    cur.executemany(q.sql, q.params)
                else:
                    cur.execute(q.sql, q.params, **prepared)
                    if cur.description is not None:
                        fetched += len(cur.fetchall())
        finally:
            cur.close()
        raw.rollback()  # type: ignore[union-attr]  # a read's transaction left open, if any
    finally:
        pooled.close()
    return fetched


def _count(result: Any) -> int:
    items = getattr(result, "items", None)
    if items is not None:
        return len(items)
    if isinstance(result, list):
        return len(result)
    return 1


def bench_audit(audit: Audit, *, repeat: int = 5,
                progress: Callable[[int, int], None] | None = None) -> list[BenchRow]:
    led = audit.ledger
    lo, hi = history_bounds(led)
    if hi is None or lo is None:
        raise NotFound("the ledger has no attempts to measure; fill it with "
                       "`python -m benchmarks generate` (or `failover-ledger generate`)")
    until = hi + 1.0
    since = until - DAY
    run_ids = sample_runs(led, since=since, until=until, n=max(repeat, 1) + 1)
    route = sample_route(led)
    if not run_ids or route is None:
        raise NotFound("the ledger has no runs in its newest day of history")
    week_since, _ = window(until, 7)
    cases: list[tuple[str, float | None, Callable[[int], Any]]] = [
        ("timeline (one run)", TIMELINE_TARGET_MS,
         lambda i: audit.timeline(run_ids[i % len(run_ids)])),
        ("runs (newest page of 50)", AGGREGATE_TARGET_MS, lambda i: audit.runs(limit=50)),
        ("failovers (1 day, page of 50)", AGGREGATE_TARGET_MS,
         lambda i: audit.failovers(limit=50, since=since, until=until)),
        ("failovers counted (1 day, the dashboard's tile)", AGGREGATE_TARGET_MS,
         lambda i: audit.count_failovers(since=since, until=until)),
        ("attempts by route (1 day, page of 100)", AGGREGATE_TARGET_MS,
         lambda i: audit.attempts(route=route, limit=100, since=since, until=until)),
        ("unknown+dispatching (page of 100)", AGGREGATE_TARGET_MS,
         lambda i: audit.open_attempts(limit=100)),
        ("health", AGGREGATE_TARGET_MS, lambda i: audit.health(until)),
    ]

    def costs(by: str) -> Callable[[int], Any]:
        lim = 100 if by == "run" else 1000  # per run: the costliest page, like the CLI shows
        return lambda i: audit.costs(by=by, label="team", limit=lim, since=since, until=until)

    for by in ("route", "group", "provider", "run", "tenant", "label"):
        cases.append((f"costs by {by} (1 day)", AGGREGATE_TARGET_MS, costs(by)))
    cases += [
        ("spend by tenant (1 day)", AGGREGATE_TARGET_MS,
         lambda i: audit.spend(by="tenant", since=since, until=until)),
        ("spend by label (1 day)", AGGREGATE_TARGET_MS,
         lambda i: audit.spend(by="label", label="team", since=since, until=until)),
        # The dashboard's index: the last seven UTC days by day (dashboard.spend.window).
        ("spend by tenant (7 days by day, the dashboard's)", AGGREGATE_TARGET_MS,
         lambda i: audit.spend(by="tenant", since=week_since, until=until, every=DAY,
                               limit=10)),
    ]
    cases.append(("activity chart (1 day, 48 buckets)", AGGREGATE_TARGET_MS,
                  lambda i: audit.activity(buckets=48, since=since, until=until)))
    # The dashboard's day: 24 buckets on the hour (chart_window), which the roll-ups count.
    c_since, c_until, c_n = chart_window(until, 24)
    cases.append(("activity chart (the dashboard's day, 24 hours)", AGGREGATE_TARGET_MS,
                  lambda i: audit.activity(buckets=c_n, since=c_since, until=c_until)))
    # The whole history (no window): every rolled hour's roll-ups and the rest, so these are
    # the reads that grow with the span of history, where the day's reads do not.
    cases += [
        ("costs by route (the whole history)", AGGREGATE_TARGET_MS,
         lambda i: audit.costs(by="route", limit=1000)),
        ("costs by tenant (the whole history)", AGGREGATE_TARGET_MS,
         lambda i: audit.costs(by="tenant", limit=1000)),
        ("spend by tenant (the whole history)", AGGREGATE_TARGET_MS,
         lambda i: audit.spend(by="tenant")),
    ]
    engine = reads_of(led).context.engine  # where the audit reads (a replica, with read_url=)
    # What a scrape of the dashboard's /metrics reads (the whole history's totals, at ``until``).
    cases.append(("metrics (a /metrics scrape)", AGGREGATE_TARGET_MS,
                  lambda i: audit.metrics(until)))
    out: list[BenchRow] = []
    for n, (name, target, fn) in enumerate(cases):
        with _recorded(engine) as sent:
            fn(repeat)  # warm-up: connection, plan cache, pages in memory; what it sends
        floor_rows = _replay(engine, sent)
        times, cpus, floors, floor_cpus = [], [], [], []
        rows = 0
        for i in range(repeat):  # the read and its floor interleaved, so drift hits both
            c0, t0 = cpu_now(), time.perf_counter()
            res = fn(i)
            times.append((time.perf_counter() - t0) * 1000)
            cpus.append((cpu_now() - c0) * 1000)
            rows = _count(res)
            c0, t0 = cpu_now(), time.perf_counter()
            _replay(engine, sent)
            floors.append((time.perf_counter() - t0) * 1000)
            floor_cpus.append((cpu_now() - c0) * 1000)
        times.sort()
        p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
        out.append(BenchRow(name, statistics.median(times), p95, times[-1], rows, target,
                            floor_p50_ms=statistics.median(floors),
                            cpu_ms=statistics.median(cpus),
                            floor_cpu_ms=statistics.median(floor_cpus),
                            statements=sum(q.end is None for q in sent),
                            floor_rows=floor_rows))
        if progress:
            progress(n + 1, len(cases))
    return out


__all__ = ["AGGREGATE_TARGET_MS", "TIMELINE_TARGET_MS", "BenchRow", "bench_audit"]
