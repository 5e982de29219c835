"""A loopback TCP proxy in front of PostgreSQL that loses a connection at a chosen COMMIT.

:class:`CommitCutter` forwards every connection (the ledger's hot path and its SQLAlchemy cold
path alike) to a real server, reading the frontend protocol as it goes: simple queries
(``Q``) and the extended protocol (``Parse``/``Bind``/``Execute``, prepared statements
included, as psycopg sends them in pipelines). It counts the ``COMMIT`` statements executed
through it and names each by the statements of its transaction (``begin``, ``settle``,
``finish``, ``release``, ``acquire``, ``renew``, ``admit``, ``read``, ...).

Armed with ``arm(n)``, the n-th ``COMMIT`` loses its connection:

* ``mode="after"``: the ``COMMIT`` (through its ``Sync``) is forwarded to the server, then the
  client's side is closed before any answer reaches it, and the server's side is shut for
  writing (the server reads the ``COMMIT`` first, commits, then sees the end). The commit
  lands; its acknowledgement is lost.
* ``mode="instead"``: the ``COMMIT`` is never forwarded; both sides are closed. The server
  rolls the transaction back; the client cannot tell the two apart.
* ``mode="terminated"``: the ``COMMIT`` (through its ``Sync``) is forwarded and the server's
  answers reach the client up to the ``ReadyForQuery`` that ends them, which is replaced by the
  ``FATAL`` error (SQLSTATE 57P01) of a backend ended by ``pg_terminate_backend``; then both
  sides are closed. The commit lands, and the client reads its ``COMMIT``'s success and then a
  session ended in the middle of its pipeline, before it sees the connection close — what a
  terminate landing between the server's ``COMMIT`` and its ``ReadyForQuery`` looks like (psycopg
  raises ``cannot exit pipeline mode while busy`` on a connection not yet closed).

``arm_kind(..., down=True)`` then takes the database away right after the cut, as a primary that
died with no standby promoted yet: every connection is closed, and every new one is closed as
soon as it is accepted, until :meth:`CommitCutter.up`.

``stall(marker)`` makes the server slow to read: the client's bytes that carry the next
statement whose text holds ``marker`` (and all after them on that connection) are held until a
cancel request has gone through the proxy (its connection ended: the server signalled the
session), so that the session is idle when the cancel comes, and ignores it.

``hold()`` makes the server slow to take new connections: each one accepted from then on waits,
unforwarded, until :meth:`CommitCutter.unhold` (``held`` says when each was accepted); the
connections already made keep working.

Everything is on 127.0.0.1. Threads, not asyncio: the sync and the async ledger both talk to it.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

_MODES = ("after", "instead", "terminated")
# What a server sends a session pg_terminate_backend ends (severity, SQLSTATE 57P01, message).
_TERMINATED = b"".join((b"SFATAL\0", b"VFATAL\0", b"C57P01\0",
                        b"Mterminating connection due to administrator command\0", b"\0"))
_TERMINATED_MSG = b"E" + struct.pack("!i", 4 + len(_TERMINATED)) + _TERMINATED

# Startup-phase request codes that are followed by another startup message.
_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
# How long stalled bytes wait for a cancel request at most: a test that misses fails, never hangs.
STALL_S = 30.0


@dataclass
class Commit:
    """One COMMIT executed through the proxy: its ordinal, its kind, whether it was cut."""

    n: int
    kind: str
    cut: str | None = None


# The statements that name a transaction, first match wins (a begin also updates the run's
# status, so the attempts insert is looked for first).
_KINDS = (
    ("INSERT INTO attempts", "begin"),
    ("UPDATE attempts SET state=", "settle"),
    ("INSERT INTO runs", "admit"),
    ("UPDATE runs SET status=", "finish"),
    ("lease_holder=NULL", "release"),
    ("SET lease_holder=", "acquire"),
    ("UPDATE runs SET lease_expires_at=", "renew"),
    ("INSERT INTO events", "event"),
    ("INSERT INTO group_waiters", "queue"),
    ("UPDATE health", "probe"),
)


def _kind(statements: list[str]) -> str:
    # Spelled as compiled or as written by hand: ``a=b`` and ``a = b`` are one marker.
    text = re.sub(r"\s*=\s*", "=", "\n".join(statements))
    for marker, kind in _KINDS:
        if marker in text:
            return kind
    writes = ("INSERT", "UPDATE", "DELETE")
    return "write" if any(s.lstrip().upper().startswith(writes) for s in statements) else "read"


def _cstring(buf: bytes, at: int) -> tuple[str, int]:
    end = buf.index(b"\0", at)
    return buf[at:end].decode("utf-8", "replace"), end + 1


@dataclass
class _Conn:
    """What the proxy knows of one client connection's protocol state."""

    client: socket.socket
    server: socket.socket
    buf: bytes = b""
    startup: bool = True
    statements: dict[str, str] = field(default_factory=dict)  # prepared name -> query
    portals: dict[str, str] = field(default_factory=dict)  # portal -> query
    tx: list[str] = field(default_factory=list)  # statements since the last COMMIT/ROLLBACK
    cutting: str | None = None  # a cut under way: forward through the next Sync, then cut
    dead: bool = False
    cancel: bool = False  # a cancel request's connection
    stalled: bool = False  # the next bytes wait for a cancel request (CommitCutter.stall)
    # Set by a "terminated" cut, before the COMMIT reaches the server: the server's answers
    # from then on are read message by message (it flushes them at the Sync, so the first
    # byte after the cut starts a message), up to the ReadyForQuery the FATAL replaces.
    terminating: bool = False


