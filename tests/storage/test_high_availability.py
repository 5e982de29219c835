"""High availability on PostgreSQL's own terms (issue 24, item 1).

Every spelling of a URL that names several servers means the same on both paths (the hot
path's psycopg connections and SQLAlchemy's cold path share one pool, made with one
connection string), blocking and asyncio; a URL that cannot be read is refused before any name
is looked up; a write that lands on a standby is a retry-safe ``DatabaseUnavailable`` and its
connection is dropped; and across a failover to a promoted synchronous standby nothing
acknowledged is lost and the same ledger writes again. Servers run on loopback only.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from ledger.api.facade import AsyncLedger, Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState
from ledger.errors import DatabaseUnavailable, InvalidArgument, NotFound
from ledger.storage import engine as eng
from ledger.testing.pgserver import PgServer, free_port

from ._readonly import driver_cause
from ._standby import caught_up, promote
from .helpers import budget, grant, routes

T0 = 1_700_000_000.0
ENV = "sha256:env"


def _conninfo(url: str) -> dict[str, str]:
    norm, parsed = eng.parse(url)
    return conninfo_to_dict(eng.postgres_conninfo(norm, parsed))


# -- the spellings ------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "postgresql+psycopg://u:pw@/db?host=127.0.0.1,127.0.0.2&port=5432,5433",
    "postgresql+psycopg://u:pw@/db?host=127.0.0.1:5432&host=127.0.0.2:5433",
    "postgresql+psycopg://u:pw@127.0.0.1:5432,127.0.0.2:5433/db",
    "postgresql://u:pw@127.0.0.1:5432,127.0.0.2:5433/db",
])
def test_every_spelling_of_several_hosts_makes_the_same_connection_string(url: str) -> None:
    assert _conninfo(url) == {
        "host": "127.0.0.1,127.0.0.2", "port": "5432,5433", "user": "u", "password": "pw",
        "dbname": "db", "target_session_attrs": "read-write"}


def test_libpq_options_pass_through_and_a_chosen_target_is_kept() -> None:
    info = _conninfo("postgresql+psycopg://u@[::1]:5432,localhost/db?connect_timeout=3"
                     "&keepalives_idle=30&keepalives_interval=5&target_session_attrs=primary"
                     "&application_name=worker")
    assert info == {"host": "::1,localhost", "port": "5432,", "user": "u", "dbname": "db",
                    "connect_timeout": "3", "keepalives_idle": "30",
                    "keepalives_interval": "5", "target_session_attrs": "primary",
                    "application_name": "worker"}
    # One host: libpq's own default target (any), as before.
    assert "target_session_attrs" not in _conninfo("postgresql+psycopg://u@127.0.0.1/db")
    assert _conninfo("postgresql+psycopg://u@/db?host=127.0.0.1,127.0.0.2&port=6432") == {
        "host": "127.0.0.1,127.0.0.2", "port": "6432", "user": "u", "dbname": "db",
        "target_session_attrs": "read-write"}


@pytest.fixture
def no_name_lookup(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every name lookup (Python's, as asyncio connections make them) and every connection
    attempt (libpq resolves names itself, inside psycopg's connect) this process makes,
    refused and recorded."""
    import psycopg

    asked: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        asked.append(args)
        raise socket.gaierror(socket.EAI_NONAME, "the test forbids name lookups")

    async def arefuse(*args: Any, **kwargs: Any) -> Any:
        refuse(*args)

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(refuse))
    monkeypatch.setattr(psycopg.AsyncConnection, "connect", classmethod(arefuse))
    return asked


