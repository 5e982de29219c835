"""Closing a blocking adapter wakes the threads blocked in its calls' socket reads.

A ``SyncAdapter`` shared by threads is closed from one (at exit, or a Run session's block
left) while another's call waits for the provider: for its status line, inside a stream, or
inside a whole body. Its read ends at once, as the local cancellation the adapter documents
(the transport kind of how far it got, ``cancelled``, source ``local``): the thread does not
wait out its read limit. Real HTTP on loopback; the server holds the answer until the test
ends, and the test closes only once the reading thread is inside its socket wait.
"""

from __future__ import annotations

import linecache
import socket
import ssl
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from ledger.adapters import StaticSecretProvider, SyncAdapter
from ledger.clock import ManualClock
from ledger.decide.effects import SendProgress
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Source, Transport
from ledger.policy.model import StreamingPolicy

from .conftest import PROFILE, SECRET, make_route
from .loopback import LoopbackServer

# Limits no test comes near: a read that waited one out would fail the join below.
LIMITS = StreamingPolicy(connect_timeout_s=60.0, read_timeout_s=60.0,
                         first_token_timeout_s=60.0, idle_timeout_s=60.0,
                         total_timeout_s=120.0)
PROMPT = 10.0  # seconds a woken thread may take to end (it takes milliseconds)

_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
_WHOLE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n"
               b"\r\n{\"id\": ")

# where the answer is held -> (streamed, what the server sends before it holds, kind, phase)
HELD = {
    "before-the-status-line": (False, b"", Transport.CONNECTION_RESET, Phase.AFTER_SEND),
    "inside-a-stream": (True, _STREAM_HEAD + b": keep-alive\n\n", Transport.STREAM_CUT,
                        Phase.MID_STREAM),
    "inside-a-whole-body": (False, _WHOLE_HEAD, Transport.STREAM_CUT, Phase.MID_STREAM),
}


class _Headed(SendProgress):
    """A progress that tells when the response's head arrived."""

    headed: threading.Event | None = None

    def first_byte(self) -> None:
        super().first_byte()
        if self.headed is not None:
            self.headed.set()


class _Holding(LoopbackServer):
    """Reads the request, writes ``sent``, then holds the connection until :attr:`done`
    (over TLS with ``tls``)."""

    def __init__(self, sent: bytes, tls: ssl.SSLContext | None = None) -> None:
        self.sent, self.tls = sent, tls
        self.done = threading.Event()
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except OSError:
                conn.close()
                return
        with conn:
            if self.read_head(conn) is None:
                return
            conn.sendall(self.sent)
            self.done.wait(60.0)


def _in_socket_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside a socket's ``recv``.

    Its innermost Python frame is on a ``.recv(`` call only once the call began: the caller,
    holding the GIL, sees it there only while the call waits with the GIL released.
    """
    frame: Any = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_lineno is None:
        return False
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return ".recv(" in line or "._sslobj.read(" in line  # a TLS socket's recv is ssl's read


@pytest.mark.parametrize("held", list(HELD))
def test_closing_a_blocking_adapter_wakes_a_read_in_flight_as_a_local_cancellation(
        held: str) -> None:
    _closed_under_a_read(held)


def test_closing_a_blocking_adapter_wakes_a_tls_read_in_flight_as_a_local_cancellation(
        self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    _closed_under_a_read("inside-a-stream", served, ssl.create_default_context(cafile=cert))


def _closed_under_a_read(held: str, served: ssl.SSLContext | None = None,
                         trusted: ssl.SSLContext | None = None) -> None:
    stream, sent, kind, phase = HELD[held]
    server = _Holding(sent, served)
    adapter = SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=LIMITS,
                          verify=trusted if trusted is not None else True)
    scheme = "https" if served is not None else "http"
    results: list[Any] = []
    headed = threading.Event()
    progress = _Headed(clock=ManualClock(0.0).now)
    progress.headed = headed

    def call() -> None:
        results.append(adapter.send(
            make_route(f"{scheme}://127.0.0.1:{server.port}/v1", "openai"),
            Envelope(parts=[Part(content="hi")], stream=stream), profile_id=PROFILE,
            on_event=lambda _e: None, progress=progress))

    worker = threading.Thread(target=call, daemon=True)
    try:
        worker.start()
        if sent:  # the read to wake is the body's, after the head
            assert headed.wait(PROMPT)
        waited = threading.Event()
        while not _in_socket_wait(worker) and worker.is_alive():
            waited.wait(0.002)  # until the read blocks: no time needs to pass for the test
        assert worker.is_alive(), results
        adapter.close()
        worker.join(PROMPT)
        assert not worker.is_alive(), "the blocked read was not woken by the close"
    finally:
        server.done.set()
        server.close()
        adapter.close()
    [result] = results
    obs = result.observation
    assert not result.ok and obs is not None
    assert (obs.transport, obs.phase) == (kind, phase), obs
    assert obs.cancelled and obs.source is Source.LOCAL
    assert "closed while this call was in flight" in (obs.message or "")
    assert result.sent
