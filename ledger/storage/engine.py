"""Opening a database: URL normalization and parsing, the engine settings of each backend.

SQLite runs in WAL mode with ``synchronous=FULL`` (an Attempt row must survive power loss before
its request leaves the process), a busy timeout (30 s, or the URL's ``?timeout=`` in seconds),
and ``BEGIN IMMEDIATE`` for every write transaction so that writers serialize up front instead
of failing on lock upgrade. PostgreSQL uses psycopg 3; writes serialize on row locks
(``SELECT ... FOR UPDATE``). Which of the two a URL names is decided once, by
:func:`ledger.storage.open_store`; each store implementation builds its own engine here.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, unquote_plus

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import NullPool

from ledger.errors import DatabaseSetupError, InvalidArgument
from ledger.storage.driver import switch_to_wal
from ledger.storage.failure import mapped
from ledger.storage.pgurl import PASSWORD_USER, conninfo, hosts_to_query, refuse_blank_options

SQLITE_BUSY_TIMEOUT_MS = 30_000

#: SQLite's URI filename options (https://sqlite.org/uri.html): what SQLAlchemy would pass to
#: SQLite for the cold path only, so a SQLite URL may not give them.
SQLITE_URI_OPTIONS = frozenset({"mode", "immutable", "vfs", "cache", "nolock", "psow", "modeof"})


def normalize_url(url: str) -> str:
    """Accept a SQLite file path or an SQLAlchemy URL; PostgreSQL URLs use psycopg 3."""
    if not url or not url.strip():
        raise InvalidArgument(
            "empty database URL; pass a SQLite file path or a postgresql+psycopg:// URL",
            field="url",
        )
    url = url.strip()
    if "://" not in url:
        if url == ":memory:" or url.startswith("file:"):
            # SQLite's name for a private in-memory database, or one of its URI filenames
            # (file::memory:, file:x?mode=memory), not a file name: left as SQLite reads it,
            # so that sqlite_file refuses it rather than a file called ":memory:" or "file:x"
            # being made in the working folder.
            return "sqlite:///" + url
        return "sqlite:///" + _unescaped_path(url)
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def _unescaped_path(path: str) -> str:
    """A plain path's absolute form, read as a URL's path is: its ``?`` begins the options
    (``ledger.db?timeout=5``, as it always has; an option the ledger does not take, such as
    the ``file.db`` of ``my?file.db``, is refused by :func:`check_sqlite_url`).

    A percent-escape is refused: the URL would decode it, and ``p%20q.db`` opened ``p q.db``.
    Quoting it instead would have opened a new, empty ``p%20q.db`` beside the ledger a
    deployment had been writing to, without a word."""
    name = path.partition("?")[0]
    escape = _ESCAPE.search(name)
    if escape is not None:
        raise InvalidArgument(
            f"the SQLite path {path!r} holds {escape[0]!r}, which a database URL reads as a "
            "percent-escape (it would open "
            f"{os.path.basename(unquote(name))!r}): pass the file's URL instead, its '%' "
            f"written %25 for a name that holds one (sqlite:///{name.replace('%', '%25')})",
            field="url")
    return os.path.abspath(path)


# libpq's connection options that carry a secret: the password, the passphrase of the client's
# key, and an OAuth client's secret.
SECRET_OPTIONS = frozenset({"password", "sslpassword", "oauth_client_secret"})
_QUERY_PAIR = re.compile(r"([?&])([^&=?]*)=([^&]*)")


# What may follow the '@' that ends a URL's user part: hosts, a path and a query whose names
# hold no '@' (a raw '@' there can only be in a query value).
_AFTER_USER = re.compile(r"[^/?#@]*(?:/[^?#@]*)?"
                         r"(?:\?[^&#=@]*(?:=[^&#]*)?(?:&[^&#=@]*(?:=[^&#]*)?)*)?(?:#.*)?", re.S)
_AT_VALUE = re.compile(r"([?&][^&#=]*=)[^&#]*(?=@[^&#@]*(?:[&#]|$))")


def redact_url(url: str) -> str:
    """The URL without its password (in its user part, or as ``password=``, ``sslpassword=``
    or another of :data:`SECRET_OPTIONS`), for messages and logs."""
    start = url.find("://") + 3
    ats = [i for i, ch in enumerate(url) if ch == "@" and i >= start] if start >= 3 else []
    if ats:
        # Which '@' ends the user part cannot always be told (a raw '@' in the password, or in
        # a query value). With a password, the last one: whatever a raw '@' splits, none of
        # the password shows (a query value's '@' costs the host in the message). Without,
        # the first one the rest of the URL can follow, so that the host shown is the host.
        with_password = PASSWORD_USER.match(url[:ats[0] + 1], start) is not None
        end = ats[-1] if with_password else next(
            (at for at in ats if _AFTER_USER.fullmatch(url, at + 1)), ats[-1])
        if PASSWORD_USER.match(url[:end + 1], start):
            colon = url.index(":", start)
            url, end = url[:colon] + ":***" + url[end:], colon + len(":***")
        if "@" in url[end + 1:]:
            # Read the other way, a query value up to its '@' would be the password's end.
            url = url[:end + 1] + _AT_VALUE.sub(r"\1***", url[end + 1:])

    def pair(m: re.Match[str]) -> str:
        # SQLAlchemy decodes a percent-escaped name; one in another case (which libpq refuses,
        # in a message that shows the URL) is hidden too.
        secret = unquote_plus(m[2]).strip().lower() in SECRET_OPTIONS
        return f"{m[1]}{m[2]}=***" if secret else m[0]

    return _QUERY_PAIR.sub(pair, url)


def _refuse_blank_sqlite_options(norm: str, where: str) -> None:
    # SQLAlchemy drops an option given no value (``?timeout=``, ``?timeout``), so the default
    # held where the URL meant something else.
    if not norm.startswith("sqlite"):
        return
    query = norm.partition("?")[2].partition("#")[0]
    for pair in filter(None, query.split("&")):
        key, eq, value = pair.partition("=")
        if not eq or not value:
            raise InvalidArgument(
                f"database URL {where!r} gives the option {key!r} no value: give it one "
                "(e.g. timeout=5), or leave it out", field="url")


def parse(url: str) -> tuple[str, URL]:
    """``url`` normalized (:func:`normalize_url`) and parsed; names the backend's problems."""
    norm = normalize_url(url)
    where = redact_url(url)  # every message below shows the URL so
    start = norm.find("://") + 3
    user = PASSWORD_USER.match(norm, start) if start >= 3 else None
    if user is not None and "@" in norm[user.end():]:
        # SQLAlchemy ends the password at its first '@': the rest of a password holding a raw
        # '@' would be read, and shown, as the host, port or database.
        raise InvalidArgument(
            f"database URL {where!r} holds an '@' after the one that ends its user "
            "part (a raw '@' in the password, or in a query value): percent-encode it as %40",
            field="url")
    refuse_blank_options(norm, where)
    _refuse_blank_sqlite_options(norm, where)
    norm = hosts_to_query(norm, where)
    try:
        parsed = make_url(norm)
    except (ArgumentError, ValueError) as e:  # ValueError: a port that is not a number
        raise InvalidArgument(
            f"cannot parse database URL {where!r} ({e}): use a SQLite file path or "
            "postgresql+psycopg://user:pass@host:port/dbname",
            field="url",
        ) from e
    name = parsed.get_backend_name()
    if name not in ("sqlite", "postgresql"):
        raise InvalidArgument(
            f"unsupported database backend {name!r}; use SQLite (a file path) or "
            "postgresql+psycopg://",
            field="url",
        )
    return norm, parsed


