"""A Gemini answer withheld for its content is a ``content_policy`` failure, never a success.

Gemini refuses a request's content inside a 200: the prompt (``promptFeedback.blockReason``) or
the answer (a candidate whose ``finishReason`` is ``SAFETY``, ``RECITATION``,
``PROHIBITED_CONTENT``, ``BLOCKLIST``, ``SPII`` and carries no text). Either is the provider's
whole verdict: a ``failed`` Attempt of category ``content_policy``, scope ``request``, no
cooldown, and the turn stops as every preset's content-policy rule says (none moves on after it).
A candidate that carries some text before ``finishReason: SAFETY`` stays that text, a success
whose ``finish_reason`` says so (docs/adapters.md). A candidate that ends empty with
``MALFORMED_FUNCTION_CALL`` or ``LANGUAGE`` (``format``) or ``OTHER`` (``unknown``) is a failure
too, never an empty success. Real HTTP over loopback (the fake provider's
raw answers), through a Run session, whole bodies and streams, both backends.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger.adapters import StaticSecretProvider
from ledger.api.facade import Ledger
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Category, CooldownEffect, Phase, Scope
from ledger.domain.records import AttemptState
from ledger.domain.values import Budget, Grant, Price, Profile, Route, WireProtocol
from ledger.errors import FailoverExhausted
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault
from tests.run.rawanswers import sse, whole

SECRETS = StaticSecretProvider({"p:a": "key-a", "p:b": "key-b"})
RUN = "r"
USAGE = {"promptTokenCount": 5, "totalTokenCount": 5}


def _candidate(finish: str, text: str | None = None) -> dict[str, Any]:
    cand: dict[str, Any] = {"finishReason": finish, "index": 0,
                            "safetyRatings": [{"category": "HARM_CATEGORY_HARASSMENT",
                                               "probability": "HIGH", "blocked": True}]}
    if text is not None:
        cand["content"] = {"parts": [{"text": text}], "role": "model"}
    return {"candidates": [cand], "usageMetadata": USAGE, "modelVersion": "m-001"}


def _answers(obj: dict[str, Any]) -> dict[str, bytes]:
    """The refusal as a whole body and as a stream (one chunk, as Gemini sends it)."""
    return {"whole": whole(obj), "stream": sse((None, obj))}


# the refusal, the reason it gives (the fact's provider code)
REFUSALS = {
    "prompt_blocked": ({"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": USAGE,
                        "modelVersion": "m-001"}, "SAFETY"),
    "candidate_safety": (_candidate("SAFETY"), "SAFETY"),
    "candidate_recitation": (_candidate("RECITATION"), "RECITATION"),
    "candidate_prohibited_empty_text": (_candidate("PROHIBITED_CONTENT", ""),
                                        "PROHIBITED_CONTENT"),
    "candidate_blocklist": (_candidate("BLOCKLIST"), "BLOCKLIST"),
    "candidate_spii": (_candidate("SPII"), "SPII"),
}


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeProvider, FakeProvider]]:
    with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b:
        yield a, b


def _turn(db_url: str, fakes: tuple[FakeProvider, FakeProvider], raw: bytes, *, stream: bool,
          policy: str = "failure-domain") -> tuple[Ledger, Any]:
    """One turn of a two-route Gemini plan whose primary answers ``raw``; (ledger, outcome)."""
    a, b = fakes
    a.clear()
    b.clear()
    a.enqueue(Behavior(fault=Fault.RAW, raw=(raw,)), model="m-a")
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
    plan = [Route(id="primary", provider="pa", model="m-a", group="ga", recipient="ra",
                  protocol=WireProtocol.GEMINI, endpoint=a.endpoint("gemini"),
                  profiles=[Profile(id="p:a")], price=price),
            Route(id="backup", provider="pb", model="m-b", group="gb", recipient="rb",
                  protocol=WireProtocol.GEMINI, endpoint=b.endpoint("gemini"),
                  profiles=[Profile(id="p:b")], price=price)]
    led = Ledger.open(db_url)
    envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
    try:
        with led.run(RUN, plan=plan, policy=policy, secrets=SECRETS,
                     budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal(1)),
                     grant=Grant(recipients={"ra": ["user_input"],
                                             "rb": ["user_input"]})) as run:
            outcome: Any = run.turn(envelope, reserve=Decimal("0.01"))
    except FailoverExhausted as e:
        outcome = e
    return led, outcome


@pytest.mark.parametrize("policy", ["failure-domain", "goclaw", "fased"])
@pytest.mark.parametrize("shape", ["whole", "stream"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_gemini_content_refusal_is_a_content_policy_failure_that_stops(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider], case: str, shape: str,
        policy: str) -> None:
    obj, reason = REFUSALS[case]
    led, outcome = _turn(db_url, fakes, _answers(obj)[shape], stream=shape == "stream",
                         policy=policy)
    [att] = led.timeline(RUN)
    assert att.state is AttemptState.FAILED
    fact = att.fact
    assert fact is not None
    assert (fact.category, fact.provider_code, fact.phase, fact.scope) == (
        Category.CONTENT_POLICY, reason, Phase.AFTER_HEADERS, Scope.REQUEST)
    assert (fact.cooldown, fact.moves_on, fact.status) == (CooldownEffect.NONE, False, 200)
    assert isinstance(outcome, FailoverExhausted)
    assert outcome.reason == "not_eligible_failure"
    assert not fakes[1].requests  # the request's content is refused wherever it goes
    assert all(h.cooldown_until is None for h in led.health().values())
    led.close()


@pytest.mark.parametrize("shape", ["whole", "stream"])
def test_gemini_answer_cut_short_by_safety_after_some_text_stays_a_success(
        db_url: str, fakes: tuple[FakeProvider, FakeProvider], shape: str) -> None:
    led, outcome = _turn(db_url, fakes, _answers(_candidate("SAFETY", "Sure, here is"))[shape],
                         stream=shape == "stream")
    assert not isinstance(outcome, FailoverExhausted)
    assert (outcome.text, outcome.output.finish_reason) == ("Sure, here is", "SAFETY")
    [att] = led.timeline(RUN)
    assert att.state is AttemptState.SUCCEEDED
    led.close()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file: the matrix below is the adapter's and the presets' reading, which the
    database only records (both databases record these facts in the tests above)."""
    return str(tmp_path / "ledger.db")


