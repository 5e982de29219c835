"""The ledger's test suite (run from the repository root: ``python -m pytest -q``)."""
