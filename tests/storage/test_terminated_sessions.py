"""Sessions the server terminates at random: no write is told unwritten that was written.

Run sessions (entry, one turn, exit) go on one after another while another session runs
``pg_terminate_backend`` on the ledger's connections every few milliseconds, as an operator's
script, a connection pooler or a failover manager may. A backend terminated around a
``COMMIT`` can end it either way, and psycopg may report it before it has seen the connection
close (today as ``cannot exit pipeline mode while busy``, or as the ``FATAL`` itself; nothing
here depends on the wording): the ledger must
treat every such outcome as unknown and resolve it under the Run's row lock, never tell it
``landed=False`` unread. Once the database answers again (the terminations stop, the ledger
closes):

* every Attempt whose request never reached the provider ends ``not_sent`` (or ``rejected``)
  with its hold voided and its capacity slot free — not ``dispatching`` with both kept, which
  recovery would later record ``unknown``, a false "sent without receipt";
* every Run whose lease acquisition was told ``landed=False`` holds no lease.

The deterministic form of the race (the terminate landing between the server's ``COMMIT`` and
its ``ReadyForQuery``) is in ``test_lost_acknowledgement.py``; this one is its randomized
companion, bounded to a few seconds.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from collections.abc import Iterable
from decimal import Decimal

import pytest

from ledger import Budget, Envelope, Grant, Ledger, Part
from ledger.adapters import ATTEMPT_HEADER
from ledger.domain.records import AttemptState, DebitState
from ledger.errors import DatabaseUnavailable, NotFound
from ledger.testing import FakeProvider
from ledger.testing.pgserver import PgServer
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

RUNS = 120
APP = "terminated-sessions"
BUDGET = Budget(max_calls=4, max_retries=2, max_cost=Decimal(1))
GRANT = Grant(recipients={"fake": ["user_input"]})
TTL_S = 600.0  # never lapses during the test: only the resolution may end what was left
_names = itertools.count()


@pytest.fixture
def db(pg_server: PgServer) -> str:
    name = f"term_{os.getpid()}_{next(_names)}"
    pg_server.create_database(name, template="ledger_template")
    return name


def _terminator(server: PgServer, db: str, stop: threading.Event, seed: int) -> None:
    """End the ledger's sessions every 5 to 30 ms until ``stop`` (a pace, not a clock: no
    decision of the ledger reads the time that passes here)."""
    import psycopg

    rnd = random.Random(seed)
    with psycopg.connect(f"host=127.0.0.1 port={server.port} dbname={db} user=postgres",
                         autocommit=True) as conn:
        while not stop.wait(rnd.uniform(0.005, 0.03)):
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE application_name = %s", (APP,))


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sessions_terminated_at_random_leave_no_written_begin_or_lease_told_unwritten(
    pg_server: PgServer, db: str, fake: FakeProvider
) -> None:
    url = pg_server.url(db) + f"?application_name={APP}"
    env = Envelope(parts=[Part(content="Compare the filings.")])
    routes = plan(fake)
    told_not_taken: list[str] = []
    errors: list[DatabaseUnavailable] = []
    led = Ledger.open(url, migrate_schema=False)
    try:
        stop = threading.Event()
        seed = int(os.environ.get("LEDGER_TERMINATE_SEED", "7"))
        killer = threading.Thread(target=_terminator, args=(pg_server, db, stop, seed),
                                  daemon=True, name="terminator")
        killer.start()
        try:
            for i in range(RUNS):
                try:
                    with led.run(f"r-{i}", plan=routes, budget=BUDGET, grant=GRANT,
                                 lease_ttl_s=TTL_S) as run:
                        run.turn(env)
                except DatabaseUnavailable as e:
                    errors.append(e)
                    fields = e.fields
                    if fields.get("operation") == "acquire" and fields.get("landed") is False:
                        told_not_taken.append(f"r-{i}")
        finally:
            stop.set()
            killer.join(30)
    finally:
        led.close()  # the database answers again: what was left unresolved is written now
    assert errors, "no session was terminated: the test proves nothing"
    sent = {r.headers.get(ATTEMPT_HEADER.lower(), "") for r in fake.requests}
    with Ledger.open(pg_server.url(db), migrate_schema=False) as books:
        never_sent = []
        for i in range(RUNS):
            for att in books.timeline(f"r-{i}") if _admitted(books, f"r-{i}") else []:
                if att.attempt_id not in sent:
                    never_sent.append((att.attempt_id, att.state, att.debit_state))
        wrong = [a for a in never_sent
                 if a[1] not in (AttemptState.NOT_SENT, AttemptState.REJECTED)
                 or a[2] is not DebitState.VOIDED]
        assert wrong == [], f"never sent, yet not ended not_sent with its hold voided: {wrong}"
        held = {r: books.get_run(r).lease_holder for r in told_not_taken}
        assert all(h is None for h in held.values()), (
            f"an acquire told landed=False holds the lease: {held}")
        slots = pg_server.psql("SELECT count(*) FROM group_slots WHERE attempt_id IN "
                               f"({_listed(a for a, _s, _d in never_sent)})", db=db)
        assert int(slots) == 0, "a never-sent Attempt still holds its capacity slot"


def _admitted(led: Ledger, run_id: str) -> bool:
    try:
        led.get_run(run_id)
    except NotFound:
        return False
    return True


def _listed(ids: Iterable[str]) -> str:
    return ", ".join(f"'{i}'" for i in ids) or "NULL"
