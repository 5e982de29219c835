"""What a route's protocol cannot build a request of is judged before any Attempt is begun.

A codec cannot map an assistant tool-call part without ``name`` or whose content is not a JSON
object (no protocol), a ``tool`` part without ``tool_call_id`` (chat completions, Responses,
Anthropic) or without ``name`` (Gemini), an envelope of system parts alone (Responses, Anthropic,
Gemini), a tool call without its result (the conversation going on after it: every protocol;
ending the request: chat completions), a tool result without its call before it (every protocol),
a tool call id used twice (in one turn: all but Gemini; in two: Anthropic and Responses), a
signed empty Gemini text between a call and its result (the route that wrote the signature)
and, on the Responses API, a ``params["tools"]`` that is not a list of built-in tools. A route
that cannot build the request is ineligible (preflight, capability); a request no route of its
plan can build is bad input, refused with ``InvalidArgument`` naming the field before anything
is recorded: no Attempt, no hold, no retry permission, no decision.
Before, the turn began an Attempt and the codec raised: a ``not_sent`` Attempt (and on a
failover a spent retry permission) for the caller's bad input. Real HTTP over loopback, on
both backends; every part is covered for disclosure (the host records its provenance), so
only the carrying decides.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from decimal import Decimal
from typing import Any, ClassVar

import pytest

from ledger import (
    Budget,
    Envelope,
    FailoverExhausted,
    Grant,
    InvalidArgument,
    Ledger,
    Part,
    Route,
)
from ledger.adapters.contract import _CODECS, WireRequest, reasoning_data, register_codec
from ledger.adapters.openai import OpenAICodec
from ledger.api.session import RunSession
from ledger.domain.facts import WireProtocol
from ledger.domain.media import REASONING_MEDIA_TYPE
from ledger.testing import FakeProvider, Fault
from ledger.testing.fakewire import thought_signature
from tests import fakeplan
from tests.fakeplan import PRICE, plan

fake = fakeplan.fake  # the shared fixtures: one fake provider per module, cleared per test
_clear = fakeplan._clear

BUDGET = Budget(max_calls=10, max_retries=5, max_cost=Decimal("1"))
QUESTION = Part(content="what is the weather in Oslo?")
# Every class these requests carry, for the fake provider: only the carrying decides.
GRANT = Grant(recipients={"fake": ["user_input", "system", "model_derived", "tool_result",
                                   "tool_description"]})


def _route(fake: FakeProvider, rid: str, protocol: str, group: str) -> Route:
    return Route(id=rid, provider="fake", model=f"{rid}-model", group=group, recipient="fake",
                 protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol), price=PRICE)


def _covered(led: Ledger, run: RunSession, part: Part) -> Part:
    """``part`` as the host vouches for it: disclosure preflight passes it on every route."""
    ref = f"host-{part.content_hash[7:19]}"
    led.record_provenance(run.lease, ref, part.content_hash, "host")
    return part.model_copy(update={"provenance": ref})


def _recorded_nothing(led: Ledger, fake: FakeProvider, run_id: str = "t") -> None:
    assert led.timeline(run_id) == [] and fake.requests == []  # no Attempt row, nothing sent
    rec = led.get_run(run_id)
    assert rec.calls_used == 0 and rec.retries_used == 0
    assert [e.kind for e in led.events(run_id) if e.kind in ("select", "stop")] == []


# -- what no protocol carries, whatever the plan ------------------------------------------------

CALL_WITHOUT_NAME = Part(role="assistant", content='{"city": "Oslo"}', tool_call_id="call_1",
                         data_class="model_derived")
CALL_NOT_AN_OBJECT = Part(role="assistant", content='["Oslo"]', tool_call_id="call_1",
                          name="weather", data_class="model_derived")


@pytest.mark.parametrize("protocol", ["openai", "openai_responses", "anthropic", "gemini"])
@pytest.mark.parametrize(("call", "said"), [
    (CALL_WITHOUT_NAME, "needs name="), (CALL_NOT_AN_OBJECT, "as a JSON object")])
def test_a_tool_call_part_no_protocol_carries_is_refused_before_any_attempt(
        db_url: str, fake: FakeProvider, protocol: str, call: Part, said: str) -> None:
    """The typed error names the part; the Run has no Attempt, no spent call or retry and no
    decision recorded, and goes on."""
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            env = Envelope(parts=[QUESTION, _covered(led, run, call)])
            with pytest.raises(InvalidArgument) as ei:
                run.turn(env)
            _recorded_nothing(led, fake)
            assert ei.value.field == "envelope.parts[1]" and said in str(ei.value)
            assert set(ei.value.fields["routes"]) == {"primary", "backup"}
            run.turn(Envelope(parts=[QUESTION]))  # the Run goes on
        assert len(led.timeline("t")) == 1


WEATHER = Part(role="assistant", content='{"city": "Oslo"}', tool_call_id="call_1",
               name="weather", data_class="model_derived")
TWELVE = Part(role="tool", content="12 C", tool_call_id="call_1", name="weather",
              data_class="tool_result")
BERGEN = Part(content="And in Bergen?")


@pytest.mark.parametrize("protocol", ["openai", "openai_responses", "anthropic", "gemini"])
def test_a_tool_call_without_its_result_before_more_conversation_is_refused_before_any_attempt(
        db_url: str, fake: FakeProvider, protocol: str) -> None:
    """Every provider answers a call without its result, the conversation going on after it,
    with a 400: an Attempt begun and sent for nothing, and after a failover the same 400 on
    every route. The typed error names the call's part and id and how to answer it; nothing is
    recorded, and the Run goes on."""
    with Ledger.open(db_url) as led:
        with led.run("t", plan=plan(fake, protocol), budget=BUDGET, grant=GRANT) as run:
            call = _covered(led, run, WEATHER)
            with pytest.raises(InvalidArgument) as ei:
                run.turn(Envelope(parts=[QUESTION, call, BERGEN]))
            _recorded_nothing(led, fake)
            assert ei.value.field == "envelope.parts[1]"
            assert "tool call 'call_1' (weather) has no result" in str(ei.value)
            assert "run.tool_result(call, ...)" in str(ei.value)
            assert set(ei.value.fields["routes"]) == {"primary", "backup"}
            run.turn(Envelope(parts=[QUESTION, call, _covered(led, run, TWELVE), BERGEN]))
            assert fake.requests[-1].problem is None
        assert len(led.timeline("t")) == 1


# -- what some protocols carry: the others' routes are skipped ----------------------------------

RESULT_WITHOUT_CALL_ID = Part(role="tool", content="12 C", name="weather",
                              data_class="tool_result")
RESULT_WITHOUT_NAME = Part(role="tool", content="12 C", tool_call_id="call_1",
                           data_class="tool_result")
SYSTEM_ONLY = [Part(role="system", content="You answer about the weather.")]
# The id call_1 again, for another call (a framework that numbers the calls of each answer).
WEATHER_AGAIN = Part(role="assistant", content='{"city": "Bergen"}', tool_call_id="call_1",
                     name="weather", data_class="model_derived")
NINE = Part(role="tool", content="9 C", tool_call_id="call_1", name="weather",
            data_class="tool_result")
IN_OSLO = Part(role="assistant", content="12 C in Oslo.", data_class="model_derived")
AGAIN_LATER = [QUESTION, WEATHER, TWELVE, IN_OSLO, BERGEN, WEATHER_AGAIN, NINE]
AGAIN_AT_ONCE = [QUESTION, WEATHER, WEATHER_AGAIN, TWELVE, NINE]


@pytest.mark.parametrize(("parts", "refuser", "carrier", "field"), [
    ([QUESTION, WEATHER, RESULT_WITHOUT_CALL_ID], "openai", "gemini", "envelope.parts[2]"),
    ([QUESTION, WEATHER, RESULT_WITHOUT_CALL_ID], "anthropic", "gemini", "envelope.parts[2]"),
    ([QUESTION, WEATHER, RESULT_WITHOUT_CALL_ID], "openai_responses", "gemini",
     "envelope.parts[2]"),
    ([QUESTION, WEATHER, RESULT_WITHOUT_NAME], "gemini", "anthropic", "envelope.parts[2]"),
    (SYSTEM_ONLY, "anthropic", "openai", "envelope.parts"),
    (SYSTEM_ONLY, "gemini", "openai", "envelope.parts"),
    (SYSTEM_ONLY, "openai_responses", "openai", "envelope.parts"),
    # A call that ends the request without its result: chat completions refuses it.
    ([QUESTION, WEATHER], "openai", "anthropic", "envelope.parts[1]"),
    # A call id used again in a later turn: Anthropic and the Responses API refuse it.
    (AGAIN_LATER, "anthropic", "openai", "envelope.parts[5]"),
    (AGAIN_LATER, "openai_responses", "gemini", "envelope.parts[5]"),
    # Two calls of one id in a turn: every protocol that sends the id refuses it.
    (AGAIN_AT_ONCE, "openai", "gemini", "envelope.parts[2]"),
    (AGAIN_AT_ONCE, "anthropic", "gemini", "envelope.parts[2]"),
    (AGAIN_AT_ONCE, "openai_responses", "gemini", "envelope.parts[2]"),
])
def test_a_route_whose_protocol_cannot_build_the_request_is_skipped_without_an_attempt(
        db_url: str, fake: FakeProvider, parts: list[Part], refuser: str, carrier: str,
        field: str) -> None:
    """Failing over to a route that cannot build the request: it is skipped (capability,
    naming the field) with no Attempt and no retry permission taken. And a plan of such
    routes only refuses the request with the typed error, nothing recorded."""
    fake.enqueue(Fault.UNAVAILABLE, model="primary-model")
    routes = [_route(fake, "primary", carrier, "ga"), _route(fake, "backup", refuser, "gb")]
    with Ledger.open(db_url) as led:
        with led.run("t", plan=routes, budget=BUDGET, grant=GRANT) as run:
            env = Envelope(parts=[_covered(led, run, p) for p in parts])
            with pytest.raises(FailoverExhausted):
                run.turn(env)
            assert [a.route_id for a in led.timeline("t")] == ["primary"]
            assert led.get_run("t").retries_used == 0
            stop = next(e for e in led.events("t") if e.kind == "stop")
            [skip] = [s for s in stop.data["skipped"] if s["route"] == "backup"]
            assert skip["reason"] == "capability" and skip["detail"].startswith(field)
        fake.clear()
        with led.run("only", plan=plan(fake, refuser), budget=BUDGET, grant=GRANT) as run:
            env = Envelope(parts=[_covered(led, run, p) for p in parts])
            with pytest.raises(InvalidArgument) as ei:
                run.turn(env)
            assert ei.value.field == field
            _recorded_nothing(led, fake, "only")


@pytest.mark.parametrize(("refuser", "carrier"), [
    ("openai", "openai_responses"), ("anthropic", "gemini"), ("anthropic", "openai_responses")])
def test_a_route_whose_provider_reads_no_result_where_it_stands_is_skipped_for_one_that_does(
        db_url: str, fake: FakeProvider, refuser: str, carrier: str) -> None:
    """The user's text between a call and its result: chat completions reads the result only
    among the tool messages right after the call, Anthropic only among the tool_result blocks
    that open the next user message (where the codec puts the text first), so each would answer
    with a 400, on every route of the plan. That route is skipped (capability, naming the call)
    with no Attempt; Gemini, which reads the result in the next turn, and the Responses API,
    which pairs it by id, take the request."""
    routes = [_route(fake, "primary", refuser, "ga"), _route(fake, "backup", carrier, "gb")]
    parts = (QUESTION, WEATHER, BERGEN, TWELVE)
    with Ledger.open(db_url) as led, led.run("t", plan=routes, budget=BUDGET,
                                              grant=GRANT) as run:
        result = run.turn(Envelope(parts=[_covered(led, run, p) for p in parts]))
        skip = _served_past_primary(led, result)
        assert skip["detail"].startswith("envelope.parts[1]: tool call 'call_1' (weather) has "
                                         "its result, envelope.parts[3], sent after "
                                         "envelope.parts[2]")
    assert [r.model for r in fake.requests] == ["backup-model"]
    assert fake.requests[0].problem is None
    fake.clear()
    err = _refused_alone(db_url, fake, plan(fake, refuser), parts)
    assert err.field == "envelope.parts[1]" and "sent after" in str(err)


def test_the_gemini_route_whose_signed_empty_text_splits_a_call_from_its_result_is_skipped(
        db_url: str, fake: FakeProvider) -> None:
    """Gemini returns an empty text part to carry a thought signature, and the route that wrote
    it sends both back: put between a call and its result, that text is a model turn of its
    own, which Gemini answers with a 400 ("function response turn comes immediately after a
    function call turn"). That route is skipped (capability, naming the call and the text) with
    no Attempt; another Gemini route leaves both out and serves the request. A plan of the
    writer alone refuses the request, nothing recorded."""
    primary = _route(fake, "primary", "gemini", "ga")
    signature = Part(role="assistant", data=reasoning_data(primary, {
        "part": "text", "thoughtSignature": thought_signature("primary-model", "text", "hm")}),
        media_type=REASONING_MEDIA_TYPE, data_class="model_derived")
    said_nothing = Part(role="assistant", content="", data_class="model_derived")
    parts = (QUESTION, WEATHER, BERGEN, signature, said_nothing, TWELVE)
    routes = [primary, _route(fake, "backup", "gemini", "gb")]
    with Ledger.open(db_url) as led, led.run("t", plan=routes, budget=BUDGET,
                                              grant=GRANT) as run:
        result = run.turn(Envelope(parts=[_covered(led, run, p) for p in parts]))
        skip = _served_past_primary(led, result)
        assert skip["detail"].startswith(
            "envelope.parts[1]: tool call 'call_1' (weather) has its result, envelope.parts[5], "
            "sent after envelope.parts[4] on route 'primary', which sends the empty answer text "
            "envelope.parts[4] back with the thought signature it wrote"), skip["detail"]
    assert [r.model for r in fake.requests] == ["backup-model"]
    assert fake.requests[0].problem is None
    fake.clear()
    err = _refused_alone(db_url, fake, [primary], parts)
    assert err.field == "envelope.parts[1]" and "on route 'primary'" in str(err)


def _refused_alone(db_url: str, fake: FakeProvider, routes: list[Route],
                   parts: Sequence[Part]) -> InvalidArgument:
    """The refusal of a turn of ``parts`` by Run ``only`` on ``routes`` (none can carry them),
    which recorded nothing and sent nothing."""
    with Ledger.open(db_url) as led, led.run("only", plan=routes, budget=BUDGET,
                                              grant=GRANT) as run:
        with pytest.raises(InvalidArgument) as ei:
            run.turn(Envelope(parts=[_covered(led, run, p) for p in parts]))
        _recorded_nothing(led, fake, "only")
    return ei.value


def _served_past_primary(led: Ledger, result: Any) -> dict[str, Any]:
    """The backup served ``result`` in one Attempt, the primary skipped for ``capability``
    (none begun): that skip, as the ``select`` event of Run ``t`` recorded it."""
    assert result.route.id == "backup" and len(result.attempts) == 1
    (select,) = [e.data for e in led.events("t", ["select"])]
    (skip,) = select["skipped"]
    assert (skip["route"], skip["reason"]) == ("primary", "capability")
    return dict(skip)


class _TrimmingCodec(OpenAICodec):
    """A host's codec of its own (chat completions on the wire) that leaves out the tool
    results no call before them asks for, where the ledger's codecs refuse them."""

    protocol: ClassVar[WireProtocol] = WireProtocol.GENERIC

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        called: set[str] = set()
        kept = []
        for part in envelope.parts:
            if part.role == "assistant" and part.tool_call_id:
                called.add(part.tool_call_id)
            elif part.role == "tool" and part.tool_call_id not in called:
                continue
            kept.append(part)
        return super().build_request(route, envelope.model_copy(update={"parts": kept}))


@pytest.fixture
def trimming_codec() -> Iterator[None]:
    assert WireProtocol.GENERIC not in _CODECS
    register_codec(_TrimmingCodec())
    try:
        yield
    finally:
        del _CODECS[WireProtocol.GENERIC]


# A memory window dropped the turn's call, and kept its result.
TRIMMED = (QUESTION, TWELVE, BERGEN)


@pytest.mark.parametrize("refuser", ["openai", "openai_responses", "anthropic", "gemini"])
def test_a_tool_result_without_its_call_skips_the_routes_that_refuse_it_and_none_records_it(
        db_url: str, fake: FakeProvider, trimming_codec: None, refuser: str) -> None:
    """A result whose call is not before it (trimmed out of the conversation, a typo'd id):
    every provider of the ledger's codecs answers it with a 400, after an Attempt was begun,
    and on a failover the same on every route. Such a route is skipped (capability, naming the
    result) with no Attempt, for a route of a codec that carries it; a plan of such routes
    only refuses the request with the typed error naming the result and the fix, nothing
    recorded, and the Run goes on."""
    carrier = Route(id="backup", provider="fake", model="backup-model", group="gb",
                    recipient="fake", protocol=WireProtocol.GENERIC,
                    endpoint=fake.endpoint("openai"), price=PRICE)
    routes = [_route(fake, "primary", refuser, "ga"), carrier]
    with Ledger.open(db_url) as led, led.run("t", plan=routes, budget=BUDGET,
                                              grant=GRANT) as run:
        result = run.turn(Envelope(parts=[_covered(led, run, p) for p in TRIMMED]))
        skip = _served_past_primary(led, result)
        assert skip["detail"].startswith("envelope.parts[1]: the tool result for "
                                         "tool_call_id='call_1' answers no tool call before it")
        assert led.get_run("t").retries_used == 0
    assert [r.model for r in fake.requests] == ["backup-model"]
    assert fake.requests[0].problem is None
    fake.clear()
    with Ledger.open(db_url) as led, led.run("only", plan=plan(fake, refuser), budget=BUDGET,
                                              grant=GRANT) as run:
        with pytest.raises(InvalidArgument) as ei:
            run.turn(Envelope(parts=[_covered(led, run, p) for p in TRIMMED]))
        assert ei.value.field == "envelope.parts[1]"
        assert "no assistant part with tool_call_id='call_1' is in the request" in str(ei.value)
        assert "trim a call and its results together" in str(ei.value)
        assert set(ei.value.fields["routes"]) == {"primary", "backup"}
        _recorded_nothing(led, fake, "only")
        # With its call before it, the result goes to the provider, which takes it.
        run.turn(Envelope(parts=[_covered(led, run, p) for p in (QUESTION, WEATHER, TWELVE,
                                                                    BERGEN)]))
        assert fake.requests[-1].problem is None
        assert len(led.timeline("only")) == 1


# -- the Responses API's built-in tools -----------------------------------------------------------

@pytest.mark.parametrize(("tools", "field"), [
    ({"type": "web_search"}, "envelope.params.tools"),
    ([{"type": "function", "name": "weather", "parameters": {}}], "envelope.params.tools[0]"),
    ([{"type": "web_search"}, "image_generation"], "envelope.params.tools[1]"),
])
def test_responses_params_tools_that_are_no_built_in_tools_are_refused_before_any_attempt(
        db_url: str, fake: FakeProvider, tools: Any, field: str) -> None:
    """``params["tools"]`` on a Responses route holds the provider's built-in tools only; no
    other protocol takes ``tools`` as a parameter, so a plan of any of them refuses it."""
    env = Envelope(parts=[QUESTION], params={"tools": tools})
    for protocols in (("openai_responses", "openai_responses"), ("openai_responses", "gemini")):
        fake.clear()
        routes = [_route(fake, "primary", protocols[0], "ga"),
                  _route(fake, "backup", protocols[1], "gb")]
        with Ledger.open(db_url) as led:
            with led.run(f"t-{protocols[1]}", plan=routes, budget=BUDGET, grant=GRANT) as run, \
                    pytest.raises(InvalidArgument) as ei:
                run.turn(env)
            assert led.timeline(f"t-{protocols[1]}") == [] and fake.requests == []
            assert led.get_run(f"t-{protocols[1]}").retries_used == 0
        assert ei.value.field == field and "Envelope.tools" in str(ei.value)
