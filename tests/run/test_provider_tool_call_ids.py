"""A provider's tool call whose id or name no part can keep is never the host's misuse.

An answer's tool calls become assistant parts (``RunResult.parts``), whose ``tool_call_id`` is
an identifier (1 to 200 printable characters, not blank) and whose ``name`` a short printable
text (:func:`ledger.domain.envelope.tool_link_problem`, the parts' own rules). A complete
answer (HTTP 200, with usage) whose call has an id over 200 characters, holding a line break
or a NUL, or blank, is served: the adapter gives the call an id of its own (``call_`` and 24
hex digits) and the Attempt's ``tool_call_id`` event keeps the provider's; the next turn sends
the conversation back with the made-up id, and the provider takes it. A name no part can keep
cannot be replaced (the host runs the tool it names), nor can arguments that are not a JSON
object: the answer is the provider's malformed answer, ``failed`` with category ``format``,
read whole first, so posted at the usage it reported (a stream's comes after the call), and
the turn stops as after the same whole body (phase ``after_headers``), streamed or not. Neither
is ``unknown`` with a kept hold, nor an ``InvalidArgument`` the host did not cause. Every protocol,
whole and streamed, real HTTP over loopback through the fake provider, a Run session as a host
drives it, both backends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger.adapters import StaticSecretProvider
from ledger.api.facade import Ledger
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.facts import Category, Phase, WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState, DebitState, RunStatus
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted
from ledger.ops.reconcile import reconcile
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

from .rawanswers import http

PROTOCOLS = ["openai", "openai_responses", "anthropic", "gemini"]
SECRETS = StaticSecretProvider({"p:a": "key-a"})
HOLD = Decimal("0.05")
PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
RUN = "r"
TOOLS = [ToolSpec(name="search", description="Search the filings.",
                  parameters={"type": "object", "properties": {"q": {"type": "string"}}})]
ARGS = {"q": "10-K"}
MADE_UP = re.compile(r"call_[0-9a-f]{24}")
# Ids a part cannot keep: too long, a line break and a NUL, blank.
BAD_IDS = {"long": "i" * 201, "control": "id\n\x00x", "blank": "   "}
# Calls no part can keep, as (name, arguments, what the failure says): a name holding a NUL,
# a name too long, arguments that are not a JSON object.
REFUSED: dict[str, tuple[str, Any, str]] = {
    "nul": ("sea\x00rch", ARGS, "the name of tool call"),
    "long": ("s" * 201, ARGS, "the name of tool call"),
    "arguments": ("search", ["10-K"], "are not a JSON object")}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


def _plan(fake: FakeProvider, protocol: str) -> list[Route]:
    """A primary and a backup route: the backup is never asked."""
    return [Route(id=rid, provider="p", model=model, group=f"g-{rid}", recipient="ra",
                  protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol),
                  profiles=[Profile(id="p:a")], price=PRICE)
            for rid, model in (("primary", "m-a"), ("backup", "m-b"))]


def _whole(protocol: str, call_id: str, name: str, args: Any = ARGS) -> bytes:
    """A complete answer of ``protocol`` calling ``name`` with ``args`` under ``call_id``,
    reporting 3 prompt and 5 completion tokens."""
    if protocol == "openai":
        obj: dict[str, Any] = {
            "id": "c1", "object": "chat.completion", "model": "m-a",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [{
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)}}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    elif protocol == "openai_responses":
        obj = {"id": "resp_1", "object": "response", "status": "completed", "model": "m-a",
               "output": [{"type": "function_call", "id": "fc_1", "call_id": call_id,
                           "name": name, "arguments": json.dumps(args)}],
               "usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}}
    elif protocol == "anthropic":
        obj = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m-a",
               "stop_reason": "tool_use",
               "content": [{"type": "tool_use", "id": call_id, "name": name, "input": args}],
               "usage": {"input_tokens": 3, "output_tokens": 5}}
    else:
        obj = {"candidates": [{"content": {"role": "model", "parts": [
            {"functionCall": {"id": call_id, "name": name, "args": args}}]},
            "finishReason": "STOP", "index": 0}], "modelVersion": "m-a",
            "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 5}}
    return http(json.dumps(obj).encode(), "application/json")


def _stream(protocol: str, call_id: str, name: str, args: Any = ARGS) -> bytes:
    """The same answer streamed, as ``protocol`` frames a tool call."""
    events: list[tuple[str | None, dict[str, Any]]] = []
    if protocol == "openai":
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": "c1", "object": "chat.completion.chunk", "model": "m-a",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        events = [(None, chunk({"role": "assistant", "tool_calls": [{
                      "index": 0, "id": call_id, "type": "function",
                      "function": {"name": name, "arguments": ""}}]})),
                  (None, chunk({"tool_calls": [{"index": 0, "function": {
                      "arguments": json.dumps(args)}}]})),
                  (None, chunk({}, "tool_calls")),
                  (None, {"id": "c1", "choices": [], "model": "m-a",
                          "usage": {"prompt_tokens": 3, "completion_tokens": 5}})]
    elif protocol == "openai_responses":
        item = {"type": "function_call", "id": "fc_1", "call_id": call_id, "name": name,
                "arguments": json.dumps(args)}
        events = [("response.output_item.done", {"type": "response.output_item.done",
                                                  "output_index": 0, "item": item}),
                  ("response.completed", {"type": "response.completed", "response": {
                      "id": "resp_1", "object": "response", "status": "completed",
                      "model": "m-a", "output": [item],
                      "usage": {"input_tokens": 3, "output_tokens": 5}}})]
    elif protocol == "anthropic":
        events = [("message_start", {"type": "message_start", "message": {
                      "id": "msg_1", "type": "message", "role": "assistant", "model": "m-a",
                      "content": [], "usage": {"input_tokens": 3, "output_tokens": 1}}}),
                  ("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "tool_use", "id": call_id,
                                                             "name": name, "input": {}}}),
                  ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
                      "type": "input_json_delta", "partial_json": json.dumps(args)}}),
                  ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                  ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 5},
                                     "delta": {"stop_reason": "tool_use"}}),
                  ("message_stop", {"type": "message_stop"})]
    else:
        events = [(None, {"candidates": [{"content": {"role": "model", "parts": [
            {"functionCall": {"id": call_id, "name": name, "args": args}}]},
            "finishReason": "STOP", "index": 0}], "modelVersion": "m-a",
            "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 5}})]
    body = "".join((f"event: {ev}\n" if ev else "") + f"data: {json.dumps(data)}\n\n"
                   for ev, data in events)
    if protocol == "openai":
        body += "data: [DONE]\n\n"
    return http(body.encode(), "text/event-stream")


def _answer(protocol: str, stream: bool, call_id: str, name: str = "search",
            args: Any = ARGS) -> bytes:
    return (_stream if stream else _whole)(protocol, call_id, name, args)


def _session(led: Ledger, fake: FakeProvider, protocol: str) -> Any:
    grant = Grant(recipients={"ra": ["user_input", "tool_description", "model_derived",
                                     "tool_result"]})
    return led.run(RUN, plan=_plan(fake, protocol), secrets=SECRETS,
                   budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
                   grant=grant)


def _sent_call_ids(protocol: str, body: dict[str, Any]) -> list[str]:
    """The ids of the tool calls a request sends back (Gemini's calls carry none)."""
    if protocol == "openai":
        return [c["id"] for m in body["messages"] for c in m.get("tool_calls") or []]
    if protocol == "openai_responses":
        return [i["call_id"] for i in body["input"] if i.get("type") == "function_call"]
    if protocol == "anthropic":
        return [b["id"] for m in body["messages"] if isinstance(m["content"], list)
                for b in m["content"] if b.get("type") == "tool_use"]
    return []


def _settled_books(led: Ledger, att: AttemptRecord, posted: Decimal) -> None:
    """The Attempt's debit posted at ``posted``, nothing held, the books balanced."""
    assert att.debit_state is DebitState.POSTED
    assert att.debit_id is not None and led.debit(att.debit_id).posted == posted
    run = led.get_run(RUN)
    assert run.reserved == 0
    books = reconcile(led)
    assert books.ok, books.violations


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("bad", list(BAD_IDS), ids=list(BAD_IDS))
def test_a_provider_tool_call_id_no_part_can_keep_is_replaced_and_the_answer_served(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool, bad: str) -> None:
    provider_id = BAD_IDS[bad]
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(_answer(protocol, stream, provider_id),)),
                 model="m-a")
    with Ledger.open(db_url) as led:
        with _session(led, fake, protocol) as run:
            first = run.turn(Envelope(parts=[Part(content="Search the 10-K.")], tools=TOOLS,
                                      stream=stream, max_output_tokens=16), reserve=HOLD)
            [call] = first.tool_calls
            assert call.tool_call_id is not None and MADE_UP.fullmatch(call.tool_call_id)
            assert (call.name, json.loads(call.content)) == ("search", ARGS)
            # The conversation goes on with the made-up id, and the provider takes it.
            result = run.tool_result(call, "3 hits")
            second = run.turn(Envelope(parts=[Part(content="Search the 10-K."), *first.parts,
                                              result], tools=TOOLS, stream=stream),
                              reserve=HOLD)
            assert second.text == Behavior().text
        assert led.get_run(RUN).status is not RunStatus.FAILED
        answered, followed = led.timeline(RUN)
        # Served: the provider's usage recorded, its cost posted, no hold kept.
        assert (answered.state, answered.category) == (AttemptState.SUCCEEDED, None)
        assert (answered.prompt_tokens, answered.completion_tokens) == (3, 5)
        assert answered.cost == PRICE.cost(3, 5)
        _settled_books(led, answered, PRICE.cost(3, 5))
        assert followed.state is AttemptState.SUCCEEDED
        [event] = led.events(RUN, ["tool_call_id"])
        assert event.attempt_id == answered.attempt_id
        # The provider's id as evidence: printable (a control character is "?"), its first
        # 200 characters, its length, and why it was replaced.
        assert event.data == {
            "provider_id": "".join(c if c.isprintable() else "?" for c in provider_id)[:200],
            "provider_id_chars": len(provider_id), "call_id": call.tool_call_id,
            "problem": {"long": "is 201 characters long", "blank": "is empty",
                        "control": "contains control characters (NUL, newline, ...)"}[bad]}
    asked = [r for r in fake.requests if r.model == "m-a"]
    assert [r.model for r in fake.requests] == ["m-a", "m-a"]  # the backup never asked
    assert asked[1].problem is None
    assert _sent_call_ids(protocol, json.loads(asked[1].body)) == (
        [] if protocol == "gemini" else [call.tool_call_id])


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("bad", list(REFUSED), ids=list(REFUSED))
def test_a_refused_tool_call_fails_format_at_its_reported_cost_and_stops_as_that_failure(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool, bad: str) -> None:
    name, args, said = REFUSED[bad]
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(_answer(protocol, stream, "call_1", name,
                                                        args),)), model="m-a")
    with Ledger.open(db_url) as led:
        with _session(led, fake, protocol) as run, pytest.raises(FailoverExhausted) as stopped:
            run.turn(Envelope(parts=[Part(content="Search the 10-K.")], tools=TOOLS,
                              stream=stream, max_output_tokens=16), reserve=HOLD)
        [att] = led.timeline(RUN)
        assert att.fact is not None and att.fact.transport is not None
        assert (att.state, att.category, att.http_status, att.fact.transport.value) == (
            AttemptState.FAILED, Category.FORMAT.value, 200, "malformed_event")
        assert said in att.fact.message
        # The answer is read whole before it is refused (a stream's usage comes after the
        # call): posted at the usage it reported, priced, never the whole hold.
        assert (att.prompt_tokens, att.completion_tokens) == (3, 5)
        assert att.cost == PRICE.cost(3, 5) < HOLD
        _settled_books(led, att, PRICE.cost(3, 5))
        # Refused once the provider finished, streamed or not: the provider's verdict, so the
        # turn stops as after the same whole body, never as if the execution were unknown.
        assert att.fact.phase is Phase.AFTER_HEADERS
        [stop] = led.events(RUN, ["stop"])
        assert stopped.value.reason == stop.data["reason"] == "not_eligible_failure"
        assert led.events(RUN, ["tool_call_id"]) == []
    assert [r.model for r in fake.requests] == ["m-a"]
