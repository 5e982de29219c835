"""The Run sessions (Ledger.run / AsyncLedger.run)."""
