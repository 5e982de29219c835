"""Tools beside the library's face, run from the command line: the demo (``failover-ledger
demo``) and the history generator (``failover-ledger generate``), both running Runs through the
public API.

Nothing in the library imports this package; only the command line does, on demand. The
benchmarks are not here: they live in ``benchmarks/`` at the root of the repository, outside the
wheel (``python -m benchmarks``).
"""
