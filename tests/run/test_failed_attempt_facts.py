"""What a failed Attempt records of the provider's answer, and how it is decided.

* The model that answered: a provider that answered, even with a failure (a failed or
  ``incomplete`` Responses answer, an error event that ended a stream after Anthropic's
  ``message_start``, Gemini's blocked prompt), named the model that served the call; the
  Attempt keeps it (``model_reported``), redacted and shortened as an answer's is, for the
  audit trail and telemetry's ``gen_ai.response.model``.
* The usage beside a chat completions error object, in a 2xx body or a stream chunk alike.
* A Responses answer's final status (``response.failed``, ``response.incomplete``) is decided
  streamed as it is whole: by its category, not as an execution whose outcome is unknown.

Real HTTP over loopback (the fake provider's raw answers), through a Run session, on SQLite
(the settle hash's duplicate rule on both backends).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger.adapters import SyncAdapter, sync_sender
from ledger.api.facade import Ledger
from ledger.api.turn import execute
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase
from ledger.domain.records import AttemptRecord, AttemptState
from ledger.domain.values import Budget, Price, Route, WireProtocol
from ledger.errors import FailoverExhausted, ProviderError, SettleConflict
from ledger.redaction import forget_secret, register_secret
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault
from tests.run.rawanswers import http, sse, whole

RUN = "r"
PRICE = Price(input_per_mtok=Decimal(100), output_per_mtok=Decimal(200))
HOLD = Decimal("0.01")
SERVED = "m-2025-06-01-served"  # not the route's model: only the provider can have said it


def _incomplete(model: str) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": "incomplete", "model": model,
            "incomplete_details": {"reason": "max_output_tokens"}, "output": [],
            "usage": {"input_tokens": 11, "output_tokens": 7}}


_MESSAGE_START = ("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "model": SERVED, "content": [],
    "usage": {"input_tokens": 11, "output_tokens": 1}}})
_OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}

# protocol, streamed, the provider's raw answer, the state the Attempt ends in
ANSWERS = {
    "responses_incomplete_body": ("openai_responses", False, whole(_incomplete(SERVED)),
                                  AttemptState.FAILED),
    "responses_incomplete_stream": ("openai_responses", True, sse(
        ("response.created", {"type": "response.created",
                              "response": {**_incomplete(SERVED), "status": "in_progress",
                                           "usage": None}}),
        ("response.incomplete", {"type": "response.incomplete",
                                 "response": _incomplete(SERVED)})), AttemptState.FAILED),
    "responses_failed_body": ("openai_responses", False, whole({
        "id": "resp_1", "object": "response", "status": "failed", "model": SERVED,
        "output": [], "error": {"code": "server_error", "message": "upstream failed"}}),
        AttemptState.FAILED),
    "anthropic_error_event_after_message_start": ("anthropic", True, sse(
        _MESSAGE_START, ("error", _OVERLOADED)), AttemptState.FAILED),
    "chat_error_chunk_after_a_chunk": ("openai", True, sse(
        (None, {"id": "c1", "object": "chat.completion.chunk", "model": SERVED,
                "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        (None, {"error": {"message": "upstream failed", "type": "server_error"}})),
        AttemptState.FAILED),
    "gemini_blocked_prompt": ("gemini", False, whole({
        "promptFeedback": {"blockReason": "SAFETY"}, "modelVersion": SERVED,
        "usageMetadata": {"promptTokenCount": 11, "totalTokenCount": 11}}),
        AttemptState.FAILED),
    # Cut after message_start: no verdict, so unknown; the model it named is still known.
    "anthropic_cut_after_message_start": ("anthropic", True, sse(_MESSAGE_START),
                                          AttemptState.UNKNOWN),
}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as f:
        yield f


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "ledger.db")


def _route(fake: FakeProvider, protocol: str) -> Route:
    return Route(id="r1", provider="p", model="m", group="g", recipient="p",
                 protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol), price=PRICE)


def _budget() -> Budget:
    return Budget(max_calls=1, max_retries=0, max_cost=Decimal(1))


def _failing_turn(led: Ledger, fake: FakeProvider, protocol: str, stream: bool,
                  raw: bytes) -> AttemptRecord:
    """One turn of one route whose only call is answered with ``raw``; its Attempt."""
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(raw,)))
    envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
    with led.run(RUN, plan=[_route(fake, protocol)], budget=_budget()) as run, \
            pytest.raises(FailoverExhausted):
        run.turn(envelope, reserve=HOLD)
    [att] = led.timeline(RUN)
    return att


@pytest.mark.parametrize("case", list(ANSWERS))
def test_failed_attempt_records_the_model_the_provider_reported(
        db: str, fake: FakeProvider, case: str) -> None:
    protocol, stream, raw, state = ANSWERS[case]
    with Ledger.open(db) as led:
        att = _failing_turn(led, fake, protocol, stream, raw)
        assert att.state is state
        assert att.model_reported == SERVED


def test_failed_attempt_model_is_redacted_and_shortened_as_an_answers_is(
        db: str, fake: FakeProvider) -> None:
    """A provider that echoes a key in its model name, with a control character, past the 200
    characters kept: stored redacted, printable, at most 200 characters."""
    key = "sk-live-9fQ2xZ7rT4mW8kP1vB6nD3hJ"
    register_secret(key)
    try:
        model = f"gpt-x/{key}\x07" + "y" * 300
        with Ledger.open(db) as led:
            att = _failing_turn(led, fake, "openai_responses", False,
                                whole(_incomplete(model)))
        assert att.state is AttemptState.FAILED and att.model_reported is not None
        assert key not in att.model_reported
        assert att.model_reported.startswith("gpt-x/[REDACTED]?yyy")
        assert len(att.model_reported) == 200
    finally:
        forget_secret(key)


def test_a_key_straddling_the_200th_character_of_a_reported_model_is_not_stored_in_part(
        db: str, fake: FakeProvider) -> None:
    """The model name was cut at 200 characters before it was redacted: a key beginning at
    the 190th character lost its tail to the cut, and its head (10 characters of the key) no
    longer matched the key, so it was stored. Redacted first, then cut, none of it is."""
    key = "Zq8Lm2Xv7Bn4Kc1Rt6Yw3Hp"  # no credential shape: only its registration finds it
    register_secret(key)
    try:
        model = "m" * 189 + "/" + key
        with Ledger.open(db) as led:
            att = _failing_turn(led, fake, "openai_responses", False,
                                whole(_incomplete(model)))
        assert att.model_reported is not None and len(att.model_reported) <= 200
        assert key[:10] not in att.model_reported
        assert att.model_reported == "m" * 189 + "/[REDACTED]"
    finally:
        forget_secret(key)


def test_a_hosts_reported_model_lengthened_by_redaction_is_stored_within_its_column(
        db_url: str, fake: FakeProvider) -> None:
    """A host's own settle may report 200 characters; a short key in them redacts to the
    longer ``[REDACTED]``. PostgreSQL refused the write (its column holds 200); both backends
    now store the redacted text cut to 200."""
    key = "k3Y9q!"  # six characters: the shortest a registered secret may be
    register_secret(key)
    try:
        model = (key + "-") * 28 + "m" * 4  # 200 characters
        assert len(model) == 200
        with Ledger.open(db_url) as led:
            led.admit_run(RUN, plan=[_route(fake, "openai")], budget=_budget())
            lease = led.acquire_lease(RUN, ttl_s=60)
            att = led.begin_attempt(lease, route="r1", envelope_hash="e" * 64,
                                    reserve=HOLD)
            done = led.settle_attempt(lease, att.attempt_id, outcome="succeeded",
                                      model_reported=model, cost=Decimal("0.001"))
            assert done.model_reported is not None and key not in done.model_reported
            [stored] = led.timeline(RUN)
            assert stored.model_reported == done.model_reported
            assert stored.model_reported.startswith("[REDACTED]-[REDACTED]-")
            assert len(stored.model_reported) == 200
    finally:
        forget_secret(key)


def test_invariant2_a_failed_attempts_reported_model_settles_again_as_the_same_write(
        db_url: str, fake: FakeProvider) -> None:
    """Invariant 2: the settle hash covers the model a failure reported, so the same receipt
    again is the same write and another model is refused; a failure that named none hashes as
    it always did (``test_a_fact_without_accepted_is_stored_and_hashed_as_before``)."""
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(whole(_incomplete(SERVED)),)))
    route = _route(fake, "openai_responses")
    with Ledger.open(db_url) as led, SyncAdapter() as adapter:
        led.admit_run(RUN, plan=[route], budget=_budget())
        lease = led.acquire_lease(RUN, ttl_s=60)
        with pytest.raises(FailoverExhausted):
            execute(led, lease, Envelope(parts=[Part(content="hi")], max_output_tokens=64),
                    sync_sender(adapter), reserve=HOLD)
        [att] = led.timeline(RUN)
        assert (att.state, att.model_reported) == (AttemptState.FAILED, SERVED)
        receipt: dict[str, Any] = {
            "outcome": "failed", "fact": att.fact, "prompt_tokens": att.prompt_tokens,
            "completion_tokens": att.completion_tokens, "cost": att.cost,
            "cached_tokens": att.cached_tokens, "reasoning_tokens": att.reasoning_tokens}
        again = led.settle_attempt(lease, att.attempt_id, model_reported=SERVED, **receipt)
        assert again == att
        with pytest.raises(SettleConflict):
            led.settle_attempt(lease, att.attempt_id, model_reported="another-model", **receipt)
        with pytest.raises(SettleConflict):
            led.settle_attempt(lease, att.attempt_id, **receipt)


# -- a chat completions error object that reports usage ---------------------------------------

_CHAT_ERROR_WITH_USAGE = {"error": {"message": "upstream failed", "type": "server_error"},
                          "model": SERVED,
                          "usage": {"prompt_tokens": 11, "completion_tokens": 7,
                                    "total_tokens": 18}}
CHAT_COST = Decimal(11 * 100 + 7 * 200) / 10**6  # 0.0025 at PRICE


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("hold", [HOLD, Decimal("0.001")], ids=["under_hold", "over_hold"])
def test_chat_error_with_usage_posts_that_usage_whole_body_or_streamed(
        db: str, fake: FakeProvider, stream: bool, hold: Decimal) -> None:
    """A chat completions error object that reports usage, as a 2xx body or as a stream chunk
    (after a first chunk), is posted at that usage's cost, at most the hold, the same both
    ways; the tokens are the Attempt's and the Run's."""
    raw = sse((None, {"id": "c1", "object": "chat.completion.chunk", "model": SERVED,
                       "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
               (None, _CHAT_ERROR_WITH_USAGE)) if stream else whole(_CHAT_ERROR_WITH_USAGE)
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(raw,)))
    envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
    with Ledger.open(db) as led:
        with led.run(RUN, plan=[_route(fake, "openai")], budget=_budget()) as run, \
                pytest.raises(FailoverExhausted):
            run.turn(envelope, reserve=hold)
        [att] = led.timeline(RUN)
        assert att.state is AttemptState.FAILED and att.fact is not None and att.fact.accepted
        assert (att.prompt_tokens, att.completion_tokens, att.cost) == (11, 7, CHAT_COST)
        assert att.model_reported == SERVED
        r = led.get_run(RUN)
        assert (r.posted, r.reserved) == (min(CHAT_COST, hold), Decimal(0))
        assert r.tokens_used == 18


def test_chat_error_with_a_stray_usage_stays_the_providers_error(
        db: str, fake: FakeProvider) -> None:
    """A usage or model beside the error that has not its shape is left out (the evidence
    body keeps it): the provider's error is still the fact, not a malformed answer."""
    raw = sse((None, {"error": {"message": "slow down", "code": "rate_limit_exceeded"},
                       "usage": "lots", "model": 5}))
    with Ledger.open(db) as led:
        att = _failing_turn(led, fake, "openai", True, raw)
        assert att.fact is not None and att.fact.transport is None
        assert att.category == "rate_limit"
        assert (att.prompt_tokens, att.model_reported) == (None, None)


