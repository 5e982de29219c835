"""What every benchmark shares: where it runs, how it reports, and a few measuring helpers.

A benchmark is a script that reports; it never fails because a target was missed. Each one
returns a :class:`Report`: typed rows, the columns its table shows, notes, the targets it was
read against, and the machine it ran on (CPU count and load average before and after, since the
numbers mean little without the load that was on the machine).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from ledger.errors import StorageError

Progress = Callable[[str], None]


class BenchError(StorageError):
    """A benchmark could not measure what it claims (a worker failed, or the scenario did not
    behave as set up); the message says what happened."""


def quiet(_msg: str) -> None:
    """A progress callback that says nothing."""


# -- statistics -------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between closest ranks."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean, NaN for no values."""
    return sum(values) / len(values) if values else math.nan


def cpu_now() -> float:
    """CPU seconds this process has used so far, every thread included (user + system)."""
    return time.process_time()


# -- the machine ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Machine:
    """Where and under which load a benchmark ran."""

    cpus: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    python: str
    platform: str
    sqlalchemy: str
    psycopg: str

    def describe(self) -> str:
        """One line for the end of a table."""
        b = ", ".join(f"{x:.2f}" for x in self.load_before)
        a = ", ".join(f"{x:.2f}" for x in self.load_after)
        return (f"machine: {self.cpus} CPUs, load average (1, 5, 15 min) {b} before, {a} after; "
                f"Python {self.python}, SQLAlchemy {self.sqlalchemy}, psycopg {self.psycopg}")


def _load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # not available on this platform
        return (math.nan, math.nan, math.nan)


class MachineProbe:
    """Samples the load average when created and again at :meth:`done`."""

    def __init__(self) -> None:
        self.before = _load()

    def done(self) -> Machine:
        """The machine description with the load average now."""
        import psycopg
        import sqlalchemy

        return Machine(
            cpus=os.cpu_count() or 1, load_before=self.before, load_after=_load(),
            python=platform.python_version(), platform=sys.platform,
            sqlalchemy=sqlalchemy.__version__, psycopg=psycopg.__version__,
        )


# -- reports ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    """One column of a report's table: its header and how a row shows in it."""

    header: str
    cell: Callable[[Any], str]
    left: bool = False


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table cell; ``-`` for a missing or undefined value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


@dataclass
class Report:
    """A benchmark's result: rows (dataclasses), the table's columns, targets and notes."""

    bench: str
    columns: Sequence[Column]
    rows: list[Any] = field(default_factory=list)
    targets: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    machine: Machine | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON data (NaN becomes null)."""
        return {
            "bench": self.bench,
            "rows": [_jsonable(r) for r in self.rows],
            "targets": dict(self.targets),
            "notes": list(self.notes),
            "skipped": list(self.skipped),
            "machine": _jsonable(self.machine) if self.machine else None,
            **{k: _jsonable(v) for k, v in self.extra.items()},
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def format_table(self) -> str:
        """An aligned text table, then the targets, notes, skips and the machine line."""
        head = [c.header for c in self.columns]
        body = [[c.cell(r) for c in self.columns] for r in self.rows]
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
        out = []
        for line in [head, *body]:
            cells = [v.ljust(w) if c.left else v.rjust(w)
                     for v, w, c in zip(line, widths, self.columns, strict=True)]
            out.append("  ".join(cells).rstrip())
        out.extend(f"target: {name}: {text}" for name, text in self.targets.items())
        out.extend(f"note: {n}" for n in self.notes)
        out.extend(f"skipped: {s}" for s in self.skipped)
        if self.machine is not None:
            out.append(self.machine.describe())
        return "\n".join(out)


# -- where a benchmark runs -------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One database a benchmark measures: its backend name, URL and what it is."""

    backend: str
    url: str
    where: str


PG_MISSING = ("PostgreSQL: server binaries (initdb, postgres) not installed; install Debian's "
              "'postgresql' package or set LEDGER_PG_BINDIR, or pass --db postgresql+psycopg://...")