#: The one option of a SQLite URL the ledger takes (:func:`sqlite_busy_timeout`).
SQLITE_OPTIONS = frozenset({"timeout"})
_SQLITE_URL_FORMS = "sqlite:///relative/path.db, sqlite:////absolute/path.db or a plain file path"


def check_sqlite_url(parsed: URL, where: str) -> None:
    """Refuse what SQLAlchemy would fail on, or drop, in a SQLite URL, before anything opens.

    SQLAlchemy raises its own ArgumentError for a user, password, host or port (a
    ``sqlite://host/x.db`` with two slashes), an ImportError for an async driver, and only
    warns of an option SQLite does not take, which it then ignores. SQLite's URI options
    (and ``uri``) pass here: :func:`sqlite_not_a_file` and :func:`sqlite_file` name them.
    """
    driver = parsed.get_driver_name()
    if driver != "pysqlite":
        raise InvalidArgument(
            f"database URL {where!r}: unsupported SQLite driver {driver!r}; the ledger opens "
            "SQLite through Python's sqlite3 module: write sqlite:///PATH (or "
            "sqlite+pysqlite:///PATH)", field="url")
    authority = [name for name, value in (("user", parsed.username), ("password",
                 parsed.password), ("host", parsed.host), ("port", parsed.port)) if value]
    if authority:
        raise InvalidArgument(
            f"database URL {where!r} gives a SQLite file a {' and a '.join(authority)}, "
            "which a file has none of (two slashes after 'sqlite:' begin a host); write "
            f"{_SQLITE_URL_FORMS}", field="url")
    for key, value in parsed.query.items():
        if key in SQLITE_OPTIONS:
            if not isinstance(value, str):
                # SQLAlchemy keeps every value; which one would hold is no one's guess.
                raise InvalidArgument(
                    f"database URL {where!r} gives the SQLite option {key!r} "
                    f"{len(value)} times; give it once", field="url")
        elif key.casefold() not in SQLITE_URI_OPTIONS and key.casefold() != "uri":
            raise InvalidArgument(
                f"database URL {where!r} gives the option {key!r}, which a SQLite ledger "
                "does not take; drop it (timeout=SECONDS is the one option it takes)",
                field="url")


