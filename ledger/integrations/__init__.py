"""Integrations with agent frameworks, each behind its own optional extra.

- :mod:`ledger.integrations.pydantic_ai`: ``LedgerModel``, a pydantic-ai ``Model`` backed by a
  ledger Run (``pip install 'failover-ledger[pydantic-ai]'``).
"""
