"""Anthropic streams the input of a tool it runs itself (``server_tool_use``, ``mcp_tool_use``)
as ``input_json_delta``, as it streams a host tool call's: over real HTTP on loopback, both
drivers, that answer is an answer, its tool input the provider's, never a host tool call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ledger.adapters import ToolCallProposal
from ledger.domain.envelope import Envelope, Part
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import PATIENT, PROFILE, adapter_for, make_route

pytestmark = pytest.mark.anyio

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def _sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                    for name, data in events)


def _block(index: int, block: dict[str, Any], *deltas: dict[str, Any]
           ) -> list[tuple[str, dict[str, Any]]]:
    return [("content_block_start", {"type": "content_block_start", "index": index,
                                     "content_block": block}),
            *(("content_block_delta", {"type": "content_block_delta", "index": index,
                                       "delta": d}) for d in deltas),
            ("content_block_stop", {"type": "content_block_stop", "index": index})]


def _json(piece: str) -> dict[str, Any]:
    return {"type": "input_json_delta", "partial_json": piece}


# A web search and an MCP call, each with its input streamed, their results, then the text.
ANSWER = _sse(
    ("message_start", {"type": "message_start", "message": {
        "id": "m1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
        "usage": {"input_tokens": 10, "output_tokens": 1}}}),
    *_block(0, {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                "input": {}}, _json(""), _json('{"query": "weather"}')),
    *_block(1, {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}),
    *_block(2, {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "create_ticket",
                "server_name": "tracker", "input": {}}, _json('{"title": '), _json('"rain"}')),
    *_block(3, {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False,
                "content": [{"type": "text", "text": "42"}]}),
    *_block(4, {"type": "text", "text": ""}, {"type": "text_delta", "text": "It is sunny."}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 3}}),
    ("message_stop", {"type": "message_stop"}))


async def test_an_anthropic_server_tool_streaming_its_input_is_an_answer_not_malformed(
        fake: FakeProvider, driver: str) -> None:
    # It was refused as malformed_event ("input_json_delta for block 0 without tool_use"):
    # every streamed answer that used a web search or an MCP server failed, and, the tool
    # having run, was never sent again.
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(_HEAD, ANSWER)))
    events: list[Any] = []
    async for adapter in adapter_for(driver, PATIENT):
        result = await adapter.send(
            make_route(fake.endpoint("anthropic"), "anthropic"),
            Envelope(parts=[Part(content="What is the weather?")], stream=True),
            profile_id=PROFILE, on_event=events.append)
    assert result.ok, result.observation
    assert result.text == "It is sunny." and not result.tool_calls
    assert not any(isinstance(e, ToolCallProposal) for e in events)