def database_name(parsed: URL) -> str | None:
    """The database a PostgreSQL URL names: in its path, or as libpq's ``dbname=``."""
    given = parsed.database or parsed.query.get("dbname")
    return given if isinstance(given, str) and given else None


def sqlite_not_a_file(parsed: URL) -> str | None:
    """What a SQLite URL names instead of a database file: ``"no file"`` (a temporary database),
    ``"an in-memory database"``, or ``None`` when it names a file.

    Every spelling SQLite (or SQLAlchemy's ``uri=true``) reads as in memory: ``:memory:``,
    the URI filenames ``file::memory:`` and ``file:NAME?mode=memory`` (the options in the
    URL's query or in the name), and the ``memdb`` VFS. Without ``uri=true`` SQLite reads a
    ``file:`` name as a file name, and would make a file called ``file::memory:``.
    """
    db = parsed.database or ""
    options: dict[str, str] = {}
    for key, value in parsed.query.items():
        options[key] = value if isinstance(value, str) else value[-1]
    if db.startswith("file:"):
        name, _, query = db[len("file:"):].partition("?")
        options.update(parse_qsl(query, keep_blank_values=True))
        if name.startswith("//"):  # file://HOST/path: the path after the authority
            name = "/" + name[2:].partition("/")[2]
        db = name
    if db == ":memory:" or options.get("mode", "").casefold() == "memory" \
            or options.get("vfs", "").casefold() == "memdb":
        return "an in-memory database"
    return None if db else "no file"


