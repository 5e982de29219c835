"""The operator commands through the real entry point (``python -m ledger.cli.main``, the
module the ``failover-ledger`` console script runs)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ledger.cli.main import main
from ledger.testing.pgserver import PgServer
from tests.pgroles import reader_role

from .seed import T0, seed

REPO = Path(__file__).resolve().parents[2]
SINCE = ["--since", str(T0 - 1)]  # the seed lives in 2023; the CLI's default window is now-24h


def cli(*args: str, env: dict[str, str] | None = None, cwd: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.pop("LEDGER_URL", None)
    e["PYTHONPATH"] = str(REPO)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], capture_output=True,
                          text=True, env=e, cwd=cwd or str(REPO), timeout=120)


def ok(*args: str, **kw: Any) -> str:
    res = cli(*args, **kw)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("cli") / "ledger.db")
    seed(url)
    return url


def test_run_show_table_and_json(sqlite_url: str) -> None:
    out = ok("--db", sqlite_url, "run", "show", "r1")
    assert "selected A  served B  failed over: yes" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#"))
    assert lines[header].split() == ["#", "KIND", "ROUTE", "PROFILE", "OUTCOME", "DEBIT",
                                     "REPORTED", "LATENCY", "TTFB", "TTFT", "TOKENS", "IN/OUT",
                                     "WHY", "AT"]
    # Each attempt's latency (begin to settle, by the ledger's clock) and its tokens in/out.
    assert lines[header + 2].split()[:14] == ["1", "first", "A", "pa1", "failed", "rate_limit",
                                              "429", "posted", "0.000000", "-", "1.000s", "-",
                                              "-", "-"]
    # The answer's first byte and token, and the cached and reasoning parts of its tokens.
    assert lines[header + 3].split()[5:16] == [
        "posted", "0.002000", "0.002000", "2.000s", "0.500s", "1.500s", "100/50", "(40",
        "cached,", "10", "reasoning)"]
    assert "next_candidate (skipped C: cooling)" in lines[header + 3]
    assert "#1 move:" in out
    doc = json.loads(ok("run", "show", "r1", "--json", "--db", sqlite_url))  # --db after, too
    assert doc["served_route"] == "B"
    assert [a["route_id"] for a in doc["attempts"]] == ["A", "B"]
    assert doc["attempts"][1]["selection"]["skipped"] == [
        {"route": "C", "reason": "cooling", "detail": "cooldown for 30s"}]


def test_lists_and_filters(sqlite_url: str) -> None:
    runs = json.loads(ok("--db", sqlite_url, "runs", "--json", "--limit", "4"))
    assert [r["run_id"] for r in runs["items"]] == ["r6", "r5", "r4", "r3"]
    nxt = json.loads(ok("--db", sqlite_url, "runs", "--json", "--cursor", runs["next_cursor"]))
    assert [r["run_id"] for r in nxt["items"]] == ["r2", "r1"]
    table = ok("--db", sqlite_url, "runs", "--status", "succeeded", "--limit", "2")
    assert "more: --cursor" in table and table.splitlines()[2].split()[:2] == ["r6", "succeeded"]

    att = json.loads(ok("--db", sqlite_url, "attempts", "--route", "B", "--outcome", "failed",
                        "--json"))
    assert [a["attempt_id"] for a in att["items"]] == ["r3-a1"]
    assert att["items"][0]["category"] == "server_error"
    # Each attempt with its debit's state: posted once settled, still held while unknown.
    every = json.loads(ok("--db", sqlite_url, "attempts", "--json", "--limit", "100"))
    states = {a["attempt_id"]: a["debit_state"] for a in every["items"]}
    assert states["r3-a1"] == "posted" and states["r4-a1"] == "reserved"
    assert states["r5-a1"] == "reserved" and None not in states.values()
    listed = ok("--db", sqlite_url, "attempts", "--route", "C", "--outcome", "unknown")
    assert listed.splitlines()[0].split()[6] == "DEBIT"
    assert listed.splitlines()[2].split()[6] == "reserved"
    opened = json.loads(ok("--db", sqlite_url, "attempts", "--open", "--json"))
    assert [(o["attempt"]["attempt_id"], o["lease_live"]) for o in opened["items"]] == [
        ("r5-a1", False), ("r4-a1", False)]  # the CLI's clock is real: every lease has expired
    # An open attempt's debit is reserved (its hold kept), and says so (issue 27: it was null).
    assert [o["attempt"]["debit_state"] for o in opened["items"]] == ["reserved", "reserved"]

    fo = ok("--db", sqlite_url, "failovers", *SINCE)
    rows = [line.split() for line in fo.splitlines()[2:]]
    assert [r[0] for r in rows] == ["r6", "r1"]
    assert "A: rate_limit 429" in fo
    # Nothing in the last day: the header, then a line saying so (the header alone looked like
    # a command that did nothing).
    assert ok("--db", sqlite_url, "failovers").splitlines()[2:] == ["(none)"]


def test_costs_and_health(sqlite_url: str) -> None:
    out = ok("--db", sqlite_url, "costs", *SINCE)
    lines = out.splitlines()
    assert lines[0].split() == ["ROUTE", "ATTEMPTS", "OK", "FAILED", "UNKNOWN", "PROMPT_TOK",
                                "COMPLETION_TOK", "CHARGED", "HELD"]
    # Charged: the posted debits (the 429 and the 500 posted nothing); held: r4's unknown
    # attempt on C and r5's dispatching one on A keep their holds.
    assert [line.split() for line in lines[2:]] == [
        ["B", "3", "2", "1", "0", "120", "60", "0.005000", "0.000000"],
        ["C", "2", "1", "0", "1", "30", "20", "0.004000", "0.020000"],
        ["A", "3", "1", "1", "0", "10", "5", "0.001000", "0.030000"],
    ]
    doc = json.loads(ok("--db", sqlite_url, "costs", "--by", "label", "--label", "team",
                        "--json", *SINCE))
    assert [(t["key"], t["cost"], t["held"]) for t in doc["items"]] == [
        ("search", "0.005", "0"), (None, "0.004", "0.05"), ("eval", "0.001", "0")]
    health = ok("--db", sqlite_url, "health")
    assert "capacity groups" in health
    g3 = next(line for line in health.splitlines() if line.startswith("g3 "))
    assert g3.split()[:2] == ["g3", "open"]  # real clock: the 2023 waiting floor has passed
    hj = json.loads(ok("--db", sqlite_url, "health", "--json"))
    assert sorted(g["group"] for g in hj["groups"]) == ["g1", "g2", "g3"]
    g3j = next(g for g in hj["groups"] if g["group"] == "g3")
    assert (g3j["stored_mode"], g3j["until"], g3j["reason"]) == (
        "unavailable", T0 + 10_000, "operator")


def test_errors_are_one_clear_line(sqlite_url: str, tmp_path: Path) -> None:
    res = cli("--db", sqlite_url, "run", "show", "nope")
    assert res.returncode == 1
    assert res.stderr == ("failover-ledger: error: unknown run id 'nope'; list runs with "
                          "`failover-ledger runs`\n")
    res = cli("--db", str(tmp_path / "absent.db"), "runs")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1  # no ledger: set-up
    assert "no ledger at" in res.stderr and "does not exist" in res.stderr
    assert not (tmp_path / "absent.db").exists()  # a reader never creates a database
    res = cli("--db", sqlite_url, "failovers", "--since", "yesterday-ish")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1
    assert "is not a time" in res.stderr
    # LEDGER_URL, then the default ./ledger.db in the working folder.
    assert json.loads(ok("runs", "--json", env={"LEDGER_URL": sqlite_url}))["items"]
    res = cli("runs", cwd=str(tmp_path))
    assert res.returncode == 2 and "ledger.db" in res.stderr
    res = cli("--db", sqlite_url, "dashboard", "--refresh", "-1")
    assert res.returncode == 2 and "--refresh must be from 0 to 86400" in res.stderr


def _no_ledger_files(tmp_path: Path) -> tuple[Path, Path]:
    """An empty SQLite file and another application's database: neither holds a ledger."""
    empty = tmp_path / "empty.db"
    empty.touch()
    app = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(app)) as conn:
        conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY)")
        conn.commit()
    return empty, app


