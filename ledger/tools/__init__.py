"""Developer tools kept apart from the library's face: the benchmarks (``failover-ledger bench``),
the synthetic history generator (``failover-ledger generate``) and the demo.

Nothing in the library imports this package; only the command line does, on demand.
"""
