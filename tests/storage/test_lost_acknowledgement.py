"""A COMMIT whose acknowledgement is lost is resolved truthfully, under the Run's row lock.

A real loopback proxy (:mod:`tests.pgcut`) stands between the ledger (hot and cold path) and a
real PostgreSQL server, and loses the connection of the n-th COMMIT, either right after
forwarding it (the commit lands, its acknowledgement is lost), instead of forwarding it (it
never lands; the ledger cannot tell the two apart), or by ending the session the way
``pg_terminate_backend`` does between the server's COMMIT and its answer to the pipeline's
Sync (the commit lands; the client reads its success, then a FATAL on a connection not yet
seen closed, which psycopg reports before it has seen the end, today as ``cannot exit
pipeline mode while busy``; no answer of the server to a statement, so the outcome is unknown
too). For every n — every commit of a Run
session's entry, of a plain and of a failover turn, and of the session's exit — on the sync and
the async ledger, the books are checked against what the fake provider received:

* every request that reached the provider has its Attempt row (joined by ``X-Ledger-Attempt``),
  and none was sent twice;
* every error is typed (:class:`DatabaseUnavailable`, naming the operation; a lost begin says
  whether it had landed), never another error hiding it;
* every Attempt that was never sent ends ``not_sent`` (or ``rejected``) with its hold voided
  and its slot freed; nothing stays reserved, the lease is released;
* an admission, settle, finish, release or acquire whose acknowledgement was lost is resolved
  (run again: under the Run's row lock, or for an admission, as the same content again): the
  block goes on as if nothing happened.

And when the database goes away right after a begin's acknowledgement is lost (the proxy then
refuses every connection, so the resolution cannot be made either), the caller is told so
(``resolved=False``), nothing is sent, and the Attempt ends ``not_sent`` with nothing held as soon
as the database answers again: at the session's next turn, at its exit, or at the ledger's
``close()``; the session's finish and release are written too.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest

from ledger import (
    AsyncLedger,
    Budget,
    Envelope,
    Grant,
    Ledger,
    Part,
    Price,
    Route,
    RunStatus,
    faults,
)
from ledger.adapters import ATTEMPT_HEADER
from ledger.api.face import storage_of
from ledger.domain.records import AttemptRecord, AttemptState, DebitState, Lease
from ledger.errors import DatabaseUnavailable, NotFound
from ledger.ops.reconcile import reconcile
from ledger.storage.pgpool import arelease, release
from ledger.testing import FakeProvider, Fault
from ledger.testing.pgserver import PgServer
from tests import fakeplan
from tests.fakeplan import plan
from tests.pgcut import CommitCutter

fake = fakeplan.fake
_clear = fakeplan._clear

BUDGET = Budget(max_calls=6, max_retries=4, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
# Long enough that the keeper never renews during a test: its commits would shift the count.
TTL_S = 600.0
_names = itertools.count()

# The writes that are run again under the Run's row lock when their acknowledgement is lost:
# the block goes on as if nothing had happened.
RESOLVED_TRANSPARENTLY = {"admit", "acquire", "settle", "finish", "release", "renew"}


@dataclass
class Outcome:
    """One session run with one lost COMMIT, as seen from outside."""

    error: BaseException | None
    cut: str | None  # the kind of the commit whose connection was lost (None: no cut)
    attempts: list[AttemptRecord]
    status: RunStatus
    lease_holder: str | None
    reserved: Decimal
    tokens_reserved: int
    slots: int
    reserved_debits: int
    unknown_events: list[str]
    requests: list[str]  # the X-Ledger-Attempt of every request the provider received


def _plan(fake: FakeProvider, n: int) -> list[Route]:
    """The two-route plan, under names of its own: health and groups start afresh."""
    return [r.model_copy(update={"id": f"{r.id}-{n}", "provider": f"{r.provider}-{n}",
                                 "group": f"{r.group}-{n}"}) for r in plan(fake)]


def _session(mode: str, url: str, fake: FakeProvider, n: int) -> BaseException | None:
    """Run ``r-<n>``'s session (entry, one turn, exit) on ``url``; the error it raised."""
    env = Envelope(parts=[Part(content="Compare the filings.")])
    run_id, routes = f"r-{n}", _plan(fake, n)
    if mode == "sync":
        with Ledger.open(url) as led:
            try:
                with led.run(run_id, plan=routes, budget=BUDGET, grant=GRANT,
                             lease_ttl_s=TTL_S) as run:
                    run.turn(env)
            except Exception as e:
                return e
            return None

    async def main() -> BaseException | None:
        async with AsyncLedger.open(url) as led:
            try:
                async with led.run(run_id, plan=routes, budget=BUDGET, grant=GRANT,
                                   lease_ttl_s=TTL_S) as run:
                    await run.turn(env)
            except Exception as e:
                return e
            return None

    return asyncio.run(main())


