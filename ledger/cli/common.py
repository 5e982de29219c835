"""Helpers shared by command modules."""

from __future__ import annotations

# The command's name. Not "ledger": Debian's ledger-cli installs a command of that name.
PROG = "failover-ledger"

