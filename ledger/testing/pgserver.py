"""A throwaway PostgreSQL server on loopback, started from the installed server binaries.

For tests of a ledger on PostgreSQL (the ledger's own suite uses it too)::

    srv = start_server()
    try:
        with Ledger.open(srv.create_database("t")) as led:
            ...
    finally:
        srv.cleanup()

Runs the server as the ``postgres`` system user when the caller is root (PostgreSQL refuses to
run as root). ``LEDGER_PG_BINDIR`` names the binaries' directory when they are not found.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg


def find_bindir() -> str | None:
    """The directory holding ``initdb``/``pg_ctl``/``postgres``, or None when not installed."""
    env = os.environ.get("LEDGER_PG_BINDIR")
    if env and Path(env, "initdb").exists():
        return env
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                   key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
                   reverse=True)
    for d in cands:
        if Path(d, "initdb").exists() and Path(d, "postgres").exists():
            return d
    initdb = shutil.which("initdb")
    if initdb and shutil.which("postgres"):
        return str(Path(os.path.realpath(initdb)).parent)
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgServer:
    """A running server; ``url(db)`` gives a psycopg URL for database ``db``."""

    bindir: str
    datadir: str
    port: int
    user: str = "postgres"
    _as_user: str | None = None
    _tmp: str | None = None
    extra_conf: dict[str, str] = field(default_factory=dict)
    _admin: psycopg.Connection[Any] | None = field(default=None, repr=False, compare=False)

    def url(self, db: str = "postgres") -> str:
        """The ``postgresql+psycopg://`` URL of database ``db`` on this server."""
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{db}"

    def _run(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = args
        if self._as_user:
            cmd = ["runuser", "-u", self._as_user, "--", *args]
        return subprocess.run(cmd, check=check, capture_output=True, text=True)

    def start(self) -> None:
        """Start the server (``pg_ctl start``) and wait until it accepts connections."""
        log = os.path.join(self.datadir, "server.log")
        opts = " ".join(f"-c {k}={v}" for k, v in self.extra_conf.items())
        res = self._run([
            os.path.join(self.bindir, "pg_ctl"), "-D", self.datadir, "-l", log, "-w", "-t", "60",
            "-o", f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1 {opts}",
            "start",
        ], check=False)
        if res.returncode != 0:
            text = Path(log).read_text() if Path(log).exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {res.stderr}\n{text[-2000:]}")
        # pg_ctl -w returns once the server accepts connections; double-check over TCP.
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server with ``pg_ctl``'s shutdown ``mode`` (smart, fast, immediate)."""
        self._close_admin()  # a smart shutdown would wait for it
        self._run([os.path.join(self.bindir, "pg_ctl"), "-D", self.datadir, "-m", mode, "-w",
                   "stop"], check=False)

    def restart(self, mode: str = "immediate") -> None:
        """Stop (by default as a crash would: ``immediate``) and start again, same data."""
        self.stop(mode)
        self.start()

    def psql(self, sql: str, db: str = "postgres") -> str:
        """Run ``sql`` with ``psql`` in ``db``; its unaligned output."""
        res = self._run([os.path.join(self.bindir, "psql"), "-h", "127.0.0.1", "-p",
                         str(self.port), "-U", self.user, "-d", db, "-v", "ON_ERROR_STOP=1",
                         "-Atc", sql])
        return res.stdout

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create database ``name`` (a copy of ``template`` when given); its :meth:`url`.

        Sent over one kept admin connection, not a ``psql`` process: a suite that makes a
        database per test spends about a tenth of a second less on each. The connection is
        opened again once when a restart of the server broke it.
        """
        from psycopg import sql

        create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        self._admin_execute(create)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, ending the sessions still on it.

        ``WITH (FORCE)``: what a test made, given back when it ends, so that a server kept for
        a whole suite holds only the databases in use.
        """
        from psycopg import sql

        self._admin_execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))

    def _admin_execute(self, statement: Any) -> None:
        from psycopg import OperationalError

        try:
            self._admin_connection().execute(statement)
        except OperationalError:
            if self._admin is None or not self._admin.closed:
                raise
            self._admin_connection().execute(statement)  # a restart broke the kept one

    def _admin_connection(self) -> psycopg.Connection[Any]:
        import psycopg

        if self._admin is None or self._admin.closed:
            self._admin = psycopg.connect(host="127.0.0.1", port=self.port, user=self.user,
                                          dbname="postgres", autocommit=True)
        return self._admin

    def _close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def cleanup(self) -> None:
        """Stop the server and remove its data directory when this module created it.

        The removal runs in a detached ``rm -rf``: a session's server holds one database per
        test (gigabytes, hundreds of thousands of files), and on a busy disk deleting them
        inline outlasted the test timeout of the teardown that called this.
        """
        self.stop("immediate")
        if self._tmp:
            subprocess.Popen(["rm", "-rf", self._tmp], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)


def start_server(*, durable: bool = False, max_connections: int = 200,
                 dir: str | None = None) -> PgServer:
    """Initdb a fresh cluster in a temp dir and start it on a free loopback port.

    ``durable=False`` turns fsync off (tests: speed, nothing to protect); ``durable=True``
    keeps production durability, so commits cost what they cost there (a crash test, a
    benchmark). ``dir``: the folder to make the cluster's temp dir in (as
    :func:`tempfile.mkdtemp`'s; default the system's). A RAM-backed one (``/dev/shm``) makes
    ``CREATE DATABASE`` several times cheaper: a copy of a database is some 300 files made,
    written and closed, 40 to 55 ms there against 150 to 400 ms on a virtual machine's disk.
    """
    bindir = find_bindir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL server binaries (initdb, postgres) are not installed")
    tmp = tempfile.mkdtemp(prefix="ledger-pg-", dir=dir)
    datadir = os.path.join(tmp, "data")
    as_user = None
    if os.geteuid() == 0:
        as_user = "postgres"
        pw = pwd.getpwnam(as_user)
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
    os.chmod(tmp, 0o755)
    srv = PgServer(bindir=bindir, datadir=datadir, port=free_port(), _as_user=as_user, _tmp=tmp)
    res = srv._run([os.path.join(bindir, "initdb"), "-D", datadir, "-U", "postgres", "-A", "trust",
                    "-E", "UTF8", "--no-locale"], check=False)
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {res.stderr}")
    conf = {"max_connections": str(max_connections), "shared_buffers": "128MB"}
    if not durable:
        conf.update({"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"})
    srv.extra_conf = conf
    srv.start()
    return srv