@dataclass
class Books:
    """One test's database, behind the proxy and read directly."""

    pg_server: PgServer
    cutter: CommitCutter
    fake: FakeProvider
    db: str
    led: Ledger

    def count(self, sql: str, run_id: str) -> int:
        return int(self.pg_server.psql(sql.replace(":run", f"'{run_id}'"), db=self.db))

    def run_cut(self, n: int, mode: str, failover: bool,
                cuts: tuple[int | tuple[int, str], ...], how: str,
                kind: tuple[str, tuple[str, ...]] | None = None) -> Outcome:
        """Run session ``n`` with ``cuts`` armed (or the first commit of ``kind[0]``, and
        those right after it the ways ``kind[1]`` says); what it left in the books."""
        self.fake.clear()
        if failover:
            self.fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
        if kind is not None:
            self.cutter.arm_kind(kind[0], how, then=kind[1])
        else:
            self.cutter.arm(*cuts, mode=how)
        try:
            error = _session(mode, self.cutter.url(self.db), self.fake, n)
        finally:
            made = self.cutter.cuts
            self.cutter.arm()
        led, run_id = self.led, f"r-{n}"
        try:
            run = led.get_run(run_id)
        except NotFound:
            run = None  # the admission itself never landed
        return Outcome(
            error=error, cut=made[0].kind if made else None,
            attempts=led.timeline(run_id) if run is not None else [],
            status=run.status if run is not None else RunStatus.ADMITTED,
            lease_holder=run.lease_holder if run is not None else None,
            reserved=run.reserved if run is not None else Decimal(0),
            tokens_reserved=run.tokens_reserved if run is not None else 0,
            slots=self.count("SELECT count(*) FROM group_slots WHERE run_id = :run", run_id),
            reserved_debits=self.count(
                "SELECT count(*) FROM debits WHERE state = 'reserved' AND run_id = :run",
                run_id),
            unknown_events=[e.attempt_id or "" for e in led.events(run_id, ["commit_unknown"])]
            if run is not None else [],
            requests=[r.headers.get(ATTEMPT_HEADER.lower(), "") for r in self.fake.requests])


@pytest.fixture
def books(pg_server: PgServer, fake: FakeProvider) -> Iterator[Books]:
    name = f"cut_{os.getpid()}_{next(_names)}"
    url = pg_server.create_database(name, template="ledger_template")
    with CommitCutter(pg_server.port) as cutter, Ledger.open(url) as led:
        yield Books(pg_server, cutter, fake, name, led)
        assert reconcile(led).violations == []