@pytest.mark.parametrize(("url", "fault"), [
    ("postgresql+psycopg://u@/db?host=127.0.0.1:5432&port=5433", "named twice"),
    ("postgresql+psycopg://u@127.0.0.1:5432,127.0.0.1:54x2/db", "port '54x2'"),
    ("postgresql+psycopg://u@127.0.0.1:notaport/db", "notaport"),
    ("postgresql+psycopg://u@/db?host=127.0.0.1:0", "port '0'"),
    ("postgresql+psycopg://u@/db?host=a,b,c&port=1,2", "3 host(s) but 2 ports"),
    ("postgresql+psycopg://u@/db?host=bad host", "host 'bad host'"),
    ("postgresql+psycopg://u@127.0.0.1,,127.0.0.2/db", "an empty host"),
    ("postgresql+psycopg://u@[::zz]:5432,127.0.0.1/db", "'::zz' is not an IPv6 address"),
    ("postgresql+psycopg://u@127.0.0.1:5432/db?host=127.0.0.2", "named twice"),
    ("postgresql+psycopg://u@/db?host=127.0.0.1&sslmode=require&sslmode=disable",
     "'sslmode' is given 2 times"),
    ("postgresql+psycopg://u@/db?host=127.0.0.1&keepalive=1", 'option "keepalive"'),
    # Values libpq would refuse only when it connects (an outage, "safe to retry", forever).
    ("postgresql+psycopg://u@/db?host=127.0.0.1&sslmode=bogus", "sslmode='bogus'"),
    ("postgresql+psycopg://u@127.0.0.1:5432,127.0.0.1:5433/db?target_session_attrs=read_write",
     "target_session_attrs='read_write'"),
    ("postgresql+psycopg://u@/db?host=127.0.0.1&connect_timeout=abc", "connect_timeout='abc'"),
    ("postgresql+psycopg://u@/db?host=127.0.0.1&keepalives_idle=x", "keepalives_idle='x'"),
    # The URL's own database, user or password overridden by the query: refused, not chosen.
    ("postgresql+psycopg://u@127.0.0.1/ledger_a?dbname=ledger_b", "dbname is named twice"),
    ("postgresql+psycopg://u@127.0.0.1/db?user=root", "user is named twice"),
    ("postgresql+psycopg://u:pw@127.0.0.1/db?password=other", "password is named twice"),
    # A parameter without a value: dropped, libpq would use its default (host=: the socket).
    ("postgresql+psycopg://u@/db?host=", "'host' is given no value"),
    ("postgresql+psycopg://u@127.0.0.1/db?sslmode=&connect_timeout=2", "'sslmode' is given"),
    # ... and one without even the '=' (SQLAlchemy's parser drops it alike).
    ("postgresql+psycopg://u@127.0.0.1:5432/db?sslmode", "'sslmode' is given no value"),
    ("postgresql+psycopg://u@127.0.0.1/db?sslmode#frag", "'sslmode' is given no value: give "
     "it one (sslmode=VALUE)"),
    ("postgresql+psycopg://u@127.0.0.1/db?sslmode=require&target_session_attrs",
     "'target_session_attrs' is given no value: give it one (target_session_attrs=VALUE)"),
    ("postgresql+psycopg://u@127.0.0.1,127.0.0.2/db?keepalives&connect_timeout=2",
     "'keepalives' is given no value"),
    # A mistyped address is never looked up as a name; hostaddr= takes addresses only.
    ("postgresql+psycopg://u@/db?host=999.1.1.1", "'999.1.1.1' is not an IPv4 address"),
    ("postgresql+psycopg://u@127.0.0.1,10.0.0.256/db", "'10.0.0.256' is not an IPv4"),
    ("postgresql+psycopg://u@localhost/db?hostaddr=999.1.1.1", "hostaddr '999.1.1.1'"),
    # Brackets are for an IPv6 address: a bracketed name is never looked up.
    ("postgresql+psycopg://u@[zz]/db", "in brackets but is not an IPv6 address"),
    ("postgresql+psycopg://u@[zz]:5432/db", "in brackets but is not an IPv6 address"),
])
def test_an_unreadable_url_is_invalid_argument_naming_its_fault_before_any_lookup(
        url: str, fault: str, no_name_lookup: list[Any]) -> None:
    async def opened() -> None:
        await AsyncLedger.open(url)

    for open_it in (lambda: Ledger.open(url), lambda: asyncio.run(opened())):
        with pytest.raises(InvalidArgument) as caught:
            open_it()
        assert caught.value.fields["field"] == "url" and fault in str(caught.value), \
            str(caught.value)
    assert no_name_lookup == []


