"""Classifier details the shared vectors do not pin down."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from ledger.decide.classify import classify, reclassify, refile
from ledger.decide.hints import parse_retry_after
from ledger.domain.facts import Category, CooldownEffect, Observation, Phase, Source
from ledger.errors import PolicyError
from ledger.policy.load import preset, validate_policy
from ledger.policy.model import FROZEN, Policy

GOCLAW = preset("goclaw")
FASED = preset("fased")
FD = preset("failure-domain")


def _obs(**kw: object) -> Observation:
    return Observation.model_validate(kw)


def test_generic_protocol_tries_every_shape() -> None:
    gemini = json.dumps({"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "x"}})
    anthropic = json.dumps({"type": "error", "error": {"type": "overloaded_error"}})
    assert classify(_obs(status=400, body=gemini), FD).category is Category.RATE_LIMIT
    assert classify(_obs(status=400, body=anthropic), FD).category is Category.OVERLOADED


def test_declared_protocol_reads_only_its_shape() -> None:
    anthropic = json.dumps({"type": "error", "error": {"type": "overloaded_error"}})
    fact = classify(_obs(status=400, body=anthropic, protocol="gemini"), FD)
    assert fact.category is Category.FORMAT  # the status decides; the anthropic field is unread


def test_structured_codes_are_case_insensitive_and_recorded() -> None:
    body = json.dumps({"error": {"code": "Insufficient_Quota", "message": "pay up"}})
    fact = classify(_obs(status=429, body=body, protocol="openai"), FD)
    assert fact.category is Category.BILLING
    assert fact.provider_code == "Insufficient_Quota"
    assert fact.message == "pay up"


def test_gemini_streaming_list_wrapper_and_overflow() -> None:
    err = {"status": "INVALID_ARGUMENT", "message": "input exceeds the maximum number of tokens"}
    body = json.dumps([{"error": err}])
    assert classify(_obs(status=400, body=body), FD).category is Category.CONTEXT_OVERFLOW


def test_anthropic_overflow_needs_the_message_prefix() -> None:
    def body(msg: str) -> str:
        return json.dumps({"error": {"type": "invalid_request_error", "message": msg}})

    long = _obs(status=400, body=body("prompt is too long: 300000 tokens"), protocol="anthropic")
    other = _obs(status=400, body=body("max_tokens: must be positive"), protocol="anthropic")
    assert classify(long, FD).category is Category.CONTEXT_OVERFLOW
    assert classify(other, FD).category is Category.FORMAT


def test_goclaw_text_rows_in_order() -> None:
    # "quota" (billing) is listed before "rate limit": first row wins.
    fact = classify(_obs(message="quota exceeded; rate limit reached"), GOCLAW)
    assert fact.category is Category.BILLING
    assert classify(_obs(message="something odd"), GOCLAW).category is Category.UNKNOWN
    # A 500 is not mapped by status under goclaw; its text decides.
    assert (
        classify(_obs(status=500, body="upstream timed out"), GOCLAW).category is Category.TIMEOUT
    )


def test_failure_domain_never_reads_text() -> None:
    assert classify(_obs(message="rate limit, overloaded"), FD).category is Category.UNKNOWN
    assert classify(_obs(status=418, body="overloaded"), FD).category is Category.FORMAT


def test_local_refusal_never_cools() -> None:
    fact = classify(_obs(status=503, source="local"), GOCLAW)
    assert fact.source is Source.LOCAL
    assert fact.cooldown is CooldownEffect.NONE


def test_exempt_provider_is_case_insensitive() -> None:
    fact = classify(_obs(status=402, provider="OpenRouter"), FASED)
    assert fact.cooldown is CooldownEffect.NONE
    assert (
        classify(_obs(status=402, provider="anthropic"), FASED).cooldown is CooldownEffect.DISABLE
    )


def test_phase_defaults_and_resubmission() -> None:
    stall = classify(_obs(transport="stream_stall"), FD)
    assert (stall.phase, stall.category, stall.resubmit) == (
        Phase.MID_STREAM,
        Category.TIMEOUT,
        False,
    )
    assert classify(_obs(transport="stream_stall"), GOCLAW).resubmit
    output = classify(_obs(status=503, effective_output=True), GOCLAW)
    assert output.moves_on and output.resubmit  # goclaw discards the output and moves on
    assert not classify(_obs(status=503, effective_output=True), FD).moves_on


def test_caller_facts_come_first() -> None:
    fact = classify(_obs(status=429, cancelled=True, over_token_budget=True), GOCLAW)
    assert fact.category is Category.CANCELLED
    assert classify(_obs(transport="dns_failure", over_token_budget=True), FD).category is (
        Category.BUDGET_EXCEEDED
    )


def test_binary_and_invalid_utf8_bodies() -> None:
    fact = classify(_obs(status=503, body=b"\xff\xfe\x00overloaded\x80"), GOCLAW)
    assert fact.category is Category.OVERLOADED
    assert classify(_obs(body=b"\xc3\x28 timed out"), GOCLAW).category is Category.TIMEOUT


def test_odd_json_shapes() -> None:
    for body in [
        "[]",
        "[1, 2]",
        "3",
        "null",
        '{"error": null}',
        '{"error": [1]}',
        '{"error": {"code": 5, "type": null, "status": {"x": 1}}}',
        "[[[[[[" * 5000,
    ]:
        fact = classify(_obs(status=503, body=body, protocol="generic"), FD)
        assert fact.category is Category.OVERLOADED


def test_secrets_are_redacted_from_evidence() -> None:
    body = json.dumps({"error": {"message": "Incorrect API key provided: sk-abcdef1234567890XYZ"}})
    fact = classify(_obs(status=401, body=body, protocol="openai"), FD)
    assert fact.message is not None
    assert "sk-abcdef" not in fact.message and "[REDACTED]" in fact.message


def test_message_is_capped() -> None:
    fact = classify(_obs(status=500, body="x " * 100_000), FD)
    assert fact.message is not None
    assert len(fact.message) <= FD.classification.message_limit_chars


def test_retry_after_http_date_against_now_or_the_date_header() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(datetime(2026, 1, 1, 12, 0, 15, tzinfo=UTC), usegmt=True)
    obs = _obs(
        status=503, headers={"retry-after": later, "Date": format_datetime(now, usegmt=True)}
    )
    assert classify(obs, GOCLAW, now=now.timestamp()).retry_after_s == 15
    assert classify(obs, GOCLAW).retry_after_s == 15  # measured from the Date header
    bare = _obs(status=503, headers={"Retry-After": later})
    assert classify(bare, GOCLAW).retry_after_s is None  # no reference: no guess
    assert classify(bare, GOCLAW, now=now.timestamp() + 60).retry_after_s == 0


def test_an_http_date_retry_after_is_measured_from_the_responses_date_whatever_our_clock(
) -> None:
    # Retry-After and Date come from the provider's clock; our clock's skew must not change the
    # wait (30 s behind would hide the hint's last 15 s, 30 s ahead would make it 45 s).
    date = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = format_datetime(datetime(2026, 1, 1, 12, 0, 15, tzinfo=UTC), usegmt=True)
    obs = _obs(status=503,
               headers={"Retry-After": later, "Date": format_datetime(date, usegmt=True)})
    for skew in (-30.0, 0.0, 30.0):
        assert classify(obs, GOCLAW, now=date.timestamp() + skew).retry_after_s == 15
    # A Date that cannot be read is no reference: our clock is.
    garbled = _obs(status=503, headers={"Retry-After": later, "Date": "yesterday"})
    assert classify(garbled, GOCLAW, now=date.timestamp() + 5).retry_after_s == 10


def test_retry_after_values() -> None:
    assert parse_retry_after("  7 ") == 7
    assert parse_retry_after("1.5") == 1.5
    for junk in ["-3", "soon", "", "9" * 400, "1e5", "Mon, 99 Foo 2026 99:99:99 GMT", None]:
        assert parse_retry_after(junk, now=0.0) is None


def test_absurd_retry_after_is_clamped() -> None:
    fact = classify(_obs(status=503, headers={"Retry-After": "9" * 30}), GOCLAW)
    assert fact.retry_after_s == GOCLAW.classification.retry_after_limit_s


def test_gemini_retry_info_forms() -> None:
    def body(delay: object) -> str:
        detail = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}
        return json.dumps({"error": {"status": "UNAVAILABLE", "details": [detail]}})

    assert (
        classify(_obs(status=503, body=body("1.5s"), protocol="gemini"), GOCLAW).retry_after_s
        == 1.5
    )
    obj = _obs(status=503, body=body({"seconds": 3, "nanos": 500_000_000}), protocol="gemini")
    assert classify(obj, GOCLAW).retry_after_s == 3.5
    assert (
        classify(_obs(status=503, body=body("soon"), protocol="gemini"), GOCLAW).retry_after_s
        is None
    )
    # A declared OpenAI body does not carry Gemini details.
    assert (
        classify(_obs(status=503, body=body("8s"), protocol="openai"), GOCLAW).retry_after_s is None
    )


def test_lone_surrogates_never_reach_the_fact() -> None:
    body = '{"error": {"code": "bad\\ud800", "message": "oops \\udfff"}}'
    fact = classify(_obs(status=500, body=body, protocol="openai"), FD)
    assert fact.provider_code is not None and fact.message is not None
    fact.provider_code.encode("utf-8")
    fact.message.encode("utf-8")


_GEMINI_BAD_KEY = json.dumps({"error": {
    "code": 400, "status": "INVALID_ARGUMENT", "message": "API key not valid.",
    "details": [{"@type": "type.googleapis.com/google.rpc.LocalizedMessage", "locale": "en-US"},
                {"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                 "reason": "API_KEY_INVALID", "domain": "googleapis.com"}]}})


def test_a_detail_the_tables_do_not_know_leaves_the_coarse_field_deciding_and_named() -> None:
    body = json.dumps({"error": {
        "code": 429, "status": "RESOURCE_EXHAUSTED", "message": "quota",
        "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                     "reason": "RATE_LIMIT_EXCEEDED"}]}})
    fact = classify(_obs(status=429, body=body, protocol="gemini"), FD)
    assert fact.category is Category.RATE_LIMIT
    assert fact.provider_code == "RESOURCE_EXHAUSTED"
    spend = json.dumps({"type": "error", "error": {
        "type": "overloaded_error", "message": "x", "details": {"error_code": "something_new"}}})
    fact = classify(_obs(status=529, body=spend, protocol="anthropic"), FD)
    assert (fact.category, fact.provider_code) == (Category.OVERLOADED, "overloaded_error")


def test_the_generic_protocol_reads_the_details_too() -> None:
    fact = classify(_obs(status=400, body=_GEMINI_BAD_KEY), FD)
    assert (fact.category, fact.provider_code) == (Category.AUTH, "API_KEY_INVALID")


def test_a_policy_frozen_before_the_detail_tables_decides_as_it_did() -> None:
    """Invariant 5: a Run admitted before the detail tables existed reads back without them."""
    older = FD.model_dump(mode="json")
    del older["classification"]["codes"]["gemini_reason"]
    del older["classification"]["codes"]["anthropic_error_code"]
    frozen = Policy.model_validate(older, context=FROZEN)
    assert frozen.classification.codes.gemini_reason == {}
    fact = classify(_obs(status=400, body=_GEMINI_BAD_KEY, protocol="gemini"), frozen)
    assert (fact.category, fact.provider_code) == (Category.FORMAT, "INVALID_ARGUMENT")


# -- policy settings behind the presets' readings of seeds 001 and 002 ----------------------------

_RATE_LIMIT_SAYING_OVERLOADED = Observation(
    status=429, protocol="anthropic",
    body=json.dumps({"type": "error",
                     "error": {"type": "rate_limit_error", "message": "Model is overloaded"}}))


def _goclaw_with(**classification: object) -> Policy:
    data = preset("goclaw").model_dump(mode="json")
    data["classification"].update(classification)
    return validate_policy(data)


def test_a_status_text_rule_outranks_a_structured_code_only_when_the_policy_says_so() -> None:
    """``status_text_first`` moves the status-text rules ahead of ``codes``; without it the
    structured code decides first, as the fixed precedence says."""
    assert classify(_RATE_LIMIT_SAYING_OVERLOADED, _goclaw_with(status_text_first=True)).category \
        is Category.OVERLOADED
    fact = classify(_RATE_LIMIT_SAYING_OVERLOADED, _goclaw_with(status_text_first=False))
    assert fact.category is Category.RATE_LIMIT and fact.provider_code == "rate_limit_error"


def test_a_status_text_rule_first_still_yields_to_caller_facts_transports_and_overflow() -> None:
    policy = _goclaw_with(status_text_first=True)
    cancelled = _RATE_LIMIT_SAYING_OVERLOADED.model_copy(update={"cancelled": True})
    assert classify(cancelled, policy).category is Category.CANCELLED
    overflow = Observation(status=429, protocol="openai", body=json.dumps(
        {"error": {"code": "context_length_exceeded", "message": "overloaded context"}}))
    assert classify(overflow, policy).category is Category.CONTEXT_OVERFLOW


def test_a_recorded_overload_reads_back_as_an_overload_under_status_text_first() -> None:
    policy = _goclaw_with(status_text_first=True)
    fact = classify(_RATE_LIMIT_SAYING_OVERLOADED, policy)
    assert reclassify(fact, policy).category is Category.OVERLOADED


def _fased_with_moves(moves_on: list[dict[str, object]]) -> Policy:
    data = preset("fased").model_dump(mode="json")
    data["moves_on"] = moves_on
    return validate_policy(data)


def test_a_move_rule_with_statuses_matches_only_failures_with_those_statuses() -> None:
    """A 504 is ``server_error`` like a 500; a rule naming ``statuses: [504]`` moves only it."""
    policy = _fased_with_moves([{"categories": ["server_error"], "statuses": [504]}])
    assert classify(Observation(status=504), policy).moves_on
    for other in (Observation(status=500), Observation(status=502),
                  Observation(status=200, protocol="openai", body=json.dumps(
                      {"error": {"code": "server_error", "message": "failed"}}))):
        fact = classify(other, policy)
        assert fact.category is Category.SERVER_ERROR and not fact.moves_on


def test_a_move_rule_with_statuses_is_applied_when_a_fact_is_refiled() -> None:
    """A replay refiles a recorded fact under a policy: the recorded status decides the rule."""
    policy = _fased_with_moves([{"categories": ["server_error"], "statuses": [504]}])
    # Failover on names some rule (refused otherwise): one no server error matches.
    other = _fased_with_moves([{"categories": ["rate_limit"]}])
    stopped = classify(Observation(status=504), other)
    assert not stopped.moves_on
    assert refile(stopped, policy).moves_on
    assert not refile(classify(Observation(status=502), other), policy).moves_on


def test_an_empty_status_list_in_a_move_rule_is_refused_naming_it() -> None:
    with pytest.raises(PolicyError) as info:
        _fased_with_moves([{"categories": ["server_error"], "statuses": []}])
    [(field, problem, fix)] = info.value.errors
    assert field == "moves_on[0].statuses" and "matches no failure" in problem
    assert "leave `statuses` out" in fix
