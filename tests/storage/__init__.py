"""The storage layer on both backends: the write path, concurrency, idempotency, the schema."""
