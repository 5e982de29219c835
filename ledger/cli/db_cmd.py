"""``failover-ledger db init [URL]``: create the database (when missing and the role may) and
the ledger's schema, idempotently (:func:`ledger.storage.provision.init_database`).

The ledger modules are imported inside the command (the parser is built on every start-up).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ledger.cli.common import PROG


def register(subparsers: Any) -> None:
    db = subparsers.add_parser("db", help=f"set a database up for the ledger: {PROG} db init URL")
    db_sub = db.add_subparsers(dest="db_command", metavar="SUBCOMMAND", required=True)
    p = db_sub.add_parser(
        "init", help="create the database if missing (when the role may) and its schema",
        description="Create the ledger's schema at URL (migrate it to the current revision). "
        "A SQLite file is created; a PostgreSQL database that does not exist is created first "
        "when the URL's role may create databases (CREATEDB), through the server's 'postgres' "
        "maintenance database with the same credentials; otherwise the error names the "
        "command an administrator runs. Safe to run again: it says what it found and did. "
        "See docs/postgresql.md.")
    p.add_argument("url", nargs="?", default=None, metavar="URL",
                   help="a SQLite path or postgresql+psycopg://user:password@host:port/dbname "
                   "(default: --db, $LEDGER_URL or ./ledger.db)")
    p.add_argument("--db", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    from ledger.storage.provision import init_database

    rep = init_database(args.url if args.url is not None else args.db)
    if args.json:
        sys.stdout.write(json.dumps(rep.to_json(), indent=2, sort_keys=True) + "\n")
        return 0
    what = "file" if rep.backend == "sqlite" else "database"
    print(f"created {what} {rep.database}" if rep.created_database
          else f"{what} {rep.database} exists", f"({rep.url})")
    print({
        "created": f"created the ledger schema (revision {rep.revision})",
        "upgraded": f"upgraded the schema from revision {rep.revision_before} to "
                    f"{rep.revision}",
        "current": f"the schema is already at the ledger's revision {rep.revision}: "
                   "nothing to do",
    }[rep.schema])
    return 0
