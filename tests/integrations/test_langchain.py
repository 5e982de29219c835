"""LangChain v1 and LangGraph on a ledger Run (``LedgerMiddleware``, ``LedgerChatModel``): a real
``create_agent`` agent with a tool and real LangGraph graphs against the shipped fake provider
over loopback, on both backends. Each model call is one turn; failover (across protocols),
budget and disclosure are the Run's; the history the agent keeps (a checkpoint included) passes
preflight because the ledger recorded it, and a history the Run did not produce is refused
before anything is sent.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (
    ModelCallLimitMiddleware,
    ModelFallbackMiddleware,
    ModelRetryMiddleware,
)
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from ledger import (
    AsyncLedger,
    Budget,
    CandidateSkipped,
    Capabilities,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    InvalidState,
    Ledger,
    Price,
    ProviderError,
    Route,
    RunStatus,
)
from ledger.clock import ManualClock
from ledger.domain.facts import WireProtocol
from ledger.domain.records import AttemptState
from ledger.integrations.langchain import LedgerChatModel, LedgerMiddleware, LedgerStop
from ledger.policy.load import preset
from ledger.policy.model import StreamingPolicy
from ledger.testing import Behavior, FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import (
    PRICE,
    cancelled_twice,
    carried_tool_file,
    narrow_first,
    tool_call_ids,
)
from tests.media import png

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

REPO = Path(__file__).resolve().parents[2]
BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
ALLOWED = ["user_input", "model_derived", "tool_result", "tool_description", "system"]
GRANT = Grant(recipients={"fake": ALLOWED})
FULL_TEXT = Behavior().text

searched: list[str] = []


@tool
def search(query: str) -> str:
    """Search the company filings."""
    searched.append(query)
    return json.dumps({"hits": 3, "query": query})


def routes(fake: FakeProvider, first: str = "openai", second: str | None = None,
           price: Price = PRICE) -> list[Route]:
    """The primary and the backup (another capacity group), each on its own protocol."""
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol=WireProtocol(first), endpoint=fake.endpoint(first),
                  price=price),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", protocol=WireProtocol(second or first),
                  endpoint=fake.endpoint(second or first), price=price)]


def agent_for(run: Any, **kw: Any) -> Any:
    middleware = [*kw.pop("before", []), LedgerMiddleware(run, **kw)]
    return create_agent(LedgerChatModel(run), tools=[search], middleware=middleware,
                        system_prompt="You are a careful analyst.")


def ais(state: dict[str, Any]) -> list[AIMessage]:
    return [m for m in state["messages"] if isinstance(m, AIMessage)]


# -- create_agent with a tool ------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [("openai", "gemini"),
                                               ("anthropic", "openai_responses"),
                                               ("gemini", "anthropic")])
def test_an_agent_with_a_tool_fails_over_from_a_503_across_protocols(
        db_url: str, fake: FakeProvider, first: str, second: str) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")  # the primary answers 503 once
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})), model="backup-model")
    searched.clear()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("agent", plan=routes(fake, first, second), budget=BUDGET,
                        grant=GRANT) as run:
            agent = agent_for(run)
            state = await agent.ainvoke({"messages": [("user", "Compare the two filings.")]})
            assert state["messages"][-1].content == FULL_TEXT and searched == ["10-K"]
            # The conversation goes on with the history the agent kept: it passes preflight.
            state = await agent.ainvoke(
                {"messages": [*state["messages"], ("user", "And the risks?")]})
            timeline = await led.timeline("agent")
            # Three model calls, four Attempts: the 503, then the backup for every call.
            assert [(a.route_id, a.state) for a in timeline] == [
                ("primary", AttemptState.FAILED), ("backup", AttemptState.SUCCEEDED),
                ("backup", AttemptState.SUCCEEDED), ("backup", AttemptState.SUCCEEDED)]
            assert timeline[0].http_status == 503
            answers = ais(state)
            assert len(answers) == 3
            for message, att in zip(answers, timeline[1:], strict=True):
                ours = message.response_metadata["ledger"]
                assert ours["attempt_id"] == att.attempt_id and ours["route"] == "backup"
                assert message.response_metadata["model_name"] == att.model_reported \
                    == "backup-model-fake-001"
                assert message.response_metadata["model_provider"] == "fake-b"
                assert message.usage_metadata is not None
                assert (message.usage_metadata["input_tokens"],
                        message.usage_metadata["output_tokens"]) == (11, 7)
            first_answer = answers[0]
            assert first_answer.response_metadata["ledger"]["attempts"] == [
                timeline[0].attempt_id, timeline[1].attempt_id]
            assert first_answer.response_metadata["ledger"]["switched"] is True
            [call] = first_answer.tool_calls
            assert call["name"] == "search" and call["args"] == {"query": "10-K"}
            if second == "gemini":
                # Gemini gives no call id: the adapter makes one up, unique in the Run, so the
                # integration keeps it (nothing to rename).
                assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
                assert await led.events("agent", ["tool_call_id"]) == []
            [result] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
            assert result.tool_call_id == call["id"]

    asyncio.run(main())
    # The tool's result went to the model after the call; the system prompt went along.
    body = json.dumps(fake.requests[2].json)
    assert '\\"hits\\": 3' in body or '"hits": 3' in body
    assert "You are a careful analyst." in body
    with Ledger.open(db_url) as led:
        assert led.get_run("agent").status is RunStatus.SUCCEEDED


@pytest.mark.parametrize(("first", "second"), [("gemini", "anthropic"),
                                               ("openai", "openai_responses"),
                                               ("anthropic", "openai")])
def test_a_tool_call_keeps_its_id_when_the_next_call_fails_over_to_another_protocol(
        db_url: str, fake: FakeProvider, first: str, second: str) -> None:
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})), model="primary-model")
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")  # the call with the tool's result
    searched.clear()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("ids", plan=routes(fake, first, second), budget=BUDGET,
                        grant=GRANT) as run:
            agent = agent_for(run)
            state = await agent.ainvoke({"messages": [("user", "Compare the two filings.")]})
            assert state["messages"][-1].text == FULL_TEXT and searched == ["10-K"]
            [call] = ais(state)[0].tool_calls
            [result] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
            assert result.tool_call_id == call["id"]
            timeline = await led.timeline("ids")
            assert [(a.route_id, a.state) for a in timeline] == [
                ("primary", AttemptState.SUCCEEDED), ("primary", AttemptState.FAILED),
                ("backup", AttemptState.SUCCEEDED)]
            # The conversation goes on, on the backup, with the id the agent holds.
            state = await agent.ainvoke(
                {"messages": [*state["messages"], ("user", "And the risks?")]})
            assert state["messages"][-1].text == FULL_TEXT

    asyncio.run(main())
    first_req, failed, backup, later = fake.requests
    assert (first_req.protocol, failed.protocol, backup.protocol) == (first, first, second)
    call_id = tool_call_ids(backup)[0]
    # The id the primary's protocol gave (or the ledger made, for Gemini) is the one the
    # backup's protocol was sent, for the call and for its result, on every later call too.
    assert tool_call_ids(backup) == tool_call_ids(later) == [call_id, call_id]
    if first == "gemini":
        assert call_id.startswith("call_") and len(call_id) == 29
    else:
        assert call_id == ("toolu_fake_1" if first == "anthropic" else "call_fake_1")
    if first != "gemini":
        assert tool_call_ids(failed) == [call_id, call_id]


def test_a_streamed_model_call_ends_with_its_tool_call_chunks_and_usage(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})), model="backup-model")

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("chunks", plan=routes(fake, "openai_responses", "anthropic"),
                        budget=BUDGET, grant=GRANT) as run:
            model = LedgerChatModel(run).bind_tools([search])
            chunks = [c async for c in model.astream("Compare the two filings.")]
            *pieces, last = chunks
            # Text as it arrived; nothing else before the end.
            assert "".join(c.text for c in pieces) == FULL_TEXT and len(pieces) > 2
            assert not any(c.tool_call_chunks or c.usage_metadata for c in pieces)
            # The last chunk: the tool call, the usage, the ledger's record.
            assert last.chunk_position == "last"
            [piece] = last.tool_call_chunks
            assert piece["name"] == "search" and json.loads(piece["args"] or "") == {
                "query": "10-K"}
            assert last.usage_metadata is not None and last.usage_metadata["output_tokens"] == 7
            [backup, failed] = list(reversed(await led.timeline("chunks")))
            assert last.response_metadata["ledger"]["attempt_id"] == backup.attempt_id
            assert last.response_metadata["ledger"]["attempts"] == [failed.attempt_id,
                                                                    backup.attempt_id]
            # The chunks add up to the answer the ledger recorded: it goes on as history.
            answer = chunks[0]
            for c in chunks[1:]:
                answer = answer + c
            assert answer.tool_calls[0]["args"] == {"query": "10-K"}
            [call] = answer.tool_calls
            again = await model.ainvoke([HumanMessage("Compare the two filings."), answer,
                                         ToolMessage("3 hits", tool_call_id=call["id"])])
            assert again.text == FULL_TEXT

    asyncio.run(main())


def test_a_streamed_agent_gets_the_text_as_it_arrives_and_the_recorded_answer(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.enqueue(Behavior(tool_call=("search", {"query": "risks"})), model="backup-model")
    searched.clear()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("s", plan=routes(fake, "anthropic", "openai"), budget=BUDGET,
                        grant=GRANT) as run:
            agent = agent_for(run)
            pieces: list[str] = []
            final: dict[str, Any] = {}
            async for mode, data in agent.astream(
                    {"messages": [("user", "What are the risks?")]},
                    stream_mode=["messages", "values"]):
                if mode == "messages" and isinstance(data[0], AIMessageChunk):
                    pieces.append(data[0].text)
                elif mode == "values":
                    final = data
            assert searched == ["risks"]
            assert "".join(pieces) == FULL_TEXT * 2 and len([p for p in pieces if p]) > 2
            answers = ais(final)
            assert [m.text for m in answers] == [FULL_TEXT, FULL_TEXT]
            assert answers[0].tool_calls[0]["args"] == {"query": "risks"}
            assert answers[0].usage_metadata is not None
            assert answers[0].usage_metadata["output_tokens"] == 7
            # The streamed answers are what the ledger recorded: a further turn passes.
            again = await agent.ainvoke({"messages": [*final["messages"], ("user", "Thanks.")]})
            assert again["messages"][-1].text == FULL_TEXT
            timeline = await led.timeline("s")
            assert [a.state for a in timeline] == [AttemptState.FAILED] + \
                [AttemptState.SUCCEEDED] * 3

    asyncio.run(main())


def test_a_blocking_agent_on_a_blocking_run_invokes_and_streams(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.enqueue(Behavior(tool_call=("search", {"query": "q"})), model="backup-model")
    searched.clear()
    with Ledger.open(db_url) as led, \
            led.run("sync", plan=routes(fake, "gemini", "openai_responses"), budget=BUDGET,
                    grant=GRANT) as run:
        agent = agent_for(run)
        state = agent.invoke({"messages": [("user", "Go.")]})
        assert state["messages"][-1].content == FULL_TEXT and searched == ["q"]
        pieces = [chunk.text for chunk, _meta in agent.stream(
            {"messages": [*state["messages"], ("user", "Again.")]}, stream_mode="messages")
            if isinstance(chunk, AIMessageChunk)]
        assert "".join(pieces) == FULL_TEXT and len([p for p in pieces if p]) > 1
        assert [a.state for a in led.timeline("sync")] == [AttemptState.FAILED] + \
            [AttemptState.SUCCEEDED] * 3


def _gated_stream(released: threading.Event) -> tuple[str, threading.Thread]:
    """A chat-completions endpoint on loopback that streams its first piece, then the rest
    only once ``released`` is set (within 30 s): the turn can end only after that."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                       "created": 0, "model": "m", **obj}).encode() + b"\n\n"

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            got = b""
            while b"\r\n\r\n" not in got:
                got += conn.recv(65536)
            head, body = got.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\n\r\n" + event({"choices": [
                             {"index": 0, "delta": {"role": "assistant", "content": "Hello"},
                              "finish_reason": None}]}))
            released.wait(30)
            conn.sendall(event({"choices": [{"index": 0, "delta": {"content": " there."},
                                             "finish_reason": "stop"}]})
                         + event({"choices": [], "usage": {"prompt_tokens": 5,
                                                           "completion_tokens": 2,
                                                           "total_tokens": 7}})
                         + b"data: [DONE]\n\n")

    server = threading.Thread(target=serve, name="gated-stream", daemon=True)
    server.start()
    return f"http://127.0.0.1:{port}/v1", server


