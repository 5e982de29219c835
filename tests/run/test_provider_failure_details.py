"""What a provider says about its failure beyond status and error type is read, under every preset.

* Wait hints in milliseconds: ``retry-after-ms`` (OpenAI) and ``x-ms-retry-after-ms`` (Azure
  OpenAI, which may send nothing else) are hints as ``Retry-After`` is, the longest of them
  winning: a 429 that says 45 s closes its capacity group for 45 s, not the default 30, and a
  same-route retry waits out exactly what it says.
* A provider's detail that refines its coarse error field decides the category: a Gemini
  ``INVALID_ARGUMENT`` whose ``google.rpc.ErrorInfo`` reason is ``API_KEY_INVALID`` is ``auth``;
  an Anthropic ``rate_limit_error`` whose ``details.error_code`` is
  ``enforced_spend_limit_reached`` is ``billing`` (it closes no group, and fased disables the
  key as for billing); so is a Gemini ``PERMISSION_DENIED`` whose reason is ``BILLING_DISABLED``.
* An OpenAI ``server_error`` reported inside a 200 answer (a Responses ``response.failed`` or
  ``error`` event) is decided as the same error with status 500 is: ``server_error`` under
  failure-domain and fased; ``unknown`` under goclaw, whose seed has no such reason. The type
  ``server_error`` alone stays unmapped: OpenAI's 503 overload carries it too.

Real HTTP over loopback (the fake provider's raw answers), through a Run session on SQLite, on
a manual clock (the retry owner's waits jump it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.decide.classify import classify
from ledger.decide.health import route_key
from ledger.decide.replay import refact
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Category, CooldownEffect, FailureFact, Observation, Scope
from ledger.domain.records import AttemptRecord, AttemptState
from ledger.domain.values import Budget, Health, Price, Route, WireProtocol
from ledger.errors import FailoverExhausted
from ledger.ops.audit import Audit
from ledger.policy.load import preset
from ledger.policy.model import Policy
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault
from tests.run.rawanswers import http, sse

RUN = "r"
T0 = 1_000_000.0
PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
PRESETS = ["failure-domain", "fased", "goclaw"]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as f:
        yield f


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "ledger.db")


def _plan(fake: FakeProvider, protocol: str) -> list[Route]:
    proto = WireProtocol(protocol)
    return [Route(id="primary", provider="pa", model="m-primary", group="ga", recipient="p",
                  protocol=proto, endpoint=fake.endpoint(protocol), price=PRICE),
            Route(id="backup", provider="pb", model="m-backup", group="gb", recipient="p",
                  protocol=proto, endpoint=fake.endpoint(protocol), price=PRICE)]


def _answer(status: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    raw = http(json.dumps(body).encode(), "application/json", status)
    head, _, rest = raw.partition(b"\r\n")
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    return head + b"\r\n" + extra + rest


class Turn:
    """One turn on the two-route plan whose primary answers with ``raws`` (one per call)."""

    def __init__(self, db: str, fake: FakeProvider, protocol: str, policy: str,
                 *raws: bytes, stream: bool = False) -> None:
        fake.clear()
        for raw in raws:
            fake.enqueue(Behavior(fault=Fault.RAW, raw=(raw,)), model="m-primary")
        self.plan = _plan(fake, protocol)
        self.clock = ManualClock(T0)
        envelope = Envelope(parts=[Part(content="hi")], stream=stream, max_output_tokens=64)
        with Ledger.open(db, clock=self.clock) as led:
            with led.run(RUN, plan=self.plan, policy=policy,
                         budget=Budget(max_calls=4, max_retries=3,
                                       max_cost=Decimal(1))) as run:
                try:
                    self.served: str | None = run.turn(envelope).route.id
                except FailoverExhausted:
                    self.served = None
            self.timeline: list[AttemptRecord] = led.timeline(RUN)
            self.groups = led.group_projections()
            self.health = led.health()

    def key_health(self, policy: str) -> Health:
        """The health row the primary's failure counts against (route, provider or profile)."""
        return self.health[route_key(self.plan[0], preset(policy))]

    @property
    def fact(self) -> FailureFact:
        first = self.timeline[0]
        assert first.route_id == "primary" and first.fact is not None
        return first.fact


