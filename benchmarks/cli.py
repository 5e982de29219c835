"""``python -m benchmarks COMMAND``: the benchmark suite's command line (run from the repository
root; the benchmarks are not part of the installed package).

``write``, ``group-ceiling``, ``turn``, ``turns-flat``, ``queue``, ``recover``, ``retention``
and ``select`` measure;
``generate`` fills a database with a large synthetic history, fast (the bulk generator), and
``audit`` times each audit query on it. Every database benchmark measures a temporary SQLite
file by default; ``--postgres`` adds a throwaway PostgreSQL server started with production
durability (fsync on), ``--no-sqlite`` leaves the SQLite file out, and ``--db URL`` measures
that database instead.
Tables go to stdout, ``--json`` prints the report as JSON, progress goes to stderr (on a
terminal, or with ``--progress``). The exit code is non-zero only when a benchmark itself fails
(1) or an argument is wrong (2), never because a target was missed (that is reported).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ledger.cli.progress import Progress, wanted
from ledger.errors import ConfigError, InvalidArgument, LedgerError

PROG = "python -m benchmarks"
DEFAULT_DB = "ledger.db"


class _Reporter:
    """A benchmark's stage messages on stderr, only when a person is watching (a terminal, or
    ``--progress``), with a progress line and ETA where the stages can be counted.
    """

    def __init__(self, bench: str, forced: bool) -> None:
        self.bar = Progress(f"bench {bench}", wanted(forced))
        self.total = 0  # measured stages expected (0: not counted)
        self.done = 0

    def __call__(self, msg: str) -> None:
        if not self.bar.enabled:
            return
        self.bar.note(msg)
        if self.total and "worker(s):" in msg:
            self.done += 1
            self.bar(self.done - 1, self.total)  # the stage starts: the previous ones are done

    def finish(self) -> None:
        if self.total:
            self.bar(self.total, self.total)
        self.bar.close()


def _add_where(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", dest="bench_db", default=None, metavar="URL",
                   help="database to measure (SQLite path or postgresql+psycopg:// URL) "
                   "instead of the temporary ones; it receives the benchmark's runs")
    p.add_argument("--postgres", action="store_true",
                   help="also measure a throwaway durable PostgreSQL server (needs the server "
                   "binaries)")
    p.add_argument("--no-sqlite", action="store_true",
                   help="with --postgres: leave out the temporary SQLite file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--progress", action="store_true",
                   help="show the stages and progress on stderr even when it is not a terminal")


def _add_tx(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-tx-count", action="store_true",
                   help="skip counting database transactions (on PostgreSQL the count waits "
                   "~11 s per measurement for the server's statistics)")


def build_parser() -> argparse.ArgumentParser:
    """Every benchmark command and its options."""
    from benchmarks import defaults as d

    parser = argparse.ArgumentParser(
        prog=PROG, description="The benchmark suite of failover-ledger (docs/benchmarks.md).")
    bench = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)

    p = bench.add_parser(
        "write", help="begin+settle attempts/s and CPU beside the raw-driver floor",
        description="Attempts per second and client CPU per attempt for begin+settle (and for "
        "a begin carrying the select event, as execute's does), beside a floor measured in the "
        "same run with the same durability: the raw driver, prepared statements, autocommit, "
        "one INSERT commit plus one UPDATE commit per attempt. Workers are OS processes.")
    _add_where(p)
    p.add_argument("--attempts", type=int, default=d.WRITE_ATTEMPTS, metavar="N",
                   help=f"attempts per measurement, split over the workers "
                   f"(default {d.WRITE_ATTEMPTS})")
    p.add_argument("--workers", default="1,8", metavar="LIST",
                   help="comma-separated worker counts (default 1,8)")
    p.add_argument("--paths", default="ledger,ledger+event", metavar="LIST",
                   help="ledger paths to measure: ledger (begin+settle), ledger+event (begin "
                   "with the select event); default both")
    p.set_defaults(func=_write)

    t = bench.add_parser(
        "turn", help="aexecute/execute against a local fake provider, over raw httpx",
        description="The whole aexecute/execute path through the httpx adapter against the "
        "local fake provider (its own process), healthy and failover (503 then a fallback in "
        "another capacity group), at each concurrency: latency overhead over a raw httpx call "
        "with the same body in the same run, calls/s, client CPU per call, and database "
        "transactions per call.")
    _add_where(t)
    _add_tx(t)
    t.add_argument("--calls", type=int, default=d.TURN_CALLS, metavar="N",
                   help=f"timed calls per measurement (default {d.TURN_CALLS})")
    t.add_argument("--count-calls", type=int, default=d.TURN_COUNT_CALLS, metavar="N",
                   help="calls of the transaction-counting pass (default "
                   f"{d.TURN_COUNT_CALLS})")
    t.add_argument("--concurrency", default="1,16", metavar="LIST",
                   help="concurrent turns, comma-separated (default 1,16)")
    t.add_argument("--drivers", default="async,sync", metavar="LIST",
                   help="async (aexecute, tasks) and/or sync (execute, threads); default both")
    t.add_argument("--scenarios", default="healthy,failover", metavar="LIST",
                   help="healthy and/or failover; default both")
    t.add_argument("--no-litellm", action="store_true",
                   help="leave out LiteLLM Router's calls/s at the highest concurrency (measured "
                   "beside the healthy async rows when litellm is installed)")
    t.set_defaults(func=_turn)

    f = bench.add_parser(
        "turns-flat", help="per-turn cost at turn 1 and turn 1,000 of one Run",
        description="One Run of N sequential healthy turns whose envelopes grow like a "
        "conversation (every earlier answer as a model-derived part with provenance): mean "
        "latency, CPU and transactions of the first and the last W turns, and their ratio.")
    _add_where(f)
    _add_tx(f)
    f.add_argument("--turns", type=int, default=d.FLAT_TURNS, metavar="N",
                   help=f"turns in the Run (default {d.FLAT_TURNS})")
    f.add_argument("--window", type=int, default=d.FLAT_WINDOW, metavar="W",
                   help=f"turns averaged at each end (default {d.FLAT_WINDOW})")
    f.add_argument("--drivers", default="async", metavar="LIST",
                   help="async (aexecute) and/or sync (execute); default async")
    f.set_defaults(func=_flat)

    c = bench.add_parser(
        "group-ceiling", help="begins/s of one limited capacity group beside N groups",
        description="begin+settle pairs per second when every worker's route is in one "
        "limited capacity group, beside the same with each worker in a group of its own (the "
        "floor, same run, same server), at each worker count; the limit is never reached. "
        "Client CPU per pair beside each. Workers are OS processes.")
    _add_where(c)
    c.add_argument("--pairs", type=int, default=d.CEILING_PAIRS, metavar="N",
                   help=f"begin+settle pairs per measurement, split over the workers "
                   f"(default {d.CEILING_PAIRS})")
    c.add_argument("--workers", default="1,2,4,8,16,32", metavar="LIST",
                   help="comma-separated worker counts (default 1,2,4,8,16,32)")
    c.add_argument("--no-raw", action="store_true",
                   help="leave out the raw driver's locked and numbered rows (PostgreSQL)")
    c.set_defaults(func=_ceiling)

    r = bench.add_parser(
        "recover", help="recovery of 10k unknown attempts over 1M attempts of history",
        description="Writes synthetic history (the bulk generator), then a dead "
        "executor's runs with dispatching attempts whose leases expire, then times "
        "ledger.ops.recovery.recover to completion, and idle passes over the same history. The "
        "full size takes minutes to build; --scale shrinks it.")
    _add_where(r)
    r.add_argument("--scale", type=float, default=1.0,
                   help="multiply the default sizes (1,000,000 history, 10,000 unknown)")
    r.add_argument("--history", type=int, default=None, metavar="N",
                   help="attempts of history (overrides --scale)")
    r.add_argument("--unknown", type=int, default=None, metavar="N",
                   help="unknown attempts to recover (overrides --scale)")
    r.add_argument("--per-run", type=int, default=d.RECOVER_PER_RUN, metavar="N",
                   help="dispatching attempts per dead run (default 1)")
    r.add_argument("--limit", type=int, default=d.RECOVER_LIMIT, metavar="N",
                   help=f"runs per recovery pass (default {d.RECOVER_LIMIT})")
    r.add_argument("--setup-workers", type=int, default=4, metavar="N",
                   help="threads making the dead executor's runs (default 4)")
    r.set_defaults(func=_recover)

    rt = bench.add_parser(
        "retention", help="a dry run and a real retention over months of generated history",
        description="Writes --attempts of synthetic history over --months whole months (the "
        "bulk generator), its unknown attempts settled in bulk, then times "
        "Ledger.drop_history as a dry run (median of --repeat) and for real, and the share "
        "of the real run spent reading the dropped rows to carry /metrics' counters over. "
        "It drops the history it wrote: point --db only at a throwaway database.")
    _add_where(rt)
    rt.add_argument("--attempts", type=int, default=d.RETENTION_ATTEMPTS, metavar="N",
                    help=f"attempts of history (default {d.RETENTION_ATTEMPTS})")
    rt.add_argument("--months", type=int, default=d.RETENTION_MONTHS, metavar="N",
                    help="whole months of history, ending at this month's start (default "
                    f"{d.RETENTION_MONTHS})")
    rt.add_argument("--repeat", type=int, default=d.RETENTION_REPEAT, metavar="N",
                    help=f"dry runs timed (default {d.RETENTION_REPEAT})")
    rt.set_defaults(func=_retention)

    s = bench.add_parser(
        "select", help="the selector's deep walk and first fit, in microseconds",
        description="select() at 10 candidates: the deep walk (every candidate but the last "
        "ineligible, each for another reason) and the first fit, p50/p95 over many "
        "iterations. Pure: no database.")
    s.add_argument("--iterations", type=int, default=d.SELECT_ITERATIONS, metavar="N",
                   help=f"timed calls per case (default {d.SELECT_ITERATIONS})")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(func=_select)

    a = bench.add_parser(
        "audit", help="latency of each audit query on --db (fill it with generate)",
        description="Each audit query, timed --repeat times over the newest day of history of "
        "--db after one warm-up: median, p95 and worst, beside the targets.")
    _add_ledger_db(a)
    a.add_argument("--repeat", type=int, default=5, help="timed runs per query (default 5)")
    a.add_argument("--progress", action="store_true", help="show progress even when piped")
    a.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    a.set_defaults(func=_audit)

    g = bench.add_parser(
        "generate", help="fill --db with a large synthetic history, fast (bulk loaded)",
        description="Simulates Runs under the goclaw preset with the ledger's pure rules and "
        "bulk-loads exactly --attempts Attempts spread over --days days before --end, "
        "bypassing the ledger's write path (minutes for millions of Attempts; "
        "failover-ledger generate writes through the ledger itself, far slower). Refuses a "
        "ledger holding runs it did not generate unless --into-existing is given.")
    _add_ledger_db(g)
    g.add_argument("--attempts", type=int, default=100_000,
                   help="attempts (default 100000; at most 100000000)")
    g.add_argument("--days", type=float, default=7.0, help="history span in days (default 7)")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--end", type=float, default=None,
                   help="epoch of the newest history (default: now)")
    g.add_argument("--progress", action="store_true", help="show progress even when piped")
    g.add_argument("--into-existing", action="store_true",
                   help="write into a ledger that already holds runs generate did not write "
                   "(refused without this flag)")
    g.add_argument("--frozen-policy", action="store_true",
                   help="freeze the goclaw preset itself in every Run (4 KB a Run) instead of "
                   "a small marker, so failover-ledger replay can replay the history")
    g.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    g.set_defaults(func=_generate)

    q = bench.add_parser(
        "queue", help="a long queue on one capacity group: wall time, begins and CPU per turn",
        description="One AsyncLedger, --sessions Run sessions each serving --turns turns "
        "through one capacity group of limit --limit, the send answering after --delay-ms: "
        "wall time beside the floor (delay x turns / limit), begin transactions per turn "
        "(counted at the driver) and client CPU per turn.")
    _add_where(q)
    q.add_argument("--sessions", type=int, default=d.QUEUE_SESSIONS, metavar="N",
                   help=f"sessions open at once (default {d.QUEUE_SESSIONS})")
    q.add_argument("--turns", type=int, default=d.QUEUE_TURNS, metavar="N",
                   help=f"turns per session, in a row (default {d.QUEUE_TURNS})")
    q.add_argument("--limit", type=int, default=d.QUEUE_LIMIT, metavar="N",
                   help=f"the capacity group's max_in_flight (default {d.QUEUE_LIMIT})")
    q.add_argument("--delay-ms", type=float, default=d.QUEUE_DELAY_MS, metavar="MS",
                   help=f"how long the send takes to answer (default {d.QUEUE_DELAY_MS:g})")
    q.set_defaults(func=_queue)

    dp = bench.add_parser(
        "deepen", help="copy --db's generated history back in time, server-side",
        description="Copies the finished Runs of --db's history (filled by generate) --copies "
        "times, each copy one span further back (default: the history's span in whole days), "
        "with INSERT ... SELECT run by the database itself: ten million Attempts from one "
        "million generated in minutes instead of an hour and a half. The newest span stays as "
        "generated, so audit measures the same day over more history. For throwaway benchmark "
        "databases only.")
    _add_ledger_db(dp)
    dp.add_argument("--copies", type=int, required=True, help="how many copies to add")
    dp.add_argument("--span-days", type=float, default=None,
                   help="how far back each copy moves (default: the history's span)")
    dp.add_argument("--progress", action="store_true", help="show progress even when piped")
    dp.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    dp.set_defaults(func=_deepen)
    return parser


def _deepen(args: argparse.Namespace) -> int:
    from benchmarks.deepen import deepen
    from ledger.api.facade import Ledger
    from ledger.domain.timefmt import iso

    if args.copies < 1:
        raise InvalidArgument("--copies must be >= 1", field="copies")
    led = Ledger.open(_ledger_db(args))
    try:
        bar = Progress("deepen", wanted(args.progress))
        rep = deepen(led, args.copies, progress=bar,
                     span_s=None if args.span_days is None else args.span_days * 86_400.0)
        bar.close()
    finally:
        led.close()
    summary = {"copies": rep.copies, "span_days": rep.span_s / 86_400.0, "rows": rep.rows,
               "since": rep.since, "until": rep.until, "seconds": round(rep.seconds, 2)}
    return _told(summary, args.json,
                 f"copied {rep.rows['attempts']} attempts in {rep.rows['runs']} runs "
                 f"({rep.rows['events']} events) in {rep.copies} copies of "
                 f"{rep.span_s / 86_400.0:g} days; history from {iso(rep.since)} to "
                 f"{iso(rep.until)}; {rep.seconds:.1f} s")


def _add_ledger_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, metavar="URL",
                   help=f"the ledger (SQLite path or postgresql+psycopg:// URL; default "
                   f"$LEDGER_URL or ./{DEFAULT_DB})")


def _ledger_db(args: argparse.Namespace) -> str:
    return str(args.db or os.environ.get("LEDGER_URL") or DEFAULT_DB)


def parse_workers(text: str) -> list[int]:
    """``--workers 1,8`` as a list of positive counts."""
    from benchmarks.common import parse_counts

    return parse_counts(text, "workers")


def _positive(value: int, name: str) -> None:
    if value < 1:
        raise InvalidArgument(f"--{name} must be at least 1", field=name.replace("-", "_"))


def _print(report: Any, as_json: bool) -> int:
    print(report.to_json() if as_json else report.format_table())
    return 0


def _told(summary: dict[str, Any], as_json: bool, text: str) -> int:
    """A command's summary: the mapping as JSON (for scripts) or one line for a reader."""
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    else:
        print(text)
    return 0


