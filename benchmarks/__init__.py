"""The benchmark suite: scripts that measure what users run and report. Not part of the
installed package (the wheel holds ``ledger`` only); run from a checkout of the repository with
``python -m benchmarks COMMAND`` (``--help`` lists them; ``docs/benchmarks.md`` explains every
figure).

* :mod:`~benchmarks.write`: begin+settle attempts/s and client CPU beside the raw-driver floor
  (``python -m benchmarks write``);
* :mod:`~benchmarks.turn`: the whole ``aexecute``/``execute`` path against a local fake
  provider, as overhead over a raw httpx call, with database transactions per call
  (``python -m benchmarks turn``);
* :mod:`~benchmarks.flat`: per-turn cost at the start and the end of a 1,000-turn Run
  (``python -m benchmarks turns-flat``);
* :mod:`~benchmarks.recover`: recovery of many unknown attempts over a long history
  (``python -m benchmarks recover``);
* :mod:`~benchmarks.retention`: a dry run and a real retention over months of generated
  history, and the share of the carried-counter read (``python -m benchmarks retention``);
* :mod:`~benchmarks.selector`: the selector's deep walk and first fit
  (``python -m benchmarks select``);
* :mod:`~benchmarks.audit`: the latency of each audit query on a large ledger
  (``python -m benchmarks audit``), filled by :mod:`~benchmarks.generate`
  (``python -m benchmarks generate``), the fast bulk generator of synthetic history.

They use the public API (``Ledger``, ``AsyncLedger``, ``execute``/``aexecute``, the adapters'
senders, ``recover``, ``select``, the audit), plus what only a benchmark needs, kept here: the
raw-driver floor (:mod:`benchmarks.floor`), the database's own statistics for counting
transactions (:mod:`benchmarks.txcount`), and the bulk loader (:mod:`benchmarks.bulk`), which
writes through the ledger's SQLAlchemy engine and bypasses its write path on purpose.
"""
