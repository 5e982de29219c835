"""``python -m ledger``: the same command line as ``failover-ledger``."""

from __future__ import annotations

from ledger.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
