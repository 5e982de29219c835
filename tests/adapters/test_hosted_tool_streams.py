"""A streamed answer that begins with a tool the provider runs itself (a web search, an MCP
call, executed code), over real HTTP on loopback, on every protocol that has hosted tools and
both drivers.

The hosted tool's first event is the answer's first sign: it stops the first-token clock (from
then on the idle limit bounds the gaps) and is the first token the Attempt records, as text or
a host tool call would be. A model thinking silently has not begun (reasoning is not content),
but a tool the provider runs is work on the answer, and once it ran the failure is never sent
again (``tool_started``): a first-token limit could only cut off the answer under way.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import pytest

from ledger.adapters import TextDelta, ToolCallProposal
from ledger.clock import ManualClock
from ledger.decide.effects import SendProgress
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import FAST, PATIENT, PROFILE, adapter_for, make_route
from .loopback import LoopbackServer

pytestmark = pytest.mark.anyio

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def _sse(*events: tuple[str | None, dict[str, Any]]) -> bytes:
    return b"".join((f"event: {name}\n" if name else "").encode()
                    + b"data: " + json.dumps(data).encode() + b"\n\n" for name, data in events)


def _block_start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("content_block_start", {"type": "content_block_start", "index": index,
                                    "content_block": block})


def _block_delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("content_block_delta", {"type": "content_block_delta", "index": index,
                                    "delta": delta})


def _block_stop(index: int) -> tuple[str, dict[str, Any]]:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


_WEB_SEARCH = {"type": "web_search_call", "id": "ws_1", "status": "in_progress"}

# protocol -> (the hosted tool's events, the answer's text and end that follow it)
ANSWERS: dict[str, tuple[bytes, bytes]] = {
    "openai_responses": (
        _sse(("response.created", {"type": "response.created", "response": {
                 "id": "r1", "model": "gpt-x", "status": "in_progress"}}),
             ("response.output_item.added", {"type": "response.output_item.added",
                                             "output_index": 0, "item": _WEB_SEARCH}),
             ("response.web_search_call.searching", {
                 "type": "response.web_search_call.searching", "output_index": 0,
                 "item_id": "ws_1"})),
        _sse(("response.output_item.done", {"type": "response.output_item.done",
                                            "output_index": 0,
                                            "item": {**_WEB_SEARCH, "status": "completed"}}),
             ("response.output_text.delta", {"type": "response.output_text.delta",
                                             "output_index": 1, "content_index": 0,
                                             "item_id": "msg_1", "delta": "It is sunny."}),
             ("response.completed", {"type": "response.completed", "response": {
                 "id": "r1", "model": "gpt-x", "status": "completed",
                 "usage": {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}}})),
    ),
    "anthropic": (
        _sse(("message_start", {"type": "message_start", "message": {
                 "id": "m1", "type": "message", "role": "assistant", "model": "claude-x",
                 "content": [], "usage": {"input_tokens": 10, "output_tokens": 1}}}),
             _block_start(0, {"type": "server_tool_use", "id": "srvtoolu_1",
                              "name": "web_search", "input": {}}),
             _block_delta(0, {"type": "input_json_delta", "partial_json": ""}),
             _block_delta(0, {"type": "input_json_delta",
                              "partial_json": "{\"query\": \"weather\"}"}),
             _block_stop(0)),
        _sse(_block_start(1, {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
                              "content": []}),
             _block_stop(1),
             _block_start(2, {"type": "text", "text": ""}),
             _block_delta(2, {"type": "text_delta", "text": "It is sunny."}),
             _block_stop(2),
             ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                "usage": {"output_tokens": 3}}),
             ("message_stop", {"type": "message_stop"})),
    ),
    "gemini": (
        _sse((None, {"candidates": [{"content": {"role": "model", "parts": [
            {"executableCode": {"language": "PYTHON", "code": "print(forecast())"}}]}}],
            "modelVersion": "gemini-x"})),
        _sse((None, {"candidates": [{"content": {"role": "model", "parts": [
            {"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "sunny"}},
            {"text": "It is sunny."}]}, "finishReason": "STOP"}],
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 3},
            "modelVersion": "gemini-x"})),
    ),
}
PROTOCOLS = list(ANSWERS)


def _route(endpoint: str, protocol: str) -> Any:
    return make_route(endpoint + ("/v1" if protocol == "openai_responses" else ""), protocol)


def _envelope() -> Envelope:
    return Envelope(parts=[Part(content="What is the weather?")], stream=True)


class _HeldAnswer(LoopbackServer):
    """Writes the head and the hosted tool's events, then holds the rest until ``go`` is set;
    moves ``clock`` to 1.0 before the head and to 2.0 before the rest."""

    def __init__(self, tool: bytes, rest: bytes, clock: ManualClock) -> None:
        self.tool, self.rest, self.clock = tool, rest, clock
        self.go = threading.Event()
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        with conn:
            got = self.read_head(conn)
            if got is None:
                return
            # The whole request is read: closing on unread bytes would reset the connection
            # (Gemini's answer ends with the body, so a reset would cut it).
            head, body = got
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            self.clock.advance(1.0)
            conn.sendall(_HEAD + self.tool)
            if not self.go.wait(30.0):
                return
            self.clock.advance(1.0)
            try:
                conn.sendall(self.rest)
            except OSError:
                return  # the client gave up (the first-token limit ended it)


class _Marks(SendProgress):
    """A progress whose first-token mark lets the held answer go on."""

    go: threading.Event | None = None

    def first_token(self) -> None:
        super().first_token()
        if self.go is not None and self.first_token_at is not None:
            self.go.set()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_hosted_tool_begins_the_answer_for_the_first_token_mark_and_clock(
        driver: str, protocol: str) -> None:
    # The rest of the answer is held until the adapter marks its first token: marked at the
    # hosted tool (clock 1.0), the answer completes; marked only at the text, it never comes
    # and the first-token limit ends the call.
    clock = ManualClock(0.0)
    tool, rest = ANSWERS[protocol]
    server = _HeldAnswer(tool, rest, clock)
    progress = _Marks(clock=clock.now)
    progress.go = server.go
    limits = PATIENT.model_copy(update={"first_token_timeout_s": 3.0})
    events: list[Any] = []
    try:
        async for adapter in adapter_for(driver, limits):
            result = await adapter.send(_route(f"http://127.0.0.1:{server.port}", protocol),
                                        _envelope(), profile_id=PROFILE,
                                        on_event=events.append, progress=progress)
    finally:
        server.go.set()
        server.close()
    assert result.ok, result.observation
    assert result.text == "It is sunny." and not result.tool_calls
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["It is sunny."]
    assert not any(isinstance(e, ToolCallProposal) for e in events)
    assert (progress.first_byte_at, progress.first_token_at) == (1.0, 1.0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_silence_after_a_hosted_tool_is_a_stall_of_an_answer_under_way(
        fake: FakeProvider, driver: str, protocol: str) -> None:
    # The hosted tool began the answer, so the silence after it is bounded by the idle limit,
    # mid-stream (it used to be the first-token limit's "no content", after_headers); the
    # stall is observed with tool_started, so it is never sent again.
    assert FAST.idle_timeout_s < FAST.first_token_timeout_s  # the two limits' kinds tell
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(_HEAD, ANSWERS[protocol][0]), raw_hold=True))
    async for adapter in adapter_for(driver, FAST):
        result = await adapter.send(make_route(fake.endpoint(protocol), protocol),
                                    _envelope(), profile_id=PROFILE, on_event=lambda _e: None)
    obs = result.observation
    assert obs is not None
    assert (obs.transport, obs.phase) == (Transport.STREAM_STALL, Phase.MID_STREAM), obs
    assert obs.tool_started and not obs.effective_output
