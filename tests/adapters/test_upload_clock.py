"""A stream's first-token limit counts from the request's last byte written, not its first.

A large document on a slow uplink takes longer to upload than the provider takes to answer:
the upload is not the model's silence. A loopback server that stops reading the request's body
for longer than the first-token limit stands in for the slow uplink (its receive buffer is
small and the body larger than every buffer on the way, so the client's write waits).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from ledger.adapters import TextDelta
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport
from ledger.policy.model import StreamingPolicy

from .conftest import DRIVERS, PROFILE, adapter_for, make_route
from .loopback import LoopbackServer

pytestmark = pytest.mark.anyio

UPLOAD_STALL_S = 2.0  # how long the server stops reading the body: the uplink's slowness
LIMITS = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=10.0, first_token_timeout_s=1.0,
                         idle_timeout_s=10.0, total_timeout_s=30.0)
BODY_TEXT = "x" * (8 << 20)  # larger than the client's send and the server's receive buffers

_CHUNK = ('data: {"id":"c1","object":"chat.completion.chunk","model":"m1","choices":[{"index":0,'
          '"delta":{"role":"assistant","content":"read it"},"finish_reason":null}]}\n\n'
          'data: {"id":"c1","object":"chat.completion.chunk","model":"m1","choices":[{"index":0,'
          '"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,'
          '"completion_tokens":2,"total_tokens":11}}\n\ndata: [DONE]\n\n')


class SlowUplink(LoopbackServer):
    """Reads the head and the body's first bytes, stops reading for ``UPLOAD_STALL_S``, reads
    the rest, then answers an OpenAI stream at once (``answer``) or stays silent."""

    def __init__(self, answer: bool) -> None:
        super().__init__()
        self.answer = answer
        self.body_read_at: float | None = None
        self.done = threading.Event()

    def serve(self, conn: socket.socket) -> None:
        with conn:
            got = self.read_head(conn)
            assert got is not None
            head, rest = got
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            self.done.wait(UPLOAD_STALL_S)
            while len(rest) < length:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    return
                rest += chunk
            self.body_read_at = time.monotonic()
            if not self.answer:
                self.done.wait(30)
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\n\r\n" + _CHUNK.encode())


@pytest.fixture
def uplink(request: pytest.FixtureRequest) -> Iterator[SlowUplink]:
    server = SlowUplink(answer=request.param)
    # Set on the listener, the small buffer is the accepted connection's: the client's write
    # of the body waits while the server does not read.
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    yield server
    server.done.set()
    server.close()


def envelope() -> Envelope:
    return Envelope(parts=[Part(content="Summarise the filing."), Part(content=BODY_TEXT)],
                    stream=True)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("uplink", [True], indirect=True)
async def test_an_upload_longer_than_the_first_token_limit_is_not_the_models_silence(
        uplink: SlowUplink, driver: str) -> None:
    events: list[object] = []
    async for a in adapter_for(driver, LIMITS):
        t0 = time.monotonic()
        result = await a.send(make_route(f"http://127.0.0.1:{uplink.port}/v1", "openai"),
                              envelope(), profile_id=PROFILE, on_event=events.append)
        elapsed = time.monotonic() - t0
    assert elapsed >= UPLOAD_STALL_S  # the upload outlasted the first-token limit ...
    assert result.ok, result.observation  # ... and the answer that followed it was taken
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "read it"


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("uplink", [False], indirect=True)
async def test_a_silence_after_the_upload_ends_by_the_first_token_limit_counted_from_its_end(
        uplink: SlowUplink, driver: str) -> None:
    async for a in adapter_for(driver, LIMITS):
        t0 = time.monotonic()
        result = await a.send(make_route(f"http://127.0.0.1:{uplink.port}/v1", "openai"),
                              envelope(), profile_id=PROFILE)
        ended = time.monotonic()
    obs = result.observation
    assert (obs.transport, obs.phase) == (Transport.FIRST_TOKEN_TIMEOUT, Phase.AFTER_SEND)
    assert uplink.body_read_at is not None
    # Counted from the body's end, never from the call's start (which would have ended it
    # during the upload) ...
    assert ended - t0 >= UPLOAD_STALL_S + LIMITS.first_token_timeout_s * 0.9
    # ... and by that limit, not a longer one (the server read the last byte after the
    # client wrote it into its send buffer).
    assert ended - uplink.body_read_at < LIMITS.first_token_timeout_s + 5.0