def sqlite_file(norm: str, parsed: URL) -> str:
    """The database file of a SQLite URL, whose folder exists: never an in-memory database
    (:func:`sqlite_not_a_file`), whatever its spelling, nor a ``file:`` URI filename."""
    check_sqlite_url(parsed, redact_url(norm))
    db = parsed.database
    what = sqlite_not_a_file(parsed)
    if not db or what is not None:
        what = what or "no file"
        raise InvalidArgument(
            f"url {norm!r} names {what}: the ledger needs a SQLite *file* (several connections "
            "share it); pass a path such as ./ledger.db",
            field="url",
        )
    unheld = sorted(k for k in parsed.query if k.casefold() in SQLITE_URI_OPTIONS)
    if unheld:
        # SQLAlchemy hands these to SQLite with uri=true (and ignores them without it), while
        # the hot path opens the file as named: mode=ro made the schema's connection read-only
        # and the Attempts' read-write.
        raise InvalidArgument(
            f"url {norm!r} gives the SQLite URI option(s) {', '.join(unheld)}, which the "
            "ledger's own connections do not take (a ledger reads and writes its file as it "
            "is); drop them from the URL (timeout=SECONDS is the one option it takes)",
            field="url",
        )
    if db.startswith("file:"):
        # SQLAlchemy opens a file: name as a plain path unless the URL says uri=true, while the
        # ledger's own sqlite3 connections hand SQLite the name as it is (a URI wherever SQLite
        # reads URI filenames): the schema went to a file called "file:x.db" and the Attempts
        # to x.db.
        raise InvalidArgument(
            f"url {norm!r} names the SQLite URI filename {db!r}, which the ledger's connections "
            "would not all open as one file; pass the file's path, such as ./ledger.db or "
            "sqlite:///path/to/ledger.db",
            field="url",
        )
    uri = sorted(k for k in parsed.query if k.casefold() == "uri")
    if uri:
        # Alone it changes nothing SQLite reads (a plain path is no URI filename), and the
        # ledger takes no option it would not honour on every connection.
        raise InvalidArgument(
            f"url {norm!r} gives the SQLite URI option {uri[0]}, which the ledger's own "
            "connections do not take (they open the file as named); drop it from the URL "
            "(timeout=SECONDS is the one option it takes)",
            field="url",
        )
    parent = os.path.dirname(os.path.abspath(db))
    if not os.path.isdir(parent):
        # Retrying cannot create a folder: a set-up problem, not an unavailable database.
        raise DatabaseSetupError(
            f"cannot open SQLite database {db!r}: folder {parent!r} does not exist; "
            "create it (mkdir -p) or choose another path; retrying will not help",
            url=redact_url(norm), problem="folder_missing", database=db, role=None,
        )
    _refuse_directory(norm, db)
    # SQLite makes the file there, and in WAL mode its -wal and -shm files beside it (they go
    # when the last connection closes): without the right to, it says only "unable to open
    # database file", or blames the file.
    made = [p for p in (db, db + "-wal", db + "-shm") if not os.path.exists(p)]
    if made and not _folder_writable(db):
        names = ", ".join(os.path.basename(p) for p in made)
        raise DatabaseSetupError(
            f"cannot open SQLite database {db!r}: folder {parent!r} is not writable by this "
            f"process, and SQLite must create {names} there (a ledger keeps its -wal and -shm "
            "files beside its file, even to read it); make the folder writable for this user "
            "or choose another path (to read a copy, copy it to a folder this user can "
            "write); retrying will not help",
            url=redact_url(norm), problem="folder_read_only", database=db, role=None,
        )
    return db


def _folder_writable(path: str) -> bool:
    """Whether this process may make files in ``path``'s folder (SQLite's -wal and -shm)."""
    return os.access(os.path.dirname(os.path.abspath(path)), os.W_OK | os.X_OK)


def _refuse_directory(norm: str, db: str) -> None:
    """Refuse a SQLite "file" that is a directory: a set-up problem, not an outage."""
    if os.path.isdir(db):
        # SQLite says only "unable to open database file" (or "disk I/O error"), which read
        # as an outage, and a wrapper retried it for ever.
        raise DatabaseSetupError(
            f"cannot open SQLite database {db!r}: it is a directory, not a file; name a file "
            f"inside it (e.g. {os.path.join(db, 'ledger.db')!r}) or another path; retrying will "
            "not help",
            url=redact_url(norm), problem="not_a_file", database=db, role=None,
        )


#: What a SQLite file holds (:func:`file_holds`).
Holds = Literal["empty", "ledger", "foreign", "not_sqlite"]
# Every revision of the ledger's schema has both; another application's file may have one.
_LEDGER_TABLES = frozenset({"alembic_version", "runs"})


