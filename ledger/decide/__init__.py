"""The pure core: classification, backoff, health, selection, preflight. No I/O here."""
