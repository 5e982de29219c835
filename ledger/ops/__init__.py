"""Operations over a whole ledger: restart-time recovery, reconciliation and the audit API.

The audit includes a replay of recorded history under another policy (:mod:`ledger.ops.replay`).
Each talks to the facade and the storage port, never to a database driver.
"""
