"""``failover-ledger replay``: what another policy would have done over recorded history.

Reads the ledger without migrating or writing it (a read-only role serves), replays every
recorded decision of the Runs admitted in the window under the given policy
(:meth:`ledger.ops.audit.Audit.replay`), and prints the differences grouped, with examples to
open with ``failover-ledger run show``, and the attempts, cost, latency and stops under both
policies. ``--json`` prints the whole report for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ledger.cli.common import PROG
from ledger.cli.ops_cmd import open_reader, parse_time, table
from ledger.domain.timefmt import iso
from ledger.errors import InvalidArgument


def _num(v: float) -> str:
    """A count: whole when it is one, else to one decimal (an expected value)."""
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def _latency(t: Any) -> str:
    return "-" if t.latency_s is None else f"{t.latency_s:.2f} s"


def report_lines(rep: Any, *, examples: int = 1, run: str | None = None,
                 tenant: str | None = None, bounded: bool = False) -> list[str]:
    """The report as an operator reads it (``failover-ledger replay`` prints these lines);
    ``run`` the one Run replayed (``--run``) and ``tenant`` the one tenant (``--tenant``), if
    asked for, and ``bounded`` whether ``--since`` or ``--until`` was given: a report of
    nothing names what kept the Runs out."""
    who = ", ".join(rep.recorded) or "no readable policy"
    # One Run's window is unbounded unless --since/--until bound it: its start is 0, which
    # printed as an admission in 1970.
    over = (f"over {rep.runs} runs admitted {iso(rep.since)} to {iso(rep.until)}" if run is None
            else f"over run {run}")
    lines = [
        f"replay of {rep.policy} ({rep.policy_hash[:19]}) {over}, recorded under {who}",
        f"{rep.decisions} decisions replayed, {rep.differing} decided differently; "
        f"{rep.check.agree} of {rep.check.decisions} recorded decisions recomputed exactly from "
        "their recorded inputs",
    ]
    if rep.check.agree != rep.check.decisions:
        lines.append("  recomputed differently (the record or the code changed since): "
                     + ", ".join(f"{e.run_id} {e.turn_id}" for e in rep.check.disagree))
    b, o = rep.baseline, rep.replayed
    lines += ["", table(["", "RECORDED", rep.policy.upper()], [
        ["turns", _num(b.turns), _num(o.turns)],
        ["served", _num(b.served), _num(o.served)],
        ["stopped", _num(b.stopped), _num(o.stopped)],
        ["open", _num(b.open), _num(o.open)],
        ["attempts", _num(b.attempts), _num(o.attempts)],
        ["cost", f"{b.cost:.6f}", f"{o.cost:.6f}"],
        ["latency (mean a turn)", _latency(b), _latency(o)],
        ["runs stopped", _num(b.runs_stopped), _num(o.runs_stopped)],
    ])]
    lines.append("")
    if not rep.decisions:
        lines.append(f"nothing was replayed: {_why_nothing(rep, run, tenant, bounded)}")
    elif not rep.findings:
        lines.append(f"{rep.policy} decides every replayed decision as recorded")
    else:
        lines.append("differences, largest first:")
        for f in rep.findings:
            lines.append(f"  {f.count:>6}  {f.text}")
            for e in f.examples[:examples]:
                lines.append(f"          e.g. {e.command}  ({e.turn_id}, {iso(e.at)}: "
                             f"{e.recorded} -> {e.replayed})")
    est = rep.estimates
    cost_share = 100 * est.cost / o.cost if o.cost else 0
    lines += ["", (f"estimates: {est.decisions} decisions in {est.runs} runs left the recorded "
                   f"path onto a route not tried then; their outcome is estimated from other "
                   f"Runs' attempts on that route in the window: {100 * est.share:.1f}% of the "
                   f"replayed attempts ({_num(round(est.attempts, 1))}) and {cost_share:.1f}% "
                   f"of its cost ({est.cost:.6f})"
                   + (f"; {est.no_evidence} steps had no evidence (counted open)"
                      if est.no_evidence else ""))]
    cov = rep.coverage
    if cov.decisions_without_inputs or cov.runs_without_policy or cov.malformed:
        lines.append(f"not replayed: {cov.decisions_without_inputs} decisions recorded without "
                     f"their inputs ({cov.turns_without_inputs} turns counted as recorded), "
                     f"{cov.runs_without_policy} runs whose frozen policy does not read, "
                     f"{cov.malformed} unreadable inputs")
    lines += [f"world: {w}" for w in cov.world]
    return lines


def _why_nothing(rep: Any, run: str | None, tenant: str | None, bounded: bool) -> str:
    """Why a report replayed no decision, in the command's words for what it asked
    (``bounded``: --since or --until was given)."""
    if rep.runs:
        return str(rep.not_replayed())
    of = f" for tenant {tenant!r}" if tenant is not None else ""
    if run is not None:
        # --run reads the run whenever it was admitted, unless --since/--until bound it.
        return f"run {run} was not admitted{of}" + (
            " between --since and --until" if bounded else "")
    return f"no run was admitted{of} in the window; widen it with --since and --until"


def _replay(args: argparse.Namespace) -> int:
    from ledger.ops.audit import Audit, to_jsonable

    if args.examples < 0:
        raise InvalidArgument("--examples must be >= 0", field="examples")
    led = open_reader(args.db, getattr(args, "read_url", None))
    try:
        audit = Audit(led)
        now = audit.now()
        since = parse_time(args.since, now, "since")
        until = parse_time(args.until, now, "until")
        rep = audit.replay(args.policy, since=since, until=until, run=args.run,
                           tenant=args.tenant)
    finally:
        led.close()
    if args.json:
        sys.stdout.write(json.dumps(to_jsonable(rep), indent=2, sort_keys=True) + "\n")
        return 0
    bounded = args.since is not None or args.until is not None
    print("\n".join(report_lines(rep, examples=args.examples, run=args.run,
                                  tenant=args.tenant, bounded=bounded)))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``replay`` command."""
    p = subparsers.add_parser(
        "replay", help="what another policy would have done over recorded history",
        description="Replays every recorded decision of the runs admitted in the window under "
        "another policy, on the recorded facts (no provider is called, nothing is written), "
        "and reports where it decides differently, grouped with examples, and the attempts, "
        f"cost, latency and stops under both. See docs/audit.md ({PROG} replay).")
    p.add_argument("--db", default=argparse.SUPPRESS, help="database URL or SQLite path")
    p.add_argument("--read-url", default=argparse.SUPPRESS,
                   help="a read replica to read from (PostgreSQL; default: $LEDGER_READ_URL, "
                   "else --db)")
    p.add_argument("--policy", required=True,
                   help="the policy to replay: a preset (goclaw, fased, failure-domain) or a "
                   "policy file")
    p.add_argument("--since", default=None,
                   help="runs admitted from this time: 24h, 7d, ISO time or epoch (default: a "
                   "day before --until; with --run, any time)")
    p.add_argument("--until", default=None,
                   help="runs admitted before this time (default: now; with --run, any time)")
    p.add_argument("--run", default=None,
                   help="only this run, whenever it was admitted (an unknown id exits 1)")
    p.add_argument("--tenant", default=None, help="only this tenant's runs")
    p.add_argument("--examples", type=int, default=1,
                   help="examples printed per difference (default 1; the JSON holds 3)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.set_defaults(func=_replay)


__all__ = ["register", "report_lines"]