def test_leaving_an_astream_of_a_blocking_run_early_never_blocks_the_event_loop(
        db_url: str) -> None:
    """Closing the stream waits for the turn, which runs to its end: LangChain's default
    closed it on the event loop, so every task of the loop (here, the one that lets the
    provider finish) stalled until the turn's total limit cut it."""
    released = threading.Event()
    endpoint, server = _gated_stream(released)
    route = Route(id="primary", provider="fake", model="m", group="ga", recipient="fake",
                  endpoint=endpoint, price=PRICE)
    policy = preset("failure-domain").model_copy(update={"streaming": StreamingPolicy(
        connect_timeout_s=5, read_timeout_s=5, first_token_timeout_s=5, idle_timeout_s=5,
        total_timeout_s=5)})  # the bound of a stalled loop: a miss fails, it never hangs

    async def leave_early(model: LedgerChatModel) -> None:
        stream = model.astream("Hello?")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(10):  # whatever closing the loop scheduled runs first
            await asyncio.sleep(0)
        released.set()

    with Ledger.open(db_url) as led, led.run("early", plan=[route], budget=BUDGET,
                                              grant=GRANT, policy=policy) as run:
        asyncio.run(leave_early(LedgerChatModel(run)))
        (attempt,) = led.timeline("early")
        assert attempt.state is AttemptState.SUCCEEDED, attempt
    server.join(5)


