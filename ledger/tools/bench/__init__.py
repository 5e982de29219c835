"""The benchmark suite behind ``failover-ledger bench``: scripts that measure what users run
and report.

* :mod:`~ledger.tools.bench.write`: begin+settle attempts/s and client CPU beside the raw-driver
  floor (``failover-ledger bench write``);
* :mod:`~ledger.tools.bench.turn`: the whole ``aexecute``/``execute`` path against a local fake
  provider, as overhead over a raw httpx call, with database transactions per call
  (``failover-ledger bench turn``);
* :mod:`~ledger.tools.bench.flat`: per-turn cost at the start and the end of a 1,000-turn Run
  (``failover-ledger bench turns-flat``);
* :mod:`~ledger.tools.bench.recover`: recovery of many unknown attempts over a long history
  (``failover-ledger bench recover``);
* :mod:`~ledger.tools.bench.selector`: the selector's deep walk and first fit
  (``failover-ledger bench select``).

They use the public API only (``Ledger``, ``AsyncLedger``, ``execute``/``aexecute``, the
adapters' senders, ``recover``, ``select``), plus the raw drivers for the floor
(:mod:`ledger.storage.baseline`) and the database's own statistics for counting transactions
(:mod:`ledger.tools.bench.txcount`). ``docs/benchmarks.md`` explains every figure.
"""