def _on_targets(args: argparse.Namespace, bench: str,
                body: Callable[[list[tuple[str, str]], _Reporter], Any],
                stages_per_target: int = 0) -> int:
    from benchmarks.common import targets

    if args.no_sqlite and not args.postgres and args.bench_db is None:
        raise InvalidArgument("--no-sqlite leaves nothing to measure; add --postgres or --db",
                              field="no_sqlite")
    report_to = _Reporter(bench, args.progress)
    with targets(db=args.bench_db, postgres=args.postgres, sqlite=not args.no_sqlite,
                 bench=bench, progress=report_to) as (found, skipped):
        report_to.total = stages_per_target * len(found)
        for t in found:
            report_to(f"bench {bench}: {t.backend} ({t.where})")
        report = body([(t.backend, t.url) for t in found], report_to)
        report.skipped.extend(skipped)
    report_to.finish()
    return _print(report, args.json)


def _write(args: argparse.Namespace) -> int:
    from benchmarks import write
    from benchmarks.common import parse_choices

    workers = parse_workers(args.workers)
    if args.attempts < max(workers):
        raise InvalidArgument(f"--attempts must be at least the largest worker count "
                              f"({max(workers)})", field="attempts")
    paths: Any = parse_choices(args.paths, "paths", write.LEDGER_MODES)
    return _on_targets(args, "write", lambda ts, progress: write.run(
        ts, workers=workers, attempts=args.attempts, modes=paths, progress=progress),
        stages_per_target=len(workers) * (1 + len(paths)))


