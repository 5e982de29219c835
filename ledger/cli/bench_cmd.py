"""``failover-ledger bench write``: the write-path benchmark (begin+settle vs the physical
floor).

Without ``--db`` it measures a temporary SQLite file; ``--postgres`` adds a throwaway PostgreSQL
server started with production-like durability (fsync on). The exit code is non-zero only when
the benchmark itself fails, never because the ledger missed the target ratio (that is reported).
On a terminal (or with ``--progress``) stderr shows each stage and a progress line with an ETA
over the measurements; piped, stderr stays quiet.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from ledger.cli.common import bench_subparsers
from ledger.cli.progress import Progress, wanted
from ledger.errors import InvalidArgument


def register(subparsers: Any) -> None:
    p = bench_subparsers(subparsers).add_parser(
        "write",
        help="attempts/s for begin+settle beside the insert+update floor",
        description="Attempts per second for begin+settle, beside a baseline measured in the "
        "same run on the same database (one single-row INSERT commit plus one single-row "
        "UPDATE commit per attempt), at each worker count (workers are OS processes).",
    )
    p.add_argument("--db", dest="bench_db", default=None, metavar="URL",
                   help="database to measure (SQLite path or postgresql+psycopg:// URL); "
                   "default: a temporary SQLite file. It gets bench runs and attempts.")
    p.add_argument("--postgres", action="store_true",
                   help="also measure a throwaway durable PostgreSQL server (needs the server "
                   "binaries)")
    p.add_argument("--attempts", type=int, default=None, metavar="N",
                   help="attempts per measurement, split over the workers (default 1000)")
    p.add_argument("--workers", default="1,8", metavar="LIST",
                   help="comma-separated worker counts (default 1,8)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--progress", action="store_true", help="show progress even when piped")
    p.set_defaults(func=_write)


def parse_workers(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise InvalidArgument(f"--workers {text!r}: give positive integers such as 1,8",
                              field="workers")
    return counts


def _write(args: argparse.Namespace) -> int:
    from ledger import bench

    workers = parse_workers(args.workers)
    attempts = args.attempts if args.attempts is not None else bench.DEFAULT_ATTEMPTS
    if attempts < max(workers):
        raise InvalidArgument(f"--attempts must be at least the largest worker count "
                              f"({max(workers)})", field="attempts")
    report = bench.BenchReport()
    bar = Progress("bench write", wanted(args.progress))

    def progress(msg: str) -> None:
        if bar.enabled:
            bar.note(msg)

    with tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        url = args.bench_db or str(Path(tmp) / "bench.db")
        where = "given database" if args.bench_db else "temporary SQLite file"
        progress(f"bench write: {bench.backend_name(url)} ({where}), workers {workers}, "
                 f"{attempts} attempts per measurement")
        report.rows.extend(bench.bench_database(url, workers=workers, attempts=attempts,
                                                progress=bar))
        if args.postgres:
            _postgres(report, workers, attempts, progress, bar)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        print(report.format_table())
    return 0


def _postgres(report: Any, workers: list[int], attempts: int, progress: Any,
              bar: Progress) -> None:
    from ledger import bench
    from ledger.testing.pgserver import find_bindir, start_server

    if find_bindir() is None:
        msg = ("PostgreSQL: server binaries (initdb, postgres) not installed; install Debian's "
               "'postgresql' package or set LEDGER_PG_BINDIR, or pass --db postgresql+psycopg://...")
        progress(f"bench write: skipping {msg}")
        report.skipped.append(msg)
        return
    progress("bench write: starting a throwaway durable PostgreSQL server")
    srv = start_server(durable=True)
    try:
        srv.psql("CREATE DATABASE ledger_bench")
        progress(f"bench write: postgresql, workers {workers}, "
                 f"{attempts} attempts per measurement")
        report.rows.extend(bench.bench_database(srv.url("ledger_bench"), workers=workers,
                                                attempts=attempts, progress=bar))
    finally:
        srv.cleanup()