# -- wait hints in milliseconds ---------------------------------------------------------------

_RATE_LIMITED = {"error": {"message": "Rate limit reached", "type": "requests", "param": None,
                           "code": "rate_limit_exceeded"}}


@pytest.mark.parametrize("header", ["retry-after-ms", "x-ms-retry-after-ms"])
def test_a_millisecond_retry_hint_closes_the_group_as_long_as_it_says(
        db: str, fake: FakeProvider, header: str) -> None:
    turn = Turn(db, fake, "openai", "failure-domain",
                _answer("429 Too Many Requests", _RATE_LIMITED, {header: "45000"}))
    assert turn.fact.category is Category.RATE_LIMIT
    assert turn.fact.retry_after_s == 45.0
    assert turn.served == "backup"
    # Not the policy's 30 s default for a 429 without a hint.
    assert turn.groups["ga"].until == T0 + 45.0


@pytest.mark.parametrize(("headers", "hint"), [
    ({"retry-after": "7", "retry-after-ms": "45000"}, 45.0),
    ({"retry-after": "60", "x-ms-retry-after-ms": "1500"}, 60.0),
    ({"retry-after-ms": "2500", "x-ms-retry-after-ms": "12500"}, 12.5),
    # Not milliseconds: ignored, as a malformed Retry-After is.
    ({"retry-after": "9", "retry-after-ms": "-5000"}, 9.0),
    ({"retry-after": "9", "retry-after-ms": "Thu, 01 Jan 2099 00:00:00 GMT"}, 9.0),
])
def test_the_longest_wait_hint_wins_whatever_its_unit(
        db: str, fake: FakeProvider, headers: dict[str, str], hint: float) -> None:
    turn = Turn(db, fake, "openai", "failure-domain",
                _answer("429 Too Many Requests", _RATE_LIMITED, headers))
    assert turn.fact.retry_after_s == hint
    assert turn.groups["ga"].until == T0 + hint


def test_goclaw_waits_out_a_millisecond_retry_hint_exactly(
        db: str, fake: FakeProvider) -> None:
    overloaded = {"error": {"message": "The engine is currently overloaded.",
                            "type": "server_error", "param": None, "code": "overloaded"}}
    turn = Turn(db, fake, "openai", "goclaw",
                _answer("503 Service Unavailable", overloaded, {"retry-after-ms": "12500"}))
    first, retry = turn.timeline[:2]
    assert first.fact is not None and first.fact.retry_after_s == 12.5
    # Longer than the nominal 2 s and within goclaw's 20 s cap: waited exactly.
    assert retry.route_id == "primary" and retry.state is AttemptState.SUCCEEDED
    assert retry.created_at - first.created_at == pytest.approx(12.5)


# -- provider details ---------------------------------------------------------------------------

_GEMINI_BAD_KEY = {"error": {
    "code": 400, "message": "API key not valid. Please pass a valid API key.",
    "status": "INVALID_ARGUMENT",
    "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID",
                 "domain": "googleapis.com",
                 "metadata": {"service": "generativelanguage.googleapis.com"}}]}}

_ANTHROPIC_SPEND_LIMIT = {"type": "error", "error": {
    "type": "rate_limit_error", "message": "You have reached your specified API usage limits.",
    "details": {"error_code": "enforced_spend_limit_reached"}}}