def file_holds(path: str, timeout_s: float = 5.0) -> Holds:
    """What the SQLite file at ``path`` holds, read without writing a byte of it, and leaving
    no ``-wal`` or ``-shm`` file beside it that was not there.

    ``"empty"``: no file, an empty one, or a database without tables (the ledger may create
    its schema there); ``"ledger"``: the ledger's schema (its ``alembic_version`` and ``runs``
    tables); ``"foreign"``: tables, but not the ledger's (another application's database);
    ``"not_sqlite"``: a file that is not a SQLite database. ``timeout_s``: how long it waits
    for another connection's lock. The one rule for "is this file a
    ledger": migrating
    (:meth:`ledger.storage.sqlite.SqliteContext.refuse_foreign`), the reporting commands and the
    demo all ask it.

    Raises:
        DatabaseSetupError: ``path`` is a directory (``problem="not_a_file"``), as
            :func:`sqlite_file` says; no retry makes it a file.
    """
    _refuse_directory("sqlite:///" + os.path.abspath(path), path)
    try:
        if os.path.getsize(path) == 0:
            return "empty"
    except FileNotFoundError:
        return "empty"
    # Not through the engine: its connection switches the file to WAL first, which writes the
    # file's header, and a file that is not a ledger must stay as it was.
    uri = Path(path).resolve().as_uri() + _holds_mode(path)
    with mapped_errors("sqlite:///" + os.path.abspath(path)):
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=timeout_s)
            try:
                names = {str(r[0]) for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'")}
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            if getattr(e, "sqlite_errorname", "") == "SQLITE_NOTADB":
                return "not_sqlite"
            raise
    names = {n for n in names if not n.startswith("sqlite_")}  # SQLite's own (sqlite_sequence)
    if not names:
        return "empty"
    return "ledger" if names >= _LEDGER_TABLES else "foreign"


def _holds_mode(path: str) -> str:
    """How :func:`file_holds` opens ``path`` (see :func:`_wal_unopened`).

    A WAL-mode file no connection has open, in a folder this process may not write, is read
    ``immutable``: SQLite cannot create the ``-shm`` file a WAL reader needs there, and read
    only or not, it said "attempt to write a readonly database", which the reporting commands
    told as a refused write. No writer can have the file open (it would have made the
    ``-wal``), so nothing changes under the read; the open that follows names the folder
    (:func:`sqlite_file`'s ``folder_read_only``)."""
    if not _wal_unopened(path):
        return "?mode=ro"
    if _folder_writable(path):
        return "?mode=rw"
    return "?mode=ro&immutable=1"


def _wal_unopened(path: str) -> bool:
    """Whether ``path`` is a WAL-mode SQLite file that no connection has open (nor left a
    journal of).

    Reading such a file read-only creates its ``-wal`` and ``-shm`` files and leaves them:
    only a writable connection removes them, when it closes as the last one. Such a connection
    runs no statement that writes, and its checkpoint on closing copies only frames another
    connection wrote meanwhile (none, when nothing else opened the file); SQLite removes the
    files only when no other connection, of any process, has the file open. A file in use, a
    rollback-journal file, or one with a journal to recover is read read-only: that creates
    no file beside it, and recovers nothing.
    """
    if any(os.path.exists(path + side) for side in ("-wal", "-shm", "-journal")):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    # The header's write and read versions (bytes 18 and 19) are 2 in WAL mode.
    return head[:16] == b"SQLite format 3\x00" and head[18:20] == b"\x02\x02"


def not_a_ledger(holds: Holds) -> str:
    """Why a file holding ``holds`` (``"foreign"`` or ``"not_sqlite"``) is no ledger, for a
    message."""
    return ("it is not a SQLite database" if holds == "not_sqlite"
            else "it holds another application's tables and no ledger schema")


def sqlite_busy_timeout(parsed: URL) -> float:
    """How long a SQLite connection waits for another's write lock (seconds): the URL's
    ``?timeout=`` or :data:`SQLITE_BUSY_TIMEOUT_MS`."""
    raw = parsed.query.get("timeout")
    if raw is None:
        return SQLITE_BUSY_TIMEOUT_MS / 1000
    try:
        value = float(raw if isinstance(raw, str) else raw[-1])
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise InvalidArgument(
            f"the SQLite URL's timeout={raw!r} is not a number of seconds from 0 to 3600; "
            "pass e.g. sqlite:///ledger.db?timeout=5", field="url")
    return value


def sqlite_engine(parsed: URL, busy_timeout_s: float) -> Engine:
    """An engine for a SQLite file: WAL, ``synchronous=FULL``, the busy timeout, and
    ``BEGIN IMMEDIATE`` for the write transactions."""
    engine = create_engine(
        parsed.difference_update_query(["timeout"]),
        connect_args={"timeout": busy_timeout_s, "isolation_level": None},
        pool_pre_ping=False,
    )
    _install_sqlite_hooks(engine, int(busy_timeout_s * 1000))
    return engine


def postgres_driver(norm: str, parsed: URL) -> None:
    """Check that a PostgreSQL URL names psycopg 3 and that it is installed."""
    if parsed.get_driver_name() != "psycopg":
        raise InvalidArgument(
            f"unsupported PostgreSQL driver {parsed.get_driver_name()!r}; "
            "use postgresql+psycopg://",
            field="url",
        )
    _require_psycopg(norm)


def postgres_conninfo(norm: str, parsed: URL, *, reads: bool = False) -> str:
    """The libpq connection string of a PostgreSQL URL (psycopg 3 only; every spelling of
    several hosts: :mod:`ledger.storage.pgurl`), checked without any name lookup; ``reads``:
    of a read replica (read-only sessions, a standby preferred).

    Every PostgreSQL path goes through it (a store, a read replica, ``db init``), so a URL
    that names no database is refused here: libpq would connect to the database named after
    the user (often the server's own ``postgres``) and the ledger would make its schema there.
    """
    if not database_name(parsed):
        raise InvalidArgument(
            f"{redact_url(norm)} names no database; add it to the URL: "
            "postgresql+psycopg://user:password@host:port/DBNAME", field="url")
    postgres_driver(norm, parsed)
    return conninfo(parsed, redact_url(norm), reads=reads)


def postgres_engine(parsed: URL, creator: Callable[[], Any], **options: Any) -> Engine:
    """An engine for a PostgreSQL URL that keeps no connection of its own: each one comes from
    ``creator`` (a store's pool, which takes it back when SQLAlchemy closes it; or a
    connection opened for one use). The engine's own URL carries no host: SQLAlchemy never
    connects by itself, so the hosts are read once, by :func:`postgres_conninfo`."""
    url = URL.create(parsed.drivername, username=parsed.username, database=parsed.database)
    engine = create_engine(url, poolclass=NullPool, creator=creator, **options)
    event.listen(engine, "handle_error", _standby_drops)
    return engine


def _standby_drops(context: Any) -> None:
    """A write a standby refused drops its connection (SQLAlchemy invalidates it, as it does
    a lost one), so that no later statement runs on it; the error says why
    (:func:`ledger.storage.failure.standby_error`). A server that does not report itself a
    standby is asked (:func:`~ledger.storage.pgpool.read_only_session`, once the refused
    transaction is rolled back): a primary that refuses this session's writes leaves the
    connection be, and the error is the set-up problem it is
    (:class:`~ledger.errors.DatabaseReadOnly`)."""
    from ledger.storage.pgpool import on_standby, read_only_session

    if getattr(context.original_exception, "sqlstate", None) != "25006":
        return
    conn = context.connection
    raw = conn.connection.driver_connection if conn is not None and not conn.invalidated \
        else None
    if raw is None or raw.closed:
        return
    if on_standby(raw):
        context.is_disconnect = True
        return
    # The refused transaction is over (the server rolls it back on any error): ended here so
    # that the server can be asked; SQLAlchemy's own rollback after this finds nothing to end.
    try:
        raw.rollback()
    except Exception:
        context.is_disconnect = True  # no answer: as a standby's, retried on a new connection
        return
    if not read_only_session(raw):
        context.is_disconnect = True


POSTGRES_EXTRA_HINT = "pip install 'failover-ledger[postgres]'"


def _require_psycopg(url: str) -> None:
    """PostgreSQL needs the optional ``postgres`` extra (psycopg 3 and its pool); say so
    before SQLAlchemy or the pool fails on the missing module with a bare ImportError."""
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError as e:
        raise InvalidArgument(
            f"{redact_url(url)} is a PostgreSQL ledger, but the PostgreSQL driver (psycopg 3 "
            f"with psycopg_pool) is not installed; install the extra: {POSTGRES_EXTRA_HINT}",
            field="url", extra="postgres",
        ) from e


def _install_sqlite_hooks(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
        switch_to_wal(dbapi_conn, busy_timeout_ms / 1000)
        cur.execute("PRAGMA synchronous = FULL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # pysqlite's own transaction handling is off (isolation_level=None); we emit BEGIN
        # ourselves so that writes take the write lock up front.
        if conn.get_execution_options().get("ledger_write"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


@contextmanager
def mapped_errors(url: str) -> Iterator[None]:
    """Driver and SQLAlchemy errors leaving the block as ledger errors
    (:mod:`ledger.storage.failure`); the transaction has been rolled back."""
    with mapped(redact_url(url)):
        yield