# -- a Responses answer's final status, streamed or whole --------------------------------------

def _failed_response(code: str) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": "failed", "model": SERVED,
            "output": [], "error": {"code": code, "message": "the response failed"},
            "usage": None}


def _responses_answer(final: dict[str, Any], stream: bool, text: str = "") -> bytes:
    """``final`` as a whole body, or streamed: created, ``text`` as deltas, then its event."""
    if not stream:
        return whole(final)
    events: list[tuple[str | None, dict[str, Any]]] = [
        ("response.created", {"type": "response.created",
                              "response": {**final, "status": "in_progress"}})]
    if text:
        events.append(("response.output_text.delta", {
            "type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
            "content_index": 0, "delta": text}))
    kind = f"response.{final['status']}"
    events.append((kind, {"type": kind, "response": final}))
    return sse(*events)


def _two_route_turn(led: Ledger, fake: FakeProvider, raw: bytes, stream: bool,
                    shown: list[str] | None = None) -> str:
    """A turn whose primary is answered with ``raw`` and whose backup (another group) would
    answer: the route that served it, or ``stop:<reason>``."""
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(raw,)), model="m-primary")
    routes = [Route(id=rid, provider="p", model=f"m-{rid}", group=f"g-{rid}", recipient="p",
                    protocol=WireProtocol.OPENAI_RESPONSES,
                    endpoint=fake.endpoint("openai_responses"), price=PRICE)
              for rid in ("primary", "backup")]
    budget = Budget(max_calls=2, max_retries=1, max_cost=Decimal(1))
    envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
    with led.run(RUN, plan=routes, budget=budget) as run:
        try:
            return run.turn(envelope, reserve=HOLD,
                            on_text=shown.append if shown is not None else None).route.id
        except FailoverExhausted as e:
            return f"stop:{e.reason}"


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_an_incomplete_responses_answer_is_decided_by_its_category_streamed_orwhole(
        db: str, fake: FakeProvider, stream: bool) -> None:
    """``response.incomplete`` holds the whole response with its final status, as the body
    does: a known verdict (``max_output_tokens``: category ``unknown``, which moves on nowhere
    under the default policy), not an execution whose outcome is unknown."""
    with Ledger.open(db) as led:
        outcome = _two_route_turn(led, fake, _responses_answer(_incomplete(SERVED), stream),
                                  stream)
        assert outcome == "stop:not_eligible_failure"
        [att] = led.timeline(RUN)
        assert att.state is AttemptState.FAILED and att.fact is not None
        assert (att.fact.phase, att.category) == (Phase.AFTER_HEADERS, "unknown")
        assert att.fact.accepted and att.fact.status == 200


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_a_failed_responses_answer_moves_on_by_its_category_streamed_orwhole(
        db: str, fake: FakeProvider, stream: bool) -> None:
    """A failed response whose error is ``rate_limit_exceeded`` moves on to another group under
    the default policy, the same streamed (``response.failed``) as whole."""
    with Ledger.open(db) as led:
        raw = _responses_answer(_failed_response("rate_limit_exceeded"), stream)
        assert _two_route_turn(led, fake, raw, stream) == "backup"
        first = led.timeline(RUN)[0]
        assert (first.route_id, first.state, first.category) == (
            "primary", AttemptState.FAILED, "rate_limit")


