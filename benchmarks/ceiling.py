"""``python -m benchmarks group-ceiling``: the ceiling of one limited capacity group.

Every begin of an Attempt in a limited capacity group must be counted against the group's limit
exactly, across processes (invariant 8), so begins of one group are serialized somewhere. This
benchmark measures what that costs. At each worker count (OS processes, started with
``spawn``), against one database:

* **one group**: every worker admits its own Run whose one route is in the *same* limited
  group, and does begin+settle pairs (``Ledger.begin_attempt`` then
  ``Ledger.settle_attempt``, succeeded), so the slot is free again before its next begin;
* **N groups** (the floor of this benchmark): the same, each worker's route in its *own*
  limited group with the same limit, so no two workers' begins share a group.

Beside the ledger, on PostgreSQL, the same two shapes through the raw driver (psycopg,
prepared statements), as a floor that leaves the ledger's client CPU out and shows the
serialization alone: per pair one transaction that writes a slot row and one that deletes it,
the first either **locked** (the group's row ``FOR UPDATE``, then a count of its slots, then
the insert: the row lock held through the COMMIT, as a limited group's begin did before
numbered slots) or **numbered** (a read of the group's slot numbers, then an insert of a free
number under a unique index, no lock: what a begin does now). SQLite has no raw rows: its
``BEGIN IMMEDIATE`` serializes every writer, one group or many.

The limit is far above the worker count (each worker holds at most one slot at a time), so a
begin is never refused or queued: the benchmark measures how begins of one group serialize,
not refusals. The rate counts begin+settle *pairs* per second of wall time (first worker's
start to the last one's finish); the ratio is one group / N groups, measured in the same run
on the same server with the same durability. Each worker also measures its own process CPU over
the measured loop: the client CPU per pair (on PostgreSQL the server's work is excluded).
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from multiprocessing.synchronize import Barrier
from typing import Any, Literal

from benchmarks import defaults
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

DEFAULT_WORKERS = (1, 2, 4, 8, 16, 32)
DEFAULT_PAIRS = defaults.CEILING_PAIRS
WARMUP_PAIRS = 5
#: The one group's limit: far above any worker count, so a begin is never refused.
LIMIT = 100_000
#: Begins per second that one limited group should reach on a 2-core machine with fsync on
#: (issue 24); reported, never enforced.
TARGET_PER_S = 1000.0
RESERVE = "0.001"

Shape = Literal["one", "many"]
SHAPES: tuple[Shape, ...] = ("one", "many")
Path = Literal["ledger", "raw locked", "raw numbered"]
RAW_PATHS: tuple[Path, ...] = ("raw locked", "raw numbered")
RAW_GROUPS = "ledger_bench_ceiling_groups"
RAW_SLOTS = "ledger_bench_ceiling_slots"


def route_for(group: str) -> Route:
    """The bench's route in capacity group ``group``."""
    return Route(id=f"ceiling-{group}", provider="bench", model="bench-model", group=group,
                 recipient="bench", price=Price())


@dataclass(frozen=True)
class Measurement:
    """One measured loop over all workers."""

    shape: Shape
    workers: int
    pairs: int
    seconds: float
    cpu_s: float
    path: Path = "ledger"

    @property
    def per_second(self) -> float:
        """begin+settle pairs per second of wall time."""
        return self.pairs / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        """Client CPU per pair, in microseconds."""
        return self.cpu_s / self.pairs * 1e6 if self.pairs else 0.0


@dataclass(frozen=True)
class CeilingRow:
    """One group beside N groups at one worker count."""

    backend: str
    workers: int
    path: str
    pairs: int
    one_per_s: float
    many_per_s: float
    ratio: float  # one / many
    one_cpu_us: float
    many_cpu_us: float
    meets_target: bool  # one group reached TARGET_PER_S
    one_seconds: float
    many_seconds: float


COLUMNS = (
    Column("backend", lambda r: r.backend, left=True),
    Column("workers", lambda r: str(r.workers)),
    Column("path", lambda r: r.path, left=True),
    Column("one group/s", lambda r: fmt(r.one_per_s)),
    Column("N groups/s", lambda r: fmt(r.many_per_s)),
    Column("ratio", lambda r: fmt(r.ratio, 2)),
    Column("CPU us/pair (one)", lambda r: fmt(r.one_cpu_us, 0)),
    Column("CPU us/pair (N)", lambda r: fmt(r.many_cpu_us, 0)),
    Column("", lambda r: "" if r.path != "ledger" else "ok" if r.meets_target
           else f"below {TARGET_PER_S:,.0f}/s", left=True),
)


# -- workers (each its own OS process) ---------------------------------------------------------

