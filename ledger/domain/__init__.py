"""The domain: values only, and the rules that keep them valid.

Routes, grants, budgets, failure facts, envelopes and parts, the records the ledger returns, the
specs of its writes, documented bounds, hashing.

Imports nothing of the package above :mod:`ledger.errors` and :mod:`ledger.redaction`; every
other room imports it.
"""
