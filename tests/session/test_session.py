"""The Run session (``with led.run(...)`` / ``async with``): held, finished and released on every
path; turns whose parts carry their provenance; tool calls and tool results; streaming;
delivered partial output; credentials on routes; children; misuse. Real HTTP over loopback
(the shipped fake provider) through each protocol, on both backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from decimal import Decimal
from pathlib import Path

import pytest

from ledger import (
    AdmissionConflict,
    AsyncLedger,
    Budget,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    InvalidState,
    Ledger,
    NotFound,
    Part,
    RunStatus,
    ToolSpec,
)
from ledger.adapters import ToolCallProposal
from ledger.domain.records import AttemptRecord, AttemptState
from ledger.domain.values import Health
from ledger.testing import Behavior, FakeProvider, Fault
from tests import fakeplan
from tests.fakeplan import plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input", "model_derived", "tool_result",
                                   "tool_description", "system"]})
TOOLS = [ToolSpec(name="search", description="Search the filings",
                  parameters={"type": "object", "properties": {"q": {"type": "string"}}})]
FULL_TEXT = Behavior().text




# -- the block -----------------------------------------------------------------------------


def test_a_session_admits_leases_finishes_and_releases(db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        with led.run("task-1", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            assert led.get_run("task-1").lease_holder == run.lease.executor
            run.turn(Envelope(parts=[Part(content="hello")]))
        rec = led.get_run("task-1")
        assert rec.status is RunStatus.SUCCEEDED and rec.lease_holder is None
        # The same block again resumes the Run (same id, same content): no LeaseHeld.
        with led.run("task-1", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            pass
        with pytest.raises(AdmissionConflict), led.run("task-1", plan=plan(fake)[:1],
                                                        budget=BUDGET, grant=GRANT):
            pass
        assert led.get_run("task-1").lease_holder is None


def test_a_clean_session_logs_nothing_at_warning(db_url: str, fake: FakeProvider,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    # A WARNING is news an operator may alert on (a lost acknowledgement and how it was
    # resolved: docs/operations.md); a session that entered, turned and left is none.
    caplog.set_level(logging.DEBUG, logger="ledger")
    with Ledger.open(db_url) as led, led.run("quiet", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        run.turn(Envelope(parts=[Part(content="hello")]))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_block_that_raises_finishes_the_run_failed(db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        with pytest.raises(RuntimeError), led.run("t", plan=plan(fake), budget=BUDGET):
            raise RuntimeError("the host's own error")
        rec = led.get_run("t")
        assert rec.status is RunStatus.FAILED and rec.lease_holder is None


@pytest.mark.parametrize("limit", ["timeout_inside", "timeout_outside", "wait_for"])
def test_an_asyncio_time_limit_ends_the_run_cancelled_wherever_the_host_catches_it(
        db_url: str, fake: FakeProvider, limit: str) -> None:
    # asyncio.timeout and wait_for cancel the turn, then raise TimeoutError from the
    # cancellation: the same interruption, whether it leaves the block or not.
    fake.set_default(Behavior(fault=Fault.NO_RESPONSE))
    env = Envelope(parts=[Part(content="hi")])

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            with contextlib.suppress(TimeoutError):
                async with led.run("t", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                    if limit == "wait_for":
                        await asyncio.wait_for(run.turn(env), 0.3)
                    elif limit == "timeout_outside":
                        async with asyncio.timeout(0.3):
                            await run.turn(env)
                    else:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.3):
                                await run.turn(env)
            rec = await led.get_run("t")
            assert rec.status is RunStatus.CANCELLED and rec.lease_holder is None

    asyncio.run(main())


def test_a_cancelled_async_block_finishes_the_run_cancelled(db_url: str,
                                                            fake: FakeProvider) -> None:
    fake.set_default(Behavior(fault=Fault.TRICKLE, delay_s=0.02))

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            streaming = asyncio.Event()

            async def agent() -> None:
                async with led.run("t", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                    await run.turn(Envelope(parts=[Part(content="hi")], stream=True),
                                   on_text=lambda _t: streaming.set())

            task = asyncio.create_task(agent())
            # Cancelled once text arrived: the stream is really running on loopback, however
            # busy the machine (a fixed sleep could cancel before the request was sent).
            await asyncio.wait_for(streaming.wait(), timeout=60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            rec = led.sync.get_run("t")
            assert rec.status is RunStatus.CANCELLED and rec.lease_holder is None
            [att] = led.sync.timeline("t")
            assert att.state is AttemptState.UNKNOWN  # sent, cut off: hold kept, never re-sent

    asyncio.run(main())


# -- turns, parts, tools -------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "gemini"])
@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_agent_with_a_tool_passes_preflight_with_no_extra_calls(
        db_url: str, fake: FakeProvider, protocol: str, stream: bool) -> None:
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")  # the primary fails over once
    fake.set_default(Behavior(tool_call=("search", {"q": "filings"})), model="backup-model")
    shown: list[str] = []

    async def main() -> None:
        async with AsyncLedger.open(db_url) as led, \
                led.run("agent", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            msgs = [Part(role="system", content="Be brief.", data_class="system"),
                    Part(content="Compare the two filings.")]
            r1 = await run.turn(Envelope(parts=msgs, tools=TOOLS, stream=stream),
                                on_text=shown.append)
            assert r1.route.id == "backup" and r1.switched
            [call] = r1.tool_calls
            assert call.name == "search" and json.loads(call.content) == {"q": "filings"}
            msgs += r1.parts
            msgs.append(await run.tool_result(call.tool_call_id or "", '{"hits": 3}'))
            fake.set_default(Behavior(), model="backup-model")
            r2 = await run.turn(Envelope(parts=msgs, tools=TOOLS, stream=stream),
                                on_text=shown.append)
            assert r2.text == FULL_TEXT
            msgs += r2.parts
            msgs.append(Part(content="And the risks?"))
            r3 = await run.turn(Envelope(parts=msgs, tools=TOOLS, stream=stream))
            assert r3.text == FULL_TEXT
            # An edited copy of the model's answer has no provenance: refused before sending.
            forged = r2.parts[0].model_copy(update={"content": "The filings are identical."})
            with pytest.raises(FailoverExhausted) as ei:
                await run.turn(Envelope(parts=[*msgs, forged, Part(content="go on")]))
            assert ei.value.reason == "no_candidate"
            assert "provenance" in json.dumps(ei.value.skipped)

    asyncio.run(main())
    if stream:
        assert "".join(shown).count(FULL_TEXT) == 2


def test_an_edited_copy_in_place_of_a_recorded_part_is_refused_across_turns(
        db_url: str, fake: FakeProvider) -> None:
    """The session hashes each part once per conversation, by identity: an edited copy put in
    the place of an answer it already hashed is hashed afresh and refused; the original
    object put back passes again."""
    with Ledger.open(db_url) as led, \
            led.run("memo", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        msgs = [Part(content="Compare the two filings.")]
        r1 = run.turn(Envelope(parts=msgs))
        msgs += [*r1.parts, Part(content="Go on.")]
        run.turn(Envelope(parts=msgs))
        original = msgs[1]
        msgs[1] = original.model_copy(update={"content": "The filings are identical."})
        with pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=msgs))
        assert ei.value.reason == "no_candidate"
        assert "provenance" in json.dumps(ei.value.skipped)
        msgs[1] = original
        assert run.turn(Envelope(parts=msgs)).text == FULL_TEXT


def test_invariant7_a_covered_answer_changed_in_place_is_hashed_again_and_not_sent(
        db_url: str, fake: FakeProvider) -> None:
    """A part is frozen only against ordinary assignment. The model's answer, changed in place
    after the session hashed it (``object.__setattr__``, as a host's library might), kept its
    old hash in the session's memo: an invented text went out as the covered model output it
    replaced. It is hashed again now, found uncovered and refused before anything is sent; the
    recorded text put back passes again."""
    with Ledger.open(db_url) as led, \
            led.run("memo", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
        msgs = [Part(content="Compare the two filings.")]
        r1 = run.turn(Envelope(parts=msgs))
        msgs += [*r1.parts, Part(content="Go on.")]
        run.turn(Envelope(parts=msgs))  # the memo now holds the answer's hash
        answer = msgs[1]
        recorded = answer.content
        assert answer.data_class == "model_derived" and answer.provenance
        sent = len(fake.requests)
        object.__setattr__(answer, "content", "The filings are identical.")
        with pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=msgs))
        assert ei.value.reason == "no_candidate"
        assert "provenance" in json.dumps(ei.value.skipped)
        assert len(fake.requests) == sent  # the invented text reached nobody
        object.__setattr__(answer, "content", recorded)
        assert run.turn(Envelope(parts=msgs)).text == FULL_TEXT


def test_a_models_answer_rebuilt_by_hand_is_model_output_and_needs_its_provenance(
        db_url: str, fake: FakeProvider) -> None:
    """Invariant 7: a Part of role 'assistant' is the model's whatever way it was built. Its
    class defaults to model_derived (never the user's own input), so an answer copied out of
    one Run into another by hand reaches no recipient approved for user input only, and none
    at all without the provenance the ledger recorded; labelled user_input it is refused."""
    trusted, outside = (r.model_copy(update={"recipient": name, "id": name})
                        for r, name in zip(plan(fake), ("trusted", "outside"), strict=True))
    grant = Grant(recipients={"trusted": ["user_input", "model_derived"],
                              "outside": ["user_input"]})
    with Ledger.open(db_url) as led:
        with led.run("analysis", plan=[trusted], budget=BUDGET, grant=grant) as run:
            answer = run.turn(Envelope(parts=[Part(content="secret analysis please")])).parts[0]
        rebuilt = Part(role="assistant", content=answer.content)
        assert rebuilt.data_class == "model_derived" and rebuilt.provenance is None
        sent = len(fake.requests)
        msgs = [Part(content="q"), rebuilt, Part(content="go on")]
        with led.run("leak", plan=[outside], budget=BUDGET, grant=grant) as run, \
                pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=msgs))
        assert ei.value.reason == "no_candidate"
        assert "not approved for: model_derived" in json.dumps(ei.value.skipped)
        # Approved for the class, the recipient still gets no part the ledger never recorded.
        wider = Grant(recipients={"outside": ["user_input", "model_derived"]})
        with led.run("unrecorded", plan=[outside], budget=BUDGET, grant=wider) as run, \
                pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=msgs))
        assert "no covering provenance: missing" in json.dumps(ei.value.skipped)
        assert len(fake.requests) == sent
        with pytest.raises(InvalidArgument) as bad:
            Part(role="assistant", content=answer.content, data_class="user_input")
        assert bad.value.field == "data_class" and "model_derived" in str(bad.value)


def test_text_and_tool_calls_go_out_as_one_assistant_message(db_url: str,
                                                            fake: FakeProvider) -> None:
    fake.set_default(Behavior(tool_call=("search", {"q": "x"})))
    with Ledger.open(db_url) as led, led.run("r", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        r1 = run.turn(Envelope(parts=[Part(content="look it up")], tools=TOOLS))
        # The call Part itself answers it (its id is typed optional on Part).
        tool = run.tool_result(r1.tool_calls[0], "42")
        run.tool_started(r1.tool_calls[0])
        assert tool.tool_call_id == r1.tool_calls[0].tool_call_id
        with pytest.raises(InvalidArgument) as ei:
            run.tool_result(Part(content="not a call"), "42")
        assert ei.value.field == "call_id" and "not a tool call" in str(ei.value)
        fake.set_default(Behavior())
        run.turn(Envelope(parts=[Part(content="look it up"), *r1.parts, tool], tools=TOOLS))
    messages = fake.requests[-1].json["messages"]
    assistant = [m for m in messages if m["role"] == "assistant"]
    assert len(assistant) == 1
    assert assistant[0]["content"] == FULL_TEXT and assistant[0]["tool_calls"][0]["id"]
    assert messages[-1] == {"role": "tool", "tool_call_id": r1.tool_calls[0].tool_call_id,
                            "content": "42"}


def test_a_started_tool_stops_the_turn_instead_of_moving_on(db_url: str,
                                                           fake: FakeProvider) -> None:
    # goclaw would discard a failed stream and move on; a tool the host started forbids it.
    fake.enqueue(Behavior(fault=Fault.STREAM_CUT, tool_call=("search", {"q": "x"}),
                          fault_after_content=True), model="primary-model")
    with Ledger.open(db_url) as led, led.run("r", plan=plan(fake, "anthropic"), budget=BUDGET,
                                             grant=GRANT, policy="goclaw") as run:
        def on_event(ev: object) -> None:
            if isinstance(ev, ToolCallProposal):
                run.tool_started(ev.call.id)  # the host starts it while the stream runs

        with pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=[Part(content="search")], tools=TOOLS, stream=True),
                     on_event=on_event)
        assert ei.value.reason == "output_exists" and "tool" in ei.value.detail
        [att] = led.timeline("r")
        assert att.tool_started and att.route_id == "primary"
        assert [e.kind for e in led.events("r", ["tool_started"])] == ["tool_started"]


def test_delivered_partial_output_is_handed_back_when_the_turn_stops(
        db_url: str, fake: FakeProvider) -> None:
    fake.enqueue(Behavior(fault=Fault.STREAM_CUT, content_before_fault=2),
                 model="primary-model")
    shown: list[str] = []
    with Ledger.open(db_url) as led, led.run("r", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        with pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=[Part(content="hi")], stream=True), on_text=shown.append)
        partial = ei.value.partial
        assert partial is not None and partial.text == "".join(shown) and partial.text
        assert FULL_TEXT.startswith(partial.text) and partial.text != FULL_TEXT
        att = led.get_attempt(partial.attempt_id)
        assert att.effective_output and att.route_id == "primary"


@pytest.mark.parametrize("session", ["async", "sync"])
def test_an_async_on_text_hears_every_delta_when_on_event_is_given_too(
        db_url: str, fake: FakeProvider, session: str) -> None:
    # Each delta goes to on_text, then to on_event; an async on_text's coroutine is awaited,
    # never dropped. The Attempt records as shown only text the caller was given: what a cut
    # hands back is exactly what on_text heard.
    fake.enqueue(Behavior(fault=Fault.STREAM_CUT, content_before_fault=2),
                 model="primary-model")
    heard: list[tuple[str, str]] = []

    async def on_text(text: str) -> None:
        await asyncio.sleep(0)
        heard.append(("text", text))

    async def on_event_async(event: object) -> None:
        heard.append(("event", getattr(event, "text", type(event).__name__)))

    def on_event_sync(event: object) -> None:
        heard.append(("event", getattr(event, "text", type(event).__name__)))

    env = Envelope(parts=[Part(content="hi")], stream=True)

    async def main() -> tuple[FailoverExhausted, AttemptState, bool]:
        async with AsyncLedger.open(db_url) as led:
            async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
                with pytest.raises(FailoverExhausted) as ei:
                    await run.turn(env, on_text=on_text, on_event=on_event_async)
            att = await led.get_attempt(ei.value.partial.attempt_id)  # type: ignore[union-attr]
            return ei.value, att.state, att.effective_output

    if session == "async":
        stop, state, effective = asyncio.run(main())
    else:
        with Ledger.open(db_url) as led:
            with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as srun, \
                    pytest.raises(FailoverExhausted) as ei:
                srun.turn(env, on_text=on_text, on_event=on_event_sync)
            stop = ei.value
            att = led.get_attempt(stop.partial.attempt_id)  # type: ignore[union-attr]
            state, effective = att.state, att.effective_output
    texts = [t for kind, t in heard if kind == "text"]
    assert len(texts) == 2
    assert heard == [*[x for t in texts for x in (("text", t), ("event", t))],
                     ("event", "Reset")]
    assert stop.partial is not None and stop.partial.text == "".join(texts)
    assert state is AttemptState.UNKNOWN and effective


class _ResetHandlerBug(Exception):
    pass


@pytest.mark.parametrize("handler", ["raises", "cancelled", "raises_sync"])
def test_a_stream_failure_keeps_its_observed_fact_when_the_reset_handler_raises_or_is_cancelled(
        db_url: str, fake: FakeProvider, handler: str) -> None:
    # goclaw moves on after a cut that followed shown text, first sending a Reset. A handler
    # that raises on it, or is cancelled in it, ends the turn with its own exception, but the
    # failure is the provider's: the Attempt is settled with the observed fact (not a caller
    # cancellation), route health counts it, and it stays unknown with its hold, never re-sent
    # (DESIGN section 2, invariant 6).
    fake.enqueue(Behavior(fault=Fault.STREAM_CUT, content_before_fault=2),
                 model="primary-model")
    env = Envelope(parts=[Part(content="hi")], stream=True)
    seen: list[str] = []
    notices: list[str] = []

    def on_notice(n: object) -> None:
        notices.append(getattr(n, "kind", ""))

    def on_event_sync(event: object) -> None:
        seen.append(type(event).__name__)
        if type(event).__name__ == "Reset":
            raise _ResetHandlerBug

    async def main() -> tuple[BaseException, list[AttemptRecord], dict[str, Health]]:
        entered = asyncio.Event()

        async def on_event(event: object) -> None:
            if handler == "raises":
                on_event_sync(event)
                return
            seen.append(type(event).__name__)
            if type(event).__name__ == "Reset":
                entered.set()
                await asyncio.Event().wait()  # until the caller cancels the turn

        async with AsyncLedger.open(db_url) as led:
            async def agent() -> None:
                async with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                                   policy="goclaw") as run:
                    await run.turn(env, on_event=on_event, on_notice=on_notice)

            task = asyncio.ensure_future(agent())
            if handler == "cancelled":
                await entered.wait()
                task.cancel()
            try:
                await task
            except BaseException as e:  # what reached the caller
                err: BaseException = e
            else:
                raise AssertionError("the turn was not interrupted")
            return err, await led.timeline("r"), await led.health()

    if handler == "raises_sync":
        with Ledger.open(db_url) as led:
            with pytest.raises(_ResetHandlerBug), led.run(
                    "r", plan=plan(fake), budget=BUDGET, grant=GRANT, policy="goclaw") as srun:
                srun.turn(env, on_event=on_event_sync, on_notice=on_notice)
            atts, health = led.timeline("r"), led.health()
    else:
        err, atts, health = asyncio.run(main())
        expected = asyncio.CancelledError if handler == "cancelled" else _ResetHandlerBug
        assert isinstance(err, expected)
    assert seen == ["TextDelta", "TextDelta", "Reset"] and notices == []
    assert [r.model for r in fake.requests] == ["primary-model"]  # nothing sent again
    [att] = atts
    assert att.route_id == "primary" and att.state is AttemptState.UNKNOWN
    assert att.debit_state.value == "reserved" and att.effective_output
    assert att.fact is not None and att.fact.category.value == "network"
    assert att.fact.transport is not None and att.fact.transport.value == "stream_cut"
    assert health["provider:fake"].failure_counts == {"network": 1}


def test_the_runs_frozen_streaming_limits_reach_the_adapter(db_url: str,
                                                            fake: FakeProvider) -> None:
    fake.set_default(Behavior(fault=Fault.SLOW_FIRST_TOKEN, delay_s=5.0))
    policy = {"name": "quick", "failover": {"enabled": False},
              "streaming": {"first_token_timeout_s": 0.3}}
    with Ledger.open(db_url) as led, led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT,
                                             policy=policy) as run:
        with pytest.raises(FailoverExhausted):
            run.turn(Envelope(parts=[Part(content="hi")], stream=True), on_text=print)
        [att] = led.timeline("r")
        assert att.fact is not None and att.fact.transport is not None
        assert att.fact.transport.value == "first_token_timeout"


# -- credentials, children, misuse ---------------------------------------------------------


def test_a_route_sends_the_key_its_environment_variable_holds(
        db_url: str, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    routes = [r.model_copy(update={"api_key_env": "FAKE_PROVIDER_KEY"}) for r in plan(fake)]
    monkeypatch.setenv("FAKE_PROVIDER_KEY", "sk-test-from-env-0123456789")
    with Ledger.open(db_url) as led, led.run("r", plan=routes, budget=BUDGET,
                                             grant=GRANT) as run:
        run.turn(Envelope(parts=[Part(content="hi")]))
    assert fake.requests[-1].headers["authorization"] == "Bearer sk-test-from-env-0123456789"
    monkeypatch.delenv("FAKE_PROVIDER_KEY")
    with Ledger.open(db_url) as led:
        # Found when the Run starts (tests/session/test_keys.py has the rest of it).
        with pytest.raises(InvalidArgument) as ei, led.run("r2", plan=routes, budget=BUDGET,
                                                           grant=GRANT):
            pytest.fail("entered")
        assert "FAKE_PROVIDER_KEY" in str(ei.value)
        # Allowed to lack it: every route is skipped unsent when a turn reaches it.
        with led.run("r2", plan=routes, budget=BUDGET, grant=GRANT, keyless_ok=True) as run:
            with pytest.raises(FailoverExhausted):
                run.turn(Envelope(parts=[Part(content="hi")]))
            assert {a.state for a in led.timeline("r2")} == {AttemptState.NOT_SENT}


def test_a_child_session_narrows_and_carves(db_url: str, fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led, led.run("p", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        with run.child("c", plan=plan(fake)[1:],
                       budget=Budget(max_calls=2, max_retries=0, max_cost=Decimal("0.1"))
                       ) as child:
            res = child.turn(Envelope(parts=[Part(content="sub-task")]))
            assert res.route.id == "backup"
        child_run = led.get_run("c")
        assert child_run.status is RunStatus.SUCCEEDED
        # The session's end gave back what the Child did not use: only its spend stays carved.
        parent = led.get_run("p")
        assert parent.carved == child_run.posted > 0 and parent.carved_calls == 1
        assert child_run.returned == Decimal("0.1") - child_run.posted


def test_invariant7_a_childs_answer_is_covered_in_its_runs_tree_and_in_no_other(
        db_url: str, fake: FakeProvider) -> None:
    """A sub-agent's answer flows back: the parent carries its child's ``result.parts`` in its
    next turn, and a sibling carries them when the parent passes them on, because provenance
    is looked up in the whole tree of the Run (root and descendants). Coverage still means
    the exact content the ledger recorded, and the grant still decides each recipient: a
    tampered copy, the same parts in a Run of another tree, and a recipient not approved
    for model_derived are all refused, and nothing of theirs is sent."""
    trusted, outside = (r.model_copy(update={"recipient": name})
                        for r, name in zip(plan(fake), ("trusted", "outside"), strict=True))
    grant = Grant(recipients={"trusted": ["user_input", "model_derived"],
                              "outside": ["user_input"]})
    small = Budget(max_calls=2, max_retries=1, max_cost=Decimal("0.1"))
    with Ledger.open(db_url) as led:
        with led.run("p", plan=[outside, trusted], budget=BUDGET, grant=grant) as run:
            with run.child("c1", plan=[trusted], budget=small) as c1:
                answer = c1.turn(Envelope(parts=[Part(content="sub-question")])).parts
            assert [p.data_class for p in answer] == ["model_derived"]
            # The parent's next turn: 'outside' is skipped by the grant, 'trusted' serves.
            back = run.turn(Envelope(parts=[Part(content="main question"), *answer]))
            assert back.route.id == trusted.id
            [skip] = led.events("p", ["select"])[-1].data["skipped"]
            assert skip["route"] == outside.id and skip["reason"] == "disclosure"
            assert "not approved for: model_derived" in json.dumps(skip)
            with run.child("c2", plan=[trusted], budget=small) as c2:
                assert c2.turn(Envelope(parts=[Part(content="q2"), *answer])).text
            sent = len(fake.requests)
            with run.child("c3", plan=[outside], budget=small) as c3, \
                    pytest.raises(FailoverExhausted) as ei:
                c3.turn(Envelope(parts=[Part(content="q3"), *answer]))
            assert "not approved for: model_derived" in json.dumps(ei.value.skipped)
            tampered = answer[0].model_copy(update={"content": "Nothing to report."})
            with pytest.raises(FailoverExhausted) as ei:
                run.turn(Envelope(parts=[Part(content="main question"), tampered]))
            assert "no covering provenance: mismatch" in json.dumps(ei.value.skipped)
        assert answer[0].provenance in led.provenance("c2")
        assert answer[0].provenance not in led.provenance("p", tree=False)
        with led.run("other", plan=[trusted], budget=BUDGET, grant=grant) as other, \
                pytest.raises(FailoverExhausted) as ei:
            other.turn(Envelope(parts=[Part(content="q"), *answer]))
        assert "no covering provenance: missing" in json.dumps(ei.value.skipped)
        assert "another tree" in json.dumps(ei.value.skipped)  # the fix names why
        assert answer[0].provenance not in led.provenance("other")
        assert len(fake.requests) == sent


def test_invariant7_a_host_cannot_record_provenance_for_a_models_output(
        db_url: str, fake: FakeProvider) -> None:
    """A model's output is covered only by what the ledger recorded when its Attempt settled,
    and a settled Attempt is never added to. ``record_provenance`` refuses the ledger's own
    kinds and any Attempt id as the ref (another tree's, the Run's own settled one), whatever
    the kind: an edited or invented answer under an Attempt id stays uncovered, and nothing
    of it is sent. What a host brings under its own id (a document) is still recorded."""
    with Ledger.open(db_url) as led:
        with led.run("tree-a", plan=plan(fake), budget=BUDGET, grant=GRANT) as a:
            (theirs,) = a.turn(Envelope(parts=[Part(content="qA")])).parts
        with led.run("tree-b", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            (mine,) = run.turn(Envelope(parts=[Part(content="qB")])).parts
            before = led.provenance("tree-b", tree=False)
            for ref in (theirs.provenance, mine.provenance):
                assert ref is not None
                forged = Part(role="assistant", content="rewritten answer", provenance=ref)
                for kind in ("model_output", "tool_call"):
                    with pytest.raises(InvalidArgument) as bad:
                        led.record_provenance(run.lease, ref, forged.content_hash, kind=kind)
                    assert bad.value.field == "kind" and "settle" in str(bad.value)
                for kind in ("tool_result", "document"):
                    with pytest.raises(InvalidArgument) as bad:
                        led.record_provenance(run.lease, ref, forged.content_hash, kind=kind)
                    assert bad.value.field == "ref" and "Attempt id" in str(bad.value)
                sent = len(fake.requests)
                with pytest.raises(FailoverExhausted) as ei:
                    run.turn(Envelope(parts=[Part(content="q"), forged, Part(content="go")]))
                assert "no covering provenance" in json.dumps(ei.value.skipped)
                assert len(fake.requests) == sent
            # The integrations' own record of a renamed call names an Attempt of its Run only.
            with pytest.raises(NotFound):
                led._record_tool_call(run.lease, theirs.provenance, mine.content_hash)
            assert led.provenance("tree-b", tree=False) == before
            # A host's own id still records what it brings.
            doc = Part(content="memo", data_class="tool_result", provenance="doc-1")
            led.record_provenance(run.lease, "doc-1", doc.content_hash, "document")
            assert run.turn(Envelope(parts=[Part(content="q"), doc])).text


def test_invariant7_a_ref_two_runs_of_a_tree_recorded_differently_covers_either_content(
        db_url: str, fake: FakeProvider) -> None:
    """A reference the parent and a Child both recorded with different content (a tool-call
    id a provider reused): a part as either Run recorded it is covered in every Run of the
    tree, though the Run's own line recorded the other content. Content no Run of the tree
    recorded under it is still a mismatch, and nothing of it is sent."""
    ref = "call_reused"
    parents, childs, nobodys = (
        Part(content=text, data_class="tool_result", provenance=ref)
        for text in ("the parent's search result", "the child's search result", "forged"))
    small = Budget(max_calls=2, max_retries=0, max_cost=Decimal("0.1"))
    with Ledger.open(db_url) as led, led.run("p", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        led.record_provenance(run.lease, ref, parents.content_hash)
        with run.child("c", budget=small) as child:
            led.record_provenance(child.lease, ref, childs.content_hash)
            assert child.turn(Envelope(parts=[Part(content="q"), parents, childs])).text
        # The parent's own record of the ref is the other content: the tree's is read too.
        assert run.turn(Envelope(parts=[Part(content="q"), childs])).text
        with run.child("c2", budget=small) as sibling:
            assert sibling.turn(Envelope(parts=[Part(content="q"), childs])).text
            assert sibling.turn(Envelope(parts=[Part(content="q2"), parents])).text
        sent = len(fake.requests)
        with pytest.raises(FailoverExhausted) as ei:
            run.turn(Envelope(parts=[Part(content="q"), nobodys]))
        assert "no covering provenance: mismatch" in json.dumps(ei.value.skipped)
        assert len(fake.requests) == sent
        assert led.provenance("c2")[ref] == {parents.content_hash, childs.content_hash}


def test_only_a_part_its_own_line_did_not_record_costs_a_turn_a_read_of_the_runs_tree(
        tmp_path: Path, fake: FakeProvider) -> None:
    # The hot path stays one read and two writes per turn whose parts the Run or its
    # ancestors recorded; a Child's answer costs that turn one more read, of the whole tree.
    from benchmarks.txcount import SqliteTxCounter

    url = f"{tmp_path}/ledger.db"
    counter = SqliteTxCounter(url)  # before the ledger opens its connections
    try:
        with Ledger.open(url) as led, led.run("p", plan=plan(fake), budget=BUDGET,
                                              grant=GRANT) as run:
            msgs = [Part(content="q")]
            msgs += run.turn(Envelope(parts=msgs)).parts
            counter.start()
            msgs += run.turn(Envelope(parts=[*msgs, Part(content="go on")])).parts
            own = counter.finish()
            with run.child("c", budget=Budget(max_calls=2, max_retries=0,
                                              max_cost=Decimal("0.1"))) as child:
                sub = child.turn(Envelope(parts=[Part(content="sub-task")])).parts
            counter.start()
            run.turn(Envelope(parts=[*msgs, Part(content="with the sub-agent's answer"), *sub]))
            childs = counter.finish()
    finally:
        counter.close()
    assert (own.reads, own.writes) == (1, 2)
    assert (childs.reads, childs.writes) == (2, 2)


def test_a_parent_does_not_adopt_its_childs_tool_calls(db_url: str, fake: FakeProvider
                                                       ) -> None:
    # The child's call is the child's to answer: its tool_started names the child's Attempt.
    fake.set_default(Behavior(tool_call=("search", {"q": "x"})))
    with Ledger.open(db_url) as led, led.run("p", plan=plan(fake), budget=BUDGET,
                                             grant=GRANT) as run:
        with run.child("c", budget=Budget(max_calls=2, max_retries=0,
                                          max_cost=Decimal("0.1"))) as child:
            [call] = child.turn(Envelope(parts=[Part(content="look")], tools=TOOLS)).tool_calls
        assert run.adopt_tool_calls([call]) == [] and not run.proposed(call.tool_call_id or "")


def test_misuse_of_a_session_is_typed_and_changes_nothing(db_url: str,
                                                         fake: FakeProvider) -> None:
    with Ledger.open(db_url) as led:
        session = led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT)
        with pytest.raises(InvalidState):
            session.turn(Envelope(parts=[Part(content="too early")]))
        with session as run:
            with pytest.raises(InvalidArgument) as ei:
                run.tool_result("call_nobody_made", "x")
            assert ei.value.field == "call_id"
            with pytest.raises(InvalidArgument):
                run.tool_started("call_nobody_made")
        with pytest.raises(InvalidState):
            run.turn(Envelope(parts=[Part(content="too late")]))
        with pytest.raises(InvalidState):
            run.tool_result("x", "y")
        assert led.timeline("r") == [] and led.events("r", ["tool_started"]) == []


def test_a_later_session_adopts_only_tool_calls_the_run_recorded(db_url: str,
                                                                fake: FakeProvider) -> None:
    # A host resuming a Run in a new session answers a call an earlier session proposed.
    fake.set_default(Behavior(tool_call=("search", {"q": "x"})))
    with Ledger.open(db_url) as led:
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as run:
            r1 = run.turn(Envelope(parts=[Part(content="look it up")], tools=TOOLS))
        [call] = r1.tool_calls
        forged = call.model_copy(update={"content": '{"q": "everything"}'})
        with led.run("r", plan=plan(fake), budget=BUDGET, grant=GRANT) as again:
            assert not again.proposed(call.tool_call_id or "")
            with pytest.raises(InvalidArgument):
                again.tool_result(call.tool_call_id or "", "42")
            assert again.adopt_tool_calls([forged]) == []  # not what the Run recorded
            assert again.adopt_tool_calls([call]) == [call.tool_call_id]
            tool = again.tool_result(call.tool_call_id or "", "42")
            fake.set_default(Behavior())
            r2 = again.turn(Envelope(parts=[Part(content="look it up"), *r1.parts, tool],
                                     tools=TOOLS))
            assert r2.text == FULL_TEXT