# the finishReason of a candidate that ends with nothing in it, the category every preset reads
EMPTY_ANSWERS = {
    # The model wrote a function call that is not one: a bad answer, as a malformed event is.
    "MALFORMED_FUNCTION_CALL": Category.FORMAT,
    # A language the model does not serve: this request does not fit this route.
    "UNEXPECTED_TOOL_CALL": Category.FORMAT,
    "TOO_MANY_TOOL_CALLS": Category.FORMAT,
    "MALFORMED_RESPONSE": Category.FORMAT,
    "LANGUAGE": Category.FORMAT,
    # No reason given, no image made, and a reason Gemini adds later: unmapped, unknown.
    "OTHER": Category.UNKNOWN,
    "NO_IMAGE": Category.UNKNOWN,
    "A_REASON_GEMINI_ADDS_LATER": Category.UNKNOWN,
}


@pytest.mark.parametrize("policy", ["failure-domain", "goclaw", "fased"])
@pytest.mark.parametrize("shape", ["whole", "stream"])
@pytest.mark.parametrize("finish", list(EMPTY_ANSWERS))
def test_gemini_empty_answer_that_gemini_failed_is_a_failure_never_an_empty_success(
        sqlite_url: str, fakes: tuple[FakeProvider, FakeProvider], finish: str, shape: str,
        policy: str) -> None:
    """A candidate with no text, call or media that ends ``MALFORMED_FUNCTION_CALL``,
    ``LANGUAGE`` or ``OTHER`` is no answer: a ``failed`` Attempt of the reason's category (a
    success would hand the caller nothing and count for the route's health), decided as each
    preset decides that category: fased rotates on ``format``, no other preset moves on."""
    obj = {"candidates": [{"finishReason": finish, "index": 0}], "usageMetadata": USAGE,
           "modelVersion": "m-001"}
    led, outcome = _turn(sqlite_url, fakes, _answers(obj)[shape], stream=shape == "stream",
                         policy=policy)
    first = led.timeline(RUN)[0]
    assert first.route_id == "primary" and first.state is AttemptState.FAILED
    fact = first.fact
    assert fact is not None
    assert (fact.category, fact.provider_code, fact.phase, fact.status) == (
        EMPTY_ANSWERS[finish], finish, Phase.AFTER_HEADERS, 200)
    # It ran and said how much: the prompt's tokens are what it is posted at.
    assert first.prompt_tokens == USAGE["promptTokenCount"]
    moves = policy == "fased" and EMPTY_ANSWERS[finish] is Category.FORMAT
    assert fact.moves_on is moves
    if moves:
        assert not isinstance(outcome, FailoverExhausted)
        assert outcome.route.id == "backup"
    else:
        assert isinstance(outcome, FailoverExhausted)
        assert outcome.reason == "not_eligible_failure"
        assert not fakes[1].requests
    led.close()
