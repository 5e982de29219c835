"""Helpers shared by command modules."""

from __future__ import annotations

from typing import Any

# The command's name. Not "ledger": Debian's ledger-cli installs a command of that name.
PROG = "failover-ledger"



def operator_name() -> str:
    """Who acts, for an operator's command that records it: ``user@host``."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment (a bare container)
        user = "operator"
    return f"{user}@{socket.gethostname()}"


def add_who_and_why(p: Any, why: str, *aliases: str, default: str | None = None) -> None:
    """``--by`` (default ``user@host``) and ``--reason`` (also spelled ``aliases``) for a
    command that acts; the reason is required unless the command has a ``default`` one."""
    if default is None:
        p.add_argument("--reason", *aliases, dest="reason", required=True, metavar="TEXT",
                       help=f"why (required, kept with the action for the audit): {why}")
    else:
        p.add_argument("--reason", *aliases, dest="reason", default=default, metavar="TEXT",
                       help=f"why, kept with the action for the audit (default: {default}): "
                       f"{why}")
    p.add_argument("--by", default=None, metavar="WHO",
                   help="who acts, kept with the action (default: the operating-system "
                   "user@host)")
