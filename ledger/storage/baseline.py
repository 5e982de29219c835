"""The write-path benchmark's baseline: the physical floor of one Attempt on a database.

Per attempt: one single-row INSERT committed, then one single-row UPDATE of that row committed,
through the same engine (same SQLite pragmas, ``BEGIN IMMEDIATE``, same PostgreSQL pool settings)
as the ledger. The table lives outside the ledger's declared schema; the benchmark creates it
before measuring and drops it afterwards.
"""

from __future__ import annotations

from sqlalchemy import Column, Engine, Float, MetaData, String, Table

from ledger.storage.engine import mapped_errors

_metadata = MetaData()

baseline = Table(
    "ledger_bench_baseline",
    _metadata,
    Column("attempt_id", String(200), primary_key=True),
    Column("worker", String(200), nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", Float(precision=53), nullable=False),
    Column("settled_at", Float(precision=53), nullable=True),
)


def create_table(engine: Engine, url: str) -> None:
    """Create the baseline table (dropping any leftover of an interrupted run)."""
    with mapped_errors(url):
        _metadata.drop_all(engine, checkfirst=True)
        _metadata.create_all(engine)


def drop_table(engine: Engine, url: str) -> None:
    with mapped_errors(url):
        _metadata.drop_all(engine, checkfirst=True)


class BaselineWriter:
    """One worker's floor: ``attempt()`` = INSERT + commit, UPDATE + commit."""

    def __init__(self, engine: Engine, url: str, worker: str) -> None:
        self.engine = engine
        self.url = url
        self.worker = worker

    def attempt(self, attempt_id: str, now: float) -> None:
        c = baseline.c
        with mapped_errors(self.url), self.engine.connect() as conn:
            conn = conn.execution_options(ledger_write=True)
            with conn.begin():
                conn.execute(baseline.insert().values(
                    attempt_id=attempt_id, worker=self.worker, state="dispatching",
                    created_at=now,
                ))
            with conn.begin():
                conn.execute(baseline.update().where(c.attempt_id == attempt_id)
                             .values(state="succeeded", settled_at=now))
