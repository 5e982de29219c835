"""The built-in adapters never hand a caller usage or cost that ``settle_attempt`` refuses.

A provider whose usage claims 2^63 tokens (a hostile or buggy counter) still delivered an
answer: the adapter reports it with ``usage`` and ``cost`` ``None`` (the whole hold is then
posted) and keeps the report as ``rejected_usage`` evidence. So a host driving the low-level
API (begin, adapter send, settle) records the answer, and the retry owner does too (with a
``usage_invalid`` event; see ``tests/run/test_stream_endings.py`` for a session turn). Real
HTTP over loopback through the fake provider, every protocol, streamed or not, both backends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger.adapters import HttpAdapter, StaticSecretProvider, SyncAdapter, Usage
from ledger.adapters.contract import codec_for
from ledger.api.facade import Ledger
from ledger.domain.bounds import MAX_TOKENS
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState, DebitState
from ledger.domain.validation import tokens_in_range
from ledger.domain.values import Budget, Grant
from ledger.ops.reconcile import reconcile
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import PATIENT, PROFILE, PROTOCOLS, SECRET, make_route

ABSURD = (2**63, 7)
HOLD = Decimal("0.05")


def _envelope(stream: bool) -> Envelope:
    return Envelope(parts=[Part(content="Say hello.")], stream=stream, max_output_tokens=16)


@pytest.mark.anyio
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_with_out_of_range_usage_comes_back_without_figures(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    fake.enqueue(Behavior(usage=ABSURD))
    res = await adapter.send(make_route(fake.endpoint(protocol), protocol), _envelope(stream),
                             profile_id=PROFILE)
    assert res.ok and res.text == Behavior().text
    assert (res.usage, res.cost) == (None, None)
    assert res.rejected_usage is not None and res.rejected_usage.prompt_tokens == 2**63


@pytest.mark.anyio
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_usage_at_the_bound_is_kept(adapter: HttpAdapter, fake: FakeProvider,
                                          protocol: str) -> None:
    fake.enqueue(Behavior(usage=(MAX_TOKENS, 7)))
    res = await adapter.send(make_route(fake.endpoint(protocol), protocol), _envelope(False),
                             profile_id=PROFILE)
    # The Responses API always says its cached and reasoning parts (0 here); the others do not.
    details = (0, 0) if protocol == "openai_responses" else (None, None)
    assert res.ok and res.usage == Usage(MAX_TOKENS, 7, *details) and res.rejected_usage is None
    assert res.cost == Decimal(3) * MAX_TOKENS / 10**6 + Decimal(15) * 7 / 10**6


@pytest.mark.anyio
async def test_a_failed_stream_never_reports_out_of_range_usage(adapter: HttpAdapter,
                                                               fake: FakeProvider) -> None:
    # Anthropic reports the prompt's usage in message_start, before the cut.
    fake.enqueue(Behavior(usage=ABSURD, fault=Fault.STREAM_CUT))
    res = await adapter.send(make_route(fake.endpoint("anthropic"), "anthropic"),
                             _envelope(True), profile_id=PROFILE)
    assert not res.ok and (res.usage, res.cost) == (None, None)
    assert res.rejected_usage is not None and res.rejected_usage.prompt_tokens == 2**63


# -- the low-level API: a host that calls the provider itself -----------------------------------


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


@pytest.mark.parametrize("stream", [False, True])
def test_low_level_host_records_the_answer_with_the_whole_hold_posted(
        db_url: str, provider: FakeProvider, stream: bool) -> None:
    provider.clear()
    provider.enqueue(Behavior(usage=ABSURD))
    route = make_route(provider.endpoint("openai"), "openai")
    led = Ledger.open(db_url)
    led.admit_run("r", plan=[route], budget=Budget(max_calls=2, max_retries=1,
                                                   max_cost=Decimal("1")),
                  grant=Grant(recipients={"fake": ["user_input"]}))
    lease = led.acquire_lease("r", ttl_s=60)
    envelope = _envelope(stream)
    att = led.begin_attempt(lease, route=route.id, profile_id=PROFILE, reserve=HOLD,
                            envelope_hash=envelope.hash)
    with SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT) as ad:
        res = ad.send(route, envelope, profile_id=PROFILE)
    assert res.ok
    # What the documentation tells a host to do: report what the adapter returned.
    done = led.settle_attempt(
        lease, att.attempt_id, outcome="succeeded",
        prompt_tokens=res.usage.prompt_tokens if res.usage else None,
        completion_tokens=res.usage.completion_tokens if res.usage else None, cost=res.cost)
    assert done.state is AttemptState.SUCCEEDED and done.debit_state is DebitState.POSTED
    assert (done.prompt_tokens, done.cost) == (None, None)
    assert led.debit(done.debit_id).posted == HOLD
    run = led.get_run("r")
    assert (run.posted, run.reserved) == (HOLD, 0)
    books = reconcile(led)
    assert books.ok, books.violations
    led.close()


# -- usage that is no report, and counts that are not counts ------------------------------------

_TEXT = "hey"


def _reply_with_usage(protocol: str, usage: Any) -> Any:
    """A complete answer of ``protocol`` whose usage object is ``usage``, parsed."""
    bodies: dict[str, dict[str, Any]] = {
        "openai": {"model": "m1", "choices": [{"index": 0, "finish_reason": "stop",
                   "message": {"role": "assistant", "content": _TEXT}}], "usage": usage},
        "openai_responses": {"status": "completed", "model": "m1", "usage": usage, "output": [
            {"type": "message", "content": [{"type": "output_text", "text": _TEXT}]}]},
        "anthropic": {"type": "message", "model": "m1", "stop_reason": "end_turn",
                      "content": [{"type": "text", "text": _TEXT}], "usage": usage},
        "gemini": {"modelVersion": "m1", "usageMetadata": usage, "candidates": [
            {"finishReason": "STOP", "content": {"parts": [{"text": _TEXT}]}}]},
    }
    return codec_for(WireProtocol(protocol)).parse_reply(bodies[protocol])


# Per protocol: a usage object without its token counts (only a total, or nothing).
_NO_COUNTS = {
    "openai": [{}, {"total_tokens": 12}, {"prompt_tokens": 10}],
    "openai_responses": [{}, {"total_tokens": 12}, {"output_tokens": 2}],
    "anthropic": [{}, {"output_tokens": 2}],
    "gemini": [{}, {"totalTokenCount": 12}, {"candidatesTokenCount": 2}],
}


@pytest.mark.parametrize(("protocol", "usage"),
                         [(p, u) for p, us in _NO_COUNTS.items() for u in us])
def test_usage_without_its_token_counts_is_not_reported_never_a_zero(protocol: str,
                                                                    usage: Any) -> None:
    reply = _reply_with_usage(protocol, usage)
    assert reply.text == _TEXT and reply.usage is None


_COUNT_KEYS = {"openai": ("prompt_tokens", "completion_tokens"),
               "openai_responses": ("input_tokens", "output_tokens"),
               "anthropic": ("input_tokens", "output_tokens"),
               "gemini": ("promptTokenCount", "candidatesTokenCount")}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("bad", [2.0, "10", -1, True])
def test_a_count_that_is_not_a_count_keeps_the_answer_and_is_rejected_usage(
        protocol: str, bad: Any) -> None:
    prompt_key, completion_key = _COUNT_KEYS[protocol]
    reply = _reply_with_usage(protocol, {prompt_key: 10, completion_key: bad})
    assert reply.text == _TEXT
    assert reply.usage is not None and reply.usage.completion_tokens == bad
    assert not tokens_in_range(reply.usage.completion_tokens)  # what the billing check rejects


def test_gemini_usage_without_candidate_tokens_is_a_report_of_zero_output() -> None:
    # Gemini's JSON leaves out a count that is 0; a prompt always has some tokens.
    reply = _reply_with_usage("gemini", {"promptTokenCount": 5, "totalTokenCount": 5})
    assert reply.usage == Usage(5, 0)


def _raw_chat_answer(usage: str) -> Behavior:
    head = json.dumps({"model": "m1", "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "hey"}}]})
    body = head[:-1] + f', "usage": {usage}}}'  # the usage text verbatim, not re-encoded
    return Behavior(fault=Fault.RAW, raw=((
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode(),))


def _session_turn(db_url: str, provider: FakeProvider, usage: str) -> Ledger:
    provider.clear()
    provider.enqueue(_raw_chat_answer(usage))
    route = make_route(provider.endpoint("openai"), "openai")
    led = Ledger.open(db_url)
    with led.run("r", plan=[route], budget=Budget(max_calls=2, max_retries=1,
                                                  max_cost=Decimal("1")),
                 grant=Grant(recipients={"fake": ["user_input"]}), secrets=StaticSecretProvider(
                     {PROFILE: SECRET})) as run:
        assert run.turn(_envelope(False), reserve=HOLD).text == "hey"
    return led


def _served_at_the_whole_hold(led: Ledger) -> AttemptRecord:
    """The Run's one Attempt: served, no usage recorded, the whole hold posted."""
    [att] = led.timeline("r")
    assert (att.state, att.debit_state) == (AttemptState.SUCCEEDED, DebitState.POSTED)
    assert (att.prompt_tokens, att.completion_tokens, att.cost) == (None, None, None)
    assert led.get_run("r").posted == HOLD
    return att


@pytest.mark.parametrize("usage", ['{"prompt_tokens":10,"completion_tokens":2.0}',
                                   '{"prompt_tokens":"10","completion_tokens":2}'])
def test_a_served_answer_with_malformed_usage_posts_the_whole_hold_with_usage_invalid(
        db_url: str, provider: FakeProvider, usage: str) -> None:
    led = _session_turn(db_url, provider, usage)
    att = _served_at_the_whole_hold(led)
    [ev] = led.events("r", ["usage_invalid"])
    assert ev.attempt_id == att.attempt_id
    assert reconcile(led).ok
    led.close()


@pytest.mark.parametrize("usage", ['{}', '{"total_tokens":12}'])
def test_a_served_answer_whose_usage_has_no_counts_posts_the_whole_hold(
        db_url: str, provider: FakeProvider, usage: str) -> None:
    led = _session_turn(db_url, provider, usage)
    _served_at_the_whole_hold(led)
    led.close()