def _worker(url: str, tag: str, group: str, n: int, warmup: int, barrier: Barrier
            ) -> tuple[float, float, float]:
    led = Ledger.open(url, migrate_schema=False, executor_id=tag)
    try:
        route = route_for(group)
        run_id = f"{tag}-run"
        led.admit_run(run_id, plan=[route],
                      budget=Budget(max_calls=n + warmup + 1, max_retries=0,
                                    max_cost=Decimal(1_000_000)),
                      role="bench")
        lease = led.acquire_lease(run_id, ttl_s=WORKER_TIMEOUT_S)

        def one() -> None:
            att = led.begin_attempt(lease, route=route.id, envelope_hash="sha256:bench",
                                    reserve=RESERVE)
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


def _raw_worker(url: str, path: Path, tag: str, group: str, n: int, warmup: int,
                barrier: Barrier) -> tuple[float, float, float]:
    import psycopg

    from benchmarks.floor import pg_connect_args

    conn = psycopg.connect(prepare_threshold=0, **pg_connect_args(url))
    start = zlib.crc32(tag.encode()) % LIMIT
    seq = iter(range(1 << 62))

    def locked(slot: str) -> None:
        conn.execute(f"SELECT 1 FROM {RAW_GROUPS} WHERE id = %s FOR UPDATE", (group,),
                     prepare=True)
        conn.execute(f"SELECT count(*) FROM {RAW_SLOTS} WHERE g = %s", (group,), prepare=True)
        conn.execute(f"INSERT INTO {RAW_SLOTS} (id, g) VALUES (%s, %s)", (slot, group),
                     prepare=True)

    def numbered(slot: str) -> None:
        held = {r[0] for r in conn.execute(f"SELECT n FROM {RAW_SLOTS} WHERE g = %s",
                                           (group,), prepare=True)}
        n = start
        while True:
            while n in held:
                n = (n + 1) % LIMIT
            if conn.execute(f"INSERT INTO {RAW_SLOTS} (id, g, n) VALUES (%s, %s, %s) "
                            "ON CONFLICT DO NOTHING RETURNING id", (slot, group, n),
                            prepare=True).fetchall():
                return
            held.add(n)

    take = locked if path == "raw locked" else numbered

    def one() -> None:
        slot = f"{tag}-{next(seq)}"
        with conn.transaction():
            take(slot)
        with conn.transaction():
            conn.execute(f"DELETE FROM {RAW_SLOTS} WHERE id = %s", (slot,), prepare=True)

    try:
        for _ in range(warmup):
            one()
        barrier.wait(timeout=WORKER_TIMEOUT_S)
        c0, t0 = time.process_time(), time.monotonic()
        for _ in range(n):
            one()
        t1, c1 = time.monotonic(), time.process_time()
        return t0, t1, c1 - c0
    finally:
        conn.close()


def groups_for(shape: Shape, prefix: str, workers: int) -> list[str]:
    """Each worker's capacity group: one shared group, or one group per worker."""
    if shape == "one":
        return [f"{prefix}-one"] * workers
    return [f"{prefix}-g{i}" for i in range(workers)]


def raw_tables(url: str, create: bool) -> None:
    """Create (dropping leftovers) or drop the raw rows' two tables (PostgreSQL)."""
    import psycopg

    from benchmarks.floor import pg_connect_args

    with psycopg.connect(autocommit=True, **pg_connect_args(url)) as pg:
        pg.execute(f"DROP TABLE IF EXISTS {RAW_SLOTS}, {RAW_GROUPS}")
        if create:
            pg.execute(f"CREATE TABLE {RAW_GROUPS} (id TEXT PRIMARY KEY)")
            pg.execute(f"CREATE TABLE {RAW_SLOTS} (id TEXT PRIMARY KEY, g TEXT NOT NULL, "
                       "n INTEGER, UNIQUE (g, n))")
            pg.execute(f"CREATE INDEX ON {RAW_SLOTS} (g)")


def measure(url: str, shape: Shape, workers: int, pairs: int, warmup: int = WARMUP_PAIRS,
            limit: int = LIMIT, path: Path = "ledger") -> Measurement:
    """Run ``pairs`` begin+settle pairs split over ``workers`` processes, every group limited
    to ``limit``. The ledger schema (or, for a raw path, :func:`raw_tables`) must exist."""
    if workers < 1 or pairs < workers:
        raise BenchError("need workers >= 1 and pairs >= workers")
    prefix = f"ceil-{shape}-{uuid.uuid4().hex[:8]}"
    groups = groups_for(shape, prefix, workers)
    if path == "ledger":
        with Ledger.open(url, migrate_schema=False) as led:
            for g in dict.fromkeys(groups):
                led.configure_group(g, max_in_flight=limit)
    else:
        import psycopg

        from benchmarks.floor import pg_connect_args

        with psycopg.connect(autocommit=True, **pg_connect_args(url)) as pg:
            for g in dict.fromkeys(groups):
                pg.execute(f"INSERT INTO {RAW_GROUPS} (id) VALUES (%s)", (g,))
    share = shares(pairs, workers)
    jobs: list[tuple[str, int, Worker, tuple[Any, ...]]] = []
    for i in range(workers):
        tag = f"{prefix}-w{i}"
        if path == "ledger":
            jobs.append((tag, share[i], _worker, (url, tag, groups[i], share[i], warmup)))
        else:
            jobs.append((tag, share[i], _raw_worker,
                         (url, path, tag, groups[i], share[i], warmup)))
    done = run_together(f"group-ceiling {path}", jobs)
    return Measurement(shape, workers, done.count, done.seconds, done.cpu_s, path)


