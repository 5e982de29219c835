"""Every fault of the fake provider, per protocol, over real HTTP on loopback.

Each test asserts the exact observation an adapter reports: transport kind, phase, status,
effective output, and that a truncated answer never comes back as a success.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal

import pytest

from ledger.adapters import HttpAdapter, Reset, StreamEvent, TextDelta, ToolCallProposal
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.facts import Phase, Transport
from ledger.policy.model import StreamingPolicy
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import DRIVERS, FAST, PROFILE, PROTOCOLS, adapter_for, make_route

pytestmark = pytest.mark.anyio

FULL_TEXT = Behavior().text


def env(stream: bool, **kw: object) -> Envelope:
    return Envelope(
        parts=[Part(role="system", content="Be brief."), Part(content="Say hello.")],
        stream=stream,
        **kw,  # type: ignore[arg-type]
    )


async def send(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool, **kw: object
) -> tuple[object, list[StreamEvent]]:
    events: list[StreamEvent] = []
    result = await adapter.send(
        make_route(fake.endpoint(protocol), protocol),
        env(stream, **kw),
        profile_id=PROFILE,
        on_event=events.append,
    )
    return result, events


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_success_reports_text_usage_cost_and_model(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool
) -> None:
    result, events = await send(adapter, fake, protocol, stream)
    assert result.ok, result.observation  # type: ignore[attr-defined]
    r = result  # type: ignore[assignment]
    assert r.text == FULL_TEXT
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 7)
    assert r.cost == (Decimal(3) * 11 + Decimal(15) * 7) / Decimal(1_000_000)
    assert r.model_reported == "m1-fake-001"
    assert r.http_status == 200 and r.observation is None and r.effective_output
    assert r.finish_reason in ("stop", "end_turn", "STOP", "completed")
    assert r.request_id and r.request_id.startswith("req_fake_")
    if stream:
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == FULL_TEXT
        assert len([e for e in events if isinstance(e, TextDelta)]) > 1
    else:
        assert events == []
    (req,) = fake.requests
    assert req.protocol == protocol and req.stream is stream


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_tool_call_proposal(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool
) -> None:
    fake.enqueue(Behavior(tool_call=("search", {"query": "failover", "k": 3})))
    tools = [ToolSpec(name="search", parameters={"type": "object", "properties": {}})]
    result, events = await send(adapter, fake, protocol, stream, tools=tools)
    assert result.ok  # type: ignore[attr-defined]
    (call,) = result.tool_calls  # type: ignore[attr-defined]
    assert call.name == "search" and call.arguments == {"query": "failover", "k": 3}
    if stream:
        proposals = [e for e in events if isinstance(e, ToolCallProposal)]
        assert [p.call for p in proposals] == [call]


STATUS_FAULTS = [
    (Fault.RATE_LIMIT, 429),
    (Fault.RATE_LIMIT_RETRY_AFTER, 429),
    (Fault.SERVER_ERROR, 500),
    (Fault.UNAVAILABLE, 503),
    (Fault.OVERLOADED, 529),
    (Fault.UNAUTHORIZED, 401),
    (Fault.CONTEXT_LENGTH, 400),
    (Fault.CONTENT_POLICY, 400),
]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fault", "status"), STATUS_FAULTS)
async def test_http_error_status(
    adapter: HttpAdapter,
    fake: FakeProvider,
    protocol: str,
    stream: bool,
    fault: Fault,
    status: int,
) -> None:
    fake.enqueue(fault)
    result, events = await send(adapter, fake, protocol, stream)
    r = result
    assert not r.ok and r.text == "" and events == []  # type: ignore[attr-defined]
    obs = r.observation  # type: ignore[attr-defined]
    expected = 503 if (protocol == "gemini" and fault is Fault.OVERLOADED) else status
    assert obs.status == expected == r.http_status  # type: ignore[attr-defined]
    assert obs.transport is None and obs.phase is Phase.AFTER_HEADERS
    assert obs.protocol.value == protocol and obs.provider == "fake"
    assert not obs.effective_output
    body = json.loads(obs.body)
    assert "error" in body
    assert r.evidence == obs.body  # type: ignore[attr-defined]
    if fault is Fault.RATE_LIMIT_RETRY_AFTER:
        assert obs.header("Retry-After") == "7"
    if fault is Fault.RATE_LIMIT:
        assert obs.header("Retry-After") is None


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_bodies_have_each_protocols_real_shape(
    adapter: HttpAdapter, fake: FakeProvider, stream: bool
) -> None:
    seen = {}
    for protocol in PROTOCOLS:
        fake.enqueue(Fault.CONTEXT_LENGTH)
        result, _ = await send(adapter, fake, protocol, stream)
        seen[protocol] = json.loads(result.observation.body)  # type: ignore[attr-defined]
    assert seen["openai"]["error"]["code"] == "context_length_exceeded"
    assert seen["anthropic"]["error"]["type"] == "invalid_request_error"
    assert seen["anthropic"]["error"]["message"].startswith("prompt is too long")
    assert seen["gemini"]["error"]["status"] == "INVALID_ARGUMENT"
    assert "exceeds the maximum number of tokens" in seen["gemini"]["error"]["message"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_prefill_is_sent_and_a_rejection_is_reported(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    fake.enqueue(Fault.PREFILL_REJECTED)
    envelope = Envelope(
        parts=[Part(content="Name a colour."), Part(role="assistant", content="The colour is")]
    )
    result = await adapter.send(
        make_route(fake.endpoint(protocol), protocol), envelope, profile_id=PROFILE
    )
    assert not result.ok and result.observation is not None
    assert result.observation.status == 400 and result.observation.phase is Phase.AFTER_HEADERS
    sent = fake.requests[0].json
    if protocol == "gemini":
        assert sent["contents"][-1] == {"role": "model", "parts": [{"text": "The colour is"}]}
    elif protocol == "anthropic":
        assert sent["messages"][-1]["role"] == "assistant"
    elif protocol == "openai_responses":
        assert sent["input"][-1] == {"type": "message", "role": "assistant",
                                     "content": "The colour is"}
    else:
        assert sent["messages"][-1] == {"role": "assistant", "content": "The colour is"}


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_server_error_once_then_success(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    fake.set_default(Fault.SERVER_ERROR_ONCE)
    first, _ = await send(adapter, fake, protocol, False)
    second, _ = await send(adapter, fake, protocol, False)
    assert first.observation.status == 500  # type: ignore[attr-defined]
    assert second.ok  # type: ignore[attr-defined]
    assert [r.fault for r in fake.requests] == [Fault.SERVER_ERROR_ONCE, Fault.OK]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_persistent_503(adapter: HttpAdapter, fake: FakeProvider, protocol: str) -> None:
    fake.set_default(Fault.UNAVAILABLE)
    for _ in range(3):
        result, _ = await send(adapter, fake, protocol, True)
        assert result.observation.status == 503  # type: ignore[attr-defined]
    assert len(fake.requests) == 3  # one request per call: nothing retried underneath


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fault", "transport"),
    [
        (Fault.RESET_BEFORE_HEADERS, Transport.CONNECTION_RESET),
        (Fault.CLOSE_BEFORE_HEADERS, Transport.CONNECTION_RESET),
        (Fault.GARBAGE, Transport.PROTOCOL_ERROR),
    ],
)
async def test_no_response_bytes_is_after_send(
    adapter: HttpAdapter,
    fake: FakeProvider,
    protocol: str,
    stream: bool,
    fault: Fault,
    transport: Transport,
) -> None:
    fake.enqueue(fault)
    result, events = await send(adapter, fake, protocol, stream)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok and events == []  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase, obs.status) == (transport, Phase.AFTER_SEND, None)
    assert not obs.effective_output
    assert len(fake.requests) == 1  # the request was really received, and only once


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_no_response_is_bounded_nonstreaming(
    fast_adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    fake.enqueue(Fault.NO_RESPONSE)
    t0 = time.monotonic()
    result, _ = await send(fast_adapter, fake, protocol, False)
    elapsed = time.monotonic() - t0
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.READ_TIMEOUT, Phase.AFTER_SEND)
    assert FAST.read_timeout_s * 0.9 <= elapsed < FAST.read_timeout_s + 3.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_no_response_streaming_is_a_first_token_timeout_after_send(
    fast_adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    # A first call opens the keep-alive connection: the 0.3 s first-token limit then measures
    # only the wait for a reply, not how long a busy machine takes to connect (which would be
    # a truthful before_send).
    warm, _ = await send(fast_adapter, fake, protocol, True)
    assert warm.ok  # type: ignore[attr-defined]
    fake.enqueue(Fault.NO_RESPONSE)
    t0 = time.monotonic()
    result, _ = await send(fast_adapter, fake, protocol, True)
    elapsed = time.monotonic() - t0
    obs = result.observation  # type: ignore[attr-defined]
    assert fake.connections == 1  # the reply was awaited on the warm connection
    assert (obs.transport, obs.phase) == (Transport.FIRST_TOKEN_TIMEOUT, Phase.AFTER_SEND)
    assert FAST.first_token_timeout_s * 0.9 <= elapsed < FAST.first_token_timeout_s + 3.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_slow_first_token_fails_over_before_output(
    fast_adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    fake.enqueue(Behavior(fault=Fault.SLOW_FIRST_TOKEN, delay_s=5.0))
    t0 = time.monotonic()
    result, events = await send(fast_adapter, fake, protocol, True)
    elapsed = time.monotonic() - t0
    obs = result.observation  # type: ignore[attr-defined]
    # Headers came at once, content did not: after_headers, and nothing was shown.
    assert (obs.transport, obs.phase, obs.status) == (
        Transport.FIRST_TOKEN_TIMEOUT,
        Phase.AFTER_HEADERS,
        200,
    )
    assert not obs.effective_output and events == []
    assert elapsed < FAST.first_token_timeout_s + 3.0


async def test_slow_first_token_within_the_limit_succeeds(fake: FakeProvider) -> None:
    from ledger.adapters import StaticSecretProvider

    limits = FAST.model_copy(update={"first_token_timeout_s": 2.0, "idle_timeout_s": 0.1})
    async with HttpAdapter(secrets=StaticSecretProvider({PROFILE: "k" * 20}), limits=limits) as a:
        fake.enqueue(Behavior(fault=Fault.SLOW_FIRST_TOKEN, delay_s=0.3))
        # The silent wait before the first token (0.3 s) is longer than the idle limit
        # (0.1 s): idle applies only once content flows.
        result, _ = await send(a, fake, "openai", True)
    assert result.ok and result.text == FULL_TEXT  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("fault", "transport"),
    [
        (Fault.STREAM_CUT, Transport.STREAM_CUT),
        (Fault.STREAM_RESET, Transport.STREAM_CUT),
        (Fault.STREAM_EOF, Transport.STREAM_CUT),
        (Fault.STALL, Transport.STREAM_STALL),
        (Fault.MALFORMED_EVENT, Transport.MALFORMED_EVENT),
    ],
)
async def test_mid_stream_failures_carry_effective_output_and_reset(
    adapter: HttpAdapter, fast_adapter: HttpAdapter, fake: FakeProvider, protocol: str,
    fault: Fault, transport: Transport
) -> None:
    if fault is Fault.STALL:  # the idle limit is what this case exercises
        adapter = fast_adapter
    fake.enqueue(fault)
    t0 = time.monotonic()
    result, events = await send(adapter, fake, protocol, True)
    elapsed = time.monotonic() - t0
    r = result
    assert not r.ok and r.text == "" and r.tool_calls == ()  # type: ignore[attr-defined]
    obs = r.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase, obs.status) == (transport, Phase.MID_STREAM, 200)
    assert obs.effective_output and r.effective_output  # type: ignore[attr-defined]
    shown = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert shown and shown != FULL_TEXT and FULL_TEXT.startswith(shown)
    assert r.partial_text == shown  # type: ignore[attr-defined]
    assert isinstance(events[-1], Reset) and events[-1].reason == transport.value
    assert elapsed < 5.0  # detected as it happened, not by a (patient) time limit
    if fault is Fault.STALL:
        assert elapsed >= FAST.idle_timeout_s * 0.9


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_in_stream_error_event_is_a_provider_failure(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    fake.enqueue(Fault.ERROR_EVENT)
    result, events = await send(adapter, fake, protocol, True)
    obs = result.observation  # type: ignore[attr-defined]
    # Responses' response.failed holds the whole response with its final status: the same
    # verdict as the body, observed so; every other error event breaks the stream off.
    phase = Phase.AFTER_HEADERS if protocol == "openai_responses" else Phase.MID_STREAM
    assert obs.transport is None and obs.phase is phase and obs.effective_output
    body = json.loads(obs.body)
    if protocol == "anthropic":
        assert body["error"]["type"] == "overloaded_error"
    elif protocol == "gemini":
        assert body["error"]["status"] == "UNAVAILABLE"
    elif protocol == "openai_responses":  # response.failed: its response's error object
        assert body["error"]["code"] == "server_error" and body["status"] == "failed"
    else:
        assert body["error"]["type"] == "server_error"
    assert isinstance(events[-1], Reset) and events[-1].reason == "provider_error"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_in_stream_error_event_before_any_content_is_a_verdict(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    """An error event before any answer began is the provider refusing the request, as the
    error status it stands for: phase ``after_headers``, never ``mid_stream`` (whose
    execution is unknown), with no output and no Reset to tell anyone."""
    fake.enqueue(Behavior(fault=Fault.ERROR_EVENT, content_before_fault=0))
    result, events = await send(adapter, fake, protocol, True)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase, obs.status) == (None, Phase.AFTER_HEADERS, 200)
    assert obs.accepted and not obs.effective_output
    assert result.partial_text == "" and events == []  # type: ignore[attr-defined]


async def test_anthropic_error_event_after_thinking_only_is_a_verdict(
    adapter: HttpAdapter, fake: FakeProvider
) -> None:
    """Reasoning is not the answer: an overloaded_error after a thinking block (the fake
    streams it before the text), before any text or tool_use, is still the verdict a 529
    would be."""
    fake.enqueue(Behavior(fault=Fault.ERROR_EVENT, content_before_fault=0, reasoning="Hmm."))
    result, events = await send(adapter, fake, "anthropic", True)
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.phase, json.loads(obs.body)["error"]["type"]) == (
        Phase.AFTER_HEADERS, "overloaded_error")
    assert not obs.effective_output and events == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_missing_terminator_after_completion_signal_is_success(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    fake.enqueue(Fault.MISSING_DONE)
    t0 = time.monotonic()
    result, _ = await send(adapter, fake, protocol, True)
    assert result.ok and result.text == FULL_TEXT  # type: ignore[attr-defined]
    # Completes at the clean end of the body, not after waiting out a (patient) idle limit.
    assert time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("fault", "transport", "phase"),
    [
        (Fault.STREAM_CUT, Transport.STREAM_CUT, Phase.MID_STREAM),
        (Fault.STREAM_RESET, Transport.STREAM_CUT, Phase.MID_STREAM),
        (Fault.STALL, Transport.STREAM_STALL, Phase.MID_STREAM),
        (Fault.STREAM_EOF, Transport.MALFORMED_EVENT, Phase.AFTER_HEADERS),
        (Fault.MALFORMED_EVENT, Transport.MALFORMED_EVENT, Phase.AFTER_HEADERS),
    ],
)
async def test_truncated_whole_body_is_never_a_success(
    adapter: HttpAdapter, fast_adapter: HttpAdapter,
    fake: FakeProvider,
    protocol: str,
    fault: Fault,
    transport: Transport,
    phase: Phase,
) -> None:
    if fault is Fault.STALL:  # the idle limit is what this case exercises
        adapter = fast_adapter
    fake.enqueue(fault)
    result, _ = await send(adapter, fake, protocol, False)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok and result.text == ""  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase, obs.status) == (transport, phase, 200)
    assert not obs.effective_output  # nothing of a whole body reaches the caller


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_200_with_error_object_is_a_failure(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    fake.enqueue(Fault.ERROR_EVENT)
    result, _ = await send(adapter, fake, protocol, False)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase, obs.status) == (None, Phase.AFTER_HEADERS, 200)
    assert "error" in json.loads(obs.body)


async def timed_send(fake: FakeProvider, driver: str, limits: StreamingPolicy,
                     behavior: Behavior | Fault, protocol: str, stream: bool
                     ) -> tuple[object, list[StreamEvent], float]:
    """One call with ``behavior`` queued, through a fresh adapter of ``driver`` with
    ``limits``: (its result, the events delivered, the seconds it took)."""
    fake.enqueue(behavior)
    async for a in adapter_for(driver, limits):
        t0 = time.monotonic()
        result, events = await send(a, fake, protocol, stream)
        return result, events, time.monotonic() - t0
    raise AssertionError("no adapter")  # pragma: no cover


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_total_deadline_bounds_an_endless_answer(fake: FakeProvider, stream: bool,
                                                       driver: str) -> None:
    limits = FAST.model_copy(update={"total_timeout_s": 0.6, "read_timeout_s": 1.0})
    result, _, elapsed = await timed_send(fake, driver, limits,
                                          Behavior(fault=Fault.TRICKLE, delay_s=0.05),
                                          "anthropic", stream)
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.TOTAL_TIMEOUT, Phase.MID_STREAM)
    assert obs.effective_output is stream
    assert 0.55 <= elapsed < 1.6


# Every limit but the one under test far beyond it: a driver that waited by another limit
# (httpcore reads a whole body with the one read limit it took when the body began) would
# take ten seconds, not a fraction of one.
PATIENT_BUT_IDLE = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=10.0,
                                   first_token_timeout_s=10.0, idle_timeout_s=0.3,
                                   total_timeout_s=20.0)
PATIENT_BUT_FIRST = PATIENT_BUT_IDLE.model_copy(update={"idle_timeout_s": 10.0,
                                                        "first_token_timeout_s": 0.3})


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_stall_after_content_ends_by_the_idle_limit_not_a_longer_read_limit(
        fake: FakeProvider, driver: str, protocol: str) -> None:
    result, events, elapsed = await timed_send(fake, driver, PATIENT_BUT_IDLE, Fault.STALL,
                                               protocol, True)
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.STREAM_STALL, Phase.MID_STREAM)
    assert obs.effective_output and any(isinstance(e, TextDelta) for e in events)
    assert 0.27 <= elapsed < 3.0


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("fault", [Fault.NO_RESPONSE, Fault.SLOW_FIRST_TOKEN])
async def test_a_silent_model_ends_by_the_first_token_limit_not_a_longer_read_limit(
        fake: FakeProvider, driver: str, fault: Fault) -> None:
    result, events, elapsed = await timed_send(fake, driver, PATIENT_BUT_FIRST,
                                               Behavior(fault=fault, delay_s=30.0), "openai",
                                               True)
    obs = result.observation  # type: ignore[attr-defined]
    assert obs.transport is Transport.FIRST_TOKEN_TIMEOUT
    assert obs.phase is (Phase.AFTER_SEND if fault is Fault.NO_RESPONSE else Phase.AFTER_HEADERS)
    assert not obs.effective_output and events == []
    assert 0.27 <= elapsed < 3.0


# The other way round: a read limit shorter than a stream's first-token and idle limits. A
# model that thinks silently for longer than it, or streams with gaps longer than it, is
# still within the limits the stream is held to (docs/adapters.md, "Streaming rules").
SHORT_READ = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=0.3,
                             first_token_timeout_s=10.0, idle_timeout_s=10.0,
                             total_timeout_s=20.0)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_stream_waits_for_its_first_token_by_that_limit_not_a_shorter_read_limit(
        fake: FakeProvider, driver: str, protocol: str) -> None:
    result, events, _ = await timed_send(fake, driver, SHORT_READ,
                                         Behavior(fault=Fault.SLOW_FIRST_TOKEN, delay_s=0.9),
                                         protocol, True)
    assert result.ok, result.observation  # type: ignore[attr-defined]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == FULL_TEXT


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_streams_gaps_are_held_to_the_idle_limit_not_a_shorter_read_limit(
        fake: FakeProvider, driver: str) -> None:
    # Content every 0.6 s, forever: only the total limit (2 s) may end it, never the read
    # limit (0.3 s) as a stall.
    limits = SHORT_READ.model_copy(update={"total_timeout_s": 2.0})
    result, events, elapsed = await timed_send(fake, driver, limits,
                                               Behavior(fault=Fault.TRICKLE, delay_s=0.6),
                                               "openai", True)
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.TOTAL_TIMEOUT, Phase.MID_STREAM)
    assert any(isinstance(e, TextDelta) for e in events)
    assert elapsed >= 1.9


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_status_line_is_still_held_to_the_read_limit(
        fake: FakeProvider, driver: str, stream: bool) -> None:
    # Before any answer, a stream too waits at most read_timeout_s for the provider's status.
    result, _, elapsed = await timed_send(fake, driver, SHORT_READ,
                                          Behavior(fault=Fault.NO_RESPONSE, delay_s=30.0),
                                          "openai", stream)
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.READ_TIMEOUT, Phase.AFTER_SEND)
    assert 0.27 <= elapsed < 3.0