def test_a_streamed_final_status_after_text_was_shown_still_stops_on_the_output(
        db: str, fake: FakeProvider) -> None:
    """Invariant 9 stands: text the caller was shown before the final event is effective
    output, and the turn stops there whatever the category."""
    shown: list[str] = []
    with Ledger.open(db) as led:
        raw = _responses_answer(_failed_response("rate_limit_exceeded"), True, text="Half an")
        assert _two_route_turn(led, fake, raw, True, shown) == "stop:output_exists"
        assert shown == ["Half an"]
        [att] = led.timeline(RUN)
        assert att.effective_output and att.fact is not None
        assert att.fact.phase is Phase.AFTER_HEADERS


def test_a_streamed_final_status_after_buffered_text_discards_it_and_moves_on(
        db: str, fake: FakeProvider) -> None:
    """Nobody was shown the text before the final event (no callback: the ledger buffers the
    stream and hands an answer over only after the settle): it is discarded, recorded so, and
    the failure is decided as the whole body is."""
    with Ledger.open(db) as led:
        raw = _responses_answer(_failed_response("rate_limit_exceeded"), True, text="Half an")
        assert _two_route_turn(led, fake, raw, True) == "backup"
        first = led.timeline(RUN)[0]
        assert not first.effective_output
        assert [e.attempt_id for e in led.events(RUN, ["discarded"])] == [first.attempt_id]


