"""``failover-ledger demo``: the failover scenarios of the brief against local fake providers.

A demo writes into a new database or one holding only earlier demo runs, which it keeps (see
:func:`ledger.tools.demo.demo_ledger`), so it can be re-run on the same ledger and tells the same
story every time, in runs of its own.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ledger.cli.common import PROG


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run a small research task against local fake providers "
                       "(into a new ledger or one holding only earlier demo runs, which stay; "
                       "refuses other history)")
    p.add_argument("--db", default=argparse.SUPPRESS, help="the ledger file to write")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from ledger.cli.main import default_db_url
    from ledger.tools.demo import run_demo

    ids = run_demo(args.db, sys.stdout)
    # Quoted, so the line can be pasted into a shell whatever the file is called.
    db = "" if args.db == default_db_url() else f" --db {shlex.quote(args.db)}"
    print(f"\nwritten to {args.db}; inspect with: {PROG}{db} run show {ids[-1]}")
    return 0