@pytest.mark.parametrize("policy", PRESETS)
def test_a_gemini_bad_key_is_an_auth_failure_under_every_preset(
        db: str, fake: FakeProvider, policy: str) -> None:
    turn = Turn(db, fake, "gemini", policy, _answer("400 Bad Request", _GEMINI_BAD_KEY))
    assert turn.fact.category is Category.AUTH
    assert turn.fact.provider_code == "API_KEY_INVALID"
    if policy == "failure-domain":
        assert turn.served is None  # auth is the Run's to fix, not another route's
    else:
        # goclaw and fased move on for auth, and cool the dead key instead of sending to it
        # again on every Run.
        assert turn.served == "backup"
        assert turn.fact.cooldown is CooldownEffect.COOLDOWN
        assert turn.key_health(policy).cooldown_until is not None


@pytest.mark.parametrize("policy", PRESETS)
def test_an_anthropic_spend_limit_is_a_billing_failure_under_every_preset(
        db: str, fake: FakeProvider, policy: str) -> None:
    turn = Turn(db, fake, "anthropic", policy,
                _answer("429 Too Many Requests", _ANTHROPIC_SPEND_LIMIT))
    assert turn.fact.category is Category.BILLING
    assert turn.fact.provider_code == "enforced_spend_limit_reached"
    # Not a rate limit: the group is not closed for the fleet to hit again when it reopens.
    assert "ga" not in turn.groups or turn.groups["ga"].until is None
    if policy == "failure-domain":
        assert turn.served is None
    else:
        assert turn.served == "backup"
    if policy == "fased":
        assert turn.fact.cooldown is CooldownEffect.DISABLE
        assert turn.key_health(policy).disabled_reason == "billing"


_GEMINI_BILLING_DISABLED = {"error": {
    "code": 403, "status": "PERMISSION_DENIED",
    "message": "This API method requires billing to be enabled. Please enable billing on "
               "project #123 by visiting the Google Cloud console, then retry.",
    "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "BILLING_DISABLED",
                 "domain": "googleapis.com",
                 "metadata": {"service": "generativelanguage.googleapis.com",
                              "consumer": "projects/123"}}]}}


@pytest.mark.parametrize("policy", PRESETS)
def test_a_gemini_billing_disabled_is_a_billing_failure_under_every_preset(
        db: str, fake: FakeProvider, policy: str) -> None:
    """A 403 PERMISSION_DENIED whose ErrorInfo reason is BILLING_DISABLED is the project's
    billing, not its key: ``billing``, as Anthropic's spend limit and OpenAI's
    ``insufficient_quota`` are, so fased disables the key for the billing backoff instead of
    cooling it for a minute and sending to it again."""
    turn = Turn(db, fake, "gemini", policy, _answer("403 Forbidden", _GEMINI_BILLING_DISABLED))
    assert turn.fact.category is Category.BILLING
    assert turn.fact.provider_code == "BILLING_DISABLED"
    if policy == "failure-domain":
        assert turn.served is None  # the Run's billing is the operator's to fix
    else:
        assert turn.served == "backup"
    if policy == "fased":
        assert turn.fact.cooldown is CooldownEffect.DISABLE
        assert turn.key_health(policy).disabled_reason == "billing"


# -- an OpenAI server_error in a 200 answer -------------------------------------------------------

_SERVER_ERROR = {"code": "server_error", "message": "The model failed to generate a response."}
_FAILED = {"id": "resp_1", "object": "response", "status": "failed", "model": "m", "output": [],
           "error": _SERVER_ERROR}
# name: the provider's answer, streamed; all of them Responses answers
IN_A_200 = {
    "response_failed_body": (_answer("200 OK", _FAILED), False),
    "response_failed_event": (sse(
        ("response.created", {"type": "response.created",
                              "response": {**_FAILED, "status": "in_progress", "error": None}}),
        ("response.failed", {"type": "response.failed", "response": _FAILED})), True),
    "error_event": (sse(("error", {"type": "error", "param": None, **_SERVER_ERROR})), True),
}