def test_only_the_query_is_read_for_a_bare_option_not_a_password_holding_a_question_mark(
        ) -> None:
    """A password may hold a raw '?' (SQLAlchemy reads it up to its '@'): its tail is no
    parameter given without a value, and the URL's own options are read as given."""
    for url in ("postgresql+psycopg://u:pa?ss@127.0.0.1:5432/db",
                "postgresql+psycopg://u:pa?ss@127.0.0.1:5432/db?sslmode=require"):
        assert eng.parse(url)[1].password == "pa?ss", url
    assert dict(eng.parse("postgresql+psycopg://u:pa?ss@127.0.0.1/db?sslmode=require")[1]
                .query) == {"sslmode": "require"}
    with pytest.raises(InvalidArgument, match="'sslmode' is given no value"):
        eng.parse("postgresql+psycopg://u:pa?ss@127.0.0.1:5432/db?sslmode")


def test_a_bad_host_is_told_how_several_hosts_are_written_only_in_a_url_of_several(
        no_name_lookup: list[Any]) -> None:
    for url, several in (("postgresql+psycopg://u@999.1.1.1/ledger", False),
                         ("postgresql+psycopg://u@/ledger?host=999.1.1.1", False),
                         ("postgresql+psycopg://u@/ledger?host=127.0.0.1,999.1.1.1", True),
                         ("postgresql+psycopg://u@/ledger?host=127.0.0.1&host=999.1.1.1", True),
                         ("postgresql+psycopg://u@127.0.0.1,999.1.1.1/ledger", True)):
        with pytest.raises(InvalidArgument) as caught:
            Ledger.open(url)
        said = str(caught.value)
        assert "host '999.1.1.1' is not an IPv4 address" in said, said
        assert ("write several hosts" in said) is several, said
    assert no_name_lookup == []


@pytest.mark.parametrize("port", ["abc", "", "0", "70000", "5x"])
def test_a_single_hosts_bad_port_is_told_as_a_list_of_hosts_port_is(
        port: str, no_name_lookup: list[Any]) -> None:
    """One host's port that is not a number said Python's "(invalid literal for int() with
    base 10: 'abc')"; a list of hosts named the port and its range. Both say the same fault;
    only a URL of several hosts goes on to say how several are written (for one host, that
    hint was beside the point)."""
    said, hinted = [], []
    # (An empty port= is "given no value", said of every parameter.)
    query = [f"postgresql+psycopg://u@/ledger?host=127.0.0.1&port={port}"] if port else []
    for url in (f"postgresql+psycopg://u@127.0.0.1:{port}/ledger",
                f"postgresql+psycopg://u@127.0.0.1:{port},127.0.0.2/ledger",
                f"postgresql+psycopg://u@[::1]:{port}/ledger", *query):
        with pytest.raises(InvalidArgument) as caught:
            Ledger.open(url)
        assert caught.value.fields["field"] == "url"
        fault, _, hint = str(caught.value).split(": ", 1)[1].partition("; ")
        said.append(fault)
        hinted.append("write several hosts" in hint)
        assert "int()" not in fault, fault
    assert len(set(said)) == 1 and said[0] == f"port {port!r} is not a number from 1 to 65535", said
    assert hinted == [False, True, False, False][:len(hinted)]
    assert no_name_lookup == []


