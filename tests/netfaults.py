"""Loopback endpoints that fail in a known way before anything is sent.

``closed_port()`` is a port nothing listens on (a connect is refused at once); ``full_backlog``
is a listener that never accepts, its accept queue filled, so new connections never complete (a
connect times out). Both are on 127.0.0.1: tests never touch another address.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest


def closed_port() -> int:
    """A loopback port that was free a moment ago: connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def full_backlog() -> Iterator[int]:
    """A listener that never accepts, with its accept queue filled: new SYNs go unanswered."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # a non-blocking connect is in progress
            s.connect(("127.0.0.1", port))
        fillers.append(s)
    yield port
    for s in fillers:
        s.close()
    listener.close()
