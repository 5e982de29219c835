"""Audit and dashboard reads may go to a read replica (``read_url=``), never the hot path.

A primary and a streaming hot standby run on loopback (:mod:`tests.storage._standby`); the
standby's replay is paused, so a Run written after the pause is on the primary only: what the
audit (its API, the command line's reports, the dashboard) cannot see came from the standby,
and what the ledger's own methods see came from the primary. Writes never go through the
replica's connections (read-only sessions, whichever server they reach), and a ``read_url``
that cannot be used is a typed ``InvalidArgument`` naming ``read_url``, before any lookup.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger import AsyncLedger, Ledger
from ledger.api.face import reads_of, storage_of
from ledger.cli.main import main as cli
from ledger.clock import ManualClock
from ledger.errors import InvalidArgument, NotFound
from ledger.ops.audit import Audit
from ledger.testing.pgserver import PgServer, start_server

from ._standby import caught_up, start_standby
from .helpers import budget, grant, routes

T0 = 1_700_000_000.0
_names = itertools.count()


@pytest.fixture(scope="module")
def replica() -> Iterator[tuple[PgServer, PgServer]]:
    """A primary and a hot standby streaming from it (asynchronously: its replay may be
    paused without stopping the primary's commits); database ``ha`` holds a ledger with Run
    ``both`` on both servers."""
    primary = start_server()
    standby = None
    try:
        primary.psql("CREATE DATABASE ha")
        with Ledger.open(primary.url("ha"), clock=ManualClock(T0)) as led:
            led.admit_run("both", plan=routes(), budget=budget(), grant=grant())
        standby = start_standby(primary, name="s1")
        caught_up(primary, standby)
        yield primary, standby
    finally:
        primary.cleanup()
        if standby is not None:
            standby.cleanup()


@pytest.fixture
def paused(replica: tuple[PgServer, PgServer]) -> Iterator[str]:
    """The standby's replay paused; a new Run written on the primary only. Its id."""
    primary, standby = replica
    standby.psql("SELECT pg_wal_replay_pause()")
    name = f"primary-only-{next(_names)}"
    try:
        with Ledger.open(primary.url("ha"), clock=ManualClock(T0),
                         migrate_schema=False) as led:
            led.admit_run(name, plan=routes(), budget=budget(), grant=grant())
        yield name
    finally:
        standby.psql("SELECT pg_wal_replay_resume()")
        caught_up(primary, standby)


def _both(replica: tuple[PgServer, PgServer], name: str = "audit") -> tuple[str, str]:
    primary, standby = replica
    return (primary.url("ha"),
            standby.url("ha") + f"?application_name={name}")


@pytest.mark.postgres
def test_the_audit_reads_the_replica_while_the_ledger_reads_and_writes_the_primary(
        replica: tuple[PgServer, PgServer], paused: str) -> None:
    primary, standby = replica
    url, read_url = _both(replica)
    with Ledger.open(url, read_url=read_url, clock=ManualClock(T0),
                     migrate_schema=False) as led:
        audit = Audit(led)
        # The audit reads the standby: the paused replay has not brought the new Run there.
        with pytest.raises(NotFound):
            audit.timeline(paused)
        assert {r.run_id for r in audit.runs().items} >= {"both"}
        assert paused not in {r.run_id for r in audit.runs().items}
        assert standby.psql("SELECT count(*) FROM pg_stat_activity "
                            "WHERE application_name = 'audit'").strip() != "0"
        with reads_of(led).context.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT pg_is_in_recovery()").scalar() is True
        # The ledger's own reads and every write are the primary's.
        assert led.get_run(paused).run_id == paused
        lease = led.acquire_lease(paused, ttl_s=30)
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:e", reserve="0.01")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded")
        assert [a.state.value for a in led.timeline(paused)] == ["succeeded"]
        with storage_of(led).context.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT pg_is_in_recovery()").scalar() is False
        assert primary.psql("SELECT count(*) FROM pg_stat_activity "
                            "WHERE application_name = 'audit'").strip() == "0"

        async def asyncio_side() -> None:
            aled = AsyncLedger(led)  # the same replica for its audit, the primary for the rest
            assert reads_of(aled) is reads_of(led)
            assert (await aled.get_run(paused)).run_id == paused

        asyncio.run(asyncio_side())
    # Once the standby replays again, the audit sees it all.
    standby.psql("SELECT pg_wal_replay_resume()")
    caught_up(primary, standby)
    with Ledger.open(url, read_url=read_url, migrate_schema=False) as led:
        story = Audit(led).timeline(paused)
        assert [a.state for a in story.attempts] == ["succeeded"]


@pytest.mark.postgres
@pytest.mark.parametrize("where", ["standby", "primary"])
def test_nothing_is_ever_written_through_the_replica_whichever_server_it_reaches(
        replica: tuple[PgServer, PgServer], where: str) -> None:
    primary, standby = replica
    target = standby if where == "standby" else primary
    with Ledger.open(primary.url("ha"), read_url=target.url("ha"),
                     migrate_schema=False) as led:
        with pytest.raises(Exception, match="read-only transaction"), \
                reads_of(led).context.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE runs SET tenant = 'x' WHERE run_id = 'both'")
        assert primary.psql("SELECT tenant IS NULL FROM runs WHERE run_id = 'both'",
                            db="ha").strip() == "t"