def _ceiling(args: argparse.Namespace) -> int:
    from benchmarks import ceiling

    workers = parse_workers(args.workers)
    if args.pairs < max(workers):
        raise InvalidArgument(f"--pairs must be at least the largest worker count "
                              f"({max(workers)})", field="pairs")
    return _on_targets(args, "group-ceiling", lambda ts, progress: ceiling.run(
        ts, workers=workers, pairs=args.pairs, progress=progress, raw=not args.no_raw),
        stages_per_target=2 * len(workers) * (1 if args.no_raw else 3))


def _turn(args: argparse.Namespace) -> int:
    from benchmarks import turn
    from benchmarks.common import parse_choices, parse_counts

    conc = parse_counts(args.concurrency, "concurrency")
    drivers = parse_choices(args.drivers, "drivers", turn.DRIVERS)
    scenarios = parse_choices(args.scenarios, "scenarios", turn.SCENARIOS)
    _positive(args.calls, "calls")
    _positive(args.count_calls, "count-calls")
    return _on_targets(args, "turn", lambda ts, progress: turn.run(
        ts, drivers=drivers, scenarios=scenarios, concurrency=conc, calls=args.calls,
        count_calls=args.count_calls, count_tx=not args.no_tx_count,
        litellm=not args.no_litellm, progress=progress))