def _check_books(out: Outcome, how: str) -> None:
    """What must hold after every lost acknowledgement."""
    by_id = {a.attempt_id: a for a in out.attempts}
    # Every request that reached the provider has its Attempt row; none was sent twice.
    assert all(rid in by_id for rid in out.requests), (out.requests, list(by_id))
    assert len(out.requests) == len(set(out.requests)), "an Attempt was sent twice"
    # Every Attempt never sent ends not_sent (or rejected) with its hold voided.
    for att in out.attempts:
        if att.attempt_id not in out.requests:
            assert att.state in (AttemptState.NOT_SENT, AttemptState.REJECTED), att
            assert att.debit_state is DebitState.VOIDED, att
    # Nothing is held: no hold, no slot, no lease.
    assert out.reserved == 0 and out.tokens_reserved == 0
    assert out.slots == 0 and out.reserved_debits == 0
    assert out.lease_holder is None
    # Every error is typed, and names the write whose acknowledgement was lost.
    if out.error is not None:
        assert isinstance(out.error, DatabaseUnavailable), repr(out.error)
    if out.cut in RESOLVED_TRANSPARENTLY:
        assert out.error is None, f"a lost {out.cut} was not resolved: {out.error!r}"
        assert out.status is RunStatus.SUCCEEDED
    if out.cut == "begin":
        assert isinstance(out.error, DatabaseUnavailable)
        fields = out.error.fields
        lands = how != "instead"
        assert fields["operation"] == "begin" and fields["resolved"] is True
        assert fields["landed"] is lands
        landed = [a.state for a in out.attempts if a.attempt_id == fields["attempt_id"]]
        assert landed == ([AttemptState.NOT_SENT] if lands else [])
        assert out.unknown_events == ([fields["attempt_id"]] if lands else [])
        assert fields["attempt_id"] not in out.requests
        assert out.status is RunStatus.FAILED


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["after", "instead", "terminated"],
                         ids=["commit-lands-ack-lost", "commit-never-lands",
                              "commit-lands-session-terminated"])
