"""``python -m benchmarks write``: begin+settle Attempts per second beside the physical floor.

At each worker count (workers are OS processes, started with ``spawn``), against one database:

* **floor**: every worker does the physical floor of an Attempt through the raw driver,
  prepared statements and autocommit (:mod:`benchmarks.floor`): one single-row INSERT
  commit plus one single-row UPDATE commit;
* **ledger**: every worker admits its own Run, takes its lease and records Attempts with
  ``Ledger.begin_attempt`` then ``Ledger.settle_attempt`` (succeeded, with a cost and tokens),
  as a host does around a model call it makes itself;
* **ledger + event**: the same, with the begin carrying the ``select`` audit event, as every
  begin made by ``execute``/``aexecute`` does.

Workers warm up, then start together behind a barrier; the rate is all attempts divided by the
wall time from the first worker's start to the last one's finish. Each worker also measures its
own process CPU time over the measured loop (``time.process_time``), so the report gives the
client CPU per attempt for the floor and for the ledger: on PostgreSQL that excludes the
server's work; on SQLite the database engine runs in the client and is included on both sides.
The figure of merit is ledger/floor; the target (:data:`TARGET_RATIO`) is reported, never
enforced.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from multiprocessing.synchronize import Barrier
from typing import Any, Literal

from benchmarks import defaults, floor
from benchmarks.common import (
    WORKER_TIMEOUT_S,
    BenchError,
    Column,
    MachineProbe,
    Progress,
    Report,
    Worker,
    fmt,
    quiet,
    run_together,
    shares,
)
from ledger.api.facade import Ledger
from ledger.domain.values import Budget, Price, Route

TARGET_RATIO = 0.8
DEFAULT_WORKERS = (1, 8)
DEFAULT_ATTEMPTS = defaults.WRITE_ATTEMPTS
WARMUP_ATTEMPTS = 10

Mode = Literal["floor", "ledger", "ledger+event"]
LEDGER_MODES: tuple[Mode, ...] = ("ledger", "ledger+event")

# One shared route (one capacity group, one health row), as when many runs call the same model.
BENCH_ROUTE = Route(id="bench-route", provider="bench", model="bench-model", group="bench-group",
                    recipient="bench", price=Price())
RESERVE = "0.001"
# What execute's begin carries: the selector's decision as the "select" audit event.
SELECT_EVENT: tuple[str, dict[str, Any]] = (
    "select", {"kind": "route", "route": BENCH_ROUTE.id, "profile": None, "reason": None,
               "detail": "", "skipped": [], "attempt_kind": "first"})


@dataclass(frozen=True)
class Measurement:
    """One measured loop over all workers."""

    mode: Mode
    workers: int
    attempts: int
    seconds: float
    cpu_s: float  # process CPU of all workers over their measured loops

    @property
    def per_second(self) -> float:
        """Attempts per second of wall time."""
        return self.attempts / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        """Client CPU per attempt, in microseconds."""
        return self.cpu_s / self.attempts * 1e6 if self.attempts else 0.0


@dataclass(frozen=True)
class WriteRow:
    """One ledger path at one worker count, beside the floor measured in the same run."""

    backend: str
    workers: int
    attempts: int
    path: str
    per_s: float
    floor_per_s: float
    ratio: float
    cpu_us: float
    floor_cpu_us: float
    floor_two_commit_ms: float  # the floor's wall time per attempt at this worker count
    meets_target: bool
    seconds: float
    floor_seconds: float


COLUMNS = (
    Column("backend", lambda r: r.backend, left=True),
    Column("workers", lambda r: str(r.workers)),
    Column("path", lambda r: r.path, left=True),
    Column("att/s", lambda r: fmt(r.per_s)),
    Column("floor att/s", lambda r: fmt(r.floor_per_s)),
    Column("ratio", lambda r: fmt(r.ratio, 2)),
    Column("CPU us/att", lambda r: fmt(r.cpu_us, 0)),
    Column("floor CPU us/att", lambda r: fmt(r.floor_cpu_us, 0)),
    Column("floor ms/att", lambda r: fmt(r.floor_two_commit_ms, 3)),
    Column("", lambda r: "ok" if r.meets_target else f"below {TARGET_RATIO}", left=True),
)


# -- workers (each its own OS process) ---------------------------------------------------------

def _ledger_worker(url: str, tag: str, n: int, warmup: int, event: bool, barrier: Barrier
                   ) -> tuple[float, float, float]:
    led = Ledger.open(url, migrate_schema=False, executor_id=tag)
    try:
        run_id = f"{tag}-run"
        led.admit_run(run_id, plan=[BENCH_ROUTE],
                      budget=Budget(max_calls=n + warmup + 1, max_retries=0,
                                    max_cost=Decimal(1_000_000)),
                      role="bench")
        lease = led.acquire_lease(run_id, ttl_s=WORKER_TIMEOUT_S)
        events = [SELECT_EVENT] if event else []

        def one() -> None:
            att = led.begin_attempt(lease, route=BENCH_ROUTE.id, envelope_hash="sha256:bench",
                                    reserve=RESERVE, events=events)
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost=RESERVE,
                               prompt_tokens=10, completion_tokens=5)

        for _ in range(warmup):
            one()
        barrier.wait(timeout=WORKER_TIMEOUT_S)
        c0, t0 = time.process_time(), time.monotonic()
        for _ in range(n):
            one()
        t1, c1 = time.monotonic(), time.process_time()
        led.release_lease(lease)
        return t0, t1, c1 - c0
    finally:
        led.close()


def _floor_worker(url: str, tag: str, n: int, warmup: int, barrier: Barrier
                  ) -> tuple[float, float, float]:
    writer = floor.open_writer(url, tag)
    try:
        for i in range(warmup):
            writer.attempt(f"{tag}-w{i}", time.time())
        barrier.wait(timeout=WORKER_TIMEOUT_S)
        c0, t0 = time.process_time(), time.monotonic()
        for i in range(n):
            writer.attempt(f"{tag}-{i}", time.time())
        t1, c1 = time.monotonic(), time.process_time()
        return t0, t1, c1 - c0
    finally:
        writer.close()


def measure(url: str, mode: Mode, workers: int, attempts: int,
            warmup: int = WARMUP_ATTEMPTS) -> Measurement:
    """Run ``attempts`` attempts split over ``workers`` processes. The database must be ready:
    the ledger schema migrated and, for the floor, its table created (see :func:`prepared`)."""
    if workers < 1 or attempts < workers:
        raise BenchError("need workers >= 1 and attempts >= workers")
    share = shares(attempts, workers)
    prefix = f"bench-{mode.replace('+', '-')}-{uuid.uuid4().hex[:8]}"
    jobs: list[tuple[str, int, Worker, tuple[Any, ...]]] = []
    for i in range(workers):
        tag = f"{prefix}-w{i}"
        if mode == "floor":
            jobs.append((tag, share[i], _floor_worker, (url, tag, share[i], warmup)))
        else:
            jobs.append((tag, share[i], _ledger_worker,
                         (url, tag, share[i], warmup, mode == "ledger+event")))
    done = run_together(mode, jobs)
    return Measurement(mode, workers, done.count, done.seconds, done.cpu_s)


@contextmanager
def prepared(url: str) -> Iterator[None]:
    """Migrate the ledger schema and create the floor's table; drop the table afterwards."""
    Ledger.open(url).close()
    floor.create_table(url)
    try:
        yield
    finally:
        floor.drop_table(url)