class Verdict(BaseModel):
    """A verdict on the filings."""

    risky: bool
    reason: str


def test_structured_output_comes_through_a_tool_call_on_any_route(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.set_default(Behavior(tool_call=("Verdict", {"risky": True, "reason": "debt"})))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("so", plan=routes(fake, "openai", "anthropic"), budget=BUDGET,
                        grant=GRANT) as run:
            verdict = await LedgerChatModel(run).with_structured_output(Verdict).ainvoke(
                "Are the filings risky?")
            assert verdict == Verdict(risky=True, reason="debt")
            agent = create_agent(LedgerChatModel(run), tools=[], response_format=Verdict,
                                 middleware=[LedgerMiddleware(run)])
            state = await agent.ainvoke({"messages": [("user", "Risky?")]})
            assert state["structured_response"] == Verdict(risky=True, reason="debt")
            with pytest.raises(InvalidArgument) as ei:
                LedgerChatModel(run).with_structured_output(Verdict, method="json_schema")
            assert ei.value.field == "method"

    asyncio.run(main())
    # The schema went to the Anthropic backup as a tool.
    assert fake.requests[-1].json["tools"][0]["name"] == "Verdict"


def test_a_deep_agent_and_its_subagent_draw_on_the_one_run(
        db_url: str, fake: FakeProvider) -> None:
    from deepagents import create_deep_agent

    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.enqueue(Behavior(tool_call=("task", {"description": "Search the 10-K filings",
                                              "subagent_type": "general-purpose"})),
                 model="backup-model")
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})), model="backup-model")
    searched.clear()

    async def main() -> str:
        async with AsyncLedger.open(db_url) as led, \
                led.run("deep", plan=routes(fake, "openai", "anthropic"), budget=BUDGET,
                        grant=GRANT) as run:
            agent = create_deep_agent(LedgerChatModel(run), tools=[search],
                                      middleware=[LedgerMiddleware(run)],
                                      system_prompt="You are a careful analyst.")
            state = await agent.ainvoke({"messages": [("user", "Compare the two filings.")]})
            assert state["messages"][-1].text == FULL_TEXT and searched == ["10-K"]
            [task] = ais(state)[0].tool_calls
            assert task["name"] == "task" and task["id"] == "toolu_fake_1"
            # The subagent's call got the same id from the provider: in the Run it has its own.
            [ev] = await led.events("deep", ["tool_call_id"])
            assert ev.data["provider_id"] == "toolu_fake_1"
            sub_id: str = ev.data["call_id"]
            # The main agent's three model calls and the subagent's two: one Run, one budget.
            timeline = await led.timeline("deep")
            assert [(a.route_id, a.state) for a in timeline] == [
                ("primary", AttemptState.FAILED)] + [("backup", AttemptState.SUCCEEDED)] * 4
            assert (await led.get_run("deep")).calls_used == 5
            state = await agent.ainvoke(
                {"messages": [*state["messages"], ("user", "And the risks?")]})
            assert state["messages"][-1].text == FULL_TEXT
            return sub_id

    sub_id = asyncio.run(main())
    _503, main_call, sub_call, sub_result, main_result, later = fake.requests
    assert "task" in [t["name"] for t in main_call.json["tools"]]
    assert "task" not in [t["name"] for t in sub_call.json["tools"]]
    assert tool_call_ids(sub_call) == [] and tool_call_ids(sub_result) == [sub_id] * 2
    assert tool_call_ids(main_result) == tool_call_ids(later) == ["toolu_fake_1"] * 2


def test_a_tool_result_is_named_as_its_call_when_a_subagent_got_the_same_provider_id(
        db_url: str, fake: FakeProvider) -> None:
    from deepagents import create_deep_agent

    # The primary (Anthropic) gives every call the id toolu_fake_1: the main agent's task call
    # and the subagent's search call. The main agent's next call fails over to Gemini, which
    # pairs a functionResponse with its functionCall by name.
    fake.enqueue(Behavior(tool_call=("task", {"description": "Search the 10-K filings",
                                              "subagent_type": "general-purpose"})),
                 model="primary-model")
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})), model="primary-model")
    fake.enqueue(Behavior(), model="primary-model")
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("names", plan=routes(fake, "anthropic", "gemini"), budget=BUDGET,
                        grant=GRANT) as run:
            agent = create_deep_agent(LedgerChatModel(run), tools=[search],
                                      middleware=[LedgerMiddleware(run)])
            state = await agent.ainvoke({"messages": [("user", "Compare the two filings.")]})
            assert state["messages"][-1].text == FULL_TEXT

    asyncio.run(main())
    last = fake.requests[-1]
    assert last.protocol == "gemini"
    pairs = [(k, p[k]["name"]) for c in last.json["contents"] for p in c["parts"]
             for k in ("functionCall", "functionResponse") if k in p]
    assert pairs == [("functionCall", "task"), ("functionResponse", "task")]


# -- stops -------------------------------------------------------------------------------------

