"""The ledger's test suite.

Run from the repository root: ``python -m pytest -q -n auto --dist loadfile``.
"""
