"""Shared fixtures: a real PostgreSQL server on loopback, and a ledger URL per backend.

The server is started once per test session from the installed binaries; a migrated template
database is cloned for each test (``CREATE DATABASE ... TEMPLATE``), which is fast and isolates
tests. Without server binaries the PostgreSQL tests are skipped with a visible reason, unless
``LEDGER_REQUIRE_POSTGRES=1``, in which case they fail.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from ledger.testing.pgserver import PgServer, find_bindir, start_server
from tests.invariants import INVARIANTS, invariants_of
from tests.netfaults import full_backlog  # noqa: F401  (a fixture for every test)

REQUIRE_PG = os.environ.get("LEDGER_REQUIRE_POSTGRES") == "1"

pytest_plugins = ["tests.hangguard"]

# The adapters take proxies from the environment, as httpx does. The tests talk to loopback
# only, directly; a machine's proxy settings (a CI runner's, for its package downloads) must
# not route them elsewhere. The tests of proxies set their own. Processes the tests start
# inherit this environment.
for _name in [n for n in os.environ if n.lower().endswith("_proxy")]:
    del os.environ[_name]
_counter = itertools.count()

# The tests never make the system resolve a name but localhost (a lookup could leave the
# machine): any other name fails here as a name that does not exist would, which is what the
# tests of DNS failures need. IP literals and localhost go to the real resolver.
_real_getaddrinfo = socket.getaddrinfo


def _loopback_names_only(host: Any, *args: Any, **kwargs: Any) -> Any:
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and name.lower() not in ("localhost", "localhost.", ""):
        try:
            ipaddress.ip_address(name.split("%", 1)[0])
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME,
                                  f"the tests resolve no name but localhost ({name!r})") from None
    return _real_getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _loopback_names_only


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False, help="run the long soak test")


#: Where a RAM-backed file system may hold the tests' scratch files, and the room it must have
#: left for them (a whole run's peak was 1.9 GB on 2 workers; the rest is margin).
SHM = "/dev/shm"
SHM_ROOM = 6 << 30
#: Chooses the scratch files' place: ``shm`` (the default where it has room) or ``disk``.
SCRATCH_ENV = "LEDGER_TEST_SCRATCH"
#: The run's scratch folder once chosen, for the workers and tests/audit/generated.py.
SCRATCH_ROOT_ENV = "LEDGER_TEST_SCRATCH_ROOT"


def _scratch_root() -> str | None:
    """A new directory on ``/dev/shm`` for this run's scratch files (``tmp_path``, generated
    histories, the PostgreSQL test servers' clusters), or ``None`` to leave them on disk.

    On a virtual machine's disk, file-system work is much of the suite's time, none of which
    the tests are about. Every commit of a SQLite ledger waits for an fsync (WAL with
    ``synchronous=FULL``; 1 to 1.5 ms each on this project's machines): a history generated
    through the API took 10.7 s on disk and 4.3 s in RAM. Each test on PostgreSQL copies the
    template database (some 300 files): 150 to 400 ms of the server's CPU on disk, 40 to
    55 ms in RAM. Nothing the tests check needs the disk: a crash test kills processes, not
    the machine, and what a killed process wrote is in the page cache either way; SQLite's
    locks, WAL and shared memory work the same on tmpfs. RAM holds only what is in use: each
    test's PostgreSQL database is dropped when it ends.
    """
    if os.environ.get(SCRATCH_ENV, "shm") == "disk" or not os.path.isdir(SHM):
        return None
    try:
        st = os.statvfs(SHM)
        if st.f_bavail * st.f_frsize < SHM_ROOM:
            return None
        _sweep_scratch()
        root = tempfile.mkdtemp(prefix=f"ledger-tests-{os.getpid()}-", dir=SHM)
        os.chmod(root, 0o711)  # the test server runs as postgres under it (as root: see pgserver)
        return root
    except OSError:
        return None


def _sweep_scratch() -> None:
    """Remove the scratch of earlier runs whose process is gone (one killed before its end)."""
    for name in os.listdir(SHM):
        if not name.startswith("ledger-tests-"):
            continue
        pid = name.split("-")[2]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(os.path.join(SHM, name), ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


@pytest.hookimpl(tryfirst=True)  # before pytest's own makes the temporary-path factory
def pytest_configure(config: pytest.Config) -> None:
    # Chosen once, by the process that starts the workers: they get the base from it
    # (pytest-xdist passes ``basetemp/popen-gwN``) and the variable by inheritance.
    if not hasattr(config, "workerinput") and config.option.basetemp is None \
            and SCRATCH_ROOT_ENV not in os.environ:
        root = _scratch_root()
        if root is not None:
            os.environ[SCRATCH_ROOT_ENV] = root
            config.option.basetemp = os.path.join(root, "base")
            config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    for n in INVARIANTS:
        config.addinivalue_line("markers", f"invariant_{n}: protects invariant {n} (DESIGN 4)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for n in invariants_of(item.nodeid):
            item.add_marker(getattr(pytest.mark, f"invariant_{n}"))
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    if find_bindir() is None:
        msg = ("PostgreSQL server binaries not installed (install Debian's 'postgresql' "
               "package); PostgreSQL tests cannot run")
        if REQUIRE_PG:
            pytest.fail(msg + " and LEDGER_REQUIRE_POSTGRES=1")
        pytest.skip(msg)
    srv = start_server(dir=os.environ.get(SCRATCH_ROOT_ENV))
    try:
        srv.psql("CREATE DATABASE ledger_template")
        from ledger.api.facade import Ledger

        Ledger.open(srv.url("ledger_template")).close()
        # No connection to the template from now on, so that copying it never finds one: an
        # autovacuum worker visiting it made a CREATE DATABASE ... TEMPLATE fail ("being
        # accessed by other users"). A database that takes no connections is skipped by
        # autovacuum, and is still copied, as template0 is.
        srv.psql("ALTER DATABASE ledger_template WITH IS_TEMPLATE true ALLOW_CONNECTIONS false")
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A migrated ledger database of its own (a copy of the template), dropped after the test:
    the server, kept for the whole run, then holds only the databases in use."""
    name = f"t_{os.getpid()}_{next(_counter)}"
    yield pg_server.create_database(name, template="ledger_template")
    _drop(pg_server, name)


@pytest.fixture
def pg_empty_url(pg_server: PgServer) -> Iterator[str]:
    """A PostgreSQL database with no schema at all, dropped after the test."""
    name = f"e_{os.getpid()}_{next(_counter)}"
    yield pg_server.create_database(name)
    _drop(pg_server, name)


def _drop(pg_server: PgServer, name: str) -> None:
    # Only room is at stake: a test that left the server stopped (or broke it on purpose)
    # keeps its verdict, and the database goes with the server's folder at the end.
    import psycopg

    with contextlib.suppress(psycopg.Error):
        pg_server.drop_database(name)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file migrated once per session: what ``ledger_template`` is to PostgreSQL.

    Migrating a new file runs every migration (about 0.1 s of CPU); a copy of this one is
    ten times cheaper, and what a fresh ledger holds is its schema alone (``alembic_version``
    is its one row), so the copy is the same ledger."""
    from ledger.api.facade import Ledger

    path = str(tmp_path_factory.mktemp("sqlite-template") / "ledger.db")
    Ledger.open(path).close()  # closed: checkpointed, no -wal file beside it
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A fresh ledger database URL, once per backend: a migrated ledger on both (a copy of
    its template), a real file on SQLite, not ``:memory:``."""
    if request.param == "sqlite":
        path = str(tmp_path) + "/ledger.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return path
    return str(request.getfixturevalue("pg_url"))