def bench_database(url: str, *, backend: str, workers: Sequence[int] = DEFAULT_WORKERS,
                   pairs: int = DEFAULT_PAIRS, warmup: int = WARMUP_PAIRS,
                   progress: Progress = quiet, raw: bool = True) -> list[CeilingRow]:
    """One group and N groups at each worker count on one database (and, on PostgreSQL with
    ``raw``, the raw driver's locked and numbered rows)."""
    Ledger.open(url).close()  # the schema, migrated once before the workers start
    paths: list[Path] = ["ledger"]
    if raw and backend == "postgresql":
        paths.extend(RAW_PATHS)
        raw_tables(url, create=True)
    rows: list[CeilingRow] = []
    try:
        for w in workers:
            for path in paths:
                rows.append(_row(url, backend, path, w, pairs, warmup, progress))
    finally:
        if len(paths) > 1:
            raw_tables(url, create=False)
    return rows


def _row(url: str, backend: str, path: Path, w: int, pairs: int, warmup: int,
         progress: Progress) -> CeilingRow:
    progress(f"bench group-ceiling: {backend}, {w} worker(s): {path}, N groups")
    many = measure(url, "many", w, pairs, warmup, path=path)
    progress(f"bench group-ceiling: {backend}, {w} worker(s): {path}, one group")
    one = measure(url, "one", w, pairs, warmup, path=path)
    ratio = one.per_second / many.per_second if many.per_second > 0 else 0.0
    return CeilingRow(
        backend=backend, workers=w, path=path, pairs=pairs,
        one_per_s=round(one.per_second, 1),
        many_per_s=round(many.per_second, 1), ratio=round(ratio, 3),
        one_cpu_us=round(one.cpu_us, 1), many_cpu_us=round(many.cpu_us, 1),
        meets_target=one.per_second >= TARGET_PER_S,
        one_seconds=round(one.seconds, 3), many_seconds=round(many.seconds, 3))


def new_report() -> Report:
    """An empty ``group-ceiling`` report with its columns and target."""
    return Report(
        bench="group-ceiling", columns=COLUMNS,
        targets={"one group": f">= {TARGET_PER_S:,.0f} begin+settle pairs/s for one limited "
                              "group on PostgreSQL with fsync on (issue 24); ratio one/N "
                              "groups reported beside it"},
        notes=[f"rate = begin+settle pairs per second (the settle frees the slot); every "
               f"group limited to {LIMIT:,} in flight, never full; one group = every worker's "
               "route in the same group, N groups = each worker's route in a group of its own "
               "(the floor, same run, same server); CPU = client process CPU of the workers "
               "over the measured loop (PostgreSQL: server CPU excluded)",
               "raw locked / raw numbered (PostgreSQL): the raw driver, per pair one "
               "transaction writing a slot row and one deleting it; locked = the group's row "
               "FOR UPDATE, count, insert (the lock held through COMMIT); numbered = read the "
               "group's numbers, insert a free one under a unique index, no lock"],
    )


def run(url_targets: Sequence[tuple[str, str]], *, workers: Sequence[int] = DEFAULT_WORKERS,
        pairs: int = DEFAULT_PAIRS, warmup: int = WARMUP_PAIRS,
        progress: Progress = quiet, raw: bool = True) -> Report:
    """The whole ``group-ceiling`` benchmark over ``(backend, url)`` targets."""
    probe = MachineProbe()
    report = new_report()
    for backend, url in url_targets:
        report.rows.extend(bench_database(url, backend=backend, workers=workers, pairs=pairs,
                                          warmup=warmup, progress=progress, raw=raw))
    report.machine = probe.done()
    return report


__all__ = [
    "DEFAULT_PAIRS",
    "DEFAULT_WORKERS",
    "LIMIT",
    "RAW_PATHS",
    "TARGET_PER_S",
    "CeilingRow",
    "Measurement",
    "bench_database",
    "groups_for",
    "measure",
    "new_report",
    "raw_tables",
    "route_for",
    "run",
]