def _flat(args: argparse.Namespace) -> int:
    from benchmarks import flat, turn
    from benchmarks.common import parse_choices

    drivers = parse_choices(args.drivers, "drivers", turn.DRIVERS)
    _positive(args.window, "window")
    if args.turns < 2 * args.window:
        raise InvalidArgument(f"--turns must be at least twice --window ({2 * args.window})",
                              field="turns")
    return _on_targets(args, "turns-flat", lambda ts, progress: flat.run(
        ts, turns=args.turns, window=args.window, drivers=drivers,
        count_tx=not args.no_tx_count, progress=progress))


def _queue(args: argparse.Namespace) -> int:
    from benchmarks import queue

    _positive(args.sessions, "sessions")
    _positive(args.turns, "turns")
    _positive(args.limit, "limit")
    if not math.isfinite(args.delay_ms) or args.delay_ms < 0:
        raise InvalidArgument("--delay-ms must be a finite number of milliseconds >= 0",
                              field="delay_ms")
    return _on_targets(args, "queue", lambda ts, progress: queue.run(
        ts, sessions=args.sessions, turns=args.turns, limit=args.limit,
        delay_ms=args.delay_ms, progress=progress))


def _recover(args: argparse.Namespace) -> int:
    from benchmarks import recover

    if args.scale <= 0:
        raise InvalidArgument("--scale must be > 0", field="scale")
    history, unknown = recover.scaled(args.scale, args.history, args.unknown)
    if history < 0:
        raise InvalidArgument("--history must be >= 0", field="history")
    _positive(unknown, "unknown")
    _positive(args.per_run, "per-run")
    _positive(args.limit, "limit")
    _positive(args.setup_workers, "setup-workers")
    return _on_targets(args, "recover", lambda ts, progress: recover.run(
        ts, history=history, unknown=unknown, per_run=args.per_run, limit=args.limit,
        setup_workers=args.setup_workers, progress=progress))


