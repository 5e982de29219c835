"""Latency of each audit query on a (generated) ledger: ``python -m benchmarks audit``.

Each query runs ``repeat`` times over the newest day of history (the aggregates' target window)
after one untimed warm-up; the report gives the median, p95 and worst wall time in milliseconds.
Health is read at the end of that day (not at the clock's now), so its one-day latency
percentiles cover the same day however long after the generation the benchmark runs.
Targets from issue 24 (on PostgreSQL): a Run's timeline under 5 ms, every one-day aggregate and
every page under 100 ms (issue 8's were 10 and 500 ms).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.bulk import history_bounds, sample_route, sample_runs
from ledger.dashboard.charts import chart_window
from ledger.errors import NotFound
from ledger.ops.audit import Audit

DAY = 86400.0
TIMELINE_TARGET_MS = 5.0
AGGREGATE_TARGET_MS = 100.0


@dataclass(frozen=True)
class BenchRow:
    query: str
    p50_ms: float
    p95_ms: float
    max_ms: float
    rows: int
    target_ms: float | None

    @property
    def ok(self) -> bool | None:
        return None if self.target_ms is None else self.p50_ms <= self.target_ms


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
    cases.append(("activity chart (1 day, 48 buckets)", AGGREGATE_TARGET_MS,
                  lambda i: audit.activity(buckets=48, since=since, until=until)))
    # The dashboard's day: 24 buckets on the hour (chart_window), which the roll-ups count.
    c_since, c_until, c_n = chart_window(until, 24)
    cases.append(("activity chart (the dashboard's day, 24 hours)", AGGREGATE_TARGET_MS,
                  lambda i: audit.activity(buckets=c_n, since=c_since, until=c_until)))
    out: list[BenchRow] = []
    for n, (name, target, fn) in enumerate(cases):
        fn(repeat)  # warm-up: connection, plan cache, pages in memory
        times = []
        rows = 0
        for i in range(repeat):
            t0 = time.perf_counter()
            res = fn(i)
            times.append((time.perf_counter() - t0) * 1000)
            rows = _count(res)
        times.sort()
        p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
        out.append(BenchRow(name, statistics.median(times), p95, times[-1], rows, target))
        if progress:
            progress(n + 1, len(cases))
    return out


__all__ = ["AGGREGATE_TARGET_MS", "TIMELINE_TARGET_MS", "BenchRow", "bench_audit"]