@pytest.mark.parametrize("policy", PRESETS)
@pytest.mark.parametrize("case", list(IN_A_200))
def test_an_openai_server_error_in_a_200_answer_is_decided_as_the_500_is(
        db: str, fake: FakeProvider, policy: str, case: str) -> None:
    raw, stream = IN_A_200[case]
    as_500 = Turn(db, fake, "openai_responses", policy,
                  _answer("500 Internal Server Error", {"error": _SERVER_ERROR}))
    Path(db).unlink()
    in_200 = Turn(db, fake, "openai_responses", policy, raw, stream=stream)
    assert in_200.fact.status == 200 and in_200.fact.provider_code == "server_error"
    # goclaw's seed has eight reasons and no server error: a 500 is `unknown` there too.
    expected = Category.UNKNOWN if policy == "goclaw" else Category.SERVER_ERROR
    assert as_500.fact.category is expected
    assert in_200.fact.category is expected
    if case == "response_failed_body" or case == "response_failed_event":
        # The whole failed response, after headers: where the 500 moves on, so does it.
        assert in_200.fact.moves_on is as_500.fact.moves_on
        assert in_200.served == as_500.served
    if policy == "failure-domain":
        assert as_500.served == "backup"


@pytest.mark.parametrize("policy", PRESETS)
def test_the_server_error_type_stays_unmapped_so_an_overloaded_503_stays_an_overload(
        db: str, fake: FakeProvider, policy: str) -> None:
    """OpenAI's 503 overload says ``type: server_error`` with no code: a mapped type would
    outrank the status. So a chat error object naming only that type, in a 200, is `unknown`
    (goclaw's keywords would still read "overloaded" in its message)."""
    overloaded = {"error": {"message": "That model is currently overloaded with other requests.",
                            "type": "server_error", "param": None, "code": None}}
    as_503 = Turn(db, fake, "openai", policy, _answer("503 Service Unavailable", overloaded),
                  _answer("503 Service Unavailable", overloaded),
                  _answer("503 Service Unavailable", overloaded))
    assert as_503.fact.category is Category.OVERLOADED
    assert as_503.served == "backup"
    Path(db).unlink()
    upstream = {"error": {"message": "The server had an error while processing your request.",
                          "type": "server_error", "param": None, "code": None}}
    in_200 = Turn(db, fake, "openai", policy, _answer("200 OK", upstream))
    assert in_200.fact.category is Category.UNKNOWN


# -- a replay reads the detail codes as the live path does -------------------------------------

_DETAILS = {
    "anthropic_spend_limit": ("anthropic", 429, _ANTHROPIC_SPEND_LIMIT),
    "gemini_bad_key": ("gemini", 400, _GEMINI_BAD_KEY),
    "gemini_billing_disabled": ("gemini", 403, _GEMINI_BILLING_DISABLED),
}


def _without_detail_tables(policy: Policy) -> Policy:
    """``policy`` whose detail tables are empty: its codes are read by the coarse fields only."""
    data = policy.model_dump(mode="json")
    data["name"] = f"{policy.name}-coarse"
    data["classification"]["codes"].update(anthropic_error_code={}, gemini_reason={})
    return Policy.model_validate(data)


def _verdict(fact: FailureFact) -> tuple[Any, ...]:
    return (fact.category, fact.scope, fact.resubmit, fact.moves_on, fact.cooldown)


@pytest.mark.parametrize("policy", PRESETS)
@pytest.mark.parametrize("case", list(_DETAILS))
def test_replay_reads_a_recorded_detail_code_as_the_live_classifier_does(
        policy: str, case: str) -> None:
    """Replay decides a recorded failure again under another policy from the fact alone. The
    fact keeps the detail code its category came from (a spend limit's ``error_code``, a Gemini
    ``ErrorInfo`` reason): under a policy whose detail tables differ, the replayed fact is the
    one the live classifier gives the same answer under that policy, and under its own policy
    the one it recorded."""
    protocol, status, body = _DETAILS[case]
    obs = Observation(status=status, body=json.dumps(body), protocol=WireProtocol(protocol))
    source = preset(policy)
    recorded = classify(obs, source)
    for target in (source, _without_detail_tables(source)):
        assert _verdict(refact(recorded, source, target)) == _verdict(classify(obs, target))


