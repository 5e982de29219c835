"""The built-in adapters never hand a caller usage or cost that ``settle_attempt`` refuses.

A provider whose usage claims 2^63 tokens (a hostile or buggy counter) still delivered an
answer: the adapter reports it with ``usage`` and ``cost`` ``None`` (the whole hold is then
posted) and keeps the report as ``rejected_usage`` evidence. So a host driving the low-level
API (begin, adapter send, settle) records the answer, and the retry owner does too (with a
``usage_invalid`` event; see ``tests/run/test_stream_endings.py`` for a session turn). Real
HTTP over loopback through the fake provider, every protocol, streamed or not, both backends.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

import pytest

from ledger.adapters import HttpAdapter, StaticSecretProvider, SyncAdapter, Usage
from ledger.api.facade import Ledger
from ledger.domain.bounds import MAX_TOKENS
from ledger.domain.envelope import Envelope, Part
from ledger.domain.records import AttemptState, DebitState
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
