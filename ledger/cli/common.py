"""Helpers shared by command modules."""

from __future__ import annotations

from typing import Any

# The command's name. Not "ledger": Debian's ledger-cli installs a command of that name.
PROG = "failover-ledger"


def bench_subparsers(subparsers: Any) -> Any:
    """The sub-commands of ``failover-ledger bench``, created by whichever module registers
    first, so any command module can add ``bench <name>`` in any registration order."""
    bench = subparsers.choices.get("bench")
    if bench is None:
        bench = subparsers.add_parser("bench", help="benchmarks")
        bench.set_defaults(_bench_sub=bench.add_subparsers(
            dest="bench_command", metavar="BENCHMARK", required=True))
    return bench.get_default("_bench_sub")