# Every command that reads an existing ledger, and never creates one.
_READERS = (["runs"], ["health"], ["run", "show", "r1"], ["replay", "--policy", "failure-domain"],
            ["recover"], ["reconcile"])


def test_a_missing_or_empty_ledger_names_db_init_and_is_left_byte_for_byte(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A newcomer's first command on a ledger not made yet: the error names the command that
    # makes one (the README's), and reading never writes (not even SQLite's header) into a
    # file it refuses.
    missing = tmp_path / "ledger.db"
    assert main(["--db", str(missing), "runs"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "does not exist" in err
    assert f"`failover-ledger db init --db {missing}`" in err, err
    assert not missing.exists()
    # Every spelling of a SQLite URL is told so (sqlite+pysqlite:/// skipped the check, and
    # the engine's first connection made the file).
    assert main(["--db", f"sqlite+pysqlite:///{missing}", "runs"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not missing.exists()
    empty, app = _no_ledger_files(tmp_path)
    before = {p: p.read_bytes() for p in (empty, app)}
    for command in _READERS:
        assert main(["--db", str(empty), *command]) == 2, command
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "holds no ledger tables" in err, err
        assert f"`failover-ledger db init --db {empty}`" in err, err
        # Another application's file: db init would refuse it too, so it is not offered.
        assert main(["--db", str(app), *command]) == 2, command
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "another application's tables" in err, err
        assert f"db init --db {app}" not in err, err
        assert {p: p.read_bytes() for p in before} == before, command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db", "empty.db"]


@pytest.mark.postgres
def test_an_empty_postgresql_database_names_db_init(
        pg_empty_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # What createdb makes: a database with no ledger tables yet.
    for command in _READERS:
        assert main(["--db", pg_empty_url, *command]) == 2, command
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "holds no ledger tables" in err, err
        assert "`failover-ledger db init --db postgresql+psycopg://" in err, err


def _same_answer_everywhere(db: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line every command that opens a ledger answers at ``db``, exit 2."""
    answers = {}
    for name, command in _ON_A_LEDGER.items():
        assert main(["--db", db, *command]) == 2, name
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.splitlines()) == 1, (name, out)
        answers[name] = out.err
    assert len(set(answers.values())) == 1, answers  # one code path, not one per command
    return next(iter(answers.values()))


def test_no_ledger_is_a_set_up_error_exit_2_alike_on_every_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where there is no ledger (no file, an empty one, another application's), every command
    that opens one said DatabaseUnavailable and exited 1, as if the database were down:
    retrying would never help. It is a DatabaseSetupError (exit 2, as a missing PostgreSQL
    database, an older schema and SchemaTooNew are) naming the fix, the same from every
    command, and nothing is created or written."""
    from ledger.cli.ops_cmd import open_reader
    from ledger.errors import DatabaseSetupError, DatabaseUnavailable

    assert set(_ON_A_LEDGER) == _commands()  # a new command is classed there
    for missing, mkdir in ((tmp_path / "none.db", ""),
                           # A missing folder too: db init creates the file, not its folder.
                           (tmp_path / "x" / "none.db", f"mkdir -p {tmp_path / 'x'} && ")):
        err = _same_answer_everywhere(str(missing), capsys)
        assert f"no ledger at {missing}: the file does not exist" in err, err
        assert f"`{mkdir}failover-ledger db init --db {missing}`" in err, err
    empty, app = _no_ledger_files(tmp_path)
    before = {p: p.read_bytes() for p in (empty, app)}
    assert "holds no ledger tables (an empty database)" in _same_answer_everywhere(
        str(empty), capsys)
    assert "another application's tables" in _same_answer_everywhere(str(app), capsys)
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db", "empty.db"]
    for db, problem in ((tmp_path / "none.db", "database_missing"),
                        (empty, "schema_outdated"), (app, "not_a_ledger")):
        with pytest.raises(DatabaseSetupError) as caught:
            open_reader(str(db))
        assert not isinstance(caught.value, DatabaseUnavailable)
        assert caught.value.fields["problem"] == problem
        assert caught.value.fields["url"] == f"sqlite:///{db}"


@pytest.mark.postgres
def test_no_postgresql_ledger_is_a_set_up_error_exit_2_alike_on_every_command(
        pg_server: PgServer, pg_empty_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A database that does not exist, and one createdb just made (no ledger tables): exit 2,
    a DatabaseSetupError naming db init, the same from every command, nothing created."""
    from ledger.cli.ops_cmd import open_reader
    from ledger.errors import DatabaseSetupError

    absent = pg_server.url("no_such_ledger")
    err = _same_answer_everywhere(absent, capsys)
    assert 'database "no_such_ledger" does not exist' in err and "db init" in err, err
    err = _same_answer_everywhere(pg_empty_url, capsys)
    assert "holds no ledger tables" in err and "`failover-ledger db init --db " in err, err
    for url, problem in ((absent, "database_missing"), (pg_empty_url, "schema_outdated")):
        with pytest.raises(DatabaseSetupError) as caught:
            open_reader(url)
        assert caught.value.fields["problem"] == problem
    assert "no_such_ledger" not in pg_server.psql("SELECT datname FROM pg_database")
    assert pg_server.psql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
                          db=pg_empty_url.rsplit("/", 1)[1]).strip() == "0"


def test_a_sqlite_url_with_options_is_read_at_the_file_it_names(
        sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sqlite:///PATH?timeout=5`` (the busy timeout, which Ledger.open takes) was looked for
    as a file named ``PATH?timeout=5``: every reading command said there was no ledger."""
    for command in (["runs"], ["reconcile"], ["run", "show", "r1"]):
        assert main(["--db", f"sqlite:///{sqlite_url}?timeout=5", *command]) == 0, command
        assert capsys.readouterr().err == ""
    missing = tmp_path / "none.db"
    assert main(["--db", f"sqlite:///{missing}?timeout=5", "runs"]) == 2
    err = capsys.readouterr().err
    assert f"no ledger at {missing}: the file does not exist" in err, err
    assert f"`failover-ledger db init --db {missing}`" in err, err
    assert not missing.exists()


def test_a_db_init_hint_keeps_the_password_masked_and_says_where_it_goes() -> None:
    """The hint printed the URL with its password masked as a command to paste, which then
    failed on the password ***. The password stays unprinted; the hint says so and how to run
    it (put the password back, or hand the URL over in $LEDGER_URL, which db init reads)."""
    from ledger.storage.failure import init_command, setup_error

    masked = "postgresql+psycopg://u:***@db.internal:5432/ledger"
    says = ("(*** stands for the password, which is never printed: put yours back in its "
            "place, or set LEDGER_URL to the whole URL and run `failover-ledger db init` "
            "alone)")
    assert init_command(masked, option="--db ") == (
        f"`failover-ledger db init --db '{masked}'` {says}")
    query = "postgresql+psycopg://u@db.internal/ledger?password=***&sslmode=require"
    assert init_command(query) == f"`failover-ledger db init '{query}'` {says}"
    plain = "postgresql+psycopg://u@db.internal:5432/ledger"
    assert init_command(plain) == f"`failover-ledger db init {plain}`"  # pasted as is
    for problem in ("database_missing", "schema_outdated"):
        assert f"`failover-ledger db init '{masked}'` {says}" in str(setup_error(problem, masked))


@pytest.mark.postgres
def test_no_postgresql_ledger_at_a_url_with_a_password_prints_no_password(
        pg_server: PgServer, pg_empty_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The test server trusts loopback: the password is carried, never checked.
    empty = pg_empty_url.replace("://postgres@", "://postgres:Hunter2-secret@")
    absent = pg_server.url("no_such_ledger").replace("://postgres@",
                                                     "://postgres:Hunter2-secret@")
    for url, option in ((empty, "--db "), (absent, "")):
        assert main(["--db", url, "runs"]) == 2
        err = capsys.readouterr().err
        assert "Hunter2" not in err, err
        shown = url.replace("Hunter2-secret", "***")
        assert f"`failover-ledger db init {option}'{shown}'` (*** stands for the password" in err


def test_an_in_memory_sqlite_database_is_refused_as_unreadable_not_as_a_missing_file(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--db :memory:`` said "no ledger at :memory:: the file does not exist" and offered
    ``db init --db :memory:``, sending the operator looking for a file. SQLite's in-memory
    database exists only inside the process that opens it: no command can read a ledger
    there. An InvalidArgument naming --db and what to pass instead, exit 2, from every
    command alike."""
    from ledger.cli.ops_cmd import open_reader
    from ledger.errors import InvalidArgument

    # SQLite's URI spellings too: they said "no ledger at .../file::memory:" (as a file).
    monkeypatch.chdir(tmp_path)
    for db in (":memory:", "sqlite:///:memory:", "file::memory:", "file:x?mode=memory",
               "sqlite:///file::memory:?cache=shared",
               "sqlite:///file:memdb1?mode=memory&cache=shared&uri=true"):
        err = _same_answer_everywhere(db, capsys)
        assert f"--db {db!r} names SQLite's in-memory database, which exists only inside the " \
            "process that opens it: no command can read a ledger another process wrote " \
            "there; pass --db the path of the ledger's file (such as ./ledger.db) or its " \
            "postgresql+psycopg:// URL, or set LEDGER_URL" in err, err
        assert "no ledger at" not in err and "db init" not in err, err
        with pytest.raises(InvalidArgument) as caught:
            open_reader(db)
        assert caught.value.fields["field"] == "db"
    assert os.listdir(tmp_path) == []
    assert main(["--db", "sqlite:///", "runs"]) == 2
    assert "--db 'sqlite:///' names no SQLite file; pass --db the path of the ledger's file" \
        in capsys.readouterr().err
    # Through the module's entry point too, in a process of its own; no file is made.
    res = cli("--db", ":memory:", "runs")
    assert res.returncode == 2 and "in-memory database" in res.stderr, res.stderr
    assert not (REPO / ":memory:").exists()


@pytest.mark.postgres
def test_with_a_read_url_the_primarys_missing_ledger_is_told_before_the_replicas(
        pg_server: PgServer, pg_url: str, pg_empty_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With --read-url, a replica without the ledger was reported even when --db named a
    database that does not exist: the operator fixed the replica first, which a replica of
    nothing can never be. --db's own problem is told first (it is the one to fix), whichever
    of the two has which problem; then, --db fixed, the replica's. A replica that holds the
    ledger is read without touching --db, and a --db that cannot be reached leaves the
    replica's problem to be told."""
    from ledger.cli.ops_cmd import open_reader
    from ledger.errors import DatabaseSetupError
    from ledger.testing.pgserver import free_port

    absent = pg_server.url("no_such_ledger")
    replica_absent = pg_server.url("no_such_replica")
    away = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/ledger"  # nothing listens
    empty_name = pg_empty_url.rsplit("/", 1)[1]

    def told(db: str, replica: str) -> str:
        assert main(["--db", db, "--read-url", replica, "runs"]) == 2, (db, replica)
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.splitlines()) == 1, out
        return out.err

    # The primary missing, the replica empty: the missing primary.
    err = told(absent, pg_empty_url)
    assert 'database "no_such_ledger" does not exist' in err and "--read-url" not in err, err
    # The other way round: the primary empty, the replica missing: the empty primary.
    err = told(pg_empty_url, replica_absent)
    assert "holds no ledger tables; create them with `failover-ledger db init --db " in err, err
    assert "no_such_replica" not in err, err
    for db, replica, problem, database in (
            (absent, pg_empty_url, "database_missing", "no_such_ledger"),
            (pg_empty_url, replica_absent, "schema_outdated", empty_name),
            # --db fixed: now the replica's.
            (pg_url, pg_empty_url, "schema_outdated", empty_name),
            (pg_url, replica_absent, "database_missing", "no_such_replica"),
            # --db away: the replica's problem is all there is to tell.
            (away, pg_empty_url, "schema_outdated", empty_name)):
        with pytest.raises(DatabaseSetupError) as caught:
            open_reader(db, replica)
        assert (caught.value.fields["problem"], caught.value.fields["database"]) == (
            problem, database), (db, replica, caught.value)
    err = told(pg_url, pg_empty_url)
    assert "holds no ledger tables; point --read-url at a replica of the ledger's database" \
        in err, err
    # A replica database that does not exist: the fix is --read-url, not createdb or db init
    # (which the library's message offers for a database it was asked to open).
    err = told(pg_url, replica_absent)
    assert "the read replica" in err and "point --read-url at a replica" in err, err
    assert "createdb" not in err and "db init" not in err, err
    # A replica holding the ledger is read whatever --db is: nothing connects to it.
    assert main(["--db", away, "--read-url", pg_url, "runs"]) == 0
    assert capsys.readouterr().err == ""
    assert "no_such_ledger" not in pg_server.psql("SELECT datname FROM pg_database")


def test_a_cursor_past_what_the_backend_binds_is_one_line_exit_2(sqlite_url: str) -> None:
    for args in (["costs", "--cursor", "o:99999999999999999999"],
                 ["costs", "--by", "tenant", "--budget-cursor", "o:99999999999999999999"],
                 ["actions", "--cursor", "1700000000.0|99999999999999999999"]):
        res = cli("--db", sqlite_url, *args, *SINCE)
        assert res.returncode == 2 and res.stdout == "", args
        assert len(res.stderr.splitlines()) == 1 and "malformed cursor" in res.stderr, args


def test_costs_label_without_by_label_is_refused_not_ignored(sqlite_url: str) -> None:
    """--label names the label of --by label; with another --by it was silently dropped, and
    the route totals read as if filtered by it."""
    for by in ("route", "tenant"):
        res = cli("--db", sqlite_url, "costs", "--by", by, "--label", "team", *SINCE)
        assert res.returncode == 2 and res.stdout == "", by
        assert len(res.stderr.splitlines()) == 1 and "add --by label" in res.stderr, by
    res = cli("--db", sqlite_url, "costs", "--label", "team", *SINCE)
    assert res.returncode == 2 and "--label 'team'" in res.stderr


def test_costs_by_label_without_its_label_names_the_flag(sqlite_url: str) -> None:
    """--by label needs --label KEY: the refusal names the flag to add, not the library's
    keyword (``label='team'``), which the command line has no way to pass."""
    res = cli("--db", sqlite_url, "costs", "--by", "label", *SINCE)
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.splitlines()) == 1 and "--label KEY" in res.stderr
    assert "label=" not in res.stderr


EPOCH = re.compile(r"\b1\d{9}(\.\d+)?\b")  # an epoch-seconds time (2001..2286)


def test_human_output_never_prints_epoch_seconds(sqlite_url: str) -> None:
    """Times people read are ISO-8601 (UTC) or relative; only --cursor tokens carry epochs."""
    outputs = [ok("--db", sqlite_url, *args) for args in (
        ["runs"], ["run", "show", "r1"], ["run", "show", "r4"], ["attempts"],
        ["attempts", "--open"], ["failovers", *SINCE], ["health"], ["costs", *SINCE])]
    for out in outputs:
        body = "\n".join(line for line in out.splitlines() if not line.startswith("more:"))
        assert not EPOCH.search(body), body
    assert "2023-11-14T22:13:20Z" in outputs[1]  # T0, the admission of r1
    assert re.search(r"admitted \d+ d ago \(2023-11-14T22:13:20Z\)", outputs[1])


def test_generate_refuses_a_ledger_holding_real_runs(tmp_path: Path) -> None:
    db = str(tmp_path / "real.db")
    seed(db)
    res = cli("--db", db, "generate", "--attempts", "50", "--days", "1", "--end", str(T0))
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1
    assert "holds runs that generate did not write" in res.stderr
    assert "--into-existing" in res.stderr
    before = json.loads(ok("--db", db, "runs", "--json", "--limit", "1000"))["items"]
    assert len(before) == 6  # nothing written
    res = cli("--db", db, "generate", "--attempts", "50", "--days", "1", "--end", str(T0),
              "--into-existing", "--json")
    assert res.returncode == 0, res.stderr
    after = json.loads(ok("--db", db, "runs", "--json", "--limit", "1000"))["items"]
    assert len(after) == 6 + json.loads(res.stdout)["runs"]
    # A ledger holding only generated history takes more of it without the flag.
    gen = str(tmp_path / "gen.db")
    assert cli("--db", gen, "generate", "--attempts", "30", "--end", str(T0)).returncode == 0
    again = cli("--db", gen, "generate", "--attempts", "30", "--end", str(T0), "--seed", "2")
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(("args", "says"), [
    # Milliseconds, an easy slip: SQLite wrote a history in year 58901 that no command reaches,
    # PostgreSQL failed with a traceback on the year's partition.
    (["--end", "1796583592939"], "--end 1796583592939.0 is not a time the ledger holds: pass "
                                 "seconds since 1970, not milliseconds"),
    (["--end", "1e20", "--into-existing"], "--end 1e+20 is not a time the ledger holds"),
    (["--end", "nan"], "--end nan is not a time the ledger holds"),
    (["--days", "1e20", "--end", str(T0)], "--days 1e+20 reaches back before 1970 from --end "
                                           "(2023-11-14T22:13:20Z): pass at most"),
    (["--attempts", "0"], "--attempts must be an integer >= 1"),
    # A slip of extra zeros: days of writing, past the disk. (With an --end checked after
    # it: were the count taken, this fails at once on the --end rather than writing for hours.)
    (["--attempts", "1000001", "--end", "nan"],
     "--attempts 1000001 is more than 1,000,000, the most one generate writes (about two hours "
     "and 7.5 GB through the ledger): pass at most 1000000, run generate again to add more, or "
     "use the benchmarks' bulk generator")])
def test_generate_refuses_times_no_other_command_reads_alike_on_both_backends_writing_nothing(
        db_url: str, capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    if "://" not in db_url:
        db_url += ".new"  # a file not made yet (db_url's is a migrated ledger)
    assert main(["--db", db_url, "generate", "--attempts", "5", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1, err
    if "://" not in db_url:
        assert not os.path.exists(db_url)  # refused before the ledger was made
        return
    assert main(["--db", db_url, "runs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["items"] == []


def test_generate_again_with_its_seed_adds_a_history_and_leaves_the_first_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The second run admitted the first history's Runs again (their ids came from the seed),
    added 14 Attempts to them and failed (exit 1) on the first Run whose content differed."""
    db = str(tmp_path / "g.db")
    made = ["--db", db, "generate", "--attempts", "50", "--days", "1", "--end", str(T0),
            "--json"]
    assert main(made) == 0
    first = {r["run_id"]: r for r in json.loads(ok("--db", db, "runs", "--json", "--limit",
                                                   "500"))["items"]}
    capsys.readouterr()
    assert main(made) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["attempts"] == 50
    runs = json.loads(ok("--db", db, "runs", "--json", "--limit", "500"))["items"]
    assert {r["run_id"]: r for r in runs if r["run_id"] in first} == first
    books = json.loads(ok("--db", db, "reconcile", "--json"))
    assert books["attempts"] == 100 and books["violations"] == []


def _on_a_terminal(*args: str, module: str = "ledger.cli.main") -> tuple[int, str, str]:
    """Run the command with stderr on a pseudo-terminal (as a person's shell has it)."""
    import pty

    master, slave = pty.openpty()
    e = dict(os.environ, PYTHONPATH=str(REPO))
    e.pop("LEDGER_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", module, *args], env=e,
                            cwd=str(REPO), stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read() if proc.stdout else ""
    rc = proc.wait(timeout=120)
    os.close(master)
    return rc, out, b"".join(chunks).decode(errors="replace")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks ...`` from the repository root, as docs/benchmarks.md runs it."""
    e = dict(os.environ)
    e.pop("LEDGER_URL", None)
    e.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True,
                          text=True, env=e, cwd=str(REPO), timeout=300)


def test_progress_with_eta_on_a_terminal_and_quiet_when_piped(tmp_path: Path) -> None:
    db = str(tmp_path / "gen.db")
    rc, out, err = _on_a_terminal("--db", db, "generate", "--attempts", "120", "--days",
                                  "0.03", "--end", str(T0))
    assert rc == 0, err
    assert "generate [" in err and "100%" in err and "120/120" in err
    assert "ETA" in err and "elapsed" in err
    assert re.match(r"generated 120 attempts", out)  # stdout keeps only the result
    piped = bench("audit", "--db", db, "--repeat", "1")
    assert piped.returncode == 0 and piped.stderr == ""
    rc, _out, err = _on_a_terminal("audit", "--db", db, "--repeat", "1", module="benchmarks")
    assert rc == 0 and "bench audit [" in err and "100%" in err
    rc, out, err = _on_a_terminal("write", "--attempts", "40", "--workers", "1",
                                  module="benchmarks")
    assert rc == 0, err
    assert "bench write: sqlite" in err and "bench write [" in err and "100%" in err
    piped = bench("write", "--attempts", "40", "--workers", "1")
    assert piped.returncode == 0 and piped.stderr == "" and "att/s" in piped.stdout
    # recover over the generated runs still in flight (their leases ended with the history)
    rc, out, err = _on_a_terminal("--db", db, "recover", "--json")
    assert rc == 0, err
    taken = json.loads(out)["recovered"]
    assert taken > 0 and "recover [" in err and f"{taken}/{taken}" in err


def test_generate_and_bench_audit(tmp_path: Path) -> None:
    db = str(tmp_path / "gen.db")
    res = cli("--db", db, "generate", "--attempts", "200", "--days", "1", "--end",
              str(T0), "--progress", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["attempts"] == 200 and summary["runs"] > 60
    assert summary["failed"] > 0 and summary["failovers"] > 0 and summary["unknown"] >= 0
    assert summary["events"] > 3 * summary["runs"]  # admit, lease, select ..., finish
    assert "100%" in res.stderr  # the progress bar, forced on though stderr is a pipe
    quiet = cli("--db", db, "runs", "--limit", "1")
    assert quiet.stderr == ""  # no progress output when not asked and not a terminal
    audit = bench("audit", "--db", db, "--repeat", "2", "--json")
    assert audit.returncode == 0, audit.stderr
    doc = json.loads(audit.stdout)
    names = [r["query"] for r in doc["results"]]
    assert doc["backend"] == "sqlite"
    assert names[0] == "timeline (one run)" and "costs by tenant (1 day)" in names
    assert all(r["p50_ms"] >= 0 and r["rows"] >= 0 for r in doc["results"])
    fo = json.loads(ok("--db", db, "failovers", "--since", str(T0 - 86400), "--until",
                       str(T0 + 60), "--json", "--limit", "5"))
    assert len(fo["items"]) == 5 and all(f["causes"] or f["served_route"] != f["selected_route"]
                                         for f in fo["items"])


def test_the_benchmarks_are_no_command_of_the_ledger(tmp_path: Path) -> None:
    res = cli("bench", "write")
    assert res.returncode == 2 and "invalid choice: 'bench'" in res.stderr
    assert "bench" not in ok("--help")


@pytest.mark.postgres
def test_cli_on_postgres(pg_url: str) -> None:
    seed(pg_url)
    doc = json.loads(ok("--db", pg_url, "run", "show", "r6", "--json"))
    assert (doc["served_route"], doc["failed_over"]) == ("C", True)
    fo = json.loads(ok("--db", pg_url, "failovers", "--json", *SINCE))
    assert [f["run_id"] for f in fo["items"]] == ["r6", "r1"]


def test_attempts_can_be_listed_by_every_outcome() -> None:
    from ledger.cli.ops_cmd import ATTEMPT_STATES
    from ledger.domain.records import AttemptState

    assert [s.value for s in AttemptState] == ATTEMPT_STATES


# Every command but the ones that make a ledger (db init; demo and generate fill a new one),
# with what it needs to get past its arguments; the policy commands open no database.
_ON_A_LEDGER = {
    "runs": ["runs"], "run show": ["run", "show", "r1"],
    "run close": ["run", "close", "r1", "--status", "failed", "--reason", "stuck"],
    "attempts": ["attempts"], "failovers": ["failovers"], "costs": ["costs", "--by", "run"],
    "health": ["health"], "health clear": ["health", "clear", "A", "--reason", "fixed"],
    "actions": ["actions"], "retention": ["retention", "--older-than", "90d"],
    "rollup": ["rollup"], "recover": ["recover"],
    "attempt settle": ["attempt", "settle", "att-1", "--outcome", "failed", "--reason", "x"],
    "reconcile": ["reconcile"], "replay": ["replay", "--policy", "failure-domain"],
    "dashboard": ["dashboard", "--port", "0"],
}
_MAKE_A_LEDGER = {"db", "demo", "generate", "policy"}


def _commands() -> set[str]:
    import argparse

    from ledger.cli.main import build_parser

    def names(parser: argparse.ArgumentParser, prefix: str) -> set[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return {prefix}
        return {n for name, p in subs[0].choices.items()
                if name not in _MAKE_A_LEDGER
                for n in names(p, f"{prefix} {name}".strip())} | (
                    {prefix} if prefix and parser.get_default("func") else set())

    return names(build_parser(), "")


def _written(url: str) -> dict[str, Any]:
    """What a command could have changed: the revision and every table's row count."""
    from sqlalchemy import create_engine, inspect, text

    from ledger.storage.engine import normalize_url

    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            state: dict[str, Any] = {
                t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar()
                for t in inspect(conn).get_table_names()}
            state["revision"] = conn.execute(text("SELECT version_num FROM alembic_version")
                                             ).scalar()
            state["open runs"] = conn.execute(text(
                "SELECT count(*) FROM runs WHERE status IN ('admitted', 'running')")).scalar()
            return state
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_readers_role_refused_write_is_a_set_up_error_exit_2_naming_the_role_and_the_fix(
        pg_server: PgServer, pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # docs/auditor-role.md's role on the primary: its refusal is not the database away (exit
    # 1, "retry"), no retry gets past it; retention (the tables' owner only) said so already.
    seed(pg_url)
    ro_url = reader_role(pg_server, pg_url)
    role = ro_url.split("://", 1)[1].split("@", 1)[0]
    before = _written(pg_url)
    for args in (["health", "clear", "A", "--reason", "fixed"],
                 ["run", "close", "r4", "--status", "failed", "--reason", "stuck"],
                 ["attempt", "settle", "r4-a1", "--outcome", "failed", "--reason", "x"],
                 ["rollup"], ["retention", "--older-than", "90d"]):
        assert main([*args, "--db", ro_url]) == 2, args
        err = capsys.readouterr().err
        assert "retrying will not help" in err and role in err, (args, err)
        if args[0] != "retention":
            assert "read-only" in err and "the role that writes the ledger" in err, err
    assert _written(pg_url) == before


def test_every_command_but_db_init_refuses_a_schema_older_or_newer_than_the_package(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A database at an older revision (0016: the same tables and columns, only the reading
    of an unreadable answer differs) is refused by every command that opens an existing
    ledger, naming ``db init``, exit 2, and nothing is written: no report read the old rows
    the new way, no operator's command migrated it behind the owner's back. A database
    stamped past the package's head is refused the same way, naming the package upgrade."""
    from sqlalchemy import create_engine, text

    from ledger.storage.engine import normalize_url
    from ledger.storage.migrate import head_revision

    from ..storage.helpers import downgrade_schema

    assert set(_ON_A_LEDGER) == _commands()
    seed(db_url)
    downgrade_schema(db_url, "0016")
    before = _written(db_url)
    assert before["revision"] == "0016" and before["open runs"] > 0
    file_before = Path(db_url).read_bytes() if "://" not in db_url else None
    for name, command in _ON_A_LEDGER.items():
        assert main(["--db", db_url, *command]) == 2, name
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert "is older than this ledger" in err, (name, err)
        assert f"it is at revision 0016, this ledger needs {head_revision()}" in err, err
        assert "failover-ledger db init " in err, (name, err)
        assert _written(db_url) == before, name
    if file_before is not None:
        assert Path(db_url).read_bytes() == file_before

    engine = create_engine(normalize_url(db_url))
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed9999'"))
    finally:
        engine.dispose()
    newer = _written(db_url)
    for name, command in _ON_A_LEDGER.items():
        # A set-up problem (2), as an older schema: retrying will not help.
        assert main(["--db", db_url, *command]) == 2, name
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert "'f00dfeed9999', newer than this ledger understands" in err, (name, err)
        assert "upgrade the ledger package" in err, (name, err)
        assert _written(db_url) == newer, name


def test_replay_says_a_reversed_window_in_iso_times_never_epoch_seconds(
        sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--db", sqlite_url, "replay", "--policy", "goclaw", "--since", "2d",
                 "--until", "3d"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"since \(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\) must be before until "
                     r"\(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\)", err), err
    assert not re.search(r"\d{9,}", err), err


@pytest.mark.parametrize(("args", "says"), [
    (["retention", "--older-than", "-1d"], "--older-than '-1d' is not an age from one day"),
    (["retention", "--older-than", "-.5w"], "--older-than '-.5w' is not an age from one day"),
    (["rollup", "--lag", "-5m"], "--lag '-5m' is not a span of time"),
    (["costs", "--since", "-2d"], "--since '-2d' is not a time")])
def test_a_negative_age_or_span_gets_the_options_own_range_message(
        sqlite_url: str, capsys: pytest.CaptureFixture[str], args: list[str],
        says: str) -> None:
    """--older-than -1d was argparse's "expected one argument", as if the value were missing."""
    assert main(["--db", sqlite_url, *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "expected one argument" not in err, err


def test_a_time_flag_outside_what_the_ledger_holds_is_refused_in_the_flags_words(
        sqlite_url: str) -> None:
    """--since/--until take epoch seconds; infinities, NaN, milliseconds and times before 1970
    are refused naming the flag, not the library's keyword and its clock.now()."""
    for text in ("1e400", "nan", "-inf", "1796583592939", "-5", "1000000d"):
        res = cli("--db", sqlite_url, "runs", f"--since={text}")
        assert res.returncode == 2 and res.stdout == "", text
        assert len(res.stderr.splitlines()) == 1, text
        assert f"--since '{text}'" in res.stderr and "clock.now()" not in res.stderr, text


def test_costs_every_is_refused_in_the_flags_words(sqlite_url: str) -> None:
    """--every below a minute is refused naming the flag (the library's words are every=)."""
    res = cli("--db", sqlite_url, "costs", "--by", "tenant", "--every", "10s", *SINCE)
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.splitlines()) == 1 and "--every '10s' is too fine" in res.stderr
    assert "every=" not in res.stderr


def test_a_directory_as_db_is_a_set_up_error_exit_2_alike_on_every_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--db /tmp`` said "database sqlite:////tmp is unavailable (disk I/O error) ... safe to
    retry" (exit 1) from every reading command, while db init said it is a directory (exit 2):
    a wrapper retried for ever. No retry makes a directory a file: the set-up error db init
    gives, exit 2, from every command, and nothing is made inside the directory."""
    from ledger.cli.ops_cmd import open_reader
    from ledger.errors import DatabaseSetupError, DatabaseUnavailable

    folder = tmp_path / "adir"
    folder.mkdir()
    for db in (str(folder), f"{folder}/", f"sqlite:///{folder}"):
        err = _same_answer_everywhere(db, capsys)
        assert f"cannot open SQLite database {str(folder)!r}: it is a directory, not a file" \
            in err, err
        assert "retrying will not help" in err and "safe to retry" not in err, err
        for command in (["db", "init"], ["demo"]):
            assert main(["--db", db, *command]) == 2, command
            assert capsys.readouterr().err == err, command
        with pytest.raises(DatabaseSetupError) as caught:
            open_reader(db)
        assert not isinstance(caught.value, DatabaseUnavailable)
        assert caught.value.fields["problem"] == "not_a_file"
    assert list(folder.iterdir()) == []
    # The file system's root, as a URL: read, never written.
    assert main(["--db", "sqlite:////", "runs"]) == 2
    assert "cannot open SQLite database '/': it is a directory" in capsys.readouterr().err


def _every_command() -> dict[str, Any]:
    """Every command of the parser tree (a parser that runs something), by its name."""
    import argparse

    from ledger.cli.main import build_parser

    found: dict[str, Any] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        if name and parser.get_default("func") is not None:
            found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}".strip())

    walk(build_parser(), "")
    return found


# The commands that open no database: --db means nothing to them.
_NO_DATABASE = {"policy schema", "policy check", "policy show", "policy export"}


def test_every_command_takes_db_after_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/audit.md: every command takes ``--db URL`` before or after the command; ``recover
    --db X`` and ``reconcile --db X`` were "unrecognized arguments". Every command the parser
    holds takes it (a new one cannot miss it), and it is the database used."""
    commands = _every_command()
    assert set(_ON_A_LEDGER) | {"db init", "demo", "generate"} | _NO_DATABASE == set(commands)
    missing = sorted(name for name, parser in commands.items()
                     if name not in _NO_DATABASE and "--db" not in parser._option_string_actions)
    assert missing == []
    db = tmp_path / "after.db"
    assert main(["db", "init", str(db)]) == 0
    capsys.readouterr()
    for command in (["recover", "--json"], ["reconcile", "--json"]):
        assert main([*command, "--db", str(db)]) == 0, command
        assert json.loads(capsys.readouterr().out), command
    # The global --db stays the default when the command's is not given.
    assert main(["--db", str(db), "reconcile"]) == 0
    capsys.readouterr()


def test_a_command_that_opens_no_database_refuses_db_after_it_saying_why(
        tmp_path: Path) -> None:
    """``policy check FILE --db URL`` (the habit every other command's --db after it teaches)
    was argparse's bare "unrecognized arguments: --db URL": the policy commands work on
    policy files alone. It stays refused (taking it and ignoring it would pretend the policy
    was checked against a ledger), saying why and what runs a policy over a ledger, exit 2,
    nothing opened or created; without --db each works as before."""
    db = tmp_path / "ledger.db"
    for command in _NO_DATABASE:
        words = command.split()
        args = {"policy check": ["goclaw"], "policy show": ["goclaw"],
                "policy export": ["goclaw"], "policy schema": []}[command]
        for argv in ([*words, *args, "--db", str(db)], [*words, f"--db={db}", *args],
                     [*words, *args, "--db"]):
            res = cli(*argv, cwd=str(tmp_path))
            assert (res.returncode, res.stdout) == (2, ""), (argv, res)
            assert res.stderr.splitlines()[-1] == (
                f"failover-ledger {command}: error: --db: {command!r} works on policy files "
                "alone and opens no database; drop --db (replay --policy FILE --db URL runs a "
                "policy over a ledger's history)"), res.stderr
        assert cli(*words, *args, cwd=str(tmp_path)).returncode == 0, command
    assert list(tmp_path.iterdir()) == []


def test_a_cursor_without_its_id_is_malformed_exit_2_on_every_listing(
        sqlite_url: str) -> None:
    """``--cursor '1|'`` (a time, no id) listed an empty page, exit 0, where every other
    malformed cursor is refused: no page hands it out, and no row has an empty id."""
    for command in (["runs"], ["attempts"], ["failovers"]):
        for cursor in ("1|", f"{T0!r}|"):
            res = cli("--db", sqlite_url, *command, "--cursor", cursor, *SINCE)
            assert res.returncode == 2 and res.stdout == "", (command, cursor, res.stdout)
            assert res.stderr == (f"failover-ledger: error: malformed cursor {cursor!r}; pass "
                                  "back next_cursor unchanged (none for the first page)\n")


@pytest.mark.parametrize(("url", "fault"), [
    ("sqlite://host/{name}", "gives a SQLite file a host"),
    ("sqlite+aiosqlite:///{path}", "unsupported SQLite driver 'aiosqlite'"),
    ("sqlite:///{path}?foo=1", "gives the option 'foo', which a SQLite ledger does not take"),
    ("sqlite:///{path}?timeout=5&timeout=6", "gives the SQLite option 'timeout' 2 times"),
])
def test_a_sqlite_url_the_ledger_cannot_take_is_one_line_exit_2_on_every_command(
        url: str, fault: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sqlite://host/x.db`` and ``sqlite+aiosqlite:///x.db`` ended in a traceback (exit 1),
    ``?foo=1`` in a SQLAlchemy warning on stderr and the option ignored (exit 0), and
    ``?timeout=5&timeout=6`` was taken: the URL's fault, one line, exit 2, from every command,
    db init too, at a real ledger."""
    path = tmp_path / "led.db"
    assert main(["db", "init", str(path)]) == 0
    capsys.readouterr()
    before = path.read_bytes()
    db = url.format(name=path.name, path=path)
    err = _same_answer_everywhere(db, capsys)
    assert fault in err and err.startswith("failover-ledger: error: database URL "), err
    assert main(["db", "init", db]) == 2
    assert capsys.readouterr().err == err
    res = cli("--db", db, "runs")  # a process of its own: no warning, no traceback
    assert (res.returncode, res.stderr) == (2, err)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["led.db"]


@pytest.mark.parametrize("query", ["sslmode", "sslmode=require&target_session_attrs"])
def test_a_bare_option_on_a_postgresql_url_is_one_line_exit_2_on_every_path_naming_it(
        query: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``?sslmode`` (no '=') was dropped by SQLAlchemy's parser without a word, and libpq
    used its default: refused as ``?sslmode=`` is, naming the option and the fix, from --db,
    $LEDGER_URL, --read-url and db init alike, before any connection is tried (nothing
    listens at the URL's port: a connection would be an outage, exit 1)."""
    from ledger.testing.pgserver import free_port

    port = free_port()
    option = query.rpartition("&")[2]
    bare = f"postgresql+psycopg://u@127.0.0.1:{port}/ledger?{query}"
    said = (f"failover-ledger: error: database URL {bare!r}: parameter {option!r} is given no "
            f"value: give it one ({option}=VALUE), or leave it out\n")
    assert _same_answer_everywhere(bare, capsys) == said
    for argv in (["db", "init", bare], ["generate", "--attempts", "1", "--db", bare]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == said, argv
    res = cli("runs", env={"LEDGER_URL": bare}, cwd=str(tmp_path))
    assert (res.returncode, res.stderr) == (2, said)
    good = f"postgresql+psycopg://u@127.0.0.1:{port}/ledger"
    res = cli("--db", good, "--read-url", bare, "runs", cwd=str(tmp_path))
    assert res.returncode == 2 and f"parameter {option!r} is given no value" in res.stderr, \
        res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_read_url_for_a_sqlite_ledger_is_refused_naming_the_flag(sqlite_url: str) -> None:
    """A SQLite ledger has no read replica: --read-url (or LEDGER_READ_URL) is refused naming
    them, not the library's read_url= keyword."""
    res = cli("--db", sqlite_url, "--read-url", sqlite_url, "runs", *SINCE)
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.splitlines()) == 1 and "drop --read-url" in res.stderr, res.stderr


@pytest.mark.parametrize(("read_url", "says"), [
    ("replica.db", "--read-url must be the postgresql+psycopg:// URL of a replica"),
    ("mysql://u@127.0.0.1/db", "--read-url: unsupported database backend 'mysql'"),
    ("postgresql+psycopg://u@127.0.0.1:5/", "--read-url: postgresql+psycopg://u@127.0.0.1:5/ "
     "names no database")])
def test_a_read_url_the_library_refuses_is_told_by_the_flag_not_the_librarys_keyword(
        read_url: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's ``read_url: ...`` and ``read_url must be ...`` of a value from --read-url
    (or $LEDGER_READ_URL) read ``--read-url ...``: a command line has no read_url. Refused
    before any connection (nothing listens at the primary's port)."""
    from ledger.testing.pgserver import free_port

    monkeypatch.chdir(tmp_path)
    db = f"postgresql+psycopg://u@127.0.0.1:{free_port()}/ledger"
    for argv, env in (([f"--read-url={read_url}", "runs"], None),
                      (["runs", "--read-url", read_url], None),
                      (["dashboard", "--read-url", read_url], None),
                      (["runs"], read_url)):
        if env is not None:
            monkeypatch.setenv("LEDGER_READ_URL", env)
        assert main(["--db", db, *argv]) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, (argv, captured)
        assert captured.err.startswith(f"failover-ledger: error: {says}"), (argv, captured.err)
        # (The folder of replica.db is named after this test.)
        assert "read_url" not in captured.err.replace(str(tmp_path), "."), (argv, captured.err)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_flag_value_is_told_by_the_flag_not_the_librarys_argument(sqlite_url: str
                                                                         ) -> None:
    """The library's ``invalid lease_ttl_s: ...`` of a value the command passed from --ttl
    reads ``--ttl ...`` on the command line."""
    for args, said in ((["recover", "--ttl", "0"], "--ttl is not a usable duration"),
                       (["recover", "--batch", "0"], "--batch is out of range"),
                       (["runs", "--limit", "0"], "--limit is out of range")):
        res = cli("--db", sqlite_url, *args)
        assert res.returncode == 2 and res.stdout == "", args
        assert len(res.stderr.splitlines()) == 1 and said in res.stderr, (args, res.stderr)
        assert "invalid " not in res.stderr and "lease_ttl_s" not in res.stderr, args
    # A positional argument is named as the usage line names it ("invalid run_id: ..." named
    # a keyword of the library's, not anything on the command line).
    res = cli("--db", sqlite_url, "run", "show", "")
    assert res.returncode == 2 and "--run-id" not in res.stderr, res.stderr
    assert "error: ID is empty" in res.stderr and "run_id" not in res.stderr, res.stderr