def test_the_password_stays_out_of_the_message() -> None:
    with pytest.raises(InvalidArgument) as caught:
        Ledger.open("postgresql+psycopg://u@/db?host=a,b,c&port=1,2&password=hunter2")
    assert "hunter2" not in str(caught.value)
    with pytest.raises(InvalidArgument) as caught:
        Ledger.open("postgresql+psycopg://u:hunter2@a:1,b:x/db")
    assert "hunter2" not in str(caught.value)
    # A password without a user name, and libpq's option names in any case.
    for url in ("postgresql+psycopg://:hunter2@127.0.0.1:1,127.0.0.1:x/db",
                "postgresql+psycopg://u@/db?host=127.0.0.1&Password=hunter2&keepalive=1"):
        with pytest.raises(InvalidArgument) as caught:
            Ledger.open(url)
        assert "hunter2" not in str(caught.value), str(caught.value)


def _opened_both_ways(url: str) -> list[Exception]:
    """What opening ``url`` raises, blocking and asyncio."""
    async def opened() -> None:
        await (await AsyncLedger.open(url)).close()

    raised: list[Exception] = []
    for open_it in (lambda: Ledger.open(url).close(), lambda: asyncio.run(opened())):
        with pytest.raises(Exception) as caught:  # each is checked by the caller
            open_it()
        raised.append(caught.value)
    return raised


def _shown(error: Exception) -> str:
    return f"{error} {getattr(error, 'fields', {})!r}"


@pytest.mark.parametrize("option", ["sslpassword", "password", "pass%77ord",
                                    "oauth_client_secret"])
def test_no_secret_libpq_option_is_shown_in_a_message_or_its_fields(option: str) -> None:
    closed = free_port()  # nothing listens on it: the connection is refused at once
    url = f"postgresql+psycopg://u@127.0.0.1:{closed}/db?{option}=TOPSECRET"
    for error in _opened_both_ways(url):
        assert isinstance(error, DatabaseUnavailable), _shown(error)
        assert "TOPSECRET" not in _shown(error) and f"{option}=***" in str(error), _shown(error)
    for error in _opened_both_ways(url + "&sslmode=bogus"):  # refused before it connects
        assert isinstance(error, InvalidArgument) and "sslmode='bogus'" in str(error)
        assert "TOPSECRET" not in _shown(error), _shown(error)


@pytest.mark.parametrize(("url", "shown"), [
    # A raw '@' in a query value and a password: which '@' ends the password cannot be told,
    # so all up to the last is hidden (a password may look like a host, a path and a query).
    ("postgresql://u:TOPSECRET@127.0.0.1:5432/db?application_name=x@y",
     "postgresql://u:***@y"),
    ("postgresql://u:TOP@SECRET@127.0.0.1:5432/db?application_name=x@y",
     "postgresql://u:***@y"),
    # Without a password the host stays the host, the value up to its '@' is hidden.
    ("postgresql://u@127.0.0.1:5432/db?application_name=TOPSECRET@x",
     "postgresql://u@127.0.0.1:5432/db?application_name=***@x"),
    # A hidden option followed by the message's ':' keeps both.
    ("postgresql://u@127.0.0.1:5432/db?PASSWORD=TOPSECRET",
     "postgresql+psycopg://u@127.0.0.1:5432/db?PASSWORD=***"),
    ("postgresql://u@127.0.0.1:5432/db?password=a&password=TOPSECRET",
     "postgresql+psycopg://u@127.0.0.1:5432/db?password=***&password=***"),
])
def test_a_refused_url_is_shown_with_its_own_host_and_no_secret(
        url: str, shown: str, no_name_lookup: list[Any]) -> None:
    for error in _opened_both_ways(url):
        assert isinstance(error, InvalidArgument), _shown(error)
        assert f"database URL {shown!r}" in str(error), str(error)
        assert "SECRET" not in _shown(error) and "[REDACTED]" not in str(error), str(error)
    assert no_name_lookup == []


@pytest.mark.parametrize("password", ["TOP/SECRET", "TOP?SECRET", "TOP#SECRET",
                                      "Zx9+/TOPSECRET=", "TOP:SE/CR?ET"])
