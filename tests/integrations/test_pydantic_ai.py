"""pydantic-ai agents on a ledger Run (``LedgerModel``): a real ``Agent`` with a tool against the
shipped fake provider over loopback, on both backends. Each model request is one turn; failover,
budget and disclosure are the Run's; the history the agent keeps passes preflight because the
ledger recorded it, and a history the Run did not produce is refused before anything is sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import FallbackExceptionGroup
from pydantic_ai.messages import (
    BinaryContent,
    ImageUrl,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from ledger import (
    AsyncLedger,
    Budget,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    InvalidState,
    Ledger,
    Price,
    ProviderError,
    RunStatus,
)
from ledger.api.session import AsyncRunSession
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState
from ledger.integrations.pydantic_ai import LedgerModel
from ledger.testing import Behavior, FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import cancelled_twice, plan, tool_call_ids

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

REPO = Path(__file__).resolve().parents[2]
BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
ALLOWED = ["user_input", "model_derived", "tool_result", "tool_description", "system"]
GRANT = Grant(recipients={"fake": ALLOWED})
FULL_TEXT = Behavior().text




searched: list[str] = []


def search(query: str) -> str:
    """Search the company filings."""
    searched.append(query)
    return json.dumps({"hits": 3, "query": query})


def agent_for(run: AsyncRunSession) -> Agent[None, str]:
    return Agent(LedgerModel(run), tools=[search], instructions="You are a careful analyst.")


def responses(messages: list[ModelMessage]) -> list[ModelResponse]:
    return [m for m in messages if isinstance(m, ModelResponse)]


# -- a multi-turn agent with a tool --------------------------------------------------------


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "gemini"])
def test_a_three_request_agent_fails_over_once_and_its_history_passes_preflight(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")  # the primary answers 503 once
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})), model="backup-model")
    searched.clear()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("agent", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            first = await agent.run("Compare the two filings.")
            assert first.output == FULL_TEXT and searched == ["10-K"]
            second = await agent.run("And the risks?", message_history=first.all_messages())
            assert second.output == FULL_TEXT
            timeline = await led.timeline("agent")
            # Three model requests, four Attempts: the 503, then the backup for every request.
            assert [(a.route_id, a.state) for a in timeline] == [
                ("primary", AttemptState.FAILED), ("backup", AttemptState.SUCCEEDED),
                ("backup", AttemptState.SUCCEEDED), ("backup", AttemptState.SUCCEEDED)]
            assert timeline[0].http_status == 503
            # What the ledger recorded reaches every response.
            rs = responses(second.all_messages())
            assert len(rs) == 3
            for r, att in zip(rs, timeline[1:], strict=True):
                details = (r.provider_details or {})["ledger"]
                assert details["attempt_id"] == att.attempt_id and details["route"] == "backup"
                assert r.model_name == att.model_reported == "backup-model-fake-001"
                assert r.provider_name == "fake-b"
                assert (r.usage.input_tokens, r.usage.output_tokens) == (11, 7)
            assert rs[0].provider_details is not None
            assert rs[0].provider_details["ledger"]["attempts"] == [
                timeline[0].attempt_id, timeline[1].attempt_id]
            [failed] = rs[0].failed_attempts or []
            assert failed.model_name == "primary-model" and "503" in (failed.error or "")
            assert isinstance(rs[0].parts[-1], ToolCallPart)
            assert (first.usage.requests, second.usage.requests) == (2, 1)

    asyncio.run(main())
    # The tool's result went to the model as the protocol's tool result, after the call.
    body = json.dumps(fake.requests[2].json)
    assert '\\"hits\\": 3' in body or '"hits": 3' in body
    assert "You are a careful analyst." in body
    with Ledger.open(db_url) as led:
        assert led.get_run("agent").status is RunStatus.SUCCEEDED


@pytest.mark.parametrize("stream", [False, True])
def test_the_agent_sees_the_cached_and_reasoning_tokens_the_ledger_recorded(
        db_url: str, fake: FakeProvider, stream: bool) -> None:
    # The three integrations report the same usage: LangChain's input/output token details
    # and the Agents SDK's usage details carry them; so must pydantic-ai's RequestUsage.
    fake.enqueue(Behavior(usage=(120, 40), cached_tokens=100, reasoning_tokens=25),
                 model="primary-model")

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("agent", plan=plan(fake, "openai"), budget=BUDGET, grant=GRANT) as run:
            agent = Agent(LedgerModel(run))
            if stream:
                async with agent.run_stream("Summarise the filing.") as result:
                    await result.get_output()
                    messages = result.all_messages()
            else:
                messages = (await agent.run("Summarise the filing.")).all_messages()
            [att] = await led.timeline("agent")
            assert (att.cached_tokens, att.reasoning_tokens) == (100, 25)
            [r] = responses(messages)
            assert (r.usage.input_tokens, r.usage.output_tokens) == (120, 40)
            assert (r.usage.cache_read_tokens, r.usage.output_reasoning_tokens) == (100, 25)

    asyncio.run(main())


def test_a_streamed_agent_run_gets_the_text_and_the_recorded_answer(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    fake.enqueue(Behavior(tool_call=("search", {"query": "risks"})), model="backup-model")
    searched.clear()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("s", plan=plan(fake, "anthropic"), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            # agent.iter streams every model request of a run with tools.
            deltas: list[str] = []
            async with agent.iter("What are the risks?") as agent_run:
                async for node in agent_run:
                    if Agent.is_model_request_node(node):
                        async with node.stream(agent_run.ctx) as events:
                            async for event in events:
                                if isinstance(event, PartDeltaEvent) and isinstance(
                                        event.delta, TextPartDelta):
                                    deltas.append(event.delta.content_delta)
                                elif isinstance(event, PartStartEvent) and isinstance(
                                        event.part, TextPart):
                                    deltas.append(event.part.content)
            assert agent_run.result is not None and searched == ["risks"]
            assert "".join(deltas) == FULL_TEXT * 2 and len(deltas) > 2
            # agent.run_stream streams the answer's text as it arrives.
            shown: list[str] = []
            async with agent.run_stream(
                    "Summarise.", message_history=agent_run.result.all_messages()) as stream:
                async for delta in stream.stream_text(delta=True, debounce_by=None):
                    shown.append(delta)
                messages = stream.all_messages()
            assert "".join(shown) == FULL_TEXT and len(shown) > 1
            # The streamed answers are what the ledger recorded: a further turn passes.
            again = await agent.run("Thanks.", message_history=messages)
            rs = responses(again.all_messages())
            assert [r.model_name for r in rs] == ["backup-model-fake-001"] * 4
            assert all(r.usage.output_tokens == 7 for r in rs)
            assert isinstance(rs[0].parts[-1], ToolCallPart)
            assert (rs[0].provider_details or {})["ledger"]["switched"] is True
            timeline = await led.timeline("s")
            assert [a.state for a in timeline] == [AttemptState.FAILED] + \
                [AttemptState.SUCCEEDED] * 4

    asyncio.run(main())


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_call_id_the_provider_reuses_gets_an_id_of_its_own_so_both_rounds_are_served(
        db_url: str, fake: FakeProvider, protocol: str, streamed: bool) -> None:
    # The fake gives every call the same id (call_fake_1, toolu_fake_1): the second round's
    # return would be taken for another copy of the first's, and refused after the tool ran.
    fake.enqueue(Behavior(tool_call=("search", {"query": "A"})),
                 Behavior(tool_call=("search", {"query": "B"})), model="primary-model")
    searched.clear()
    provider_id = "toolu_fake_1" if protocol == "anthropic" else "call_fake_1"

    async def main() -> list[str]:
        async with AsyncLedger.open(db_url) as led, \
                led.run("ids", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            if streamed:
                # agent.iter streams every model request (LedgerModel.request_stream).
                async with agent.iter("Search twice.") as agent_run:
                    async for node in agent_run:
                        if Agent.is_model_request_node(node):
                            async with node.stream(agent_run.ctx) as events:
                                async for _event in events:
                                    pass
                assert agent_run.result is not None
                result = agent_run.result
            else:
                result = await agent.run("Search twice.")
            assert result.output == FULL_TEXT and searched == ["A", "B"]
            calls = [p.tool_call_id for r in responses(result.all_messages())
                     for p in r.parts if isinstance(p, ToolCallPart)]
            assert calls[0] == provider_id and calls[1] != provider_id
            [ev] = await led.events("ids", ["tool_call_id"])
            assert ev.data == {"provider_id": provider_id, "call_id": calls[1]}
            assert ev.attempt_id == (await led.timeline("ids"))[1].attempt_id
            return calls

    first, second = asyncio.run(main())
    assert len(fake.requests) == 3
    assert tool_call_ids(fake.requests[2]) == [first, first, second, second]


def test_streamed_text_reaches_the_agent_while_the_attempt_is_still_on_the_wire(
        db_url: str, fake: FakeProvider) -> None:
    # The answer sends two pieces, then nothing: only streaming can show them before the end.
    fake.set_default(Behavior(fault=Fault.STALL, content_before_fault=2))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("live", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            async with agent.run_stream("Go.") as stream:
                async for text in stream.stream_text(delta=True, debounce_by=None):
                    assert text and FULL_TEXT.startswith(text)
                    [att] = await led.timeline("live")
                    assert att.state is AttemptState.DISPATCHING  # not answered yet
                    break  # the agent stops reading: the turn is cancelled
            [att] = await led.timeline("live")
            # Sent and cut off by the caller: unknown, its hold kept, never re-sent.
            assert att.state is AttemptState.UNKNOWN

    asyncio.run(main())
    assert len(fake.requests) == 1


# -- stops -----------------------------------------------------------------------------------


# A unit of cost per output token: each answer posts 7 (its reported usage), and each call's
# hold is its max_tokens (16). Two calls post 14; the third's hold would overdraw 29.
COSTLY = Price(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1_000_000))


@pytest.mark.parametrize(("kind", "budget", "reason", "detail"), [
    ("calls", Budget(max_calls=2, max_retries=1, max_cost=Decimal(1000)), "call_allowance",
     "no model call left"),
    ("cost", Budget(max_calls=10, max_retries=5, max_cost=Decimal(29)), "budget", ""),
])
def test_a_run_whose_budget_runs_out_stops_cleanly_with_failover_exhausted(
        db_url: str, fake: FakeProvider, kind: str, budget: Budget, reason: str,
        detail: str) -> None:
    fake.set_default(Behavior(tool_call=("search", {"query": "again"})))  # never stops asking
    routes = [r.model_copy(update={"price": COSTLY}) for r in plan(fake)]

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            with pytest.raises(FailoverExhausted) as ei:
                async with led.run("tight", plan=routes, budget=budget, grant=GRANT) as run:
                    await agent_for(run).run("Search until done.",
                                             model_settings={"max_tokens": 16})
            stop = ei.value
            assert isinstance(stop, ExceptionGroup)
            assert stop.reason == reason and detail in stop.detail
            rec = await led.get_run("tight")
            # The Run's own bounds stopped it on purpose: stopped, not failed.
            assert rec.status is RunStatus.STOPPED and rec.calls_used == 2
            if kind == "cost":
                assert rec.posted == Decimal(14)  # within the budget: nothing overdrawn
            timeline = await led.timeline("tight")
            assert [a.state for a in timeline] == [AttemptState.SUCCEEDED] * 2

    asyncio.run(main())
    assert len(fake.requests) == 2  # the third request was never sent
    assert fake.requests[0].json["max_tokens"] == 16


def test_a_stop_is_failover_exhausted_which_fallback_exception_group_handlers_see_beside(
        db_url: str, fake: FakeProvider) -> None:
    fake.set_default(Fault.UNAVAILABLE)

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("down", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            # except* on the attempts' errors works on it as on any ExceptionGroup ...
            try:
                await agent.run("Anyone there?")
            except* ProviderError as group:
                assert isinstance(group, FailoverExhausted)
                assert len(group.exceptions) == 2 and len(group.attempts) == 2
            # ... and a handler of pydantic-ai's FallbackExceptionGroup does not catch it.
            caught: list[str] = []
            try:
                await agent.run("Anyone there?")
            except FallbackExceptionGroup:  # pragma: no cover - pydantic-ai's own, not raised
                caught.append("fallback")
            except FailoverExhausted as stop:
                caught.append(stop.reason)
            assert caught and caught[0] != "fallback"
            assert len(await led.timeline("down")) >= 2

    asyncio.run(main())


def test_a_streamed_stop_hands_back_the_delivered_partial_output(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(fault=Fault.STREAM_CUT, content_before_fault=2), model="primary-model")

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("cut", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            shown: list[str] = []
            with pytest.raises(FailoverExhausted) as ei:
                async with agent_for(run).run_stream("Go.") as stream:
                    async for text in stream.stream_text(delta=True, debounce_by=None):
                        shown.append(text)
            partial = ei.value.partial
            assert partial is not None and partial.text == "".join(shown) and shown
            assert partial.route == "primary"
            [att] = await led.timeline("cut")  # delivered output: the turn did not move on
            assert att.effective_output

    asyncio.run(main())


# -- how the Run ends ------------------------------------------------------------------------


def test_a_reader_that_leaves_run_stream_early_ends_the_run_cancelled(
        db_url: str, fake: FakeProvider) -> None:
    async def main() -> list[RunStatus]:
        out = []
        async with AsyncLedger.open(db_url) as led:
            # Read to the end: served, succeeded.
            async with led.run("whole", plan=plan(fake), budget=BUDGET, grant=GRANT) as run, \
                    agent_for(run).run_stream("Go.") as stream:
                assert await stream.get_output() == FULL_TEXT
            out.append((await led.get_run("whole")).status)
            # Left while the answer was still on the wire: the turn is cancelled.
            fake.set_default(Behavior(fault=Fault.STALL, content_before_fault=2))
            async with led.run("left", plan=plan(fake), budget=BUDGET, grant=GRANT) as run, \
                    agent_for(run).run_stream("Go.") as stream:
                async for _text in stream.stream_text(delta=True, debounce_by=None):
                    break
            out.append((await led.get_run("left")).status)
            [att] = await led.timeline("left")
            assert att.state is AttemptState.UNKNOWN
        return out

    assert asyncio.run(main()) == [RunStatus.SUCCEEDED, RunStatus.CANCELLED]


def test_a_streamed_answer_that_arrived_but_was_not_read_to_its_end_ends_the_run_cancelled(
        db_url: str, fake: FakeProvider) -> None:
    from pydantic_ai.models import ModelRequestParameters

    async def main() -> RunStatus:
        async with AsyncLedger.open(db_url) as led:
            async with led.run("unread", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                model = LedgerModel(run)
                messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart("Go.")])]
                async with model.request_stream(messages, None,
                                                ModelRequestParameters()) as response:
                    assert response._turn is not None
                    await response._turn  # the whole answer is in and recorded ...
                    [att] = await led.timeline("unread")
                    assert att.state is AttemptState.SUCCEEDED
                # ... but the reader never read it: the agent was not served.
            return (await led.get_run("unread")).status

    assert asyncio.run(main()) is RunStatus.CANCELLED


def test_a_request_whose_outcome_is_unknown_is_never_asked_again_in_the_same_session(
        db_url: str, fake: FakeProvider) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("unknown", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            agent = Agent(LedgerModel(run))
            # A reader that left a stream early, and a call a timeout gave up on.
            fake.enqueue(Behavior(fault=Fault.TRICKLE, delay_s=0.05))
            async with agent.run_stream("Stream it.") as stream:
                async for _text in stream.stream_text(delta=True, debounce_by=None):
                    break
            fake.enqueue(Fault.NO_RESPONSE)
            # Given up once the request has left, as a timeout would (without racing the
            # clock: a fixed timeout on a busy machine could fire before the request left).
            call = asyncio.ensure_future(agent.run("Answer it."))
            assert await asyncio.to_thread(fake.wait_for_requests, 2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            attempts = await led.timeline("unknown")
            assert [a.state for a in attempts] == [AttemptState.UNKNOWN] * 2
            with pytest.raises(FailoverExhausted) as ei:
                async with agent.run_stream("Stream it.") as stream:
                    await stream.get_output()
            assert ei.value.reason == "execution_unknown"
            assert ei.value.attempts == [attempts[0].attempt_id]
            with pytest.raises(FailoverExhausted) as ei:
                await agent.run("Answer it.")
            assert ei.value.reason == "execution_unknown"
            assert ei.value.attempts == [attempts[1].attempt_id]
            # Streamed or not, it is the same request.
            with pytest.raises(FailoverExhausted) as ei:
                await agent.run("Stream it.")
            assert ei.value.attempts == [attempts[0].attempt_id]
            with pytest.raises(FailoverExhausted) as ei:
                async with agent.run_stream("Answer it.") as stream:
                    await stream.get_output()
            assert ei.value.attempts == [attempts[1].attempt_id]
            assert await led.timeline("unknown") == attempts

    asyncio.run(main())
    assert len(fake.requests) == 2


def test_a_streamed_request_cancelled_twice_is_refused_as_unknown_not_left_in_flight(
        db_url: str, fake: FakeProvider) -> None:
    async def stream(agent: Agent[None, str]) -> str:
        async with agent.run_stream("Stream it.") as streamed:
            return await streamed.get_output()

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("twice", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            agent = Agent(LedgerModel(run))
            # pydantic-ai's request_timeout cancels the call, then its draining.
            await cancelled_twice(lambda: stream(agent), fake)
            [att] = await led.timeline("twice")
            assert att.state is AttemptState.UNKNOWN
            with pytest.raises(FailoverExhausted) as ei:
                await stream(agent)
            assert ei.value.reason == "execution_unknown"
            assert ei.value.attempts == [att.attempt_id]

    asyncio.run(main())
    assert len(fake.requests) == 1


@pytest.mark.parametrize(("policy", "reason", "status"), [
    (None, "no_candidate", RunStatus.FAILED),
    ({"name": "off", "failover": {"enabled": False}}, "failover_disabled", RunStatus.STOPPED),
])
def test_a_stop_the_host_caught_ends_the_agents_run_failed_or_stopped(
        db_url: str, fake: FakeProvider, policy: Any, reason: str, status: RunStatus) -> None:
    fake.set_default(Fault.UNAVAILABLE)

    async def main() -> RunStatus:
        async with AsyncLedger.open(db_url) as led:
            async with led.run("down", plan=plan(fake), budget=BUDGET, grant=GRANT,
                               policy=policy) as run:
                try:
                    await agent_for(run).run("Anyone there?")
                except FailoverExhausted as stop:
                    assert stop.reason == reason
                else:  # pragma: no cover - the test's premise
                    pytest.fail("not stopped")
            return (await led.get_run("down")).status

    assert asyncio.run(main()) is status


# -- history the Run did not produce -----------------------------------------------------


def test_a_blocking_run_session_is_refused_naming_its_type_and_the_fix(
        db_url: str, fake: FakeProvider) -> None:
    # pydantic-ai's run_sync cannot run on the async session the model needs (the session
    # exists inside a running loop only); a blocking one is refused, saying what it got.
    with Ledger.open(db_url) as led, \
            led.run("blocking", plan=plan(fake), budget=BUDGET, grant=GRANT) as blocking, \
            pytest.raises(InvalidArgument) as info:
        LedgerModel(blocking)  # type: ignore[arg-type]
    assert info.value.field == "run"
    assert "(got RunSession)" in str(info.value) and " at 0x" not in str(info.value)
    assert "async with led.run(...) as run" in str(info.value)
    assert fake.requests == []


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_stream"])
def test_a_model_used_outside_its_runs_block_is_refused_as_not_entered_or_ended(
        db_url: str, fake: FakeProvider, stream: bool) -> None:
    """Before the block a request read the Run's timeline and raised ``NotFound: unknown run
    id``, where LangChain and the Agents SDK say the session is not entered yet."""
    async def ask(agent: Agent[None, str]) -> None:
        if stream:
            async with agent.run_stream("Hi") as result:
                await result.get_output()
        else:
            await agent.run("Hi")

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            session = led.run("outside", plan=plan(fake), budget=BUDGET, grant=GRANT)
            with pytest.raises(InvalidState, match="has not been entered yet"):
                await ask(Agent(LedgerModel(session)))
            async with session as run:
                agent = Agent(LedgerModel(run))
                await ask(agent)
            with pytest.raises(InvalidState, match="has ended"):
                await ask(agent)

    asyncio.run(main())
    assert len(fake.requests) == 1


def test_history_the_run_did_not_produce_is_refused_before_sending(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("edit", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            first = await agent.run("Compare the two filings.")
            history = first.all_messages()
            sent = len(fake.requests)

            # 1. The model's answer, edited by the host.
            last = history[-1]
            assert isinstance(last, ModelResponse)
            edited = [*history[:-1],
                      replace(last, parts=[TextPart(content="The filings are identical.")])]
            # 2. A tool result the tool never returned.
            forged_result = [
                replace(m, parts=[replace(p, content='{"hits": 1000}') for p in m.parts])
                if isinstance(m, ModelRequest) and any(isinstance(p, ToolReturnPart)
                                                       for p in m.parts) else m
                for m in history]
            # 3. A whole exchange the Run never had, with the ledger's details copied over.
            invented: list[ModelMessage] = [
                ModelRequest(parts=[UserPromptPart(content="Earlier question")]),
                ModelResponse(parts=[ToolCallPart(tool_name="search", args='{"query": "x"}',
                                                  tool_call_id="call_invented")],
                              provider_details=last.provider_details),
                ModelRequest(parts=[ToolReturnPart(tool_name="search", content="secret",
                                                   tool_call_id="call_invented")]),
                ModelResponse(parts=[TextPart(content="ok")])]
            for case, bad in (("edited", edited), ("forged", forged_result),
                              ("invented", invented)):
                with pytest.raises(FailoverExhausted) as ei:
                    await agent.run("Go on.", message_history=bad)
                assert ei.value.reason == "no_candidate", case
                assert "provenance" in json.dumps(ei.value.skipped, default=str)
            assert len(fake.requests) == sent  # nothing was sent
            # The history as the Run produced it still passes.
            assert (await agent.run("Go on.", message_history=history)).output == FULL_TEXT

    asyncio.run(main())


def test_a_history_message_the_ledger_refuses_is_named_by_its_index(
        db_url: str, fake: FakeProvider) -> None:
    """A history holds a request per tool round: the refusal of one says which it is, as its
    index in the agent's messages; the history as the Run produced it is served as before."""
    fake.enqueue(Behavior(tool_call=("search", {"query": "10-K"})))

    def with_parts(history: list[ModelMessage], at: int, kind: type[Any],
                   **change: Any) -> list[ModelMessage]:
        """``history`` with each ``kind`` part of its message ``at`` changed."""
        message = history[at]
        return [*history[:at], replace(message, parts=[
            replace(p, **change) if isinstance(p, kind) else p for p in message.parts]),
                *history[at + 1:]]

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("index", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            agent = agent_for(run)
            history = (await agent.run("Compare the two filings.")).all_messages()
            assert [type(m).__name__ for m in history] == [
                "ModelRequest", "ModelResponse", "ModelRequest", "ModelResponse"]
            sent = len(fake.requests)
            long_id = "x" * 300
            long_ids = with_parts(with_parts(history, 1, ToolCallPart, tool_call_id=long_id), 2,
                                  ToolReturnPart, tool_call_id=long_id)
            cases: dict[str, tuple[list[ModelMessage], Any, int, str | None, str]] = {
                # A tool call's id no part can keep, and its result's.
                "call id": (long_ids, "Go on.", 1, "tool_call_id",
                            "messages[1] (a ModelResponse): invalid tool_call_id: is 300 "
                            "characters long"),
                # A link as what the tool returned: the ledger never sends one on.
                "tool link": (with_parts(history, 2, ToolReturnPart, content=ImageUrl(
                    "https://attacker.example/chart.png")), "Go on.", 2, None,
                              "messages[2] (a ModelRequest): LedgerModel: tool 'search' "
                              "returned a link"),
                # A reasoning item the ledger carried, cut in the host's keeping.
                "cut reasoning": ([history[0], replace(history[1], parts=[ThinkingPart(
                    content="", provider_details={"ledger": {"reasoning": "abc"}}),
                    *history[1].parts]), *history[2:]], "Go on.", 1, "reasoning",
                                  "messages[1] (a ModelResponse): a reasoning item the ledger "
                                  "returned with an earlier answer is not valid base64"),
                # The new prompt's file, of a type no part carries.
                "user file": (history, ["Read it.", BinaryContent(
                    data=b"PK\x03\x04", media_type="application/msword")], 4, "media_type",
                              "messages[4] (a ModelRequest): user content of kind 'binary' "
                              "cannot be sent: invalid media_type"),
            }
            for case, (bad, prompt, index, part_field, says) in cases.items():
                with pytest.raises(InvalidArgument) as ei:
                    await agent.run(prompt, message_history=bad)
                assert ei.value.field == "messages", case
                assert ei.value.fields["message_index"] == index, case
                assert ei.value.fields["part_field"] == part_field, case
                assert str(ei.value).startswith(says), (case, str(ei.value))
            assert len(fake.requests) == sent  # nothing was sent
            # The history as the Run produced it is sent as before: the tool's result after
            # its call.
            again = await agent.run("Go on.", message_history=history)
            assert again.output == FULL_TEXT
            assert len(fake.requests) == sent + 1
            body = json.dumps(fake.requests[-1].json)
            assert '\\"hits\\": 3' in body or '"hits": 3' in body

    asyncio.run(main())


# -- resuming after a crash ----------------------------------------------------------------

CHILD = r"""
import asyncio, json, os, sys
from decimal import Decimal
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_ai.agent import CallToolsNode
from ledger import AsyncLedger, Budget, Grant, Price, Route
from ledger.integrations.pydantic_ai import LedgerModel

url, endpoint, out = sys.argv[1:4]
def search(query: str) -> str:
    '''Search the company filings.'''
    return "never reached"

async def main():
    routes = [Route.model_validate(r) for r in json.loads(os.environ["PLAN"])]
    budget = Budget.model_validate_json(os.environ["BUDGET"])
    grant = Grant.model_validate_json(os.environ["GRANT"])
    led = await AsyncLedger.open(url)
    run = await led.run("resume", plan=routes, budget=budget, grant=grant).__aenter__()
    agent = Agent(LedgerModel(run), tools=[search])
    async with agent.iter("Compare the two filings.") as agent_run:
        async for node in agent_run:
            if isinstance(node, CallToolsNode):  # the model asked for the tool: crash now
                with open(out, "wb") as f:
                    f.write(ModelMessagesTypeAdapter.dump_json(agent_run.all_messages()))
                os._exit(17)

asyncio.run(main())
"""


def test_an_agent_resumes_a_crashed_run_from_the_history_it_kept(
        db_url: str, fake: FakeProvider, tmp_path: Path) -> None:
    fake.set_default(Behavior(tool_call=("search", {"query": "10-K"})))
    routes = plan(fake)
    saved = tmp_path / "history.json"
    env = dict(os.environ, PYTHONPATH=str(REPO),
               PLAN=json.dumps([r.model_dump(mode="json") for r in routes]),
               BUDGET=BUDGET.model_dump_json(), GRANT=GRANT.model_dump_json())
    child = subprocess.run([sys.executable, "-c", CHILD, db_url, "", str(saved)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 17, child.stderr
    history = ModelMessagesTypeAdapter.validate_json(saved.read_bytes())
    fake.set_default(Behavior())
    searched.clear()

    async def main() -> None:
        # The crashed executor's lease lapses (no sleeping: this process's clock is past it).
        clock = ManualClock(start=time.time() + 3600)
        async with AsyncLedger.open(db_url, clock=clock) as led:
            assert (await led.get_run("resume")).status is RunStatus.RUNNING
            async with led.run("resume", plan=routes, budget=BUDGET, grant=GRANT) as run:
                agent = agent_for(run)
                result = await agent.run(message_history=history)  # runs the pending tool
                assert result.output == FULL_TEXT and searched == ["10-K"]
            timeline = await led.timeline("resume")
            assert [a.state for a in timeline] == [AttemptState.SUCCEEDED] * 2
            assert (await led.get_run("resume")).status is RunStatus.SUCCEEDED

    asyncio.run(main())
    # The second request carried the crashed session's tool call and this one's result.
    messages = fake.requests[-1].json["messages"]
    assert [m["role"] for m in messages][-2:] == ["assistant", "tool"]


CHILD_IN_CALL = r"""
import asyncio, sys
from pydantic_ai import Agent
from ledger.integrations.pydantic_ai import LedgerModel
from tests.integrations.crashchild import in_call_run

async def main():
    run = await in_call_run()
    agent = Agent(LedgerModel(run))
    if sys.argv[3] == "stream":
        async with agent.run_stream(sys.argv[2]) as streamed:
            await streamed.get_output()
    else:
        await agent.run(sys.argv[2])

asyncio.run(main())
"""


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_whose_executor_died_after_sending_is_never_sent_again(
        db_url: str, fake: FakeProvider, stream: bool) -> None:
    # The provider answered; the process died (the named crash point after the send) before
    # the ledger settled the Attempt. The agent asks the same again, the same way, in a new
    # process.
    routes = plan(fake)
    question = "Compare the two filings."
    env = dict(os.environ, PYTHONPATH=str(REPO), LEDGER_FAULTS="dispatch.after_send",
               PLAN=json.dumps([r.model_dump(mode="json") for r in routes]),
               BUDGET=BUDGET.model_dump_json(), GRANT=GRANT.model_dump_json())
    child = subprocess.run([sys.executable, "-c", CHILD_IN_CALL, db_url, question,
                            "stream" if stream else "whole"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr
    assert len(fake.requests) == 1

    async def main() -> None:
        clock = ManualClock(start=time.time() + 3600)  # the crashed lease lapsed
        async with AsyncLedger.open(db_url, clock=clock) as led:
            with pytest.raises(FailoverExhausted) as ei:
                async with led.run("in-call", plan=routes, budget=BUDGET, grant=GRANT) as run:
                    agent = Agent(LedgerModel(run))
                    if stream:
                        async with agent.run_stream(question) as streamed:
                            await streamed.get_output()
                    else:
                        await agent.run(question)
            [att] = await led.timeline("in-call")
            assert ei.value.reason == "execution_unknown"
            assert ei.value.attempts == [att.attempt_id]
            assert att.state in (AttemptState.UNKNOWN, AttemptState.DISPATCHING)

    asyncio.run(main())
    assert len(fake.requests) == 1  # never sent again