class CommitCutter:
    """The proxy (see the module docstring); ``port`` is where the ledger connects."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._cuts: dict[int, str] = {}
        self._kinds: dict[str, str] = {}
        self._then: list[str] = []
        self._down_after = False
        self.down = False
        self.commits: list[Commit] = []
        self._conns: list[_Conn] = []
        self._closed = False
        self._admit = threading.Event()
        self._admit.set()
        self.held: list[float] = []  # time.monotonic() of each connection accepted while held
        self._stall: str | None = None
        self._cancelled = threading.Event()
        self._accepter = threading.Thread(target=self._accept, daemon=True,
                                          name="commit-cutter")
        self._accepter.start()

    def url(self, db: str, user: str = "postgres") -> str:
        """The ledger URL of database ``db`` through the proxy."""
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{db}"

    def arm(self, *cuts: int | tuple[int, str], mode: str = "after") -> None:
        """Count COMMITs from zero; lose the connection of each ``cuts``-th (none: none),
        the ``mode`` way, or the way a ``(n, mode)`` pair says."""
        modes = dict(c if isinstance(c, tuple) else (c, mode) for c in cuts)
        assert set(modes.values()) <= set(_MODES)
        with self._lock:
            self._cuts, self._kinds, self._then = modes, {}, []
            self._down_after = False
            self.commits = []

    def arm_kind(self, kind: str, mode: str = "after", *, then: tuple[str, ...] = (),
                 down: bool = False) -> None:
        """Count COMMITs from zero; lose the connection of the first one of ``kind``, and of
        the ``len(then)`` COMMITs right after it, the ways ``then`` says; with ``down``, the
        database is away from the first cut on (until :meth:`up`)."""
        assert {mode, *then} <= set(_MODES)
        with self._lock:
            self._cuts, self._kinds, self._then = {}, {kind: mode}, list(then)
            self._down_after = down
            self.commits = []

    def up(self) -> None:
        """The database answers again (after ``arm_kind(..., down=True)``); nothing is armed."""
        with self._lock:
            self.down, self._down_after = False, False
            self._cuts, self._kinds, self._then = {}, {}, []

    def stall(self, marker: str) -> None:
        """Hold the bytes of the next statement whose text holds ``marker``, and what follows
        them on its connection, until a cancel request has gone through (or ``STALL_S``)."""
        with self._lock:
            self._stall = marker
            self._cancelled.clear()

    def hold(self) -> None:
        """New connections wait, unanswered, until :meth:`unhold` (a server slow to accept)."""
        self._admit.clear()

    def unhold(self) -> None:
        """The connections held are made, and new ones again at once."""
        self._admit.set()

    @property
    def cuts(self) -> list[Commit]:
        """The COMMITs whose connection was lost."""
        with self._lock:
            return [c for c in self.commits if c.cut is not None]

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._closed = True
        self._admit.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for c in list(self._conns):
            self._kill(c)

    def __enter__(self) -> CommitCutter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._admit.is_set():
                self.held.append(time.monotonic())
                self._admit.wait()
                if self._closed:
                    client.close()
                    return
            if self.down:  # the database is away: the connection ends before a word
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, server)
            with self._lock:
                # Checked again under the lock: a connection accepted while the database went
                # away (_go_down) must not outlive it.
                away = self.down
                if not away:
                    self._conns.append(conn)
            if away:
                self._kill(conn)
                continue
            threading.Thread(target=self._upstream, args=(conn,), daemon=True).start()
            threading.Thread(target=self._downstream, args=(conn,), daemon=True).start()

    def _downstream(self, conn: _Conn) -> None:
        """Server to client, until either side ends (or the connection is cut)."""
        pending = b""
        while True:
            try:
                data = conn.server.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            if conn.dead:
                continue  # a cut connection: the server's answers are drained, never told
            if conn.terminating:
                data, pending, ready = _until_ready(pending + data)
                if ready:
                    with contextlib.suppress(OSError):
                        conn.client.sendall(data + _TERMINATED_MSG)
                    self._kill(conn)
                    return
            try:
                conn.client.sendall(data)
            except OSError:
                if conn.dead:
                    # Cut while this answer was on its way: the cut closed the client, and
                    # has yet to forward the COMMIT. Closing the server's side here could
                    # drop it (an "after" cut told "instead"): drain until the server ends.
                    continue
                break
        if conn.cancel:
            self._cancelled.set()  # the server ended it: the session was signalled
        if not conn.dead:
            self._kill(conn)
        with contextlib.suppress(OSError):
            conn.server.close()

    def _upstream(self, conn: _Conn) -> None:
        """Client to server, message by message."""
        while not conn.dead:
            try:
                data = conn.client.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._kill(conn)
                return
            conn.buf += data
            out, cut = self._messages(conn)
            if cut is not None:
                self._cut_off(conn, out, cut)
                if self._down_after:
                    self._go_down()
                return
            if conn.stalled:
                self._cancelled.wait(STALL_S)
                conn.stalled = False
            try:
                if out:
                    conn.server.sendall(out)
            except OSError:
                self._kill(conn)
                return

    def _messages(self, conn: _Conn) -> tuple[bytes, str | None]:
        """The complete messages of ``conn.buf`` to forward, and a cut to make after them."""
        out = bytearray()
        while True:
            buf = conn.buf
            if conn.startup:
                if len(buf) < 8:
                    return bytes(out), None
                (length,) = struct.unpack("!i", buf[:4])
                if len(buf) < length:
                    return bytes(out), None
                (code,) = struct.unpack("!i", buf[4:8])
                conn.startup = code in (_SSL_REQUEST, _GSS_REQUEST)
                out += buf[:length]
                conn.buf = buf[length:]
                if code == _CANCEL_REQUEST:
                    conn.startup, conn.cancel = False, True
                continue
            if len(buf) < 5:
                return bytes(out), None
            kind = buf[:1]
            (length,) = struct.unpack("!i", buf[1:5])
            if len(buf) < 1 + length:
                return bytes(out), None
            msg, conn.buf = buf[:1 + length], buf[1 + length:]
            body = msg[5:]
            committed = False
            if kind == b"Q":
                query, _ = _cstring(body, 0)
                self._stalls(conn, query)
                committed = self._executed(conn, query)
            elif kind == b"P":
                name, at = _cstring(body, 0)
                query, _ = _cstring(body, at)
                self._stalls(conn, query)
                conn.statements[name] = query
            elif kind == b"B":
                portal, at = _cstring(body, 0)
                stmt, _ = _cstring(body, at)
                conn.portals[portal] = conn.statements.get(stmt, "")
            elif kind == b"E":
                portal, _ = _cstring(body, 0)
                committed = self._executed(conn, conn.portals.get(portal, ""))
            if committed:
                cut = self._count(conn)
                if cut == "instead":
                    return bytes(out), "instead"  # the COMMIT never reaches the server
                if cut in ("after", "terminated"):
                    conn.cutting = cut
                    if kind == b"Q":
                        return bytes(out + msg), cut
            out += msg
            if conn.cutting is not None and kind == b"S":
                return bytes(out), conn.cutting

    def _stalls(self, conn: _Conn, query: str) -> None:
        with self._lock:
            if self._stall is not None and self._stall in query:
                self._stall, conn.stalled = None, True

    def _executed(self, conn: _Conn, query: str) -> bool:
        """Note a statement run on ``conn``; whether it was a COMMIT."""
        head = query.strip().rstrip(";").strip().upper()
        if head == "COMMIT":
            return True
        if head == "ROLLBACK":
            conn.tx = []
        elif head != "BEGIN" and not head.startswith("SELECT 1"):
            conn.tx.append(query)
        return False

    def _count(self, conn: _Conn) -> str | None:
        with self._lock:
            commit = Commit(len(self.commits) + 1, _kind(conn.tx))
            conn.tx = []
            self.commits.append(commit)
            if self._then and any(c.cut for c in self.commits[:-1]):
                commit.cut = self._then.pop(0)  # right after a cut by kind
            else:
                commit.cut = self._cuts.get(commit.n) or self._kinds.pop(commit.kind, None)
        return commit.cut

    def _cut_off(self, conn: _Conn, last: bytes, how: str) -> None:
        """Lose the connection: the client hears nothing more (not even an answer the server
        gives ``last``); the server reads ``last``, then the end of its input. ``terminated``:
        the client hears the server's answers to ``last`` but for its ``ReadyForQuery``, then
        the session's end (:meth:`_downstream`)."""
        if how == "terminated":
            conn.terminating = True  # before ``last`` leaves: its answers are read as such
            with contextlib.suppress(OSError):
                conn.server.sendall(last)
            return
        conn.dead = True  # before ``last`` leaves: no answer to it can reach the client
        with contextlib.suppress(OSError):
            conn.client.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            conn.client.close()
        with contextlib.suppress(OSError):
            if last:
                conn.server.sendall(last)
        with contextlib.suppress(OSError):
            conn.server.shutdown(socket.SHUT_WR)  # after the data: FIN, never a reset
        # The downstream thread drains the server's answers until it closes its side.

    def _go_down(self) -> None:
        """The database goes away: every other connection ends, new ones are refused."""
        with self._lock:
            self.down = True
            conns = [c for c in self._conns if not c.dead]
        for c in conns:
            self._kill(c)

    def _kill(self, conn: _Conn) -> None:
        conn.dead = True
        for s in (conn.client, conn.server):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def commit_cutter(target_port: int) -> Iterator[CommitCutter]:
    """A :class:`CommitCutter` in front of the server listening on ``target_port``."""
    cutter = CommitCutter(target_port)
    try:
        yield cutter
    finally:
        cutter.close()


def _until_ready(data: bytes) -> tuple[bytes, bytes, bool]:
    """The server's complete messages at the start of ``data`` up to its first
    ``ReadyForQuery`` (excluded), what is left (an incomplete message), and whether the
    ``ReadyForQuery`` came."""
    at = 0
    while len(data) - at >= 5:
        (length,) = struct.unpack("!i", data[at + 1:at + 5])
        if len(data) - at < 1 + length:
            break
        if data[at:at + 1] == b"Z":
            return data[:at], b"", True
        at += 1 + length
    return data[:at], data[at:], False
