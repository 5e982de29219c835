"""The facade and the turn drivers.

:class:`~ledger.api.facade.Ledger` and :class:`~ledger.api.facade.AsyncLedger`, the Run session,
``execute``/``aexecute`` and the lease keeper.

Arguments are checked here; decisions are made by :mod:`ledger.decide` and written through the
storage port. Import the public names from :mod:`ledger` itself.
"""