def _stopped_turn(led: Ledger, fake: FakeProvider, protocol: str, stream: bool,
                  raw: bytes) -> FailoverExhausted:
    """One turn of one route whose only call is answered with ``raw``; how it stopped."""
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(raw,)))
    envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
    with led.run(RUN, plan=[_route(fake, protocol)], budget=_budget()) as run, \
            pytest.raises(FailoverExhausted) as stopped:
        run.turn(envelope, reserve=HOLD)
    return stopped.value


# protocol, streamed, the provider's raw answer, what its error must name
WHY = {
    "responses_failed_body": ("openai_responses", False, whole({
        "id": "resp_1", "object": "response", "status": "failed", "model": SERVED,
        "output": [], "error": {"code": "server_error",
                                "message": "The model failed to generate a response."}}),
        "server_error (HTTP 200, code server_error): The model failed to generate a response."),
    "chat_error_chunk": ("openai", True, sse(
        (None, {"error": {"message": "upstream failed", "type": "server_error"}})),
        "unknown (HTTP 200, code server_error): upstream failed"),
    "anthropic_529": ("anthropic", False, http(
        json.dumps({"type": "error", "error": {"type": "overloaded_error",
                                               "message": "Overloaded"}}).encode(),
        "application/json", "529 Overloaded"),
        "overloaded (HTTP 529, code overloaded_error): Overloaded"),
    "gemini_blocked_prompt": ("gemini", False, whole({
        "promptFeedback": {"blockReason": "SAFETY"}, "modelVersion": SERVED,
        "usageMetadata": {"promptTokenCount": 11, "totalTokenCount": 11}}),
        "content_policy (HTTP 200, code SAFETY): prompt blocked: blockReason=SAFETY"),
    "html_502": ("openai", False, http(b"<html>502 Bad Gateway</html>", "text/html",
                                        "502 Bad Gateway"),
                 "server_error (HTTP 502)"),
}


