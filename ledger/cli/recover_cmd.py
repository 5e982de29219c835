"""``failover-ledger recover``: take over runs whose executor lease expired; ``reconcile``.

The ledger modules are imported inside the commands (the parser is built on every start-up).
``--ttl``, ``--limit`` and ``--batch`` default to ``None``, meaning
:func:`ledger.ops.recovery.recover`'s own defaults, which the help text names.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from ledger.cli.common import PROG, add_who_and_why, operator_name
from ledger.cli.progress import Progress, wanted

# Shown in --help; tests/recovery/test_cli.py holds them equal to ledger.ops.recovery's defaults.
HELP_TTL_S = 30.0
HELP_LIMIT = 1000
HELP_BATCH = 100


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "recover",
        help="fence dead executors; mark what was sent without receipt unknown",
        description="Take over every run whose executor lease expired: bump its fence, mark "
        "dispatching attempts unknown (they keep their hold and are never re-sent), release "
        "the dead executor's capacity slots. Safe to run repeatedly and from several hosts.",
    )
    p.add_argument("--executor", default=None, help="executor id to take the runs over as")
    p.add_argument("--ttl", type=float, default=None,
                   help=f"lease time-to-live for the taken-over runs, seconds "
                   f"(default {HELP_TTL_S:g})")
    p.add_argument("--limit", type=int, default=None,
                   help=f"at most this many runs (default {HELP_LIMIT})")
    p.add_argument("--batch", type=int, default=None,
                   help=f"runs taken over per transaction (default {HELP_BATCH})")
    p.add_argument("--keep-lease", action="store_true",
                   help="keep the new lease (default: release it so a host can acquire the run)")
    p.add_argument("--run", action="append", dest="runs", metavar="RUN_ID",
                   help="only this run (repeatable)")
    p.add_argument("--close-past-deadline", action="store_true",
                   help="then close (failed) every unfinished run past its deadline that no "
                   "live executor holds, under a fresh fence, with a close event")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--progress", action="store_true", help="show progress even when piped")
    p.add_argument("--db", default=argparse.SUPPRESS, help="database URL or SQLite path")
    p.set_defaults(func=_recover)

    att = subparsers.add_parser("attempt", help=f"one attempt: {PROG} attempt settle ID ...")
    att_sub = att.add_subparsers(dest="attempt_command", metavar="SUBCOMMAND", required=True)
    st = att_sub.add_parser(
        "settle", help="settle an unknown attempt with evidence (a late receipt)",
        description="Record what is known of an attempt whose outcome is unknown (sent, no "
        "receipt), e.g. from the provider's usage console: its state moves from unknown to "
        "--outcome once, its hold is posted (the evidenced cost, the rest released) or voided "
        "(not_sent), and a late_receipt event keeps who (--by), what and why (--reason, "
        "required). Only an unknown attempt is accepted; no lease is needed.")
    # Python 3.13's rule for a value that only looks like an option: "-1,2" is a value, so
    # --usage -1,2 reaches the check that says what is wrong with it (3.11 and 3.12 take it
    # for an unknown option and say only "expected one argument").
    st._negative_number_matcher = re.compile(r"^-\.?\d")
    st.add_argument("attempt_id", metavar="ID")
    st.add_argument("--outcome", required=True, choices=["succeeded", "failed", "not_sent"],
                    help="what the evidence shows")
    st.add_argument("--usage", metavar="PROMPT,COMPLETION",
                    help="the tokens billed, e.g. 812,240 (or --prompt-tokens and "
                    "--completion-tokens)")
    st.add_argument("--prompt-tokens", type=int, default=None)
    st.add_argument("--completion-tokens", type=int, default=None)
    st.add_argument("--cost", default=None,
                    help="what it cost (default: the usage at the route's frozen price; with "
                    "no usage either, the whole hold)")
    add_who_and_why(st, "the evidence (a console link, a ticket); --note is the same option",
                    "--note")
    st.add_argument("--json", action="store_true", help="print the settled attempt as JSON")
    st.add_argument("--db", default=argparse.SUPPRESS, help="database URL or SQLite path")
    st.set_defaults(func=_attempt_settle)

    c = subparsers.add_parser("reconcile", help="check every stored invariant over the ledger")
    c.add_argument("--json", action="store_true", help="print the figures as JSON")
    c.add_argument("--db", default=argparse.SUPPRESS, help="database URL or SQLite path")
    c.set_defaults(func=_reconcile)


def _recover(args: argparse.Namespace) -> int:
    from ledger.cli.ops_cmd import open_writer
    from ledger.ops.recovery import DEFAULT_BATCH, DEFAULT_LIMIT, DEFAULT_RECOVERY_TTL_S, recover

    bar = Progress("recover", wanted(args.progress))
    # An existing ledger: a wrong --db must not make a new, empty one that "needs nothing".
    with open_writer(args.db) as led:
        _known(led, args.runs or [])
        rep = recover(led, executor_id=args.executor,
                      lease_ttl_s=DEFAULT_RECOVERY_TTL_S if args.ttl is None else args.ttl,
                      limit=DEFAULT_LIMIT if args.limit is None else args.limit,
                      batch=DEFAULT_BATCH if args.batch is None else args.batch,
                      release=not args.keep_lease, run_ids=args.runs, progress=bar,
                      close_past_deadline=args.close_past_deadline)
    bar.close()
    if args.json:
        sys.stdout.write(json.dumps(rep.to_json(), indent=2) + "\n")
        return 0
    print(f"recovered {len(rep.runs)} run(s), {rep.unknown_attempts} attempt(s) newly unknown"
          + (f", skipped {len(rep.skipped)} (locked by another session's transaction, or "
             "taken or renewed meanwhile; the next pass tries again)" if rep.skipped else ""))
    for r in rep.runs:
        print(f"  {r.run_id}: fence {r.previous_fence} -> {r.fence} (was {r.previous_executor})"
              f", continue on {r.route}, settled {len(r.settled)}, unknown {len(r.unknown)}")
        for a in r.unknown:
            print(f"    unknown {a.attempt_id} turn {a.turn_id} route {a.route_id} "
                  f"hold {a.reserved}")
    for run_id, ids in rep.orphans.items():
        print(f"  {run_id}: {len(ids)} orphan(s) newly unknown, the run left to its current "
              f"executor: {', '.join(ids)}")
    if args.close_past_deadline:
        print(f"closed {len(rep.closed)} run(s) past their deadline (failed)"
              + (": " + ", ".join(rep.closed) if rep.closed else ""))
    return 0


def _known(led: Any, run_ids: list[str]) -> None:
    """Refuse ``--run`` ids no Run has: a typo would read as a Run that needed nothing."""
    from ledger.errors import NotFound

    unknown = []
    for run_id in dict.fromkeys(run_ids):
        try:
            led.get_run(run_id)
        except NotFound:
            unknown.append(run_id)
    if unknown:
        raise NotFound(f"unknown run id(s) {', '.join(map(repr, unknown))}; nothing was "
                       f"recovered: check the --run ids (list runs with `{PROG} runs`)",
                       run_ids=unknown)


def _reconcile(args: argparse.Namespace) -> int:
    from ledger.cli.ops_cmd import open_reader
    from ledger.ops.reconcile import reconcile

    # An existing ledger, read as it is: a wrong --db must not pass as a clean, empty one.
    with open_reader(args.db) as led:
        res = reconcile(led)
    if args.json:
        sys.stdout.write(json.dumps(res.to_json(), indent=2) + "\n")
    else:
        print(res.summary())
        for v in res.violations:
            print(f"  violation: {v}")
        for c in res.cost_over_hold:
            print(f"  cost_over_hold: {c}")
        for t in res.tokens_over_hold:
            print(f"  tokens_over_hold: {t}")
    return 0 if res.ok else 1


def _usage(args: argparse.Namespace) -> tuple[int | None, int | None]:
    from ledger.errors import InvalidArgument

    if args.outcome == "not_sent":
        # Said here, by the flags given: the library's refusal names its keywords
        # (prompt_tokens), which this command spells --usage or --prompt-tokens.
        given = [flag for flag, value in (
            ("--usage", args.usage), ("--prompt-tokens", args.prompt_tokens),
            ("--completion-tokens", args.completion_tokens), ("--cost", args.cost))
            if value is not None]
        if given:
            raise InvalidArgument(
                f"{' and '.join(given)} given with --outcome not_sent: a request that never "
                "ran used and cost nothing; drop it, or settle as succeeded or failed",
                field=given[0].removeprefix("--").replace("-", "_"))
    if args.usage is None:
        return args.prompt_tokens, args.completion_tokens
    if args.prompt_tokens is not None or args.completion_tokens is not None:
        raise InvalidArgument("--usage is --prompt-tokens and --completion-tokens in one; pass "
                              "one form, not both", field="usage")
    parts = args.usage.split(",")
    try:
        if len(parts) != 2:
            raise ValueError(args.usage)
        prompt, completion = int(parts[0]), int(parts[1])
    except ValueError:
        raise InvalidArgument(f"--usage {args.usage!r} is not PROMPT,COMPLETION; pass two "
                              "token counts such as 812,240", field="usage") from None
    if prompt < 0 or completion < 0:
        raise InvalidArgument(f"--usage {args.usage!r} has a negative token count; pass the "
                              "counts the provider billed, such as 812,240", field="usage")
    return prompt, completion


def _attempt_settle(args: argparse.Namespace) -> int:
    from ledger.cli.ops_cmd import open_reader
    from ledger.ops.audit import to_jsonable

    prompt, completion = _usage(args)
    by = operator_name() if args.by is None else args.by
    led = open_reader(args.db)  # an existing ledger: nothing is created or migrated
    try:
        before = led.get_attempt(args.attempt_id)
        att = led.settle_unknown(args.attempt_id, outcome=args.outcome, prompt_tokens=prompt,
                                 completion_tokens=completion, cost=args.cost, note=args.reason,
                                 by=by)
        run = led.get_run(att.run_id)
        debit = led.debit(att.debit_id)
    finally:
        led.close()
    if args.json:
        sys.stdout.write(json.dumps(to_jsonable(att), indent=2, sort_keys=True) + "\n")
        return 0
    print(f"attempt {att.attempt_id} of run {att.run_id}: {before.state.value} -> "
          f"{att.state.value}; debit {debit.state.value}, posted {debit.posted} of the hold "
          f"{debit.reserved}")
    print(f"run {run.run_id}: charged {run.posted}, held {run.reserved}")
    return 0