def floor_two_commit_ms(url: str, attempts: int = 300, warmup: int = 20) -> float:
    """The floor's median wall time of one attempt (two commits) on one connection, in ms;
    creates and drops the floor's table."""
    from benchmarks.common import percentile

    floor.create_table(url)
    try:
        writer = floor.open_writer(url, "two-commit")
        try:
            for i in range(warmup):
                writer.attempt(f"w{i}", time.time())
            times = []
            for i in range(attempts):
                t0 = time.perf_counter()
                writer.attempt(f"a{i}", time.time())
                times.append((time.perf_counter() - t0) * 1000)
        finally:
            writer.close()
    finally:
        floor.drop_table(url)
    return percentile(times, 0.5)


def bench_database(url: str, *, backend: str, workers: Sequence[int] = DEFAULT_WORKERS,
                   attempts: int = DEFAULT_ATTEMPTS, warmup: int = WARMUP_ATTEMPTS,
                   modes: Sequence[Mode] = LEDGER_MODES, progress: Progress = quiet
                   ) -> list[WriteRow]:
    """Measure the floor and each ledger path at each worker count on one database."""
    rows: list[WriteRow] = []
    with prepared(url):
        for w in workers:
            progress(f"bench write: {backend}, {w} worker(s): floor")
            floor = measure(url, "floor", w, attempts, warmup)
            for mode in modes:
                progress(f"bench write: {backend}, {w} worker(s): {mode}")
                m = measure(url, mode, w, attempts, warmup)
                ratio = m.per_second / floor.per_second if floor.per_second > 0 else 0.0
                rows.append(WriteRow(
                    backend=backend, workers=w, attempts=attempts,
                    path="begin+settle" if mode == "ledger" else "begin(event)+settle",
                    per_s=round(m.per_second, 1), floor_per_s=round(floor.per_second, 1),
                    ratio=round(ratio, 3), cpu_us=round(m.cpu_us, 1),
                    floor_cpu_us=round(floor.cpu_us, 1),
                    floor_two_commit_ms=round(w * 1000 / floor.per_second, 4)
                    if floor.per_second else 0.0,
                    meets_target=ratio >= TARGET_RATIO,
                    seconds=round(m.seconds, 3), floor_seconds=round(floor.seconds, 3),
                ))
    return rows


def new_report() -> Report:
    """An empty ``write`` report with its columns and target."""
    return Report(
        bench="write", columns=COLUMNS,
        targets={"ratio": f"ledger att/s >= {TARGET_RATIO} x floor att/s at every worker count "
                          "on both backends (issue 13)"},
        notes=["floor = raw driver, prepared statements, autocommit: one INSERT commit + one "
               "UPDATE commit per attempt; CPU = client process CPU of the workers over the "
               "measured loop (PostgreSQL: server CPU excluded; SQLite: the engine runs in the "
               "client, on both sides)",
               "floor ms/att = workers / floor att/s: at 1 worker, the floor's two-commit time"],
    )


def run(url_targets: Sequence[tuple[str, str]], *, workers: Sequence[int] = DEFAULT_WORKERS,
        attempts: int = DEFAULT_ATTEMPTS, warmup: int = WARMUP_ATTEMPTS,
        modes: Sequence[Mode] = LEDGER_MODES, progress: Progress = quiet) -> Report:
    """The whole ``write`` benchmark over ``(backend, url)`` targets."""
    probe = MachineProbe()
    report = new_report()
    for backend, url in url_targets:
        report.rows.extend(bench_database(url, backend=backend, workers=workers,
                                          attempts=attempts, warmup=warmup, modes=modes,
                                          progress=progress))
    report.machine = probe.done()
    return report


__all__ = [
    "DEFAULT_ATTEMPTS",
    "DEFAULT_WORKERS",
    "TARGET_RATIO",
    "Measurement",
    "WriteRow",
    "bench_database",
    "floor_two_commit_ms",
    "measure",
    "new_report",
    "prepared",
    "run",
]
