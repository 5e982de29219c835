"""The adapters' pooled connections: reused while the server keeps them, never reused once the
server has closed them.

httpcore's pool asks each idle connection whether its socket is readable (an idle HTTP/1.1
connection that is readable has been closed by its server) before it places a request on it;
the asyncio clients answer that from a socket of ours (``ledger.adapters.transport``). A check
that always said "readable" would open a connection per request; one that never did would send
the next request into a closed connection and fail it. A real server on loopback counts the
connections it accepts.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from ledger.adapters import ClientRegistry

from .loopback import LoopbackServer

PATIENCE_S = 60
CALLS = 5


class _Server(LoopbackServer):
    """HTTP/1.1 on loopback answering ``200 ok`` with keep-alive; with ``close_after``, it
    closes each connection after its answer (without saying so) and marks it closed."""

    def __init__(self, *, close_after: bool) -> None:
        self.close_after = close_after
        self.closed = threading.Semaphore(0)
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}/"

    def serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while (got := self.read_head(conn, buf)) is not None:
                _, buf = got
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                if self.close_after:
                    conn.shutdown(socket.SHUT_RDWR)
                    conn.close()
                    self.closed.release()
                    return


@pytest.fixture
def keeping() -> Iterator[_Server]:
    server = _Server(close_after=False)
    yield server
    server.close()


@pytest.fixture
def closing() -> Iterator[_Server]:
    server = _Server(close_after=True)
    yield server
    server.close()


@pytest.mark.anyio
async def test_async_pool_reuses_a_connection_its_server_keeps(keeping: _Server) -> None:
    registry = ClientRegistry()
    client = registry.get(keeping.url)
    for _ in range(CALLS):
        assert (await client.get(keeping.url)).text == "ok"
    await registry.aclose()
    assert keeping.accepted == 1


@pytest.mark.anyio
async def test_async_pool_never_sends_into_a_connection_its_server_closed(
        closing: _Server) -> None:
    registry = ClientRegistry()
    client = registry.get(closing.url)
    for _ in range(CALLS):
        assert (await client.get(closing.url)).text == "ok"
        assert closing.closed.acquire(timeout=PATIENCE_S)  # closed before the next request
    await registry.aclose()
    assert closing.accepted == CALLS


def test_blocking_pool_reuses_a_connection_its_server_keeps(keeping: _Server) -> None:
    registry = ClientRegistry()
    client = registry.get_sync(keeping.url)
    for _ in range(CALLS):
        assert client.get(keeping.url).text == "ok"
    registry.close()
    assert keeping.accepted == 1


def test_blocking_pool_never_sends_into_a_connection_its_server_closed(
        closing: _Server) -> None:
    registry = ClientRegistry()
    client = registry.get_sync(closing.url)
    for _ in range(CALLS):
        assert client.get(closing.url).text == "ok"
        assert closing.closed.acquire(timeout=PATIENCE_S)
    registry.close()
    assert closing.accepted == CALLS
