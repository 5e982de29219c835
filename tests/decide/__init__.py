"""The pure core without a database: classification, retries, health, selection, policies."""
