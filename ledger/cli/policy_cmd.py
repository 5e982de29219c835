"""``failover-ledger policy``: print the policy JSON schema, check a policy file, show a resolved
policy, export a preset's file to start one's own from."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ledger.cli.common import PROG
from ledger.errors import PolicyError
from ledger.policy import PRESETS


class _NoDatabase(argparse.Action):
    """``--db`` after a policy command, which opens no database: every other command takes
    ``--db`` there, so an operator's habit meets a refusal that says why, not argparse's
    "unrecognized arguments" (and not an option taken and then ignored)."""

    def __call__(self, parser: argparse.ArgumentParser, _namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: '{parser.prog.removeprefix(PROG + ' ')}' works on "
                     "policy files alone and opens no database; drop --db (replay --policy "
                     "FILE --db URL runs a policy over a ledger's history)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "policy", help="policy files: schema, check, show, export (no database)",
        description="Work on policy files alone: no policy command opens a database, so none "
        "takes --db (replay --policy FILE runs a policy over a ledger's history).")
    sub = p.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", required=True)

    schema = sub.add_parser("schema", help="print the JSON schema of a policy file")
    schema.set_defaults(func=_schema)

    check = sub.add_parser("check", help="validate policy files (or preset names)")
    check.add_argument("files", nargs="+", metavar="FILE", help=f"a path, or {', '.join(PRESETS)}")
    check.set_defaults(func=_check)

    show = sub.add_parser("show", help="print a policy as resolved JSON, with its hash")
    show.add_argument("file", metavar="FILE", help=f"a path, or {', '.join(PRESETS)}")
    show.set_defaults(func=_show)

    export = sub.add_parser(
        "export", help="print a preset's file as shipped, comments included, to edit a copy of")
    export.add_argument("preset", metavar="PRESET", choices=list(PRESETS),
                        help=", ".join(PRESETS))
    export.set_defaults(func=_export)
    for command in (schema, check, show, export):
        # nargs="?": a bare --db is told the same, not "expected one argument".
        command.add_argument("--db", nargs="?", action=_NoDatabase, help=argparse.SUPPRESS)


def schema_text() -> str:
    """The schema exactly as published in ``docs/policy.schema.json``."""
    from ledger.policy.load import policy_json_schema

    return json.dumps(policy_json_schema(), indent=2, sort_keys=True) + "\n"


def _schema(args: argparse.Namespace) -> int:
    sys.stdout.write(schema_text())
    return 0


def _report(e: PolicyError, source: str) -> None:
    if e.file is None:
        # The loader read no file: the source named no preset and no file (or was empty).
        print(f"{PROG}: error: {source!r} is neither a preset nor a policy file",
              file=sys.stderr)
    else:
        print(f"{PROG}: error: policy {e.file} is invalid", file=sys.stderr)
        print(f"  file: {e.file}", file=sys.stderr)
    for field, problem, fix in e.errors:
        print(f"  field: {field}", file=sys.stderr)
        print(f"    problem: {problem}", file=sys.stderr)
        print(f"    fix: {fix}", file=sys.stderr)
    if not e.errors:
        print(f"  {e}", file=sys.stderr)


def _check(args: argparse.Namespace) -> int:
    from ledger.policy.load import load_policy, policy_hash

    status = 0
    for source in args.files:
        try:
            policy = load_policy(source)
        except PolicyError as e:
            _report(e, source)
            status = 2
            continue
        print(f"ok: {policy.name} {policy_hash(policy)}")
    return status


def _show(args: argparse.Namespace) -> int:
    from ledger.policy.load import load_policy, policy_hash

    try:
        policy = load_policy(args.file)
    except PolicyError as e:
        _report(e, args.file)
        return 2
    out = {"hash": policy_hash(policy), "policy": policy.model_dump(mode="json")}
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


def _export(args: argparse.Namespace) -> int:
    # The file itself, not the resolved JSON: its comments say why each value is what it is,
    # and an installed wheel keeps the presets where a user would not look for them.
    from ledger.policy.load import preset_path

    try:
        path = preset_path(args.preset)
    except PolicyError as e:
        _report(e, args.preset)
        return 2
    sys.stdout.write(path.read_text(encoding="utf-8"))
    return 0
