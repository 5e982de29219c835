"""``ledger demo``: the failover scenarios of the brief against local fake providers."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run a small research task against local fake providers")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from ledger.demo import run_demo

    ids = run_demo(args.db, sys.stdout)
    print(f"\nwritten to {args.db}; inspect with: ledger run show {ids[-1]}")
    return 0