def _retention(args: argparse.Namespace) -> int:
    from benchmarks import retention

    _positive(args.attempts, "attempts")
    _positive(args.months, "months")
    _positive(args.repeat, "repeat")
    return _on_targets(args, "retention", lambda ts, progress: retention.run(
        ts, attempts=args.attempts, months=args.months, repeat=args.repeat,
        progress=progress))


def _select(args: argparse.Namespace) -> int:
    from benchmarks import selector

    _positive(args.iterations, "iterations")
    report_to = _Reporter("select", False)
    report = selector.run(iterations=args.iterations, progress=report_to)
    report_to.finish()
    return _print(report, args.json)


def _audit(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from benchmarks.audit import bench_audit
    from benchmarks.common import MachineProbe
    from ledger.cli.ops_cmd import open_reader, table
    from ledger.ops.audit import Audit

    if args.repeat < 1:
        raise InvalidArgument("--repeat must be >= 1", field="repeat")
    audit = Audit(open_reader(_ledger_db(args)))
    try:
        bar = Progress("bench audit", wanted(args.progress))
        probe = MachineProbe()
        rows = bench_audit(audit, repeat=args.repeat, progress=bar)
        machine = probe.done()
        bar.close()
        backend = audit.ledger.backend
    finally:
        audit.ledger.close()
    if args.json:
        sys.stdout.write(json.dumps({"backend": backend, "machine": asdict(machine),
                                     "results": [
            {"query": r.query, "p50_ms": round(r.p50_ms, 3), "p95_ms": round(r.p95_ms, 3),
             "max_ms": round(r.max_ms, 3), "rows": r.rows, "target_ms": r.target_ms,
             "ok": r.ok, "floor_p50_ms": round(r.floor_p50_ms, 3),
             "x_floor": None if r.ratio is None else round(r.ratio, 2),
             "cpu_ms": round(r.cpu_ms, 3),
             "floor_cpu_ms": round(r.floor_cpu_ms, 3), "statements": r.statements,
             "floor_rows": r.floor_rows}
            for r in rows]}, indent=2) + "\n")
        return 0
    print(f"audit query latency on {backend} (ms over {args.repeat} runs; newest day), beside "
          "the raw driver's replay of the same statements (the floor) and client CPU per read")
    print(table(["QUERY", "P50", "P95", "MAX", "ROWS", "TARGET", "FLOOR", "x FLOOR", "CPU",
                 "FLOOR CPU", "STMTS"],
                [[r.query, f"{r.p50_ms:.2f}", f"{r.p95_ms:.2f}", f"{r.max_ms:.2f}", r.rows,
                  "-" if r.target_ms is None else
                  f"<{r.target_ms:.0f} {'ok' if r.ok else 'MISSED'}",
                  f"{r.floor_p50_ms:.2f}", "-" if r.ratio is None else f"{r.ratio:.2f}",
                  f"{r.cpu_ms:.2f}",
                  f"{r.floor_cpu_ms:.2f}", r.statements] for r in rows]))
    print(machine.describe())
    return 0


def _generate(args: argparse.Namespace) -> int:
    from benchmarks.generate import MAX_ATTEMPTS, POLICY_HASH, generate
    from ledger.api.facade import Ledger
    from ledger.api.face import storage_of
    from ledger.domain.timefmt import iso
    from ledger.storage.audit import AuditQueries

    if args.attempts < 1:
        raise InvalidArgument("--attempts must be >= 1", field="attempts")
    if args.attempts > MAX_ATTEMPTS:
        raise InvalidArgument(
            f"--attempts {args.attempts} is more than {MAX_ATTEMPTS:,}, the most one load "
            f"writes (about 350 GB): pass at most {MAX_ATTEMPTS}, or deepen a smaller history "
            "(python -m benchmarks deepen)", field="attempts")
    if args.days <= 0:
        raise InvalidArgument("--days must be > 0", field="days")
    led = Ledger.open(_ledger_db(args))
    try:
        if not args.into_existing:
            ctx = storage_of(led).context
            other = AuditQueries(ctx).first_run_other_than(policy_hash=POLICY_HASH)
            if other is not None:
                raise InvalidArgument(
                    f"{ctx.where} holds runs that the bulk generator did not write (e.g. "
                    f"{other!r}); synthetic history would mix into their audit answers. Point "
                    "--db at a new database, or pass --into-existing to add it anyway",
                    field="into_existing", run_id=other)
        end = args.end if args.end is not None else time.time()
        bar = Progress("generate", wanted(args.progress))
        t0 = time.monotonic()
        st = generate(led, attempts=args.attempts, days=args.days, end=end, seed=args.seed,
                      progress=bar, frozen_policy=args.frozen_policy)
        bar.close()
        took = time.monotonic() - t0
    finally:
        led.close()
    summary = {"runs": st.runs, "attempts": st.attempts, "failed": st.failed,
               "unknown": st.unknown, "not_sent": st.not_sent, "dispatching": st.dispatching,
               "failovers": st.failovers, "events": st.events, "since": st.since,
               "until": st.until, "seconds": round(took, 2)}
    return _told(summary, args.json,
                 f"generated {st.attempts} attempts in {st.runs} runs ({st.failed} failed, "
                 f"{st.unknown} unknown, {st.not_sent} not sent, {st.dispatching} dispatching; "
                 f"{st.failovers} runs failed over; {st.events} events) from "
                 f"{iso(st.since)} to {iso(st.until)} in {took:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark command; its exit code (2 for bad input, 1 for a failed benchmark)."""
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        rc = int(func(args))
        sys.stdout.flush()
        return rc
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except LedgerError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
