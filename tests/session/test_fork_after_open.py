"""A process forked after ``Ledger.open`` (gunicorn ``--preload``, Celery's prefork pool,
multiprocessing's ``fork``): the child is an executor of its own, on connections and threads of
its own, and the parent goes on unharmed.

Before the fix the child kept its parent's default executor id, so parent and child entering
one Run both held fence 1 of its lease and both sent the turn; and it kept the parent's pooled
PostgreSQL connections, so the two processes' messages interleaved on one socket (replies
crossed, ``prepared statement _pg3_1 already exists``, then hangs), and the parent's SQLite
writer and ``ledger-cold`` threads, which do not exist in a child (its asyncio calls waited for
ever). Each test forks with ``os.fork()``; the child reports through a pipe and leaves with
``os._exit``. Both backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Ledger, Part
from ledger.adapters import ClientRegistry
from ledger.api.face import storage_of
from ledger.errors import LeaseHeld
from ledger.storage.pgpool import own_pids, release
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake
_clear = fakeplan._clear

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() is POSIX's")

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived"]})
HELLO = Envelope(parts=[Part(content="hello")], stream=False)
#: How long the parent waits for a child's report before it ends the child (a hang).
CHILD_S = 60.0


class Child:
    """A forked child running ``work(child)``; its JSON reports read by the parent."""

    def __init__(self, work: Callable[[Child], Any]) -> None:
        self._reports, self._writer = os.pipe()
        self._go_read, self._go = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            status = 0
            try:
                os.close(self._reports)
                os.close(self._go)
                self.report({"done": work(self)})
            except BaseException as e:
                status = 1
                with contextlib.suppress(BaseException):
                    self.report({"error": f"{type(e).__name__}: {e}"})
            finally:
                os._exit(status)
        os.close(self._writer)
        os.close(self._go_read)
        self._buffer = b""

    def report(self, value: Any) -> None:
        """In the child: tell the parent ``value``."""
        os.write(self._writer, (json.dumps(value) + "\n").encode())

    def wait_go(self) -> None:
        """In the child: wait until the parent says :meth:`go`."""
        os.read(self._go_read, 1)

    def go(self) -> None:
        os.write(self._go, b"g")

    def next(self) -> Any:
        """The child's next report; a child silent for :data:`CHILD_S` is ended (it hung)."""
        deadline = time.monotonic() + CHILD_S
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._reports], [], [], max(left, 0))
            if not ready:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                pytest.fail(f"the forked child hung (nothing reported in {CHILD_S} s)")
            chunk = os.read(self._reports, 65536)
            if not chunk:
                os.waitpid(self.pid, 0)
                pytest.fail("the forked child ended without reporting")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def result(self) -> Any:
        """The child's last report (``work``'s result), once it has exited."""
        got = self.next()
        _, status = os.waitpid(self.pid, 0)
        os.close(self._reports)
        os.close(self._go)
        assert "error" not in got, got["error"]
        assert os.waitstatus_to_exitcode(status) == 0
        return got["done"]


def _turn(led: Ledger, run_id: str, routes: list[Any]) -> str:
    with led.run(run_id, plan=routes, budget=BUDGET, grant=GRANT) as run:
        return run.turn(HELLO).text


async def _aturn(led: AsyncLedger, run_id: str, routes: list[Any]) -> str:
    async with led.run(run_id, plan=routes, budget=BUDGET, grant=GRANT) as run:
        return (await run.turn(HELLO)).text


def test_a_forked_child_is_an_executor_of_its_own_so_one_of_parent_and_child_holds_a_run(
        db_url: str, fake: Any) -> None:
    routes = plan(fake)
    with Ledger.open(db_url) as led:
        _turn(led, "before", routes)  # connections, threads and pools exist at the fork
        fake.clear()
        parent_id = led.executor_id

        def in_child(child: Child) -> Any:
            with led.run("shared", plan=routes, budget=BUDGET, grant=GRANT) as run:
                child.report({"entered": run.lease.executor, "fence": run.lease.fence})
                child.wait_go()  # the parent tries the Run meanwhile
                text = run.turn(HELLO).text
            return {"executor": led.executor_id, "text": text}

        child = Child(in_child)
        entered = child.next()
        assert "error" not in entered, entered
        assert entered["entered"] != parent_id, "the child took its parent's executor id"
        # The parent is another executor: the child's live lease is not its own.
        with pytest.raises(LeaseHeld), led.run("shared", plan=routes, budget=BUDGET,
                                               grant=GRANT):
            pass
        child.go()
        done = child.result()
        assert done["executor"] == entered["entered"] != led.executor_id == parent_id
        assert len(fake.requests) == 1  # one turn, sent once
        attempts = led.timeline("shared")
        assert [(a.executor, a.fence) for a in attempts] == [(entered["entered"], 1)]
        # The parent goes on: the Run is free once the child left it.
        assert _turn(led, "after", routes)