@pytest.mark.parametrize("hosts", [1, 2])
def test_a_password_holding_a_raw_slash_question_mark_or_hash_is_never_shown(
        password: str, hosts: int) -> None:
    ports = [free_port() for _ in range(hosts)]
    authority = ",".join(f"127.0.0.1:{port}" for port in ports)
    url = f"postgresql://u:{password}@{authority}/db"
    # SQLAlchemy reads the password up to its '@', and so does the split of several hosts.
    info = _conninfo(url)
    assert info["password"] == password and info["dbname"] == "db", info
    assert info["host"] == ",".join(["127.0.0.1"] * hosts), info
    assert info["port"] == ",".join(map(str, ports)), info
    assert eng.redact_url(url) == f"postgresql://u:***@{authority}/db"
    for error in _opened_both_ways(url):
        assert isinstance(error, DatabaseUnavailable), _shown(error)
        assert "SECRET" not in _shown(error) and "u:***@" in str(error), _shown(error)


@pytest.mark.parametrize("url", [
    # A raw '@' in the password: SQLAlchemy would read its rest as the host, port or database.
    "postgresql://u:TOP@SECRET@127.0.0.1:{0}/db",
    "postgresql://u:TOP@SE:CRET@127.0.0.1:{0}/db",
    "postgresql://u:TOP@SE/CRET@127.0.0.1:{0},127.0.0.1:{0}/db",
    # ... and what follows it read as a host with a query whose value holds the last '@'.
    "postgresql://u:TOP@SECRET?x=SECRET@127.0.0.1:{0}/db",
    "postgresql://u:TOP@SECRET?x=y&z=SECRET@127.0.0.1:{0}/db",
    # Several hosts, or a user part, before an '@' in a query value read as a password's end.
    "postgresql://u:TOP,SE/CRET@127.0.0.1:{0},127.0.0.1:{0}/db",
    "postgresql://u@127.0.0.1:{0},127.0.0.1:{0}/db?application_name=TOPSECRET@x",
    "postgresql://u@127.0.0.1:{0}/db?application_name=TOPSECRET@x",
])
def test_a_url_whose_user_part_cannot_be_told_is_refused_without_showing_the_password(
        url: str, no_name_lookup: list[Any]) -> None:
    url = url.format(free_port())
    for error in _opened_both_ways(url):
        assert isinstance(error, InvalidArgument) and error.fields["field"] == "url", \
            _shown(error)
        assert "%40" in str(error) and "SECRET" not in _shown(error), _shown(error)
    assert no_name_lookup == []


# -- a real server behind a host that is down ----------------------------------------------------


def _spellings(server: PgServer, db: str) -> list[str]:
    dead = free_port()  # nothing listens: libpq goes on to the next host
    up = server.port
    return [
        f"postgresql+psycopg://postgres@/{db}?host=127.0.0.1,127.0.0.1&port={dead},{up}",
        f"postgresql+psycopg://postgres@/{db}?host=127.0.0.1:{dead}&host=127.0.0.1:{up}",
        f"postgresql+psycopg://postgres@127.0.0.1:{dead},127.0.0.1:{up}/{db}",
    ]


def _sessions(server: PgServer, db: str, name: str | None = None) -> int:
    """Client sessions on database ``db`` named ``name`` (None: any but psql's own; an
    autovacuum worker visiting the database is not one)."""
    which = "application_name <> 'psql'" if name is None else f"application_name = '{name}'"
    return int(server.psql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' "
                           f"AND {which} AND backend_type = 'client backend'"))