@pytest.mark.parametrize("case", list(WHY))
def test_a_failed_attempts_error_names_the_provider_code_and_message(
        db: str, fake: FakeProvider, case: str) -> None:
    """The error of a failed Attempt, and the stop's message that lists it, say why in one
    line: the provider's code and its message, not only the category and the status. It
    still pickles whole, its fact and attributes kept."""
    protocol, stream, raw, why = WHY[case]
    with Ledger.open(db) as led:
        stopped = _stopped_turn(led, fake, protocol, stream, raw)
    err = stopped.exceptions[0]
    assert isinstance(err, ProviderError)
    assert str(err) == f"p/m: {why}"
    assert f"r1: failed: p/m: {why} [attempt {err.attempt_id}]" in str(stopped)
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.fact, back.attempt_id, back.route) == (
        str(err), err.fact, err.attempt_id, "r1")


def test_the_provider_message_an_error_names_is_redacted_and_bounded(
        db: str, fake: FakeProvider) -> None:
    """A provider message that echoes a key and runs on for 1000 characters: the error names
    it redacted, cut to 200 characters."""
    key = "sk-live-9fQ2xZ7rT4mW8kP1vB6nD3hJ"
    register_secret(key)
    try:
        message = f"bad key {key} " + "x" * 1000
        raw = whole({"error": {"message": message, "type": "invalid_request_error",
                               "code": "invalid_api_key"}})
        with Ledger.open(db) as led:
            stopped = _stopped_turn(led, fake, "openai", False, raw)
        text = str(stopped.exceptions[0])
        head = "p/m: auth (HTTP 200, code invalid_api_key): "
        assert text.startswith(head + "bad key [REDACTED] xxx")
        assert key not in text and key not in str(stopped)
        assert len(text) == len(head) + 200
    finally:
        forget_secret(key)
