"""Entry point of the ``failover-ledger`` command (also ``python -m ledger``).

Start-up is kept short (``--help`` and argument parsing well under 0.3 s): this module and the
command modules import only the standard library and :mod:`ledger.errors` at the top; SQLAlchemy,
httpx and the pydantic models are imported inside the command functions that use them.

Each command module exposes ``register(subparsers)``, adding its sub-commands with
``set_defaults(func=...)``; ``func(args) -> int`` returns the exit code. Errors derived from
:class:`ledger.errors.LedgerError` become one clear line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import sys
from collections.abc import Sequence

from ledger import __version__
from ledger.cli.common import PROG
from ledger.errors import ConfigError, InvalidArgument, LedgerError, SchemaTooNew

DEFAULT_DB = "ledger.db"

# Command modules, each with register(subparsers).
COMMAND_MODULES: list[str] = [
    "ledger.cli.demo_cmd",
    "ledger.cli.policy_cmd",
    "ledger.cli.ops_cmd",
    "ledger.cli.recover_cmd",
    "ledger.cli.db_cmd",
    "ledger.cli.replay_cmd",
]


def default_db_url() -> str:
    """``LEDGER_URL`` or the embedded SQLite file in the working folder."""
    return os.environ.get("LEDGER_URL") or DEFAULT_DB


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser: global options and every command module's sub-commands."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="The run/attempt ledger for safe LLM model failover."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "--db",
        default=None,
        help=f"database URL or SQLite path (default: $LEDGER_URL or ./{DEFAULT_DB})",
    )
    parser.add_argument(
        "--read-url",
        default=None,
        help="a read replica of the database (PostgreSQL) for the reports and the dashboard: "
        "they read there, every write goes to --db (default: $LEDGER_READ_URL, else --db)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (2 for bad input and set-up problems: no
    ledger at ``--db``, a schema older or newer than the package; 1 for other ledger errors).

    Without ``argv`` it is the program (``failover-ledger``, ``python -m ledger``): the
    process ends when it returns, so what the command loaded is left for the operating
    system to reclaim (:func:`_program_exit`) rather than freed object by object.
    """
    if argv is None:
        try:
            return _command(None)
        finally:
            _program_exit()
    frozen = gc.get_freeze_count()
    try:
        return _command(argv)
    finally:
        if not frozen:
            # A reporting command freezes what it loads (ledger.cli.ops_cmd._loading): the
            # caller's collector gets it back.
            gc.unfreeze()


def _program_exit() -> None:
    # gc.freeze() puts every object the collector tracks out of its reach: the interpreter's
    # exit then neither walks nor frees the ~60,000 objects a command loads (classes,
    # functions, SQLAlchemy's and pydantic's tables), about 0.2 s of a 0.5 s reporting
    # command. Nothing runs after this but the exit; what a command opens it closes itself.
    gc.freeze()


#: The options whose value is an age, a span or a time: "-1d" after one is its (bad) value,
#: which argparse would take for an unknown option and answer "expected one argument".
SIGNED_VALUE_OPTIONS = ("--older-than", "--since", "--until", "--lag", "--fold-after",
                        "--every")
_SIGNED = re.compile(r"-[0-9.]")


def _signed_values(argv: Sequence[str]) -> list[str]:
    """``--older-than -1d`` as ``--older-than=-1d``: the value reaches the option's own check,
    which says the range (argparse reads a bare ``-1`` as a number, not ``-1d``)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg in SIGNED_VALUE_OPTIONS and i + 1 < len(argv) and _SIGNED.match(argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


# The library's argument names that a command's flag spells otherwise.
_FLAG_OF = {"lease_ttl_s": "ttl"}


def _options_of(parser: argparse.ArgumentParser, func: object) -> dict[str, str]:
    """The command's own arguments by destination as its usage line names them (``ttl`` ->
    ``--ttl``, ``run_id`` -> ``RUN_ID``): those of the (sub)parser whose command is
    ``func``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if sub.get_default("func") is func:
                    return {a.dest: a.option_strings[-1] if a.option_strings
                            else str(a.metavar or a.dest.upper()) for a in sub._actions
                            if a.dest != argparse.SUPPRESS}
                found = _options_of(sub, func)
                if found:
                    return found
    return {}


def _in_flag_words(e: Exception, args: argparse.Namespace,
                   parser: argparse.ArgumentParser) -> str:
    """The error as the command line reads it: the library's ``invalid lease_ttl_s: ...``
    of a value the command passed from a flag says ``--ttl ...``, and its ``read_url: ...``
    and ``read_url must be ...`` say ``--read-url: ...`` and ``--read-url must be ...``."""
    text = str(e)
    field = getattr(e, "field", None)
    if not isinstance(e, InvalidArgument) or not field:
        return text
    if text.startswith(f"invalid {field}: "):
        flag = _options_of(parser, getattr(args, "func", None)).get(_FLAG_OF.get(field, field))
        if flag is not None:
            return f"{flag} {text[len(f'invalid {field}: '):]}"
        return text
    # A URL's refusal leads with the library's keyword instead (the URL as a whole cannot be
    # used). Only the global options' (whose value the library takes as given, whether from
    # the flag or from $LEDGER_READ_URL): a command's own flag may lead a sentence that goes on
    # in the library's other keywords ("since ... must be before until ...").
    flag = {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings
            }.get(field)
    if flag is not None and text.startswith(field) and text[len(field):][:1] in (":", " "):
        return flag + text[len(field):]
    return text


def _command(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(_signed_values(sys.argv[1:] if argv is None else argv))
    if getattr(args, "db", None) is None:
        args.db = default_db_url()
    if getattr(args, "read_url", None) is None:
        args.read_url = os.environ.get("LEDGER_READ_URL") or None
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        rc = int(func(args))
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at exit
        return rc
    except (ConfigError, SchemaTooNew) as e:
        # A schema newer than the package is a set-up problem like an older one (exit 2, not
        # 1 as for a server away): retrying will not help, upgrading the package will.
        print(f"{PROG}: error: {_in_flag_words(e, args, parser)}", file=sys.stderr)
        return 2
    except LedgerError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into a pager or `head` that closed early: not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