@pytest.mark.postgres
@pytest.mark.parametrize("spelling", [0, 1, 2], ids=["lists", "repeated", "authority"])
def test_every_spelling_reaches_the_server_on_both_paths_blocking_and_asyncio(
        pg_server: PgServer, pg_url: str, spelling: int) -> None:
    db = pg_url.rsplit("/", 1)[1]
    url = _spellings(pg_server, db)[spelling] + f"&application_name=ha{spelling}"
    url = url.replace(f"/{db}&", f"/{db}?")  # the authority spelling has no query yet
    led = Ledger.open(url, clock=ManualClock(T0))  # migrations: the cold path
    try:
        led.configure_group("g", max_in_flight=None)
        led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=30)
        att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded")

        async def asyncio_side() -> list[AttemptState]:
            aled = AsyncLedger(led)
            second = await aled.begin_attempt(lease, route="a", envelope_hash=ENV,
                                              reserve="0.01")
            await aled.settle_attempt(lease, second.attempt_id, outcome="succeeded")
            # The URL's own options reached every connection, this loop's too.
            assert _sessions(pg_server, db, f"ha{spelling}") >= 2
            return [a.state for a in await aled.timeline("r1")]

        assert asyncio.run(asyncio_side()) == [AttemptState.SUCCEEDED] * 2
        assert led.get_run("r1").calls_used == 2
    finally:
        led.close()


# -- a primary and its synchronous standby -------------------------------------------------------


def _typed_while_down(call: Any) -> DatabaseUnavailable:
    with pytest.raises(DatabaseUnavailable) as caught:
        call()
    assert driver_cause(caught.value) is not None
    return caught.value


@pytest.mark.postgres
def test_a_failover_to_the_promoted_standby_loses_nothing_acknowledged_and_reconnects(
        cluster: tuple[PgServer, PgServer]) -> None:
    primary, standby = cluster
    # The standby first: a connection must never land on it while it is one.
    url = (f"postgresql+psycopg://postgres@/ha?host=127.0.0.1,127.0.0.1"
           f"&port={standby.port},{primary.port}&connect_timeout=5")
    led = Ledger.open(url, clock=ManualClock(T0))
    aled = AsyncLedger(led)
    try:
        led.configure_group("g", max_in_flight=None)
        led.admit_run("r1", plan=routes(), budget=budget(calls=20), grant=grant())
        lease = led.acquire_lease("r1", ttl_s=300)
        acknowledged = []
        for _ in range(2):
            att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01")
            acknowledged.append(led.settle_attempt(lease, att.attempt_id,
                                                   outcome="succeeded").attempt_id)

        async def before() -> str:
            att = await aled.begin_attempt(lease, route="a", envelope_hash=ENV,
                                           reserve="0.01")
            return (await aled.settle_attempt(lease, att.attempt_id,
                                              outcome="succeeded")).attempt_id

        acknowledged.append(asyncio.run(before()))
        assert _sessions(standby, "ha") == 0  # nothing of the ledger's on the standby

        primary.stop("immediate")  # the primary dies; the standby is still one
        # Every face fails typed while no server takes writes: the standby is refused by
        # the URL's target (read-write), the primary is gone.
        _typed_while_down(lambda: led.begin_attempt(lease, route="a", envelope_hash=ENV,
                                                    reserve="0.01"))
        _typed_while_down(lambda: led.admit_run("r2", plan=routes(), budget=budget(),
                                                grant=grant()))
        _typed_while_down(lambda: asyncio.run(_renew(aled, lease)))

        promote(standby)
        # The same ledger, no reopening: every path reconnects to the new primary.
        att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01")
        acknowledged.append(led.settle_attempt(lease, att.attempt_id,
                                               outcome="succeeded").attempt_id)
        acknowledged.append(asyncio.run(before()))
        led.admit_run("r2", plan=routes(), budget=budget(), grant=grant())
        timeline = led.timeline("r1")
        assert [a.attempt_id for a in timeline] == acknowledged
        assert all(a.state is AttemptState.SUCCEEDED for a in timeline)
        assert led.get_run("r1").calls_used == len(acknowledged)
    finally:
        led.close()