# A unit of cost per output token: each answer posts 7 (its reported usage), and each call's
# hold is its max_tokens (16). Two calls post 14; the third's hold would overdraw 29.
COSTLY = Price(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1_000_000))


@pytest.mark.parametrize(("budget", "reason"), [
    (Budget(max_calls=2, max_retries=1, max_cost=Decimal(1000)), "call_allowance"),
    (Budget(max_calls=10, max_retries=5, max_cost=Decimal(29)), "budget"),
])
def test_a_run_whose_budget_runs_out_stops_the_agent_and_is_not_retried(
        db_url: str, fake: FakeProvider, budget: Budget, reason: str) -> None:
    fake.set_default(Behavior(tool_call=("search", {"query": "again"})))  # never stops asking

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            with pytest.raises(FailoverExhausted) as ei:
                async with led.run("tight", plan=routes(fake, price=COSTLY), budget=budget,
                                   grant=GRANT) as run:
                    agent = create_agent(LedgerChatModel(run, max_tokens=16), tools=[search],
                                         middleware=[LedgerMiddleware(run)])
                    await agent.ainvoke({"messages": [("user", "Search until done.")]})
            stop = ei.value
            # A LangChain model error that retrying cannot fix, and the ledger's stop.
            assert isinstance(stop, LedgerStop) and not stop.is_retryable
            assert stop.reason == reason and isinstance(stop, ExceptionGroup)
            rec = await led.get_run("tight")
            assert rec.status is RunStatus.STOPPED and rec.calls_used == 2
            if reason == "budget":
                assert rec.posted == Decimal(14)  # within the budget: nothing overdrawn

    asyncio.run(main())
    assert len(fake.requests) == 2  # the third request was never sent
    # Every call got a tool call id of its own (the fake reuses one: the Run renamed it).
    assert fake.requests[1].json["max_tokens"] == 16


def test_a_stop_split_by_except_star_or_pickled_stays_a_ledger_stop_that_is_not_retried(
        db_url: str, fake: FakeProvider) -> None:
    # The primary answers 503 and the backup cannot stream: the stop holds the primary's
    # ProviderError and a CandidateSkipped for the backup, so except* splits the group.
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    primary, backup = routes(fake)
    plan = [primary, backup.model_copy(update={"capabilities": Capabilities(streaming=False)})]

    async def main() -> LedgerStop:
        async with AsyncLedger.open(db_url) as led:
            with pytest.raises(LedgerStop) as ei:
                async with led.run("split", plan=plan, budget=BUDGET, grant=GRANT) as run:
                    await _drain(LedgerChatModel(run).astream("Answer it."))
            return ei.value

    stop = asyncio.run(main())
    assert {type(e) for e in stop.exceptions} == {ProviderError, CandidateSkipped}
    parts: list[BaseException] = []
    try:
        raise stop
    except* ProviderError as group:
        parts.append(group)
    except* CandidateSkipped as group:
        parts.append(group)
    assert len(parts) == 2
    for part in parts:
        assert type(part) is LedgerStop and part.is_retryable is False
        assert (part.reason, part.attempts) == (stop.reason, stop.attempts)
    stop.add_note("seen by the host")
    back = pickle.loads(pickle.dumps(stop))
    assert type(back) is LedgerStop and back.is_retryable is False
    assert back.__notes__ == stop.__notes__ and str(back) == str(stop)


def test_a_stop_with_exit_behavior_end_ends_the_agent_and_the_run_stopped(
        db_url: str, fake: FakeProvider) -> None:
    fake.set_default(Behavior(tool_call=("search", {"query": "q"})))
    once = Budget(max_calls=1, max_retries=0, max_cost=Decimal(1))

    async def main() -> RunStatus:
        async with AsyncLedger.open(db_url) as led:
            async with led.run("end", plan=routes(fake), budget=once, grant=GRANT) as run:
                agent = agent_for(run, exit_behavior="end")
                state = await agent.ainvoke({"messages": [("user", "Search.")]})
                last = state["messages"][-1]
                assert isinstance(last, AIMessage) and not last.tool_calls
                assert last.response_metadata["ledger"]["stop"] == "call_allowance"
                assert last.text.startswith("The ledger stopped this model request "
                                            "(call_allowance). ")
                assert last.text.split(". ", 1)[1][:1].isupper()  # the detail, a sentence
                # The notice is not model output: it is never sent to a model.
                model = LedgerChatModel(run)
                envelope = await model.envelope(state["messages"], stop=None, stream=False)
                assert [p.role for p in envelope.parts] == ["user", "assistant", "assistant",
                                                            "tool"]
            return (await led.get_run("end")).status

    assert asyncio.run(main()) is RunStatus.STOPPED
    assert len(fake.requests) == 1


