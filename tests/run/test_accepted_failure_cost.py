"""A failure the provider reported inside a 2xx answer is charged as it ran, whole or streamed.

The provider accepted the request (a 2xx status) and then said, in its answer, that it failed:
a Responses answer whose status is ``incomplete`` (its output limit reached), an error object in
a 2xx body, Gemini's blocked prompt, or the same ended by an error event in a stream. It ran the
call, so it may bill it: with the usage it reported the Attempt is posted that cost (at most the
hold), and with none the whole hold, which stands in for the cost nobody reported. The same
answer read as a whole body or as a stream is charged the same; only an error status (not 2xx)
without usage posts nothing. Attempts whose fact was stored before ``accepted`` existed keep what
they posted and their settle hash. Real HTTP over loopback (the fake provider's raw answers),
on both backends: the Run's counters and what is left of its budget, the audit and reconcile
must say the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.api.facade import Ledger
from ledger.decide.settle import settle_spec
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import FailureFact, Observation, Phase, WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState, DebitState, Lease, Outcome
from ledger.domain.values import Budget, Price, Route
from ledger.errors import FailoverExhausted, InvalidArgument, SettleConflict
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.policy.load import preset
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault
from tests.run.rawanswers import sse, whole

RUN = "r"
PRICE = Price(input_per_mtok=Decimal(100), output_per_mtok=Decimal(200))
HOLD = Decimal("0.01")
MAX_COST = Decimal(1)
MAX_TOKENS = 10_000
# The settle hash of the fact below, as the package computed it before `accepted` existed.
PRE_ACCEPTED_HASH = "sha256:a43ff0a6f655837f3e5fe58657d3f48caf2207a28db444f72aa6e99ca66db004"


_INCOMPLETE = {"id": "resp_1", "object": "response", "status": "incomplete", "model": "m",
               "incomplete_details": {"reason": "max_output_tokens"}, "output": [],
               "usage": None}
_OVERLOADED = {"type": "overloaded_error", "message": "Overloaded"}
_GEMINI_ERROR = {"code": 500, "status": "INTERNAL", "message": "internal error"}
_CHAT_ERROR = {"message": "upstream failed", "type": "server_error", "code": None}

# protocol, streamed, the provider's raw 2xx answer: a failure reported without usage
NO_USAGE = {
    "responses_incomplete_body": ("openai_responses", False, whole(_INCOMPLETE)),
    "responses_incomplete_stream": ("openai_responses", True, sse(
        ("response.created", {"type": "response.created",
                              "response": {**_INCOMPLETE, "status": "in_progress"}}),
        ("response.incomplete", {"type": "response.incomplete", "response": _INCOMPLETE}))),
    "chat_error_body": ("openai", False, whole({"error": _CHAT_ERROR})),
    "chat_error_stream": ("openai", True, sse((None, {"error": _CHAT_ERROR}))),
    "anthropic_error_body": ("anthropic", False, whole({"type": "error",
                                                         "error": _OVERLOADED})),
    "anthropic_error_stream": ("anthropic", True, sse(
        ("error", {"type": "error", "error": _OVERLOADED}))),
    "gemini_error_body": ("gemini", False, whole({"error": _GEMINI_ERROR})),
    "gemini_error_stream": ("gemini", True, sse((None, {"error": _GEMINI_ERROR}))),
}

_BLOCKED = {"promptFeedback": {"blockReason": "SAFETY"}, "modelVersion": "m-001",
            "usageMetadata": {"promptTokenCount": 11, "totalTokenCount": 11}}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as f:
        yield f


def _route(fake: FakeProvider, protocol: str) -> Route:
    return Route(id="r1", provider="p", model="m", group="g", recipient="p",
                 protocol=WireProtocol(protocol), endpoint=fake.endpoint(protocol), price=PRICE)


def _budget() -> Budget:
    return Budget(max_calls=1, max_retries=0, max_cost=MAX_COST, max_tokens=MAX_TOKENS)


def _failing_turn(led: Ledger, fake: FakeProvider, protocol: str, stream: bool,
                  behavior: Behavior) -> AttemptRecord:
    """One turn of one route whose only call fails as ``behavior`` answers; its Attempt."""
    fake.clear()
    fake.enqueue(behavior)
    envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
    with led.run(RUN, plan=[_route(fake, protocol)], budget=_budget()) as run, \
            pytest.raises(FailoverExhausted):
        run.turn(envelope, reserve=HOLD)
    [att] = led.timeline(RUN)
    return att


def _assert_books(led: Ledger, *, charged: Decimal, tokens: int) -> None:
    """The Run's counters, what is left of its budget, the audit, replay and reconcile
    agree."""
    run = led.get_run(RUN)
    assert (run.posted, run.reserved) == (charged, Decimal(0))
    assert run.cost_left == MAX_COST - charged
    assert (run.tokens_used, run.tokens_reserved) == (tokens, 0)
    assert run.tokens_left == MAX_TOKENS - tokens
    audit = Audit(led)
    tl = audit.timeline(RUN)
    assert (tl.total_cost, tl.held) == (charged, Decimal(0))
    [tot] = [t for t in audit.costs(by="run").items if t.key == RUN]
    assert (tot.cost, tot.held) == (charged, Decimal(0))
    assert audit.replay("failure-domain", run=RUN).baseline.cost == charged
    books = reconcile(led)
    assert books.ok, books.violations


@pytest.mark.parametrize("case", list(NO_USAGE))
def test_a_failure_inside_a_2xx_answer_without_usage_posts_the_whole_hold(
        db_url: str, fake: FakeProvider, case: str) -> None:
    protocol, stream, raw = NO_USAGE[case]
    with Ledger.open(db_url) as led:
        att = _failing_turn(led, fake, protocol, stream, Behavior(fault=Fault.RAW, raw=(raw,)))
        assert (att.state, att.debit_state) == (AttemptState.FAILED, DebitState.POSTED)
        assert att.fact is not None and att.fact.status == 200 and att.fact.accepted
        # A Responses answer's final status event holds the whole response, as the body does,
        # and every other error event here comes before any content, so no answer was begun:
        # each is the provider's verdict, observed as the same body is (after_headers).
        assert att.fact.phase is Phase.AFTER_HEADERS
        # Nothing reported stays nothing reported on the Attempt: the hold is what is posted.
        assert (att.prompt_tokens, att.completion_tokens, att.cost) == (None, None, None)
        assert att.reserved_tokens > 0
        _assert_books(led, charged=HOLD, tokens=att.reserved_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_a_blocked_gemini_prompt_posts_the_usage_it_reports(
        db_url: str, fake: FakeProvider, stream: bool) -> None:
    raw = sse((None, _BLOCKED)) if stream else whole(_BLOCKED)
    with Ledger.open(db_url) as led:
        att = _failing_turn(led, fake, "gemini", stream, Behavior(fault=Fault.RAW, raw=(raw,)))
        assert (att.state, att.debit_state) == (AttemptState.FAILED, DebitState.POSTED)
        assert att.fact is not None and att.fact.accepted
        cost = Decimal(11) * 100 / 10**6
        assert (att.prompt_tokens, att.completion_tokens, att.cost) == (11, 0, cost)
        _assert_books(led, charged=cost, tokens=11)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_an_error_status_without_usage_still_posts_nothing(
        db_url: str, fake: FakeProvider, stream: bool) -> None:
    with Ledger.open(db_url) as led:
        att = _failing_turn(led, fake, "openai_responses", stream,
                            Behavior(fault=Fault.SERVER_ERROR))
        assert (att.state, att.debit_state) == (AttemptState.FAILED, DebitState.POSTED)
        assert att.fact is not None and att.fact.status == 500 and not att.fact.accepted
        _assert_books(led, charged=Decimal(0), tokens=0)


# -- facts stored before `accepted` existed, and the low-level settle -------------------------


def _begin(led: Ledger, fake: FakeProvider) -> tuple[Lease, str]:
    led.admit_run(RUN, plan=[_route(fake, "openai")], budget=_budget())
    lease = led.acquire_lease(RUN, ttl_s=60)
    envelope = Envelope(parts=[Part(content="hi")])
    att = led.begin_attempt(lease, route="r1", envelope_hash=envelope.hash, reserve=HOLD,
                            reserve_tokens=100)
    return lease, att.attempt_id


def test_a_2xx_failure_settled_without_accepted_reads_as_it_posted(
        db_url: str, fake: FakeProvider) -> None:
    """What a settle stored before the field existed (a 2xx answered failure, no usage:
    nothing posted) is read the same way by every report, and settles again as the same
    write."""
    obs = Observation(status=200, phase=Phase.AFTER_HEADERS, protocol=WireProtocol.OPENAI,
                      body=json.dumps({"error": _CHAT_ERROR}))
    with Ledger.open(db_url) as led:
        lease, attempt_id = _begin(led, fake)
        first = led.settle_attempt(lease, attempt_id, outcome="failed", observation=obs)
        assert first.fact is not None and not first.fact.accepted
        assert first.debit_state is DebitState.POSTED
        again = led.settle_attempt(lease, attempt_id, outcome="failed", observation=obs)
        assert again == first  # the same write, accepted (invariant 2)
        _assert_books(led, charged=Decimal(0), tokens=0)


def test_an_accepted_failure_settles_again_as_the_same_write_and_not_as_another(
        db_url: str, fake: FakeProvider) -> None:
    obs = Observation(status=200, phase=Phase.AFTER_HEADERS, protocol=WireProtocol.OPENAI,
                      body=json.dumps({"error": _CHAT_ERROR}), accepted=True)
    with Ledger.open(db_url) as led:
        lease, attempt_id = _begin(led, fake)
        first = led.settle_attempt(lease, attempt_id, outcome="failed", observation=obs)
        again = led.settle_attempt(lease, attempt_id, outcome="failed", observation=obs)
        assert again == first and first.fact is not None and first.fact.accepted
        with pytest.raises(SettleConflict):
            led.settle_attempt(lease, attempt_id, outcome="failed",
                               observation=obs.model_copy(update={"accepted": False}))
        _assert_books(led, charged=HOLD, tokens=100)


def test_a_fact_without_accepted_is_stored_and_hashed_as_before() -> None:
    """The settle hash of a fact that is not ``accepted`` is the one computed before the field
    existed, so a repeated settle of an Attempt recorded then is the same write (invariant
    2)."""
    fact = FailureFact(category="unknown", status=200, phase=Phase.AFTER_HEADERS)
    assert "accepted" not in fact.to_json()
    assert FailureFact.model_validate_json(json.dumps(fact.to_json())) == fact
    route = Route(id="r1", provider="p", model="m", group="g", recipient="p",
                  protocol=WireProtocol.OPENAI, endpoint="https://x.invalid/v1", price=PRICE)
    lease = Lease(run_id=RUN, executor="e", fence=1, expires_at=100.0)
    spec = settle_spec(preset("failure-domain"), route, None, lease, "a1",
                       outcome=Outcome.FAILED, fact=fact, observation=None, now=1.0,
                       effective_output=None, tool_started=None, prompt_tokens=None,
                       completion_tokens=None, cost_micros=None, model_reported=None,
                       output_hash=None, events=[], provenance=(), repeat=False)
    assert spec.settle_hash == PRE_ACCEPTED_HASH


def test_accepted_with_an_error_status_is_refused() -> None:
    with pytest.raises(InvalidArgument) as e:
        Observation(status=429, accepted=True)
    assert e.value.fields["field"] == "accepted"
    with pytest.raises(InvalidArgument) as e:
        FailureFact(category="rate_limit", status=429, phase=Phase.AFTER_HEADERS, accepted=True)
    assert e.value.fields["field"] == "accepted"
