"""The read-only provider-health dashboard (``failover-ledger dashboard``; needs the
``dashboard`` extra).

One server-rendered page, no build step, no network: inline CSS and an inline SVG chart. It
reads through :class:`ledger.ops.audit.Audit` and never writes, so a read-only database role is
enough. It shows credential profile *ids* only; secrets are never stored in the ledger at all.
"""
