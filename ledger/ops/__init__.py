"""Operations over a whole ledger: restart-time recovery, reconciliation and the audit API.

Each talks to the facade and the storage port, never to a database driver.
"""