@pytest.mark.postgres
def test_a_read_only_refusal_is_a_set_up_error_only_where_the_server_says_it_is_the_primary(
        cluster: tuple[PgServer, PgServer]) -> None:
    # 25006 is both a standby's answer to any write (a failover: retrying helps) and a read-only
    # role's on the primary (set-up: it never does). A server that does not report
    # in_hot_standby (before PostgreSQL 14), or a refused transaction begun before a
    # promotion, is asked; only a primary on which this session's next transaction is
    # read-only too makes it a set-up error.
    import psycopg
    from psycopg.pq import TransactionStatus

    from ledger.storage.pgpool import read_only_session

    primary, standby = cluster
    primary.psql("CREATE ROLE reader LOGIN; GRANT SELECT ON ALL TABLES IN SCHEMA public TO "
                 "reader; ALTER ROLE reader IN DATABASE ha SET default_transaction_read_only = "
                 "on", db="ha")
    caught_up(primary, standby)

    def asked(server: PgServer, user: str, *, autocommit: bool = True) -> bool:
        with psycopg.connect(host="127.0.0.1", port=server.port, user=user, dbname="ha",
                             autocommit=autocommit) as conn:
            answer = read_only_session(conn)
            # SQLAlchemy's connection (not in autocommit) is left out of a transaction.
            assert conn.info.transaction_status is TransactionStatus.IDLE
            return answer

    for autocommit in (True, False):
        assert asked(standby, "reader", autocommit=autocommit) is False  # in recovery
        assert asked(standby, "postgres", autocommit=autocommit) is False
        assert asked(primary, "postgres", autocommit=autocommit) is False  # it may write
        assert asked(primary, "reader", autocommit=autocommit) is True
    primary.stop("immediate")
    promote(standby)
    assert asked(standby, "reader") is True  # the primary now
    assert asked(standby, "postgres") is False


async def _renew(aled: AsyncLedger, lease: Any) -> None:
    await aled.renew_lease(lease, ttl_s=300)


@pytest.mark.postgres
def test_a_write_that_lands_on_a_standby_is_retry_safe_and_drops_its_connection(
        cluster: tuple[PgServer, PgServer]) -> None:
    primary, standby = cluster
    # target_session_attrs=any, the standby first: connections land on it.
    url = (f"postgresql+psycopg://postgres@/ha?host=127.0.0.1,127.0.0.1"
           f"&port={standby.port},{primary.port}&target_session_attrs=any"
           "&application_name=lands")
    with Ledger.open(primary.url("ha"), clock=ManualClock(T0)) as writer:
        writer.configure_group("g", max_in_flight=None)
        writer.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    caught_up(primary, standby)
    led = Ledger.open(url, clock=ManualClock(T0), migrate_schema=False)
    aled = AsyncLedger(led)
    try:
        assert led.get_run("r1").run_id == "r1"  # reads are served where it landed

        def refused(call: Any) -> None:
            err = _typed_while_down(call)
            assert err.fields["standby"] is True, err
            cause = driver_cause(err)  # psycopg's error, or SQLAlchemy's around it
            assert getattr(getattr(cause, "orig", cause), "sqlstate", None) == "25006"

        refused(lambda: led.acquire_lease("r1", ttl_s=30))  # the hot path, blocking
        refused(lambda: asyncio.run(aled.acquire_lease("r1", ttl_s=30)))  # asyncio
        refused(lambda: led.admit_run("r2", plan=routes(), budget=budget(),
                                      grant=grant()))  # the cold path (SQLAlchemy)
        # Nothing was written.
        with Ledger.open(primary.url("ha"), migrate_schema=False) as check, \
                pytest.raises(NotFound):
            check.get_run("r2")
        assert primary.psql("SELECT lease_holder IS NULL FROM runs WHERE run_id = 'r1'",
                            db="ha").strip() == "t"

        primary.stop("immediate")
        promote(standby)
        lease = led.acquire_lease("r1", ttl_s=30)  # the same ledger writes to it now
        att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve="0.01")
        assert led.settle_attempt(lease, att.attempt_id, outcome="succeeded").state is \
            AttemptState.SUCCEEDED
    finally:
        led.close()
