"""Invariant 9 for the tools a provider runs itself (hosted tools): a failure after one ran is
never sent again, on another route or the same one.

A hosted MCP call (Anthropic's ``mcp_tool_use``, a Responses ``mcp_call``), a web search or
Gemini's executed code runs at the provider, on the request's behalf, before any text: an
error that comes after it, in the stream or as the failed whole response, is not "nothing was
begun". The Attempt is observed with ``tool_started`` and the turn stops with
``output_exists`` under every policy, the backup receiving nothing. The controls: an error
before anything, or after reasoning alone, still moves on under the default preset.
Real HTTP over loopback (the provider's bytes, ``Fault.RAW``), sync and async, both backends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger.adapters import StaticSecretProvider
from ledger.api.facade import AsyncLedger, Ledger
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted
from ledger.policy.load import preset
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

from .rawanswers import sse, whole

SECRETS = StaticSecretProvider({"p:a": "key-a", "p:b": "key-b"})
RUN = "r"

_MCP_CALL = {"type": "mcp_call", "id": "mcp_1", "server_label": "tracker",
             "name": "create_ticket", "arguments": "{}"}
_MCP_DONE = {**_MCP_CALL, "output": "ticket 42 created"}
_CREATED = ("response.created", {"type": "response.created", "response": {
    "id": "r1", "model": "gpt-x", "status": "in_progress"}})
_SERVER_ERROR = {"code": "server_error", "message": "The server had an error"}
_MESSAGE_START = ("message_start", {"type": "message_start", "message": {
    "id": "m1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
    "usage": {"input_tokens": 10, "output_tokens": 1}}})
_OVERLOADED = ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                   "message": "Overloaded"}})
_GEMINI_UNAVAILABLE = (None, {"error": {"code": 503, "message": "The model is overloaded.",
                                        "status": "UNAVAILABLE"}})


def _block(index: int, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("content_block_start", {"type": "content_block_start", "index": index,
                                     "content_block": block}),
            ("content_block_stop", {"type": "content_block_stop", "index": index})]


def _item(index: int, added: dict[str, Any], done: dict[str, Any]
          ) -> list[tuple[str, dict[str, Any]]]:
    return [("response.output_item.added", {"type": "response.output_item.added",
                                            "output_index": index, "item": added}),
            ("response.output_item.done", {"type": "response.output_item.done",
                                           "output_index": index, "item": done})]


# (protocol, streamed, the primary's whole answer): each after the provider ran a tool.
RAN = {
    "anthropic-mcp-then-overloaded-event": ("anthropic", True, sse(
        _MESSAGE_START,
        *_block(0, {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "create_ticket",
                    "server_name": "tracker", "input": {}}),
        *_block(1, {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False,
                    "content": [{"type": "text", "text": "ticket 42 created"}]}),
        _OVERLOADED)),
    "responses-mcp-then-error-event": ("openai_responses", True, sse(
        _CREATED, *_item(0, _MCP_CALL, _MCP_DONE),
        ("error", {"type": "error", **_SERVER_ERROR}))),
    "responses-mcp-then-response-failed": ("openai_responses", True, sse(
        _CREATED, *_item(0, _MCP_CALL, _MCP_DONE),
        ("response.failed", {"type": "response.failed", "response": {
            "id": "r1", "model": "gpt-x", "status": "failed", "output": [_MCP_DONE],
            "error": {"code": "server_error",
                      "message": "The model failed to generate a response."}}}))),
    "responses-whole-failed-with-mcp-output": ("openai_responses", False, whole({
        "id": "r1", "object": "response", "model": "gpt-x", "status": "failed",
        "output": [_MCP_DONE],
        "error": {"code": "server_error", "message": "The model failed to generate a response."},
        "usage": {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}})),
    "gemini-executed-code-then-error-chunk": ("gemini", True, sse(
        (None, {"candidates": [{"content": {"role": "model", "parts": [
            {"executableCode": {"language": "PYTHON", "code": "print(open_ticket())"}},
            {"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "ticket 42"}}]}}],
            "modelVersion": "gemini-x"}),
        _GEMINI_UNAVAILABLE)),
}

# (protocol, streamed, the primary's answer): a tool the provider ran, then an answer the
# adapter refuses once parsed (a host tool call without a name, text no caller can store):
# a `format` failure, which `fased` moves on from, unless a tool already ran.
REFUSED = {
    "anthropic-whole-mcp-then-unnamed-tool-call": ("anthropic", False, whole({
        "id": "m1", "type": "message", "role": "assistant", "model": "claude-x", "content": [
            {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "create_ticket",
             "server_name": "tracker", "input": {}},
            {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False,
             "content": [{"type": "text", "text": "ticket 42 created"}]},
            {"type": "tool_use", "id": "toolu_1", "input": {}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 10, "output_tokens": 3}})),
    "gemini-whole-code-then-unnamed-call": ("gemini", False, whole({
        "candidates": [{"content": {"role": "model", "parts": [
            {"executableCode": {"language": "PYTHON", "code": "print(open_ticket())"}},
            {"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "ticket 42"}},
            {"functionCall": {"args": {}}}]}, "finishReason": "STOP"}],
        "modelVersion": "gemini-x"})),
    "responses-whole-mcp-then-lone-surrogate": ("openai_responses", False, whole({
        "id": "r1", "object": "response", "model": "gpt-x", "status": "completed",
        "output": [_MCP_DONE, {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "done \ud83d"}]}],
        "usage": {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}})),
    "responses-stream-mcp-then-lone-surrogate": ("openai_responses", True, sse(
        _CREATED, *_item(0, _MCP_CALL, _MCP_DONE),
        ("response.output_text.delta", {"type": "response.output_text.delta",
                                        "output_index": 1, "content_index": 0,
                                        "item_id": "msg_1", "delta": "done \ud83d"}),
        ("response.completed", {"type": "response.completed", "response": {
            "id": "r1", "model": "gpt-x", "status": "completed", "output": [_MCP_DONE],
            "usage": {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}}}))),
}

# The controls: nothing of the provider's own tools ran, so the verdict moves on as before.
CLEAN = {
    "anthropic-overloaded-first": ("anthropic", sse(_MESSAGE_START, _OVERLOADED)),
    "anthropic-thinking-then-overloaded": ("anthropic", sse(
        _MESSAGE_START,
        *_block(0, {"type": "thinking", "thinking": "Let me think.", "signature": "sig"}),
        _OVERLOADED)),
    "responses-reasoning-then-error-event": ("openai_responses", sse(
        _CREATED,
        *_item(0, {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "reasoning", "id": "rs_1", "summary": []}),
        ("error", {"type": "error", **_SERVER_ERROR}))),
    "gemini-error-first": ("gemini", sse(_GEMINI_UNAVAILABLE)),
}


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeProvider, FakeProvider]]:
    with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b:
        yield a, b


@pytest.fixture(autouse=True)
def _clean(fakes: tuple[FakeProvider, FakeProvider]) -> None:
    for f in fakes:
        f.clear()


def _session_args(fakes: tuple[FakeProvider, FakeProvider], protocol: str,
                  policy: str) -> dict[str, Any]:
    a, b = fakes
    wire = WireProtocol(protocol)
    plan = [Route(id=rid, provider=f"p{n}", model=f"m-{n}", group=f"g{n}", recipient=f"r{n}",
                  protocol=wire, endpoint=fake.endpoint(protocol),
                  profiles=[Profile(id=f"p:{n}")], price=Price())
            for rid, n, fake in (("primary", "a", a), ("backup", "b", b))]
    return {"plan": plan, "policy": preset(policy),
            "budget": Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
            "grant": Grant(recipients={"ra": ["user_input"], "rb": ["user_input"]})}


def _sync(db_url: str, args: dict[str, Any], envelope: Envelope) -> BaseException | None:
    with Ledger.open(db_url) as led:
        try:
            with led.run(RUN, secrets=SECRETS, **args) as run:
                run.turn(envelope, on_text=lambda _t: None)
        except FailoverExhausted as e:
            return e
    return None


def _async(db_url: str, args: dict[str, Any], envelope: Envelope) -> BaseException | None:
    async def main() -> BaseException | None:
        try:
            async with AsyncLedger.open(db_url) as led, led.run(
                    RUN, secrets=SECRETS, **args) as run:
                await run.turn(envelope, on_text=lambda _t: None)
        except FailoverExhausted as e:
            return e
        return None

    return asyncio.run(main())


DRIVERS = {"sync": _sync, "async": _async}


def _turn(db_url: str, fakes: tuple[FakeProvider, FakeProvider], protocol: str, stream: bool,
          raw: bytes, driver: str, policy: str = "failure-domain"
          ) -> tuple[list[AttemptRecord], BaseException | None]:
    fakes[0].enqueue(Behavior(fault=Fault.RAW, raw=(raw,)))
    envelope = Envelope(parts=[Part(content="Open a ticket for the outage.")], stream=stream)
    raised = DRIVERS[driver](db_url, _session_args(fakes, protocol, policy), envelope)
    with Ledger.open(db_url) as led:
        return led.timeline(RUN), raised


@pytest.mark.parametrize("driver", sorted(DRIVERS))
@pytest.mark.parametrize("case", sorted(RAN))
def test_invariant9_a_failure_after_a_hosted_tool_ran_is_never_sent_to_another_route(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider], case: str, driver: str) -> None:
    protocol, stream, raw = RAN[case]
    attempts, raised = _turn(db_url, fakes, protocol, stream, raw, driver)
    [att] = attempts
    assert att.state is AttemptState.FAILED
    assert att.tool_started and att.fact is not None and att.fact.tool_started
    assert not att.fact.resubmit and not att.fact.moves_on
    assert isinstance(raised, FailoverExhausted) and raised.reason == "output_exists"
    assert "tool of this reply already started" in str(raised)
    assert fakes[1].requests == []  # the backup never saw the request
    assert len(fakes[0].requests) == 1  # nor was it sent to the primary again


def test_invariant9_a_hosted_tool_stops_even_a_preset_that_resubmits_unknown_executions(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider]) -> None:
    """``goclaw`` resubmits a stream cut mid-way; a tool the provider ran it does not."""
    protocol, stream, raw = RAN["anthropic-mcp-then-overloaded-event"]
    attempts, raised = _turn(db_url, fakes, protocol, stream, raw, "sync", policy="goclaw")
    assert [a.route_id for a in attempts] == ["primary"]
    assert attempts[0].fact is not None and attempts[0].fact.phase is Phase.MID_STREAM
    assert isinstance(raised, FailoverExhausted) and raised.reason == "output_exists"
    assert fakes[1].requests == [] and len(fakes[0].requests) == 1


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_an_error_before_any_hosted_tool_ran_is_still_a_verdict_that_moves_on(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider], case: str) -> None:
    protocol, raw = CLEAN[case]
    attempts, raised = _turn(db_url, fakes, protocol, True, raw, "sync")
    assert raised is None
    first, second = attempts
    assert first.fact is not None
    assert (first.fact.phase, first.fact.tool_started, first.tool_started) == (
        Phase.AFTER_HEADERS, False, False)
    assert (second.route_id, second.state) == ("backup", AttemptState.SUCCEEDED)
    assert len(fakes[1].requests) == 1


@pytest.mark.parametrize("driver", sorted(DRIVERS))
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_invariant9_an_answer_refused_after_a_hosted_tool_ran_is_never_sent_again(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider], case: str, driver: str) -> None:
    """Whole or streamed, refused while parsed or once parsed: the tool that ran is known."""
    protocol, stream, raw = REFUSED[case]
    attempts, raised = _turn(db_url, fakes, protocol, stream, raw, driver, policy="fased")
    [att] = attempts
    assert att.tool_started and att.fact is not None and att.fact.tool_started
    assert isinstance(raised, FailoverExhausted) and raised.reason == "output_exists"
    assert fakes[1].requests == [] and len(fakes[0].requests) == 1
