"""``python -m benchmarks retention``: what a retention run costs, and the share of it spent
reading the dropped rows once more to carry ``/metrics``' counters over.

1. **History**: ``attempts`` (default 300,000) of synthetic runs over ``months`` whole UTC
   months (default 4) ending at the first instant of this month, written by the bulk
   generator (:func:`benchmarks.generate.generate`), which gives each month its partition on
   PostgreSQL. Its ``unknown`` attempts are then marked ``failed`` in one ``UPDATE`` (an
   operator's settlements, in bulk): a month holding an open attempt is kept whole, and this
   benchmark measures months dropped. The runs still running at the end of the history (and
   their month) stay. Nothing is rolled up: the carried-counter read sums the attempts
   either way.
2. **Dry run**: ``drop_history(1 day, dry_run=True)`` with the ledger clock a day past the
   end, so every month of the history is old enough; timed (``repeat`` times, the median).
3. **Retention**: the same, real, timed once; the time spent inside the carried-counter read
   (:func:`ledger.storage.retention._carry`, wrapped here: on PostgreSQL a full read of each
   dropped month, made before the drops' write-blocking locks) is reported beside it, with
   its share of the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text

from benchmarks import defaults
from benchmarks.common import BenchError, Column, MachineProbe, Progress, Report, fmt, quiet
from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.clock import ManualClock
from ledger.storage import partitions

DAY = 86400.0
DEFAULT_ATTEMPTS = defaults.RETENTION_ATTEMPTS
DEFAULT_MONTHS = defaults.RETENTION_MONTHS
DEFAULT_REPEAT = defaults.RETENTION_REPEAT


@dataclass(frozen=True)
class RetentionRow:
    """One retention on one backend."""

    backend: str
    history_attempts: int
    months: int
    dropped_parts: int
    dropped_attempts: int
    dropped_events: int
    kept_parts: int
    dry_run_s: float
    retention_s: float
    carry_s: float
    carry_share: float
    build_s: float


COLUMNS = (
    Column("backend", lambda r: r.backend, left=True),
    Column("history", lambda r: f"{r.history_attempts:,}"),
    Column("months", lambda r: str(r.months)),
    Column("dropped attempts", lambda r: f"{r.dropped_attempts:,}"),
    Column("dropped events", lambda r: f"{r.dropped_events:,}"),
    Column("parts", lambda r: f"{r.dropped_parts} dropped, {r.kept_parts} kept"),
    Column("dry run s", lambda r: fmt(r.dry_run_s, 3)),
    Column("retention s", lambda r: fmt(r.retention_s, 3)),
    Column("carry s", lambda r: fmt(r.carry_s, 3)),
    Column("carry share", lambda r: f"{r.carry_share:.0%}"),
    Column("build s", lambda r: fmt(r.build_s, 0)),
)


def month_start(t: float) -> float:
    """The first instant (UTC) of ``t``'s month."""
    y, m = partitions.month_of(t)
    return datetime(y, m, 1, tzinfo=UTC).timestamp()


@contextmanager
def _timed_carry() -> Iterator[list[float]]:
    """The seconds of each carried-counter read while the block runs."""
    from ledger.storage import retention

    spent: list[float] = []
    carry = retention._carry

    def timed(*args: Any) -> None:
        t0 = time.perf_counter()
        try:
            carry(*args)
        finally:
            spent.append(time.perf_counter() - t0)

    retention._carry = timed  # type: ignore[assignment]
    try:
        yield spent
    finally:
        retention._carry = carry


def bench_database(url: str, backend: str, *, attempts: int = DEFAULT_ATTEMPTS,
                   months: int = DEFAULT_MONTHS, repeat: int = DEFAULT_REPEAT,
                   progress: Progress = quiet) -> RetentionRow:
    """Build the history on one database, then time a dry run and a real retention."""
    if attempts < 1 or months < 1 or repeat < 1:
        raise BenchError("need attempts >= 1, months >= 1 and repeat >= 1")
    from benchmarks.generate import generate

    end = month_start(time.time())
    y, m = partitions.month_of(end)
    since = datetime(*partitions.month_after(y, m, -months), 1, tzinfo=UTC).timestamp()
    progress(f"bench retention: {backend}: {attempts:,} attempts over {months} month(s)")
    t0 = time.monotonic()
    with Ledger.open(url, clock=ManualClock(end)) as led:
        generate(led, attempts=attempts, days=(end - since) / DAY, end=end, seed=1)
        with storage_of(led).context.engine.begin() as conn:
            conn.execute(text("UPDATE attempts SET state = 'failed' WHERE state = 'unknown'"))
    build_s = time.monotonic() - t0
    with Ledger.open(url, clock=ManualClock(end + DAY), migrate_schema=False) as led:
        progress(f"bench retention: {backend}: dry runs")
        dry_times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            dry = led.drop_history(DAY, by="bench", reason="bench", dry_run=True)
            dry_times.append(time.perf_counter() - t0)
        if not dry.dropped:
            raise BenchError("the dry run found nothing to drop in the generated history")
        progress(f"bench retention: {backend}: retention")
        with _timed_carry() as spent:
            t0 = time.perf_counter()
            done = led.drop_history(DAY, by="bench", reason="bench")
            took = time.perf_counter() - t0
    if (done.dropped, done.kept) != (dry.dropped, dry.kept):
        raise BenchError("the retention dropped other history than its dry run planned")
    carry_s = sum(spent)
    # Seconds kept to the microsecond: a share recomputed from rounded tens of
    # milliseconds would disagree with the reported one by more than its own rounding.
    return RetentionRow(
        backend=backend, history_attempts=attempts, months=months,
        dropped_parts=len(done.dropped), dropped_attempts=done.rows("attempts"),
        dropped_events=done.rows("events"), kept_parts=len(done.kept),
        dry_run_s=round(statistics.median(dry_times), 6), retention_s=round(took, 6),
        carry_s=round(carry_s, 6), carry_share=round(carry_s / took, 3) if took else 0.0,
        build_s=round(build_s, 1))


def new_report() -> Report:
    """An empty ``retention`` report."""
    return Report(
        bench="retention", columns=COLUMNS,
        notes=["dry run s = median of the dry runs; retention s = one real run, wall time of "
               "drop_history (its ANALYZE after the drops included); carry s = the time "
               "inside it reading the dropped rows to carry /metrics' counters over, and its "
               "share of the run; parts = partitions on PostgreSQL, tables on SQLite; "
               "build = the generated history"])


def run(url_targets: Sequence[tuple[str, str]], *, attempts: int = DEFAULT_ATTEMPTS,
        months: int = DEFAULT_MONTHS, repeat: int = DEFAULT_REPEAT,
        progress: Progress = quiet) -> Report:
    """The whole ``retention`` benchmark over ``(backend, url)`` targets."""
    probe = MachineProbe()
    report = new_report()
    for backend, url in url_targets:
        report.rows.append(bench_database(url, backend, attempts=attempts, months=months,
                                          repeat=repeat, progress=progress))
    report.machine = probe.done()
    return report


__all__ = ["DEFAULT_ATTEMPTS", "DEFAULT_MONTHS", "DEFAULT_REPEAT", "RetentionRow",
           "bench_database", "month_start", "new_report", "run"]
