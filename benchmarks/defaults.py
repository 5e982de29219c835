"""The benchmarks' default sizes, importable without the storage stack (the CLI's help reads
them; ``failover-ledger --help`` must stay fast)."""

WRITE_ATTEMPTS = 2000
TURN_CALLS = 800
TURN_COUNT_CALLS = 100
FLAT_TURNS = 1000
FLAT_WINDOW = 20
RECOVER_PER_RUN = 1
RECOVER_LIMIT = 1000  # ledger.ops.recovery.DEFAULT_LIMIT
SELECT_ITERATIONS = 20_000
CEILING_PAIRS = 3000
QUEUE_SESSIONS = 120
QUEUE_TURNS = 3
QUEUE_LIMIT = 4
QUEUE_DELAY_MS = 30.0