@pytest.mark.postgres
def test_several_replicas_prefer_a_standby_and_fall_back_to_the_primary(
        replica: tuple[PgServer, PgServer]) -> None:
    primary, standby = replica
    both = (f"postgresql+psycopg://postgres@/ha?host=127.0.0.1,127.0.0.1"
            f"&port={primary.port},{standby.port}")
    with Ledger.open(primary.url("ha"), read_url=both, migrate_schema=False) as led, \
            reads_of(led).context.engine.connect() as conn:
        # The primary is listed first; a standby is preferred.
        assert conn.exec_driver_sql("SELECT pg_is_in_recovery()").scalar() is True


@pytest.fixture
def no_name_lookup(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import psycopg

    asked: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        asked.append(args)
        raise socket.gaierror(socket.EAI_NONAME, "the test forbids name lookups")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(refuse))
    return asked


PG = "postgresql+psycopg://u@127.0.0.1:5432/db"


@pytest.mark.parametrize(("url", "read_url", "fault"), [
    (PG, "postgresql+psycopg://u@127.0.0.1:54x2/db", "read_url: "),
    (PG, "postgresql+psycopg://u@/db?host=127.0.0.1:5432&port=5433", "named twice"),
    (PG, "postgresql+psycopg://u:hunter2@/db?host=a,b,c&port=1,2", "3 host(s) but 2 ports"),
    (PG, f"{PG}?sslmode", "parameter 'sslmode' is given no value"),
    (PG, "mysql://u@127.0.0.1/db", "unsupported database backend"),
    (PG, "replica.db", "must be the postgresql+psycopg:// URL of a replica"),
    ("ledger.db", PG, "a SQLite ledger has no read replica"),
    (PG, 42, "database URL string"),
])
def test_a_read_url_that_cannot_be_used_is_invalid_argument_before_any_lookup(
        url: str, read_url: Any, fault: str, no_name_lookup: list[Any],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    async def opened() -> None:
        await AsyncLedger.open(url, read_url=read_url)

    for open_it in (lambda: Ledger.open(url, read_url=read_url),
                    lambda: asyncio.run(opened())):
        with pytest.raises(InvalidArgument) as caught:
            open_it()
        assert caught.value.field == "read_url" and fault in str(caught.value), \
            str(caught.value)
        assert "hunter2" not in str(caught.value)
    assert no_name_lookup == []
    assert not (tmp_path / "ledger.db").exists()  # nothing was created


@pytest.mark.postgres
def test_the_command_line_reads_the_replica_and_writes_the_primary(
        replica: tuple[PgServer, PgServer], paused: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, read_url = _both(replica)

    def runs(*argv: str) -> set[str]:
        assert cli([*argv, "runs", "--json", "--limit", "1000"]) == 0
        return {r["run_id"] for r in json.loads(capsys.readouterr().out)["items"]}

    assert paused in runs("--db", url)  # the primary
    assert paused not in runs("--db", url, "--read-url", read_url)  # the paused standby
    monkeypatch.setenv("LEDGER_READ_URL", read_url)
    assert paused not in runs("--db", url)
    assert cli(["--db", url, "run", "show", paused]) == 1
    assert "unknown run id" in capsys.readouterr().err
    # A command that writes goes to the primary, whatever $LEDGER_READ_URL says.
    assert cli(["--db", url, "run", "close", paused, "--status", "cancelled",
                "--reason", "test"]) == 0
    capsys.readouterr()
    assert replica[0].psql(f"SELECT status FROM runs WHERE run_id = '{paused}'",
                           db="ha").strip() == "cancelled"


@pytest.mark.postgres
def test_the_dashboard_reads_the_replica(replica: tuple[PgServer, PgServer],
                                         paused: str) -> None:
    from starlette.testclient import TestClient

    from ledger.dashboard.app import create_app

    url, read_url = _both(replica)
    with TestClient(create_app(url, read_url=read_url), base_url="http://127.0.0.1") as client:
        assert client.get(f"/runs/{paused}").status_code == 404
        assert client.get("/runs/both").status_code == 200
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        assert client.get(f"/runs/{paused}").status_code == 200
    with pytest.raises(InvalidArgument) as caught, \
            Ledger.open(url, migrate_schema=False) as led:
        create_app(ledger=led, read_url=read_url)
    assert caught.value.field == "read_url"


def _reads_conninfo(url: str) -> dict[str, str]:
    from psycopg.conninfo import conninfo_to_dict

    from ledger.storage import engine as eng

    norm, parsed = eng.parse(url)
    return conninfo_to_dict(eng.postgres_conninfo(norm, parsed, reads=True))


def test_a_replica_connection_is_read_only_and_prefers_a_standby_unless_told_otherwise() -> None:
    many = _reads_conninfo("postgresql+psycopg://u@127.0.0.1:5432,127.0.0.2:5433/db")
    assert many["target_session_attrs"] == "prefer-standby"
    assert many["options"] == "-c default_transaction_read_only=on"
    chosen = _reads_conninfo("postgresql+psycopg://u@127.0.0.1:5432,127.0.0.2:5433/db"
                             "?target_session_attrs=standby&options=-c%20work_mem%3D64MB")
    assert chosen["target_session_attrs"] == "standby"
    assert chosen["options"] == "-c work_mem=64MB -c default_transaction_read_only=on"
    assert "target_session_attrs" not in _reads_conninfo("postgresql+psycopg://u@127.0.0.1/db")