@contextmanager
def targets(*, db: str | None, postgres: bool, sqlite: bool = True, bench: str,
            progress: Progress = quiet) -> Iterator[tuple[list[Target], list[str]]]:
    """The databases to measure and the reasons any was skipped.

    ``db`` given: that database only. Otherwise a temporary SQLite file (unless
    ``sqlite=False``) and, with ``postgres``, a throwaway PostgreSQL server started with
    production durability (fsync on), each removed afterwards.
    """
    from benchmarks.floor import backend

    skipped: list[str] = []
    if db is not None:
        yield [Target(backend(db), db, "given database")], skipped
        return
    with tempfile.TemporaryDirectory(prefix=f"ledger-bench-{bench}-") as tmp:
        found: list[Target] = []
        if sqlite:
            found.append(Target("sqlite", os.path.join(tmp, "bench.db"),
                                "temporary SQLite file"))
        srv = None
        try:
            if postgres:
                from ledger.testing.pgserver import find_bindir, start_server

                if find_bindir() is None:
                    progress(f"bench {bench}: skipping {PG_MISSING}")
                    skipped.append(PG_MISSING)
                else:
                    progress(f"bench {bench}: starting a throwaway durable PostgreSQL server")
                    srv = start_server(durable=True)
                    srv.psql("CREATE DATABASE ledger_bench")
                    found.append(Target("postgresql", srv.url("ledger_bench"),
                                        "throwaway PostgreSQL server, fsync on"))
            yield found, skipped
        finally:
            if srv is not None:
                srv.cleanup()


def parse_counts(text: str, what: str) -> list[int]:
    """``"1,16"`` -> ``[1, 16]``; a typed error naming ``what`` for anything else."""
    from ledger.errors import InvalidArgument

    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise InvalidArgument(f"--{what} {text!r}: give positive integers such as 1,8",
                              field=what)
    return counts


def parse_choices(text: str, what: str, allowed: Sequence[str]) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each one of ``allowed``; a typed error otherwise."""
    from ledger.errors import InvalidArgument

    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in allowed]
    if not got or bad:
        raise InvalidArgument(f"--{what} {text!r}: choose from {', '.join(allowed)}",
                              field=what)
    return got




# -- worker processes that start together -----------------------------------------------------

WORKER_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Together:
    """What worker processes did together: their operations, from the first one's start to
    the last one's end, and the process CPU they spent in their measured loops."""

    count: int
    seconds: float
    cpu_s: float


# A worker: a module-level function (spawned processes import it by name) called with its
# arguments and then the barrier behind which every worker starts; it returns the monotonic
# start and end of its measured loop and the process CPU the loop took.
Worker = Callable[..., tuple[float, float, float]]


def _run_one(work: Worker, args: tuple[Any, ...], tag: str, n: int, barrier: Any,
             results: Any) -> None:
    try:
        t0, t1, cpu = work(*args, barrier)
        results.put((tag, "ok", t0, t1, n, cpu))
    except BaseException as e:  # reported to the parent, which raises BenchError
        barrier.abort()
        results.put((tag, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                     0.0, 0, 0.0))


def run_together(label: str, jobs: Sequence[tuple[str, int, Worker, tuple[Any, ...]]]
                 ) -> Together:
    """Run each ``(tag, operations, worker, args)`` in a spawned process of its own (no
    inherited connections or locks), all starting behind one barrier; a failed worker is a
    :class:`BenchError` naming ``label`` and its tag (the first that did not merely see the
    barrier broken by another)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(jobs))
    results = ctx.Queue()
    procs = [ctx.Process(target=_run_one, args=(work, args, tag, n, barrier, results),
                         daemon=True)
             for tag, n, work, args in jobs]
    for p in procs:
        p.start()
    got: list[tuple[str, str, Any, float, int, float]] = []
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
        raise BenchError(f"{label} worker {first[0]} failed: {first[2]}")
    return Together(count=sum(g[4] for g in got),
                    seconds=max(float(g[3]) for g in got) - min(float(g[2]) for g in got),
                    cpu_s=sum(g[5] for g in got))


def shares(total: int, workers: int) -> list[int]:
    """``total`` split over ``workers`` as evenly as it goes."""
    return [total // workers + (1 if i < total % workers else 0) for i in range(workers)]


__all__ = [
    "WORKER_TIMEOUT_S",
    "BenchError",
    "Column",
    "Machine",
    "MachineProbe",
    "Progress",
    "Report",
    "Target",
    "Together",
    "Worker",
    "cpu_now",
    "fmt",
    "mean",
    "parse_choices",
    "parse_counts",
    "percentile",
    "quiet",
    "run_together",
    "shares",
    "targets",
]