def test_an_explicit_executor_id_is_kept_in_a_forked_child(db_url: str) -> None:
    with Ledger.open(db_url, executor_id="host-1") as led:
        child = Child(lambda _: led.executor_id)
        assert child.result() == "host-1"  # the host's promise to differ per process
        assert led.executor_id == "host-1"


def test_parent_and_child_are_each_served_on_their_own_runs_and_the_parent_goes_on(
        db_url: str, fake: Any) -> None:
    routes = plan(fake)
    led = Ledger.open(db_url)
    aled = AsyncLedger(led)
    try:
        # Before the fork the parent has used both paths, blocking and asyncio: its pooled
        # connections, SQLite's writer thread and the ledger-cold threads all exist.
        _turn(led, "before", routes)
        asyncio.run(_aturn(aled, "before-async", routes))

        def in_child(_: Child) -> Any:
            texts = [_turn(led, f"child-{i}", routes) for i in range(3)]
            texts.append(asyncio.run(_aturn(aled, "child-async", routes)))
            return texts

        child = Child(in_child)
        texts = [_turn(led, f"parent-{i}", routes) for i in range(3)]
        texts.append(asyncio.run(_aturn(aled, "parent-async", routes)))
        assert all(texts)
        assert all(child.result())
        # The parent goes on after the child is gone, both ways.
        assert _turn(led, "after", routes)
        assert asyncio.run(_aturn(aled, "after-async", routes))
        for run_id in ("child-0", "child-1", "child-2", "child-async", "parent-0", "parent-1",
                       "parent-2", "parent-async", "after", "after-async"):
            assert [a.state.value for a in led.timeline(run_id)] == ["succeeded"], run_id
            assert led.get_run(run_id).lease_holder is None, run_id
    finally:
        led.close()


def _backend_pid(conn: Any) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return int(row[0])


@pytest.mark.postgres
def test_a_forked_child_never_uses_a_connection_it_inherited(pg_url: str, fake: Any) -> None:
    routes = plan(fake)
    with Ledger.open(pg_url) as led:
        store = storage_of(led)
        pool = store.driver.pool  # type: ignore[attr-defined]
        _turn(led, "before", routes)
        inherited = own_pids(pool.where)
        assert inherited  # the parent's pool holds connections at the fork

        def in_child(_: Child) -> Any:
            seen = []
            for _ in range(3):  # the hot path's checkouts
                conn = pool.checkout()
                try:
                    seen.append(_backend_pid(conn))
                finally:
                    release(conn)
            with store.context.engine.connect() as conn:  # the cold path's (SQLAlchemy)
                seen.append(int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()))
            _turn(led, "in-child", routes)
            return {"seen": seen, "own": sorted(own_pids(pool.where))}

        got = Child(in_child).result()
        assert not set(got["seen"]) & inherited, "the child used its parent's connections"
        assert not set(got["own"]) & inherited
        # The parent's sessions are untouched: its pooled connections still serve it.
        assert _turn(led, "after", routes)
        conn = pool.checkout()
        try:
            assert _backend_pid(conn) in inherited | own_pids(pool.where)
        finally:
            release(conn)


class _PortEcho(http.server.BaseHTTPRequestHandler):
    """Answers each request with the client port it came from (keep-alive, HTTP/1.1)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = json.dumps({"port": self.client_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


def test_a_forked_child_never_uses_an_http_connection_its_parent_kept_open() -> None:
    # An adapter's clients keep their connections to a provider open between calls: a child
    # using the parent's would interleave its requests with the parent's on one socket, each
    # reading the other's answers (one Attempt settled with another's answer and usage).
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PortEcho)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    registry = ClientRegistry()
    try:
        first = registry.get_sync(url).get(url).json()["port"]
        child = Child(lambda _c: registry.get_sync(url).get(url).json()["port"])
        assert child.result() != first
        # The parent's connection is its own still, and serves it.
        assert registry.get_sync(url).get(url).json()["port"] == first
    finally:
        registry.close()
        server.shutdown()
        server.server_close()


def test_a_lock_another_thread_held_as_the_process_forked_is_free_in_the_child() -> None:
    # Only the forking thread exists in a child: a module lock another thread of the parent
    # held then (building a TLS context or a validator, registering a secret, arming a fault
    # point, remembering a session) would never be released there, and the child's first use
    # of it would hang.
    from ledger import faults, redaction
    from ledger.adapters import transport
    from ledger.domain import validation
    from ledger.integrations import _run

    def locks() -> dict[str, Any]:
        return {"tls": transport._TLS_LOCK, "building": validation._BUILDING,
                "secrets": redaction._REGISTRY._lock, "install": redaction._install_lock,
                "faults": faults._lock, "memory": _run._MEMORY_LOCK}

    held, release_them = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.ExitStack() as stack:
            for lock in locks().values():
                stack.enter_context(lock)
            held.set()
            release_them.wait(CHILD_S)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(CHILD_S)
    try:
        child = Child(lambda _c: {name: lock.acquire(timeout=5)
                                  for name, lock in locks().items()})
        got = child.result()
    finally:
        release_them.set()
        holder.join()
    assert got == dict.fromkeys(got, True) and len(got) == 6
