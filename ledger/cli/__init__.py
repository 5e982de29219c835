"""The ``ledger`` command line."""