@pytest.mark.parametrize("failover", [False, True], ids=["plain", "failover"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_commit_of_a_session_whose_acknowledgement_is_lost_is_resolved_truthfully(
    books: Books, mode: str, failover: bool, how: str
) -> None:
    cut_kinds: list[str] = []
    for n in itertools.count(1):
        out = books.run_cut(n, mode, failover, (n,), how)
        if out.cut is None:
            break  # n is past the session's last commit: every one of them was cut
        _check_books(out, how)
        cut_kinds.append(out.cut)
        assert n < 40, "the session never ended without a cut"
    # The uncut session served the turn (after a failover when there was one to make).
    assert out.error is None and out.status is RunStatus.SUCCEEDED
    assert [a.state for a in out.attempts] == (
        [AttemptState.FAILED, AttemptState.SUCCEEDED] if failover
        else [AttemptState.SUCCEEDED])
    # Every commit of the session's entry, its turn and its exit was cut once.
    turn = ["begin", "settle"] * (2 if failover else 1)
    writes = [k for k in cut_kinds if k != "read"]
    assert writes == ["admit", "acquire", *turn, "finish", "release"], cut_kinds


@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["acquire", "begin", "settle", "release"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_write_whose_session_is_terminated_after_its_commit_is_never_told_unwritten(
    books: Books, mode: str, kind: str
) -> None:
    """``pg_terminate_backend`` landing between a write's COMMIT and the server's answer to
    its pipeline's Sync: the commit is durable, and psycopg reports an error on a connection it
    has not yet seen closed (today ``cannot exit pipeline mode while busy``; the test does not
    depend on the wording). That is no answer of the server to
    a statement, so the write's outcome is unknown and is resolved under the Run's row lock: an
    acquire, settle or release goes on as if nothing happened, and the turn's begin is told
    ``landed=True`` and ends ``not_sent`` with nothing held — never ``landed=False`` with its
    Attempt left ``dispatching``, its hold and its capacity slot kept, or a lease held that
    its caller was told was not taken."""
    out = books.run_cut(1, mode, False, (), "terminated", kind=(kind, ()))
    assert out.cut == kind
    _check_books(out, "terminated")
    if kind == "begin":
        # What holds, whatever psycopg's (or libpq's) wording for a session ended in the middle
        # of its pipeline: the driver's error, told commit unknown, resolved under the row
        # lock, and told landed (it did).
        import psycopg

        assert isinstance(out.error, DatabaseUnavailable)
        assert isinstance(out.error.__cause__, psycopg.Error)
        fields = out.error.fields
        assert fields["commit"] == "unknown"
        assert fields["resolved"] is True and fields["landed"] is True



@pytest.mark.postgres
def test_a_write_the_server_refused_in_its_commit_pipeline_is_told_not_landed(
    books: Books
) -> None:
    """The other side of the split: a statement the server answers with an error in the same
    pipeline as the COMMIT (here a lock not granted within the lock timeout, SQLSTATE 55P03, on
    the settle's debit row another session holds), on a connection it still serves, is the
    server saying nothing of the transaction committed. It is told ``resolved=True,
    landed=False`` without a resolution, and nothing of it is recorded."""
    books.pg_server.psql(f"ALTER DATABASE {books.db} SET lock_timeout = '200ms'")
    url = books.pg_server.url(books.db)
    committing: list[str] = []
    with Ledger.open(url) as led:
        led.admit_run("r", plan=plan_routes(), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=TTL_S)
        att = led.begin_attempt(lease, route="primary", envelope_hash="sha256:e",
                                reserve="0.1")
        holder = _locking(books, "SELECT 1 FROM debits WHERE attempt_id = "
                          f"'{att.attempt_id}' FOR UPDATE")
        faults.arm("settle.before_commit", committing.append)
        try:
            with pytest.raises(DatabaseUnavailable) as err:
                led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.05")
        finally:
            faults.disarm()
            holder.rollback()
            holder.close()
        assert committing == ["settle.before_commit"]  # the COMMIT went with the lock wait
        fields = err.value.fields
        assert fields["contention"] == "55P03" and "commit" not in fields
        assert fields["operation"] == "settle"
        assert fields["resolved"] is True and fields["landed"] is False
        assert led.get_attempt(att.attempt_id).state is AttemptState.DISPATCHING
        assert led.get_run("r").reserved == Decimal("0.1")
        done = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.05")
        assert done.state is AttemptState.SUCCEEDED
        led.release_lease(lease)


def _locking(books: Books, sql: str) -> Any:
    """A session of its own holding the row locks ``sql`` takes, until rolled back.

    At most a minute idle: the server then ends it, so a test whose interruption never lands
    fails (the write it holds up goes through) instead of waiting for ever."""
    import psycopg

    conn = psycopg.connect(f"host=127.0.0.1 port={books.pg_server.port} dbname={books.db} "
                           "user=postgres")
    conn.execute("SET idle_in_transaction_session_timeout = '60s'")
    conn.execute(sql)
    return conn

# When the database answers again, in each case: the session's next turn, its exit, the
# ledger's close() after an exit that failed too.
AGAIN = ("next_turn", "exit", "close")


def _session_down(cutter: CommitCutter, db: str, fake: FakeProvider, n: int, mode: str,
                  again: str) -> tuple[DatabaseUnavailable, BaseException | None]:
    """Run ``r-<n>``'s session: its first begin lands, its acknowledgement is lost and the
    database goes away (the resolution cannot connect); it answers again at ``again``.

    Returns the turn's error and what the session's block raised to its caller.
    """
    env = Envelope(parts=[Part(content="Compare the filings.")])
    run_id, routes = f"r-{n}", _plan(fake, n)
    lost: list[DatabaseUnavailable] = []

    def failed(e: DatabaseUnavailable) -> None:
        lost.append(e)
        if again != "close":
            cutter.up()

    cutter.arm_kind("begin", "after", down=True)
    if mode == "sync":
        led = Ledger.open(cutter.url(db))
        raised: BaseException | None = None
        try:
            with led.run(run_id, plan=routes, budget=BUDGET, grant=GRANT,
                         lease_ttl_s=TTL_S) as run:
                try:
                    run.turn(env)
                except DatabaseUnavailable as e:
                    failed(e)
                    if again != "next_turn":
                        raise
                    run.turn(env)
        except DatabaseUnavailable as e:
            raised = e
        finally:
            cutter.up()
            led.close()
        return lost[0], raised

    async def main() -> BaseException | None:
        led = await AsyncLedger.open(cutter.url(db))
        try:
            async with led.run(run_id, plan=routes, budget=BUDGET, grant=GRANT,
                               lease_ttl_s=TTL_S) as run:
                try:
                    await run.turn(env)
                except DatabaseUnavailable as e:
                    failed(e)
                    if again != "next_turn":
                        raise
                    await run.turn(env)
        except DatabaseUnavailable as e:
            return e
        finally:
            cutter.up()
            await led.close()
        return None

    raised = asyncio.run(main())
    return lost[0], raised


@pytest.mark.postgres
@pytest.mark.parametrize("again", AGAIN)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_never_sent_begin_left_unresolved_while_the_database_is_away_ends_not_sent(
    books: Books, mode: str, again: str
) -> None:
    """The begin lands, its acknowledgement is lost, and the database stays away for its
    resolution: the caller is told the begin is unresolved (``resolved=False``), nothing is sent,
    and as soon as the database answers again (the next turn, the session's exit, or the
    ledger's close() after an exit that failed too) the Attempt ends ``not_sent`` with nothing
    held, before anything else is written for the Run; the session's finish and release are
    written too."""
    n = 1
    lost, raised = _session_down(books.cutter, books.db, books.fake, n, mode, again)
    assert [c.kind for c in books.cutter.cuts] == ["begin"]
    fields = lost.fields
    assert fields["operation"] == "begin" and fields["commit"] == "unknown"
    assert fields["resolved"] is False and fields["landed"] is None
    assert fields["deferred"] is True
    notes = "\n".join(getattr(lost, "__notes__", []))
    assert "could not be resolved" in notes and "as soon as the database answers" in notes
    # The caller sees the begin's error itself, never what the exit ran into.
    assert raised is (None if again == "next_turn" else lost)
    if again == "close":
        assert "finishes the Run and releases its lease at its next write" in notes
    attempt_id = fields["attempt_id"]
    led, run_id = books.led, f"r-{n}"
    requests = [r.headers.get(ATTEMPT_HEADER.lower(), "") for r in books.fake.requests]
    assert attempt_id not in requests  # nothing was sent
    [att, *rest] = led.timeline(run_id)
    assert att.attempt_id == attempt_id
    assert att.state is AttemptState.NOT_SENT and att.debit_state is DebitState.VOIDED
    run = led.get_run(run_id)
    assert run.reserved == 0 and run.tokens_reserved == 0
    assert run.calls_used == len(rest)  # the never-sent Attempt gave its call back
    assert books.count("SELECT count(*) FROM group_slots WHERE run_id = :run", run_id) == 0
    assert books.count("SELECT count(*) FROM debits WHERE state = 'reserved' "
                       "AND run_id = :run", run_id) == 0
    assert run.lease_holder is None
    [event] = led.events(run_id, ["commit_unknown"])
    assert event.attempt_id == attempt_id
    assert event.data == {"operation": "begin", "resolution": "not_sent"}
    if again == "next_turn":
        # Resolved before the next turn wrote anything: its Attempt's events come after.
        assert [a.state for a in rest] == [AttemptState.SUCCEEDED]
        assert requests == [rest[0].attempt_id]
        later = [e.event_id for e in led.events(run_id) if e.attempt_id == rest[0].attempt_id]
        assert later and event.event_id < min(later)
        assert run.status is RunStatus.SUCCEEDED
    else:
        assert rest == [] and requests == []
        assert run.status is RunStatus.FAILED


@pytest.mark.postgres
def test_a_lost_settle_whose_resolution_is_lost_too_is_retried_by_the_caller_idempotently(
    books: Books
) -> None:
    cutter = books.cutter
    with Ledger.open(cutter.url(books.db)) as led:
        led.admit_run("r", plan=plan_routes(), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=TTL_S)
        att = led.begin_attempt(lease, route="primary", envelope_hash="sha256:e",
                                reserve="0.1")
        # Commit 1 is the settle (the ledger knows the Attempt from its begin: nothing is read
        # first), 2 its resolution (which finds the settle landed: it writes nothing).
        cutter.arm(1, 2, mode="after")
        with pytest.raises(DatabaseUnavailable) as err:
            led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.05")
        assert [(c.n, c.kind) for c in cutter.cuts] == [(1, "settle"), (2, "read")]
        cutter.arm()
        assert err.value.fields["operation"] == "settle"
        assert err.value.fields["resolved"] is False
        # The same settle again is the same write: recorded once.
        done = led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.05")
        assert done.state is AttemptState.SUCCEEDED
        assert led.get_run("r").posted == Decimal("0.05")
        assert led.get_run("r").reserved == 0


@pytest.mark.postgres
@pytest.mark.parametrize("how", ["after", "instead", "terminated"])
def test_a_lost_renew_is_resolved_and_a_hosts_lost_begin_is_told_for_it_to_retry(
    books: Books, how: str
) -> None:
    cutter = books.cutter
    with Ledger.open(cutter.url(books.db)) as led:
        led.admit_run("r", plan=plan_routes(), budget=BUDGET, grant=GRANT)
        lease = led.acquire_lease("r", ttl_s=60)
        cutter.arm_kind("renew", mode=how)
        renewed = led.renew_lease(lease, ttl_s=TTL_S)
        assert [c.kind for c in cutter.cuts] == ["renew"]
        assert renewed.fence == lease.fence
        assert led.get_run("r").lease_expires_at == renewed.expires_at
        # A host's own begin is not undone by the store: it is told, and retries it with the
        # same attempt id (the same write), then sends.
        cutter.arm_kind("begin", mode=how)
        with pytest.raises(DatabaseUnavailable) as err:
            led.begin_attempt(renewed, route="primary", envelope_hash="sha256:e",
                              reserve="0.1", attempt_id="att-host")
        cutter.arm()
        assert err.value.fields["operation"] == "begin"
        assert err.value.fields["commit"] == "unknown"
        assert err.value.fields["resolved"] is False
        assert "retry the begin with attempt_id='att-host'" in "".join(err.value.__notes__)
        att = led.begin_attempt(renewed, route="primary", envelope_hash="sha256:e",
                                reserve="0.1", attempt_id="att-host")
        assert att.state is AttemptState.DISPATCHING
        assert led.get_run("r").calls_used == 1


def plan_routes() -> list[Route]:
    """A plan whose endpoint is never called (the tests here send nothing)."""
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol="openai", endpoint="http://127.0.0.1:9/v1",
                  price=price)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_begin_that_failed_before_its_commit_was_sent_is_told_as_not_landed(
    db_url: str, fake: FakeProvider, mode: str
) -> None:
    """On both backends: a begin the database failed before its COMMIT left wrote nothing,
    and the turn's error says so (no resolution is needed, and none is made)."""

    def unavailable(_name: str) -> None:
        raise DatabaseUnavailable("the server went away before the commit")

    faults.arm("begin.before_commit", unavailable)
    try:
        error = _session(mode, db_url, fake, 1)
    finally:
        faults.disarm()
    assert isinstance(error, DatabaseUnavailable)
    assert error.fields["operation"] == "begin" and error.fields["resolved"] is True
    assert error.fields["landed"] is False and "commit" not in error.fields
    assert fake.requests == []
    with Ledger.open(db_url) as led:
        assert led.timeline("r-1") == []
        run = led.get_run("r-1")
        assert run.reserved == 0 and run.lease_holder is None
        assert run.status is RunStatus.FAILED
        assert led.events("r-1", ["commit_unknown"]) == []


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_connection_the_abort_had_to_close_goes_as_a_dropped_one_draining_its_idle_neighbours(
    books: Books, mode: str
) -> None:
    """A session terminated between a begin's COMMIT and the answer to its Sync surfaces while
    psycopg has not yet seen the connection end; the abort cannot end the transaction on it and
    closes it. It is a dropped connection all the same: the pool drains the idle connections
    beside it (the same restart or termination may have ended them), as it does for one the
    server was seen to drop, and never lends them again."""
    url = books.cutter.url(books.db)

    def begin(led: Any, lease: Lease) -> Any:
        return led.begin_attempt(lease, route="primary", envelope_hash="sha256:e",
                                 reserve="0.1", attempt_id="att-cut")

    if mode == "sync":
        with Ledger.open(url) as led:
            led.admit_run("r", plan=plan_routes(), budget=BUDGET, grant=GRANT)
            lease = led.acquire_lease("r", ttl_s=TTL_S)  # the pool is proven: it lends now
            pool = storage_of(led).driver.pool
            idle = [pool.checkout() for _ in range(3)]
            for conn in idle:
                release(conn)
            assert not any(c.closed for c in idle)
            books.cutter.arm_kind("begin", "terminated")
            with pytest.raises(DatabaseUnavailable) as err:
                begin(led, lease)
            books.cutter.arm()
            error, closed = err.value, [c.closed for c in idle]
    else:
        async def main() -> tuple[DatabaseUnavailable, list[bool]]:
            async with AsyncLedger.open(url) as led:
                await led.admit_run("r", plan=plan_routes(), budget=BUDGET, grant=GRANT)
                lease = await led.acquire_lease("r", ttl_s=TTL_S)
                pool = storage_of(led).driver.pool
                idle = [await pool.acheckout() for _ in range(3)]
                for conn in idle:
                    await arelease(conn)
                assert not any(c.closed for c in idle)
                books.cutter.arm_kind("begin", "terminated")
                with pytest.raises(DatabaseUnavailable) as err:
                    await begin(led, lease)
                books.cutter.arm()
                return err.value, [c.closed for c in idle]

        error, closed = asyncio.run(main())
    assert error.fields["commit"] == "unknown"
    assert closed == [True, True, True], "the idle neighbours of the closed one stayed in the pool"


def _same_write(led: Any, point: str, lease: Lease | None) -> Any:
    """The host's own write at ``point`` (a coroutine on an AsyncLedger): the same again is
    the same write."""
    if point == "begin":
        assert lease is not None
        return led.begin_attempt(lease, route="primary", envelope_hash="sha256:e",
                                 reserve="0.1", attempt_id="att-1")
    if point == "settle":
        assert lease is not None
        return led.settle_attempt(lease, "att-1", outcome="succeeded", cost="0.05")
    return led.acquire_lease("r", ttl_s=TTL_S)


def _in_psycopg_wait(thread_id: int) -> Callable[[], bool]:
    """Whether the thread ``thread_id`` is inside psycopg's wait for the server's answer.

    A SIGINT that lands there makes psycopg cancel the statement (its outcome then unknown),
    which is what the test is about; one that lands a moment earlier, in Python code inside
    the pipeline's block, leaves psycopg waiting for the answer of a statement nothing
    cancels, behind a lock the test releases only after the interruption."""

    def waiting() -> bool:
        frame = sys._current_frames().get(thread_id)
        return (frame is not None and frame.f_code.co_name.startswith("wait")
                and "psycopg" in frame.f_code.co_filename)

    return waiting


def _when_it_waits(books: Books, interrupt: Callable[[], None],
                   ready: Callable[[], bool] = lambda: True) -> threading.Thread:
    """A thread that calls ``interrupt`` once a statement of the database waits for a row
    lock (the settle's COMMIT pipeline, behind :func:`_locking`'s session) and ``ready()``
    holds."""
    import psycopg

    def watch() -> None:
        with psycopg.connect(f"host=127.0.0.1 port={books.pg_server.port} "
                             f"dbname={books.db} user=postgres", autocommit=True) as conn:
            while True:
                row = conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted "
                                   "AND pid <> pg_backend_pid()").fetchone()
                if row is not None and row[0] and ready():
                    break
        interrupt()

    thread = threading.Thread(target=watch, daemon=True, name="interrupter")
    thread.start()
    return thread


@pytest.mark.postgres
@pytest.mark.timeout(120)  # a settle that never waited on the lock would wait for ever
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_interruption_while_a_commit_awaits_its_answer_says_its_outcome_is_unknown(
    books: Books, mode: str
) -> None:
    """A host's own settle whose COMMIT pipeline waits on a row lock another session holds is
    interrupted while it waits: a ``KeyboardInterrupt`` (a real SIGINT) on the blocking ledger,
    a cancellation on the asyncio one. psycopg then asks the server to cancel the statement, a
    request that may arrive before the COMMIT is carried out or after it: the outcome is
    unknown. The interruption propagates unchanged, never swallowed, and says so; the same call
    again, under the Run's row lock, finds the settle done or does it: recorded once."""
    url = books.pg_server.url(books.db)
    seen: list[BaseException] = []
    if mode == "sync":
        with Ledger.open(url) as led:
            led.admit_run("r", plan=plan_routes(), budget=BUDGET, grant=GRANT)
            lease = led.acquire_lease("r", ttl_s=TTL_S)
            _same_write(led, "begin", lease)
            holder = _locking(books, "SELECT 1 FROM debits WHERE attempt_id = 'att-1' "
                                     "FOR UPDATE")
            main = threading.main_thread().ident
            assert main == threading.get_ident()
            try:
                watcher = _when_it_waits(books,
                                         lambda: signal.pthread_kill(main, signal.SIGINT),
                                         _in_psycopg_wait(main))
                with pytest.raises(KeyboardInterrupt) as caught:
                    _same_write(led, "settle", lease)
                watcher.join(30)
                seen.append(caught.value)
            finally:
                holder.rollback()
                holder.close()
            done = _same_write(led, "settle", lease)  # the same write: found done, or done
            assert done.state is AttemptState.SUCCEEDED
            led.release_lease(lease)
    else:
        async def amain() -> None:
            async with AsyncLedger.open(url) as led:
                await led.admit_run("r", plan=plan_routes(), budget=BUDGET, grant=GRANT)
                lease = await led.acquire_lease("r", ttl_s=TTL_S)
                await _same_write(led, "begin", lease)
                holder = _locking(books, "SELECT 1 FROM debits WHERE attempt_id = 'att-1' "
                                         "FOR UPDATE")

                async def host() -> None:
                    try:
                        await _same_write(led, "settle", lease)
                    except asyncio.CancelledError as e:
                        seen.append(e)  # as the host's own code sees it
                        raise

                try:
                    task = asyncio.ensure_future(host())
                    loop = asyncio.get_running_loop()
                    watcher = _when_it_waits(books, lambda: loop.call_soon_threadsafe(
                        task.cancel))
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    watcher.join(30)
                finally:
                    holder.rollback()
                    holder.close()
                done = await _same_write(led, "settle", lease)
                assert done.state is AttemptState.SUCCEEDED
                await led.release_lease(lease)

        asyncio.run(amain())
    [interrupted] = seen
    notes = "\n".join(getattr(interrupted, "__notes__", []))
    assert "commit unknown" in notes and "make the same call again" in notes, notes
    run = books.led.get_run("r")
    assert run.calls_used == 1 and run.posted == Decimal("0.05") and run.reserved == 0
    assert run.lease_holder is None