def test_a_replay_under_a_policy_without_the_spend_limit_detail_moves_on_as_it_would_live(
        db: str, fake: FakeProvider, tmp_path: Path) -> None:
    """An Anthropic spend limit recorded under failure-domain is ``billing`` and stops. A copy
    of the preset that does not map the detail reads it as the ``rate_limit_error`` it came
    with: a provider 429 that moves on to another group. ``ledger replay`` under that copy says
    so, as that policy would have decided live, instead of keeping the recorded ``billing``."""
    turn = Turn(db, fake, "anthropic", "failure-domain",
                _answer("429 Too Many Requests", _ANTHROPIC_SPEND_LIMIT))
    assert turn.fact.category is Category.BILLING and turn.served is None
    coarse = _without_detail_tables(preset("failure-domain"))
    live = classify(Observation(status=429, body=json.dumps(_ANTHROPIC_SPEND_LIMIT),
                                protocol=WireProtocol.ANTHROPIC), coarse)
    assert (live.category, live.moves_on) == (Category.RATE_LIMIT, True)
    with Ledger.open(db, clock=ManualClock(T0 + 60)) as led:
        report = Audit(led).replay(coarse, run=RUN)
        same = Audit(led).replay("failure-domain", run=RUN)
    assert same.differing == 0
    [moved] = [f for f in report.findings if f.key == "moved_on"]
    assert (moved.subject, moved.count) == ("rate_limit (HTTP 429)", 1)


# -- a 408 --------------------------------------------------------------------------------------

_TIMED_OUT = {"error": {"code": 408, "message": "Your request timed out"}}


@pytest.mark.parametrize("policy", PRESETS)
@pytest.mark.parametrize("body", [_TIMED_OUT, {}], ids=["timed_out", "bare"])
def test_a_408_is_a_timeout_decided_as_each_preset_decides_an_answered_timeout(
        db: str, fake: FakeProvider, policy: str, body: dict[str, Any]) -> None:
    """docs/presets: a 408 is ``timeout`` by the shared status rule. failure-domain moves on
    after no timeout the provider answered (its seed's table does not list 408): the turn
    stops. fased moves on. goclaw maps no 408 status: its keywords decide ("timed out" is a
    timeout and moves on; no keyword is ``unknown`` and stops)."""
    turn = Turn(db, fake, "openai", policy, _answer("408 Request Timeout", body))
    expected = {
        "failure-domain": (Category.TIMEOUT, None),
        "fased": (Category.TIMEOUT, "backup"),
        "goclaw": ((Category.TIMEOUT, "backup") if body else (Category.UNKNOWN, None)),
    }[policy]
    assert (turn.fact.category, turn.served) == expected
    assert turn.fact.status == 408 and turn.fact.resubmit


def test_a_copy_of_failure_domain_that_maps_408_as_a_server_error_moves_on_after_it(
        db: str, fake: FakeProvider) -> None:
    """The documented opt-in: ``408: server_error`` in a copy's status table decides a 408 as a
    bare 504 is, moving on to the next route."""
    data = preset("failure-domain").model_dump(mode="json")
    data["name"] = "failure-domain-408"
    data["classification"]["status"]["408"] = "server_error"
    fact = classify(Observation(status=408, body=json.dumps(_TIMED_OUT)),
                    Policy.model_validate(data))
    as_504 = classify(Observation(status=504, body="Gateway Timeout"), preset("failure-domain"))
    assert _verdict(fact) == _verdict(as_504)
    assert (fact.category, fact.scope, fact.moves_on) == (
        Category.SERVER_ERROR, Scope.ROUTE, True)
