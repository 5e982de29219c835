"""The write-path benchmark: Attempts per second for begin+settle, beside the physical floor.

For each worker count, two measurements run against the same database with the same engine
settings (:func:`ledger.storage.engine.create`):

* **ledger**: every worker (an OS process) admits its own Run, takes its lease, and records
  Attempts: ``begin_attempt`` then ``settle_attempt`` (succeeded, with a cost), each its own
  transaction, exactly as an executor does around a model call;
* **baseline**: every worker performs the physical floor of an Attempt: one single-row INSERT
  committed plus one single-row UPDATE of that row committed (:mod:`ledger.storage.baseline`).

Workers start together (a barrier after a short warm-up) and the rate is the total number of
attempts divided by the wall time from the first worker's start to the last one's finish. The
ratio ledger/baseline is the figure of merit; the target is :data:`TARGET_RATIO` or more. Missing
the target is reported, not an error.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from multiprocessing.synchronize import Barrier
from typing import Any, Literal

from ledger.api import Ledger
from ledger.errors import StorageError
from ledger.model import Budget, Price, Route
from ledger.storage import baseline as baseline_mod
from ledger.storage import engine as engine_mod

TARGET_RATIO = 0.5
DEFAULT_WORKERS = (1, 8)
DEFAULT_ATTEMPTS = 1000
WARMUP_ATTEMPTS = 5
WORKER_TIMEOUT_S = 1800.0

Mode = Literal["ledger", "baseline"]

# One shared route (one provider group, one health row), as when many runs use the same model.
# Free by declaration (Price()): the benchmark holds a fixed RESERVE per attempt.
BENCH_ROUTE = Route(id="bench-route", provider="bench", model="bench-model", group="bench-group",
                    recipient="bench", price=Price())
RESERVE = "0.001"


class BenchError(StorageError):
    """A benchmark worker failed; the message carries its traceback's last line."""


@dataclass(frozen=True)
class Measurement:
    mode: Mode
    workers: int
    attempts: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.attempts / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class BenchRow:
    backend: str
    workers: int
    attempts: int
    ledger_per_s: float
    baseline_per_s: float
    ratio: float
    meets_target: bool
    ledger_s: float
    baseline_s: float


@dataclass
class BenchReport:
    rows: list[BenchRow] = field(default_factory=list)
    target: float = TARGET_RATIO
    skipped: list[str] = field(default_factory=list)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)

    @property
    def meets_target(self) -> bool:
        return all(r.meets_target for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_ratio": self.target,
            "meets_target": self.meets_target,
            "cpus": self.cpus,
            "rows": [asdict(r) for r in self.rows],
            "skipped": list(self.skipped),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def format_table(self) -> str:
        head = ("backend", "workers", "attempts", "ledger att/s", "baseline att/s", "ratio", "")
        lines = [head]
        for r in self.rows:
            lines.append((
                r.backend, str(r.workers), str(r.attempts), f"{r.ledger_per_s:.1f}",
                f"{r.baseline_per_s:.1f}", f"{r.ratio:.2f}",
                "ok" if r.meets_target else f"below target {self.target}",
            ))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = []
        for line in lines:
            cells = [c.ljust(w) if i in (0, 6) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(line, widths, strict=True))]
            out.append("  ".join(cells).rstrip())
        out.append(f"target: ledger >= {self.target} x baseline; "
                   + ("met on every row" if self.meets_target else "NOT met on every row")
                   + f" ({self.cpus} CPUs)")
        out.extend(f"skipped: {s}" for s in self.skipped)
        return "\n".join(out)


# -- workers (each its own OS process) --------------------------------------------------------

def _ledger_worker(url: str, tag: str, n: int, warmup: int, barrier: Barrier
                   ) -> tuple[float, float]:
    led = Ledger.open(url, migrate_schema=False, executor_id=tag)
    try:
        run_id = f"{tag}-run"
        led.admit_run(run_id, plan=[BENCH_ROUTE],
                      budget=Budget(max_calls=n + warmup + 1, max_retries=0,
                                    max_cost=Decimal(1_000_000)),
                      role="bench")
        lease = led.acquire_lease(run_id, ttl_s=WORKER_TIMEOUT_S)

        def one() -> None:
            att = led.begin_attempt(lease, route=BENCH_ROUTE.id, envelope_hash="sha256:bench",
                                    reserve=RESERVE)
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost=RESERVE,
                               prompt_tokens=10, completion_tokens=5)

        for _ in range(warmup):
            one()
        barrier.wait(timeout=WORKER_TIMEOUT_S)
        t0 = time.monotonic()
        for _ in range(n):
            one()
        t1 = time.monotonic()
        led.release_lease(lease)
        return t0, t1
    finally:
        led.close()


