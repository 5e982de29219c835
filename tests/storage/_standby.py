"""A hot standby of a test server: ``pg_basebackup -R`` of the primary, started on another
loopback port, streaming from it; :func:`promote` makes it the primary (a failover)."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ledger.testing.pgserver import PgServer, free_port, start_server


def start_standby(primary: PgServer, *, name: str = "s1") -> PgServer:
    """A standby of ``primary`` (whose default ``pg_hba.conf`` lets replication in from
    loopback), up and streaming; ``name`` is its ``application_name`` on the primary."""
    tmp = tempfile.mkdtemp(prefix="ledger-pg-standby-")
    datadir = os.path.join(tmp, "data")
    as_user = None
    if os.geteuid() == 0:
        as_user = "postgres"
        pw = pwd.getpwnam(as_user)
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
    os.chmod(tmp, 0o755)
    srv = PgServer(bindir=primary.bindir, datadir=datadir, port=free_port(), _as_user=as_user,
                   _tmp=tmp, extra_conf={**primary.extra_conf, "hot_standby": "on"})
    res = srv._run([os.path.join(primary.bindir, "pg_basebackup"), "-h", "127.0.0.1", "-p",
                    str(primary.port), "-U", primary.user, "-D", datadir, "-R", "-X", "stream",
                    "-c", "fast", "-d", f"application_name={name}"], check=False)
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"pg_basebackup failed: {res.stderr}")
    srv.start()
    deadline = time.monotonic() + 30
    # Streaming once the primary lists it (its WAL sender), so what the primary commits next
    # reaches it.
    while primary.psql(f"SELECT count(*) FROM pg_stat_replication "
                       f"WHERE application_name = '{name}' AND state = 'streaming'") != "1\n":
        if time.monotonic() > deadline:
            raise RuntimeError("the standby did not start streaming")
    return srv


def make_synchronous(primary: PgServer, name: str = "s1") -> None:
    """Restart ``primary`` with ``synchronous_commit=on`` and standby ``name`` synchronous
    (a commit is acknowledged once that standby has it), and wait until it is. On the command
    line, where the test server's own settings are (they outrank ALTER SYSTEM)."""
    conf = {k: v for k, v in primary.extra_conf.items() if k != "synchronous_commit"}
    primary.extra_conf = {**conf, "synchronous_standby_names": name}
    primary.restart("fast")
    deadline = time.monotonic() + 30
    while primary.psql("SELECT sync_state FROM pg_stat_replication "
                       f"WHERE application_name = '{name}'").strip() != "sync":
        if time.monotonic() > deadline:
            raise RuntimeError(f"standby {name} did not become synchronous")


def caught_up(primary: PgServer, standby: PgServer) -> None:
    """Wait until ``standby`` has replayed everything ``primary`` has written so far."""
    lsn = primary.psql("SELECT pg_current_wal_lsn()").strip()
    deadline = time.monotonic() + 30
    while standby.psql(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn").strip() != "t":
        if time.monotonic() > deadline:
            raise RuntimeError("the standby did not catch up")


def promote(standby: PgServer) -> None:
    """Make ``standby`` the primary (``pg_ctl promote``, waiting until it takes writes)."""
    standby._run([os.path.join(standby.bindir, "pg_ctl"), "-D", standby.datadir, "-w",
                  "promote"])


@contextmanager
def synchronous_pair(db: str = "ha") -> Iterator[tuple[PgServer, PgServer]]:
    """A primary with a synchronous hot standby ``s1`` (``synchronous_commit=on``): a commit
    is acknowledged once the standby has it. Database ``db`` holds the ledger's schema on both.
    Both servers are removed at the end."""
    from ledger import Ledger

    primary = start_server()
    standby = None
    try:
        primary.psql(f"CREATE DATABASE {db}")
        Ledger.open(primary.url(db)).close()  # the schema, before the copy
        standby = start_standby(primary, name="s1")
        make_synchronous(primary, "s1")
        assert primary.psql("SHOW synchronous_commit").strip() == "on"
        yield primary, standby
    finally:
        primary.cleanup()
        if standby is not None:
            standby.cleanup()
