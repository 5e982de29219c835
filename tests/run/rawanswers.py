"""Whole HTTP responses as bytes, for ``Fault.RAW`` answers of the fake provider: a provider's
answer exactly as the wire carries it (a JSON body, or server-sent events)."""

from __future__ import annotations

import json
from typing import Any


def http(body: bytes, content_type: str, status: str = "200 OK") -> bytes:
    """One response: ``status``, ``content_type``, the length, ``connection: close``."""
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: "
            f"{len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def whole(obj: dict[str, Any]) -> bytes:
    """A 200 whose body is ``obj`` as JSON."""
    return http(json.dumps(obj).encode(), "application/json")


def sse(*events: tuple[str | None, dict[str, Any]]) -> bytes:
    """A 200 stream of ``(event name or None, data)`` server-sent events."""
    body = b"".join((f"event: {name}\n" if name else "").encode()
                    + b"data: " + json.dumps(data).encode() + b"\n\n" for name, data in events)
    return http(body, "text/event-stream")