def _baseline_worker(url: str, tag: str, n: int, warmup: int, barrier: Barrier
                     ) -> tuple[float, float]:
    eng = engine_mod.create(url)
    try:
        writer = baseline_mod.BaselineWriter(eng, url, tag)
        for i in range(warmup):
            writer.attempt(f"{tag}-w{i}", time.time())
        barrier.wait(timeout=WORKER_TIMEOUT_S)
        t0 = time.monotonic()
        for i in range(n):
            writer.attempt(f"{tag}-{i}", time.time())
        t1 = time.monotonic()
        return t0, t1
    finally:
        eng.dispose()


def _worker_main(mode: Mode, url: str, tag: str, n: int, warmup: int, barrier: Barrier,
                 results: Any) -> None:
    try:
        fn = _ledger_worker if mode == "ledger" else _baseline_worker
        t0, t1 = fn(url, tag, n, warmup, barrier)
        results.put((tag, "ok", t0, t1, n))
    except BaseException as e:  # reported to the parent, which raises BenchError
        barrier.abort()
        results.put((tag, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 0, 0))


def measure(url: str, mode: Mode, workers: int, attempts: int,
            warmup: int = WARMUP_ATTEMPTS) -> Measurement:
    """Run ``attempts`` attempts split over ``workers`` processes; the database must be ready
    (the ledger schema migrated and, for the baseline, its table created)."""
    if workers < 1 or attempts < workers:
        raise ValueError("need workers >= 1 and attempts >= workers")
    ctx = mp.get_context("spawn")  # no inherited connections or locks
    barrier = ctx.Barrier(workers)
    results = ctx.Queue()
    share = [attempts // workers + (1 if i < attempts % workers else 0) for i in range(workers)]
    prefix = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_worker_main,
                         args=(mode, url, f"{prefix}-w{i}", share[i], warmup, barrier, results),
                         daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    got: list[tuple[str, str, Any, float, int]] = []
    try:
        for _ in procs:
            got.append(results.get(timeout=WORKER_TIMEOUT_S))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()
    errors = [g for g in got if g[1] != "ok"]
    if errors:
        first = sorted(errors, key=lambda g: "BrokenBarrierError" in str(g[2]))[0]
        raise BenchError(f"{mode} worker {first[0]} failed: {first[2]}")
    start = min(float(g[2]) for g in got)
    end = max(float(g[3]) for g in got)
    return Measurement(mode, workers, sum(g[4] for g in got), end - start)


@contextmanager
def prepared(url: str) -> Iterator[None]:
    """Migrate the ledger schema and create the baseline table; drop the table afterwards."""
    norm = engine_mod.normalize_url(url)
    Ledger.open(norm).close()
    eng = engine_mod.create(norm)
    try:
        baseline_mod.create_table(eng, norm)
        yield
    finally:
        try:
            baseline_mod.drop_table(eng, norm)
        finally:
            eng.dispose()


def backend_name(url: str) -> str:
    eng = engine_mod.create(engine_mod.normalize_url(url))
    name = eng.dialect.name
    eng.dispose()
    return name


def bench_database(url: str, *, workers: Sequence[int] = DEFAULT_WORKERS,
                   attempts: int = DEFAULT_ATTEMPTS, warmup: int = WARMUP_ATTEMPTS,
                   target: float = TARGET_RATIO, label: str | None = None,
                   progress: Callable[[int, int], None] | None = None) -> list[BenchRow]:
    """Measure ledger and baseline at each worker count on one database; ``progress(done,
    total)`` is told after each of the ``2 * len(workers)`` measurements."""
    norm = engine_mod.normalize_url(url)
    backend = label or backend_name(norm)
    rows: list[BenchRow] = []
    with prepared(norm):
        for i, w in enumerate(workers):
            base = measure(norm, "baseline", w, attempts, warmup)
            if progress is not None:
                progress(2 * i + 1, 2 * len(workers))
            led = measure(norm, "ledger", w, attempts, warmup)
            if progress is not None:
                progress(2 * i + 2, 2 * len(workers))
            ratio = led.per_second / base.per_second if base.per_second > 0 else 0.0
            rows.append(BenchRow(
                backend=backend, workers=w, attempts=attempts,
                ledger_per_s=round(led.per_second, 1), baseline_per_s=round(base.per_second, 1),
                ratio=round(ratio, 3), meets_target=ratio >= target,
                ledger_s=round(led.seconds, 3), baseline_s=round(base.seconds, 3),
            ))
    return rows


__all__ = [
    "DEFAULT_ATTEMPTS",
    "DEFAULT_WORKERS",
    "TARGET_RATIO",
    "BenchError",
    "BenchReport",
    "BenchRow",
    "Measurement",
    "bench_database",
    "measure",
]