def test_a_retry_around_the_ledger_never_sends_a_stopped_request_again(
        db_url: str, fake: FakeProvider) -> None:
    fake.set_default(Fault.UNAVAILABLE)
    # retry_on=(Exception,): a retry policy that ignores LangChain's is_retryable.
    retry = ModelRetryMiddleware(max_retries=2, retry_on=(Exception,), on_failure="error",
                                 initial_delay=0, jitter=False)

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("twice", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            with pytest.raises(InvalidArgument) as ei:
                await agent_for(run, before=[retry]).ainvoke({"messages": [("user", "Hi")]})
            assert ei.value.field == "retry" and "ModelRetryMiddleware" in str(ei.value)
            assert "RetryPolicy" in str(ei.value) and ".with_retry()" in str(ei.value)
            # LangChain's own retries only: the Agents SDK's are no fix here.
            assert [m for m in ("ModelSettings", "Runner.run", "tenacity")
                    if m in str(ei.value)] == []
            assert isinstance(ei.value.__cause__, FailoverExhausted)
            # With LangChain's default retry_on the stop is not retried at all.
            default = ModelRetryMiddleware(max_retries=2, on_failure="error", initial_delay=0)
            with pytest.raises(LedgerStop):
                await agent_for(run, before=[default]).ainvoke({"messages": [("user", "Yo")]})
            # ModelFallbackMiddleware before the ledger: its fallback call comes back through
            # LedgerMiddleware as the same request, and is refused the same way.
            other = GenericFakeChatModel(messages=iter([AIMessage("from the fallback")]))
            with pytest.raises(InvalidArgument) as ei:
                await agent_for(run, before=[ModelFallbackMiddleware(other)]).ainvoke(
                    {"messages": [("user", "Again?")]})
            assert ei.value.field == "retry" and "ModelFallbackMiddleware" in str(ei.value)
            assert len(await led.timeline("twice")) == 6  # three turns, two Attempts each

    asyncio.run(main())
    assert len(fake.requests) == 6


async def _two_unknown_outcomes(run: Any, fake: FakeProvider) -> LedgerChatModel:
    """A model whose two requests were sent and never answered: "Stream it." by a reader that
    left the stream early, "Answer it." by a call a timeout gave up on."""
    model = LedgerChatModel(run)
    fake.enqueue(Behavior(fault=Fault.TRICKLE, delay_s=0.05))
    stream = model.astream("Stream it.")
    async for _chunk in stream:
        break
    await stream.aclose()
    fake.enqueue(Fault.NO_RESPONSE)
    call = asyncio.ensure_future(model.ainvoke("Answer it."))
    # Given up once the request has left (what a timeout does, without racing the clock: a
    # fixed timeout on a busy machine could fire before the request was written).
    assert await asyncio.to_thread(fake.wait_for_requests, 2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    return model


def test_a_request_whose_outcome_is_unknown_is_never_sent_again_in_the_same_session(
        db_url: str, fake: FakeProvider) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("unknown", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            model = await _two_unknown_outcomes(run, fake)
            attempts = await led.timeline("unknown")
            assert [a.state for a in attempts] == [AttemptState.UNKNOWN] * 2
            # Asked again: refused, nothing sent.
            for again in (lambda: _drain(model.astream("Stream it.")),
                          lambda: model.ainvoke("Answer it.")):
                with pytest.raises(LedgerStop) as ei:
                    await again()
                assert ei.value.reason == "execution_unknown"
                assert ei.value.attempts and set(ei.value.attempts) <= {
                    a.attempt_id for a in attempts}
            assert await led.timeline("unknown") == attempts

    asyncio.run(main())
    assert len(fake.requests) == 2


async def _drain(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


def test_a_streamed_request_cancelled_twice_is_refused_as_unknown_not_left_in_flight(
        db_url: str, fake: FakeProvider) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("twice", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            model = LedgerChatModel(run)
            await cancelled_twice(lambda: _drain(model.astream("Stream it.")), fake)
            [att] = await led.timeline("twice")
            assert att.state is AttemptState.UNKNOWN
            with pytest.raises(LedgerStop) as ei:
                await _drain(model.astream("Stream it."))
            assert ei.value.reason == "execution_unknown"
            assert ei.value.attempts == [att.attempt_id]

    asyncio.run(main())
    assert len(fake.requests) == 1


def test_a_request_is_the_same_request_streamed_or_not(db_url: str, fake: FakeProvider) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("modes", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            model = await _two_unknown_outcomes(run, fake)
            # Outcome unknown: asked again the other way, refused.
            for again in (lambda: model.ainvoke("Stream it."),
                          lambda: _drain(model.astream("Answer it."))):
                with pytest.raises(LedgerStop) as ei:
                    await again()
                assert ei.value.reason == "execution_unknown"
            # Stopped: sent again the other way, refused as a retry.
            fake.set_default(Fault.UNAVAILABLE)
            with pytest.raises(LedgerStop):
                await model.ainvoke("Anyone there?")
            sent = len(fake.requests)
            with pytest.raises(InvalidArgument) as ia:
                await _drain(model.astream("Anyone there?"))
            assert ia.value.field == "retry" and len(fake.requests) == sent

    asyncio.run(main())


def test_a_streamed_request_sent_under_its_former_turn_id_is_not_sent_again(
        db_url: str, fake: FakeProvider) -> None:
    # Before a request was one whether streamed or not, the integrations named a streamed
    # request's turn by its envelope's hash: an Attempt an executor of that version left
    # unknown is found under that id after an upgrade.
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("former", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            model = LedgerChatModel(run)
            envelope = await model.envelope([HumanMessage("Stream it.")], stop=None,
                                            stream=True)
            fake.enqueue(Fault.NO_RESPONSE)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(run.turn(envelope, turn_id="turn-" + envelope.hash[7:19]),
                                       0.5)
            [att] = await led.timeline("former")
            for again in (lambda: model.ainvoke("Stream it."),
                          lambda: _drain(model.astream("Stream it."))):
                with pytest.raises(LedgerStop) as ei:
                    await again()
                assert ei.value.reason == "execution_unknown"
                assert ei.value.attempts == [att.attempt_id]

    asyncio.run(main())
    assert len(fake.requests) == 1


def test_a_request_in_flight_in_another_thread_is_not_sent_twice_at_once(
        db_url: str, fake: FakeProvider) -> None:
    # A blocking session's call runs in a thread a timeout cannot stop (ainvoke on a blocking
    # Run); asked again meanwhile, it is refused, and the first call still ends served.
    fake.enqueue(Behavior(fault=Fault.SLOW_FIRST_TOKEN, delay_s=1.0))
    with Ledger.open(db_url) as led, \
            led.run("twice", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
        model = LedgerChatModel(run)

        async def main() -> None:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(model.ainvoke("Answer it."), 0.2)
            with pytest.raises(LedgerStop) as ei:
                await model.ainvoke("Answer it.")
            assert ei.value.reason == "execution_unknown" and "in flight" in str(ei.value)
            while not [a for a in led.timeline("twice")
                       if a.state is AttemptState.SUCCEEDED]:
                await asyncio.sleep(0.05)  # the first call, still in its thread, ends

        asyncio.run(main())
    assert len(fake.requests) == 1


def test_the_middleware_serves_the_agents_calls_whatever_model_the_agent_was_built_with(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})))
    searched.clear()
    never = GenericFakeChatModel(messages=iter([AIMessage("not the ledger's")]))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("other", plan=routes(fake, "anthropic"), budget=BUDGET,
                        grant=GRANT) as run:
            agent = create_agent(never, tools=[search], middleware=[LedgerMiddleware(run)])
            state = await agent.ainvoke({"messages": [("user", "Compare the two filings.")]})
            assert state["messages"][-1].text == FULL_TEXT and searched == ["10-K"]
            assert [m.response_metadata["ledger"]["route"] for m in ais(state)] == [
                "primary", "primary"]
            assert len(await led.timeline("other")) == 2

    asyncio.run(main())
    # The tools create_agent bound for the call went to the provider.
    assert [t["name"] for t in fake.requests[0].json["tools"]] == ["search"]


def test_model_call_limit_and_the_run_budget_the_first_to_run_out_stops(
        db_url: str, fake: FakeProvider) -> None:
    fake.set_default(Behavior(tool_call=("search", {"query": "again"})))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            # LangChain's limit counts model calls: it ends the agent first, nothing recorded
            # for the call it refuses.
            async with led.run("limit", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
                agent = agent_for(run, before=[ModelCallLimitMiddleware(run_limit=2)])
                state = await agent.ainvoke({"messages": [("user", "Go.")]})
                assert "limit" in state["messages"][-1].text.lower()
                assert len(await led.timeline("limit")) == 2
            # The Run counts physical calls: with a failover in each model call its allowance
            # (4 calls) runs out at the third model call, before ModelCallLimit's 5.
            fake.clear()
            fake.set_default(Behavior(tool_call=("search", {"query": "again"})))
            for _ in range(3):
                fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
            tight = Budget(max_calls=4, max_retries=4, max_cost=Decimal(1))
            with pytest.raises(LedgerStop) as ei:
                async with led.run("budget", plan=routes(fake), budget=tight,
                                   grant=GRANT) as run:
                    agent = agent_for(run, before=[ModelCallLimitMiddleware(run_limit=5)])
                    await agent.ainvoke({"messages": [("user", "Go.")]})
            assert ei.value.reason in ("call_allowance", "retry_allowance")
            assert len(await led.timeline("budget")) == 4

    asyncio.run(main())


# -- history the Run did not produce -------------------------------------------------------


def test_history_the_run_did_not_produce_is_refused_before_sending(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("edit", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            state = await agent.ainvoke({"messages": [("user", "Compare the two filings.")]})
            history = state["messages"]
            sent = len(fake.requests)
            last = history[-1]
            assert isinstance(last, AIMessage)
            call_msg = history[1]
            assert isinstance(call_msg, AIMessage) and call_msg.tool_calls
            # 1. The model's answer, edited by the host (its ledger details kept).
            edited = [*history[:-1], last.model_copy(update={"content": "Identical."})]
            # 2. A tool result the tool never returned.
            forged_result = [m.model_copy(update={"content": '{"hits": 1000}'})
                             if isinstance(m, ToolMessage) else m for m in history]
            # 3. Edited arguments of a recorded tool call.
            bad_args = dict(call_msg.tool_calls[0], args={"query": "everything"})
            edited_call = [call_msg.model_copy(update={"tool_calls": [bad_args]})
                           if m is call_msg else m for m in history]
            # 4. A whole exchange the Run never had, with the ledger's details copied over.
            invented = [HumanMessage("Earlier question"),
                        AIMessage("", tool_calls=[{"name": "search", "args": {"query": "x"},
                                                   "id": "call_invented"}],
                                  response_metadata=call_msg.response_metadata),
                        ToolMessage("secret", tool_call_id="call_invented"),
                        AIMessage("ok")]
            for case, bad in (("edited", edited), ("forged", forged_result),
                              ("args", edited_call), ("invented", invented)):
                with pytest.raises(FailoverExhausted) as ei:
                    await agent.ainvoke({"messages": [*bad, ("user", "Go on.")]})
                assert ei.value.reason == "no_candidate", case
                assert "provenance" in json.dumps(ei.value.skipped, default=str), case
            assert len(fake.requests) == sent  # nothing was sent
            # The history as the Run produced it still passes.
            state = await agent.ainvoke({"messages": [*history, ("user", "Go on.")]})
            assert state["messages"][-1].text == FULL_TEXT

    asyncio.run(main())


# -- misuse: typed errors, nothing recorded -----------------------------------------------------


def test_misuse_is_refused_with_the_fix_and_records_nothing(
        db_url: str, fake: FakeProvider) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            session = led.run("misuse", plan=routes(fake), budget=BUDGET, grant=GRANT)
            # Before the block: the middleware is built, and used outside the Run.
            early = LedgerMiddleware(session)
            agent = create_agent(LedgerChatModel(session), tools=[search], middleware=[early])
            with pytest.raises(InvalidState, match="outside its Run"):
                await agent.ainvoke({"messages": [("user", "Hi")]})
            async with session as run:
                with pytest.raises(InvalidArgument) as ei:
                    LedgerChatModel(run, route="nowhere")
                assert ei.value.field == "route" and "primary, backup" in str(ei.value)
                with pytest.raises(InvalidArgument) as ei:
                    LedgerMiddleware(run, exit_behavior="retry")  # type: ignore[arg-type]
                assert ei.value.field == "exit_behavior"
                # A keyword another chat model takes is refused, as in a call, not ignored.
                for kwargs, hint in (({"max_retries": 3}, "retry owner"),
                                     ({"timeout": 5}, "policy"),
                                     ({"streaming": True}, "astream"),
                                     ({"store": True}, "conversation"),
                                     ({"stop": ["END"]}, "stop sequences are not carried"),
                                     ({"model": "gpt-x"}, "pick a route with route="),
                                     ({"seed": 7}, "every route's protocol")):
                    with pytest.raises(InvalidArgument) as ei:
                        LedgerChatModel(run, **kwargs)
                    assert ei.value.field == next(iter(kwargs)) and hint in str(ei.value)
                model = LedgerChatModel(run)
                for kwargs, field in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                                      ({"store": True}, "store"),
                                      ({"timeout": 3}, "timeout")):
                    with pytest.raises(InvalidArgument) as ei:
                        await model.bind(**kwargs).ainvoke("Hi")
                    assert ei.value.field == field
                with pytest.raises(InvalidArgument) as ei:
                    await model.ainvoke("Hi", stop=["END"])
                assert ei.value.field == "stop"
                with pytest.raises(InvalidArgument) as ei:
                    model.invoke("Hi")  # an async session's model, called blocking
                assert ei.value.field == "run" and "ainvoke" in str(ei.value)
                with pytest.raises(InvalidArgument) as ei:
                    await model.ainvoke([HumanMessage(content=[
                        {"type": "audio", "base64": "AAAA", "mime_type": "audio/wav"}])])
                assert ei.value.field == "messages"
            # After the block.
            with pytest.raises(InvalidState, match="has ended"):
                await agent.ainvoke({"messages": [("user", "Hi")]})
            assert await led.timeline("misuse") == []
        with pytest.raises(InvalidArgument) as ei:
            LedgerMiddleware(object())  # type: ignore[arg-type]
        assert ei.value.field == "run"

    asyncio.run(main())
    assert fake.requests == []


def test_a_human_image_and_document_go_as_binary_parts(db_url: str, fake: FakeProvider) -> None:
    from tests.media import pdf, png

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("media", plan=routes(fake, "anthropic"), budget=BUDGET,
                        grant=GRANT) as run:
            import base64

            message = HumanMessage(content=[
                {"type": "text", "text": "What is in these?"},
                {"type": "image", "base64": base64.b64encode(png()).decode(),
                 "mime_type": "image/png"},
                {"type": "file", "base64": base64.b64encode(pdf()).decode(),
                 "mime_type": "application/pdf", "filename": "10-K.pdf"}])
            answer = await LedgerChatModel(run).ainvoke([message])
            assert answer.text == FULL_TEXT

    asyncio.run(main())
    [req] = fake.requests
    assert [m.media_type for m in req.media] == ["image/png", "application/pdf"]


# -- a tool that returns an image --------------------------------------------------------------

CHART = png(24, 24)


@tool
def chart(name: str) -> list[dict[str, Any]]:
    """Render a chart of a metric."""
    return [{"type": "text", "text": f"the chart of {name}"},
            {"type": "image", "base64": base64.b64encode(CHART).decode(),
             "mime_type": "image/png"}]


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "gemini"])
def test_invariant7_a_tools_image_is_the_tools_result_not_the_users_input(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    """A tool that returns an image (a ToolMessage with an image block): the image goes as the
    call's file, of class ``tool_result`` under the call's provenance, after the tool's result
    on the wire; a recipient the grant approves for the user's input only never receives it,
    and the history carrying it again passes preflight."""
    plan, grant = narrow_first(routes(fake, protocol))
    fake.enqueue(Behavior(tool_call=("chart", {"name": "revenue"})), model="primary-model")

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("tool-image", plan=plan, budget=BUDGET, grant=grant) as run:
            agent = create_agent(LedgerChatModel(run), tools=[chart],
                                 middleware=[LedgerMiddleware(run)])
            state = await agent.ainvoke({"messages": [("user", "Chart the revenue.")]})
            assert state["messages"][-1].text == FULL_TEXT
            (select,) = [e.data for e in await led.events("tool-image", ["select"])][-1:]
            assert [(s["route"], s["reason"]) for s in select["skipped"]] == [
                ("primary", "disclosure")]
            assert "not approved for: tool_result" in select["skipped"][0]["detail"]
            (call,) = [m for m in state["messages"] if isinstance(m, ToolMessage)]
            assert call.tool_call_id in await led.provenance("tool-image")
            # Sent again with the history, the recorded result and image are covered.
            follow_up = {"messages": [*state["messages"], ("user", "And the costs?")]}
            assert (await agent.ainvoke(follow_up))["messages"][-1].text == FULL_TEXT

    asyncio.run(main())
    assert [r.model for r in fake.requests] == ["primary-model", "backup-model", "backup-model"]
    assert fake.requests[0].media == ()  # the user-input-only recipient never got the image
    for req in fake.requests[1:]:
        carried_tool_file(req, CHART, "the chart of revenue")


def test_a_tools_link_is_refused_naming_the_fix_and_nothing_is_sent(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})))
    leak = "https://attacker.example/c.png?d=ACCOUNT-12000"

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("tool-link", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            model = LedgerChatModel(run).bind_tools([search])
            first = await model.ainvoke([HumanMessage("Search.")])
            (call,) = first.tool_calls
            linked = ToolMessage(content=[{"type": "image", "url": leak}],
                                 tool_call_id=call["id"])
            with pytest.raises(InvalidArgument) as ei:
                await model.ainvoke([HumanMessage("Search."), first, linked])
            assert ei.value.field == "messages"
            assert "never sends a link a tool returned" in str(ei.value)
            assert "base64" in str(ei.value) and "human message" not in str(ei.value)

    asyncio.run(main())
    assert len(fake.requests) == 1


# -- LangGraph: a graph resumed from its checkpoint in another process --------------------------

GRAPH = r"""
import json, os, sqlite3, sys
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from ledger.integrations.langchain import LedgerChatModel

def build(run, search, checkpoints):
    model = LedgerChatModel(run).bind_tools([search])
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([search]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    saver = SqliteSaver(sqlite3.connect(checkpoints, check_same_thread=False))
    return graph.compile(checkpointer=saver)
"""

CHILD = GRAPH + r"""
from ledger import Budget, Grant, Ledger, Route
url, checkpoints = sys.argv[1:3]

@tool
def search(query: str) -> str:
    '''Search the company filings.'''
    os._exit(17)  # the process dies while the tool runs: after the model's checkpoint

routes = [Route.model_validate(r) for r in json.loads(os.environ["PLAN"])]
led = Ledger.open(url)
run = led.run("graph", plan=routes, budget=Budget.model_validate_json(os.environ["BUDGET"]),
              grant=Grant.model_validate_json(os.environ["GRANT"])).__enter__()
graph = build(run, search, checkpoints)
question = {"messages": [("user", "Compare the two filings.")]}
thread = {"configurable": {"thread_id": "t1"}}
if os.environ.get("GRAPH_MODE") == "stream":  # the node's invoke streams its model call
    for _ in graph.stream(question, thread, stream_mode="messages", durability="sync"):
        pass
else:
    graph.invoke(question, thread, durability="sync")
"""


def _graph_module() -> Any:
    namespace: dict[str, Any] = {}
    exec(GRAPH, namespace)  # the graph the child builds, built the same way here
    return namespace["build"]


def _child(db_url: str, checkpoints: Path, plan: list[Route], faults: str = "",
           mode: str = "invoke") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO),
               PLAN=json.dumps([r.model_dump(mode="json") for r in plan]),
               BUDGET=BUDGET.model_dump_json(), GRANT=GRANT.model_dump_json(), GRAPH_MODE=mode)
    env.pop("LEDGER_FAULTS", None)
    if faults:
        env["LEDGER_FAULTS"] = faults
    return subprocess.run([sys.executable, "-c", CHILD, db_url, str(checkpoints)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_graph_resumes_from_its_checkpoint_in_another_process(
        db_url: str, fake: FakeProvider, tmp_path: Path) -> None:
    fake.set_default(Behavior(tool_call=("search", {"query": "10-K"})))
    plan = routes(fake, "openai", "gemini")
    checkpoints = tmp_path / "checkpoints.db"
    child = _child(db_url, checkpoints, plan)
    assert child.returncode == 17, child.stderr
    fake.set_default(Behavior())
    searched.clear()
    build = _graph_module()
    config = {"configurable": {"thread_id": "t1"}}
    # The crashed executor's lease lapses (no sleeping: this process's clock is past it).
    clock = ManualClock(start=time.time() + 3600)
    with Ledger.open(db_url, clock=clock) as led:
        assert led.get_run("graph").status is RunStatus.RUNNING
        with led.run("graph", plan=plan, budget=BUDGET, grant=GRANT) as run:
            graph = build(run, search, str(checkpoints))
            assert graph.get_state(config).next == ("tools",)  # the checkpoint holds the call
            state = graph.invoke(None, config)  # runs the pending tool, then the model
            assert state["messages"][-1].text == FULL_TEXT and searched == ["10-K"]
            # An answer the Run never produced, slipped into the thread, is refused.
            sent = len(fake.requests)
            with pytest.raises(LedgerStop) as ei:
                graph.invoke({"messages": [AIMessage("The filings are identical."),
                                           HumanMessage("Go on.")]}, config)
            assert ei.value.reason == "no_candidate" and len(fake.requests) == sent
        timeline = led.timeline("graph")
        assert [a.state for a in timeline] == [AttemptState.SUCCEEDED] * 2
    # The resumed request carried the crashed process's tool call and this one's result.
    messages = fake.requests[-1].json["messages"]
    assert [m["role"] for m in messages][-2:] == ["assistant", "tool"]


@pytest.mark.parametrize(("crashed", "resumed"), [("invoke", "invoke"), ("stream", "invoke"),
                                                  ("invoke", "stream")])
def test_an_interrupted_model_node_is_not_sent_again_on_resume(
        db_url: str, fake: FakeProvider, tmp_path: Path, crashed: str, resumed: str) -> None:
    plan = routes(fake)
    checkpoints = tmp_path / "checkpoints.db"
    # The child dies after its request was answered and before the ledger settled it: the
    # checkpoint has no model output, the ledger has an Attempt sent without a receipt. The
    # graph resumes streamed or not, whichever way the crashed one ran.
    child = _child(db_url, checkpoints, plan, faults="dispatch.after_send", mode=crashed)
    assert child.returncode == -9, child.stderr
    assert len(fake.requests) == 1
    build = _graph_module()
    config = {"configurable": {"thread_id": "t1"}}
    clock = ManualClock(start=time.time() + 3600)
    with Ledger.open(db_url, clock=clock) as led:
        with pytest.raises(LedgerStop) as ei, \
                led.run("graph", plan=plan, budget=BUDGET, grant=GRANT) as run:
            graph = build(run, search, str(checkpoints))
            assert graph.get_state(config).next == ("agent",)  # LangGraph re-runs the node
            if resumed == "stream":
                for _ in graph.stream(None, config, stream_mode="messages"):
                    pass
            else:
                graph.invoke(None, config)
        assert ei.value.reason == "execution_unknown"
        [att] = led.timeline("graph")
        assert ei.value.attempts == [att.attempt_id]
        assert att.state in (AttemptState.UNKNOWN, AttemptState.DISPATCHING)
        assert led.get_run("graph").status is RunStatus.FAILED
    assert len(fake.requests) == 1  # never sent again


def test_an_image_the_model_returned_is_a_content_block_the_next_call_carries(
        db_url: str, fake: FakeProvider) -> None:
    from tests.media import png

    image = png()
    fake.enqueue(Behavior(image_out=("image/png", image)))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("image", plan=routes(fake, "gemini"), budget=BUDGET,
                        grant=GRANT) as run:
            model = LedgerChatModel(run)
            answer = await model.ainvoke("Draw the revenue chart.")
            blocks = answer.content_blocks
            assert [b["type"] for b in blocks] == ["text", "image"]
            assert blocks[1]["mime_type"] == "image/png"
            again = await model.ainvoke([HumanMessage("Draw the revenue chart."), answer,
                                         HumanMessage("Now in blue.")])
            assert again.text == FULL_TEXT
            # An edited image is not what the model returned: refused, nothing sent.
            import base64

            edited = answer.model_copy(update={"content": [
                blocks[0], {**blocks[1], "base64": base64.b64encode(png(8, 8)).decode()}]})
            with pytest.raises(FailoverExhausted) as ei:
                await model.ainvoke([HumanMessage("Draw the revenue chart."), edited,
                                     HumanMessage("Now in blue.")])
            assert ei.value.reason == "no_candidate"

    asyncio.run(main())
    assert len(fake.requests) == 2
    assert [m.role for m in fake.requests[1].media] == ["model"]


def test_a_history_message_the_ledger_refuses_is_named_by_its_index(
        db_url: str, fake: FakeProvider) -> None:
    """A history holds a tool message per call: the refusal of one says which it is."""
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("tool-id", plan=routes(fake), budget=BUDGET, grant=GRANT) as run:
            model = LedgerChatModel(run).bind_tools([search])
            first = await model.ainvoke([HumanMessage("Search.")])
            (call,) = first.tool_calls
            answered = ToolMessage("3 hits", tool_call_id=call["id"])
            stray = ToolMessage("4 hits", tool_call_id="x" * 300)
            with pytest.raises(InvalidArgument) as ei:
                await model.ainvoke([HumanMessage("Search."), first, answered, stray])
            assert ei.value.field == "messages" and ei.value.fields["message_index"] == 3
            assert ei.value.fields["part_field"] == "tool_call_id"
            assert str(ei.value).startswith("messages[3] (a ToolMessage): invalid tool_call_id: "
                                            "is 300 characters long")
            # A reasoning item the ledger carried, cut in the host's keeping.
            cut = first.model_copy(update={"response_metadata": {
                **first.response_metadata,
                "ledger": {**first.response_metadata["ledger"], "reasoning": ["abc"]}}})
            with pytest.raises(InvalidArgument) as ei:
                await model.ainvoke([HumanMessage("Search."), cut, answered])
            assert ei.value.fields["message_index"] == 1
            assert ei.value.fields["part_field"] == "reasoning"
            assert str(ei.value).startswith("messages[1] (a AIMessage): a reasoning item the "
                                            "ledger returned with an earlier answer is not valid")

    asyncio.run(main())
    assert len(fake.requests) == 1
