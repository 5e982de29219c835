"""A synchronous standby that stops acknowledging: commits wait, and nothing is sent meanwhile.

With ``synchronous_commit=on`` and the standby named in ``synchronous_standby_names``, the
primary acknowledges a ``COMMIT`` only once the standby has it. Here the standby's WAL receiver
is frozen (``SIGSTOP``): it stays connected and says nothing, as a standby on a hung host or a
stalled network does. A turn begun then waits in its begin's ``COMMIT`` (the server shows it
waiting in ``SyncRep``); the ledger never cancels a ``COMMIT`` and sends only once its begin is
acknowledged, so the provider receives nothing while it waits. Once the standby answers again
(``SIGCONT``) the turn goes on by itself: one request, one Attempt, settled, on both servers.
Blocking and asyncio; the operator's remedies are in docs/high-availability.md.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from decimal import Decimal
from typing import Any

import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Ledger, Part
from ledger.adapters import (
    ATTEMPT_HEADER,
    HttpAdapter,
    SyncAdapter,
    async_sender,
    sync_sender,
)
from ledger.api.face import storage_of
from ledger.api.turn import aexecute, execute
from ledger.decide.turn import RunResult
from ledger.domain.records import AttemptState, DebitState
from ledger.testing import FakeProvider
from ledger.testing.pgserver import PgServer
from tests.fakeplan import plan

from ._fleet import LIMITS
from ._standby import caught_up

pytestmark = pytest.mark.postgres

BUDGET = Budget(max_calls=4, max_retries=2, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
DEADLINE_S = 60.0


class _NoWait:
    def sleep(self, seconds: float) -> None:
        pass

    async def asleep(self, seconds: float) -> None:
        pass


def _waiting_in_syncrep(primary: PgServer) -> int:
    """Sessions of the ledger's database whose commit waits for the standby."""
    return int(primary.psql("SELECT count(*) FROM pg_stat_activity WHERE datname = 'ha' "
                            "AND wait_event = 'SyncRep'"))


def _until(what: str, cond: Any) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {DEADLINE_S:.0f} s")
        time.sleep(0.02)  # polling the server, not waiting for time to pass


# A statement timeout of the role or the URL does not end a commit's wait for the standby
# (PostgreSQL stops the statement's timer before the commit): the wait outlasts it.
TIMEOUT = "?options=-c%20statement_timeout%3D500"


@pytest.mark.parametrize(("mode", "options"), [
    ("sync", ""), ("async", ""), ("sync", TIMEOUT)], ids=["sync", "async", "statement_timeout"])
def test_a_begin_waiting_for_a_silent_standby_sends_nothing_until_it_answers(
        cluster: tuple[PgServer, PgServer], mode: str, options: str) -> None:
    primary, standby = cluster
    env = Envelope(parts=[Part(content="Compare the filings.")])
    with FakeProvider().in_thread() as fake, \
            Ledger.open(primary.url("ha") + options, migrate_schema=False) as led:
        led.admit_run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=600)
        if options:  # the timeout is in force on the ledger's connections
            with pytest.raises(Exception, match="statement timeout"), \
                    storage_of(led).context.engine.connect() as conn:
                conn.exec_driver_sql("SELECT pg_sleep(1)")
        receiver = int(standby.psql("SELECT pid FROM pg_stat_wal_receiver"))
        outcome: list[Any] = []

        def turn() -> None:
            try:
                if mode == "sync":
                    with SyncAdapter(limits=LIMITS) as adapter:
                        outcome.append(execute(led, lease, env,
                                               sync_sender(adapter, limits=LIMITS),
                                               sleeper=_NoWait()))
                    return

                async def aturn() -> RunResult:
                    async with HttpAdapter(limits=LIMITS) as adapter:
                        return await aexecute(AsyncLedger(led), lease, env,
                                              async_sender(adapter, limits=LIMITS),
                                              sleeper=_NoWait())

                outcome.append(asyncio.run(aturn()))
            except BaseException as e:
                outcome.append(e)

        os.kill(receiver, signal.SIGSTOP)  # the standby stops acknowledging
        worker = threading.Thread(target=turn, daemon=True)
        try:
            worker.start()
            _until("commit waiting for the standby", lambda: _waiting_in_syncrep(primary) > 0)
            # The begin's COMMIT waits (one round trip to the server later, still): the request
            # has not left, and the turn has not returned.
            assert _waiting_in_syncrep(primary) == 1
            assert fake.requests == [] and outcome == [] and worker.is_alive()
            # Written to the primary's WAL, seen by nobody until the standby has it.
            assert primary.psql("SELECT query FROM pg_stat_activity "
                                "WHERE wait_event = 'SyncRep'").strip() == "COMMIT"
            assert primary.psql("SELECT count(*) FROM attempts", db="ha").strip() == "0"
            if options:  # still waiting, three times the statement timeout later
                _until("a wait outlasting the statement timeout", lambda: primary.psql(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' "
                    "AND clock_timestamp() - query_start > interval '1.5 s'").strip() == "1")
                assert fake.requests == [] and outcome == [] and worker.is_alive()
        finally:
            os.kill(receiver, signal.SIGCONT)  # the standby answers again
        worker.join(DEADLINE_S)
        assert not worker.is_alive(), "the turn did not finish once the standby answered"

    (result,) = outcome
    assert isinstance(result, RunResult), result
    (request,) = fake.requests
    assert request.headers[ATTEMPT_HEADER.lower()] == result.attempt.attempt_id
    caught_up(primary, standby)
    for server in (primary, standby):  # the standby has every acknowledged record
        with Ledger.open(server.url("ha"), migrate_schema=False) as check:
            (att,) = check.timeline("r")
            assert att.attempt_id == result.attempt.attempt_id
            assert att.state is AttemptState.SUCCEEDED
            assert check.debit(att.debit_id).state is DebitState.POSTED
