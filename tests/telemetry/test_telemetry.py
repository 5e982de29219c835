"""OpenTelemetry spans and metrics of real turns, read back through the SDK's in-memory exporter
and metric reader.

Every turn runs the real retry owner over the real adapters against the fake provider on
loopback, on both backends. The ledger's clock is a ManualClock that the send function advances,
so the begin-to-settle latency the metrics report is known exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, SpanKind, StatusCode

from ledger import telemetry
from ledger.adapters import (
    HttpAdapter,
    StaticSecretProvider,
    SyncAdapter,
    ToolCallProposal,
    async_sender,
    sync_sender,
)
from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.turn import Dispatch, SendResult, aexecute, execute
from ledger.clock import ManualClock
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.facts import WireProtocol
from ledger.domain.records import Lease
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted
from ledger.policy.load import preset
from ledger.policy.model import AdmissionPolicy, Policy, StreamingPolicy
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"p:a": "sk-test-otel-PRIMARY-0123456789abcdefXYZ",
           "p:b": "AIzaTestOtelBackupKey0123456789abcdefXYZ"}
SYSTEM = "You are a careful analyst of private filings."
PROMPT = "Summarise the confidential ACME merger memo for the board."
ANSWER = "The memo proposes a merger with Globex at a premium of twelve percent."
SEND_S = 1.25  # how far each send moves the ledger's clock
PATIENT = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=10.0,
                          first_token_timeout_s=10.0, idle_timeout_s=10.0, total_timeout_s=20.0)


@dataclass
class Otel:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader

    def finished(self) -> list[ReadableSpan]:
        return sorted(self.spans.get_finished_spans(), key=lambda s: s.start_time or 0)

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        data = self.metrics.get_metrics_data()
        out: list[tuple[dict[str, Any], Any]] = []
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        out += [(dict(p.attributes or {}), p) for p in m.data.data_points]
        return out

    def dump(self) -> str:
        """Everything exported, as text: what an exporter could ever send anywhere."""
        data = self.metrics.get_metrics_data()
        return "\n".join([s.to_json() for s in self.spans.get_finished_spans()]
                         + [data.to_json() if data else ""])


@pytest.fixture
def otel() -> Iterator[Otel]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry.enable(tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        yield Otel(spans, reader)
    finally:
        telemetry.disable()
        tracer_provider.shutdown()
        meter_provider.shutdown()


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeProvider, FakeProvider]]:
    with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b:
        yield a, b


@pytest.fixture
def clean_fakes(fakes: tuple[FakeProvider, FakeProvider]) -> tuple[FakeProvider, FakeProvider]:
    for f in fakes:
        f.clear()
        f.set_default(Behavior(text=ANSWER))
    return fakes


@pytest.fixture(scope="module")
def adapter() -> Iterator[SyncAdapter]:
    ad = SyncAdapter(secrets=StaticSecretProvider(SECRETS), limits=PATIENT)
    yield ad
    ad.close()


def routes(a: FakeProvider, b: FakeProvider) -> list[Route]:
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(4))
    return [
        Route(id="primary", provider="openai", model="gpt-primary", group="ga", recipient="ra",
              protocol=WireProtocol.OPENAI, endpoint=a.endpoint("openai"), price=price,
              profiles=[Profile(id="p:a")]),
        Route(id="backup", provider="google", model="gemini-backup", group="gb",
              recipient="rb", protocol=WireProtocol.GEMINI, endpoint=b.endpoint("gemini"),
              price=price, profiles=[Profile(id="p:b")]),
    ]


ENVELOPE = Envelope(parts=[Part(role="system", content=SYSTEM),
                           Part(content=PROMPT)], max_output_tokens=64,
                    params={"temperature": 0.2})


def admit(led: Ledger, plan: list[Route], run_id: str = "r",
          policy: Policy | str = "failure-domain") -> Lease:
    led.admit_run(run_id, plan=plan, policy=policy,
                  budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
                  grant=Grant(recipients={"ra": ["user_input"],
                                          "rb": ["user_input"]}))
    return led.acquire_lease(run_id)


def advancing(clock: ManualClock, send: Callable[[Dispatch], Any]) -> Callable[[Dispatch], Any]:
    """The send, taking SEND_S of the ledger's time."""
    def timed(d: Dispatch) -> Any:
        clock.advance(SEND_S)
        return send(d)
    return timed


def by_name(spans: list[ReadableSpan]) -> tuple[ReadableSpan, list[ReadableSpan]]:
    turns = [s for s in spans if s.name == "ledger.turn"]
    assert len(turns) == 1
    return turns[0], [s for s in spans if s.name != "ledger.turn"]


def assert_children(turn: ReadableSpan, attempts: list[ReadableSpan]) -> None:
    assert turn.parent is None
    for a in attempts:
        assert a.kind is SpanKind.CLIENT
        assert a.parent is not None and a.parent.span_id == turn.context.span_id
        assert a.context.trace_id == turn.context.trace_id
        assert turn.start_time <= a.start_time <= a.end_time <= turn.end_time  # type: ignore[operator]


def assert_no_content_or_secret(otel: Otel) -> None:
    text = otel.dump()
    for secret in SECRETS.values():
        assert secret not in text
    for content in (SYSTEM, PROMPT, ANSWER):
        for fragment in (content, content[:24], content[-24:]):
            assert fragment not in text
    for span in otel.spans.get_finished_spans():
        assert not any(k.startswith(("gen_ai.input", "gen_ai.output", "gen_ai.system_"))
                       for k in span.attributes or {})


def metric_total(otel: Otel, name: str) -> dict[tuple[Any, ...], Any]:
    """A counter's total by (route, outcome), over its other attributes."""
    out: dict[tuple[Any, ...], Any] = {}
    for a, p in otel.points(name):
        key = (a.get("ledger.route"), a.get("ledger.outcome"))
        out[key] = out.get(key, 0) + p.value
    return out


def test_healthy_turn_is_one_turn_span_over_one_attempt_span_with_genai_names(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    a, b = clean_fakes
    clock = ManualClock(1_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        lease = admit(led, routes(a, b))
        res = execute(led, lease, ENVELOPE,
                      advancing(clock, sync_sender(adapter, limits=PATIENT)), turn_id="turn-1")
        att = led.timeline("r")[0]
    assert res.route.id == "primary" and res.output.text == ANSWER
    assert trace.get_current_span() is INVALID_SPAN  # the turn left no span current behind

    turn, attempts = by_name(otel.finished())
    assert len(attempts) == 1
    assert_children(turn, attempts)
    span = attempts[0]
    assert span.name == "chat gpt-primary"
    assert span.status.status_code is StatusCode.UNSET
    attrs = dict(span.attributes or {})
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-primary",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.2,
        "gen_ai.response.model": "gpt-primary-fake-001",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 7,
        "server.address": "127.0.0.1",
        "server.port": int(a.endpoint("openai").rsplit(":", 1)[1].split("/")[0]),
        "ledger.run_id": "r",
        "ledger.turn_id": "turn-1",
        "ledger.attempt_id": att.attempt_id,
        "ledger.attempt.seq": att.seq,
        "ledger.attempt.kind": "first",
        "ledger.route": "primary",
        "ledger.capacity_group": "ga",
        "ledger.recipient": "ra",
        "ledger.protocol": "openai",
        "ledger.profile_id": "p:a",
        "ledger.debit_id": att.debit_id,
        "ledger.debit.reserved": float(att.reserved),
        "ledger.debit.state": "posted",
        "ledger.cost": float(att.cost or 0),
        "ledger.outcome": "succeeded",
        # The response's first byte, on the ledger's clock (the send moved it SEND_S first).
        "ledger.attempt.time_to_first_byte": SEND_S,
    }
    assert att.model_reported == attrs["gen_ai.response.model"]
    assert dict(turn.attributes or {}) == {
        "ledger.run_id": "r", "ledger.turn_id": "turn-1", "ledger.outcome": "succeeded",
        "ledger.attempts": 1, "ledger.failovers": 0, "ledger.route": "primary",
        "ledger.attempt_id": att.attempt_id, "ledger.resets": 0, "ledger.tool_calls": 0}
    assert turn.status.status_code is StatusCode.UNSET
    assert turn.instrumentation_scope is not None
    assert turn.instrumentation_scope.schema_url == telemetry.SCHEMA_URL
    assert_no_content_or_secret(otel)

    assert metric_total(otel, "ledger.attempts") == {("primary", "succeeded"): 1}
    assert otel.points("ledger.failovers") == []
    [(lat_attrs, lat)] = otel.points("ledger.attempt.duration")
    assert lat.count == 1 and lat.sum == pytest.approx(SEND_S)  # begin to settle, ledger clock
    assert lat_attrs["ledger.route"] == "primary"
    [(_, op)] = otel.points("gen_ai.client.operation.duration")
    assert op.count == 1 and op.sum > 0
    tokens = {x["gen_ai.token.type"]: p.sum for x, p in otel.points("gen_ai.client.token.usage")}
    assert tokens == {"input": 11, "output": 7}
    [(_, first_byte)] = otel.points("ledger.attempt.time_to_first_byte")
    assert first_byte.sum == pytest.approx(SEND_S)
    assert otel.points("gen_ai.client.operation.time_to_first_chunk") == []  # not streamed


def test_failover_turn_has_a_failed_and_a_serving_attempt_under_one_turn_and_counts_the_move(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider]) -> None:
    a, b = clean_fakes
    a.enqueue(Fault.UNAVAILABLE, model="gpt-primary")
    clock = ManualClock(1_000.0)

    async def turn() -> Any:
        async with HttpAdapter(secrets=StaticSecretProvider(SECRETS), limits=PATIENT) as ad:
            with Ledger.open(db_url, clock=clock) as led:
                lease = admit(led, routes(a, b))
                send = async_sender(ad, limits=PATIENT)

                async def timed(d: Dispatch) -> SendResult:
                    clock.advance(SEND_S)
                    current.append(trace.get_current_span().get_span_context().span_id)
                    return await send(d)

                res = await aexecute(AsyncLedger(led), lease, ENVELOPE, timed,
                                     turn_id="turn-1")
                return res, led.timeline("r")

    current: list[int] = []
    res, tl = asyncio.run(turn())
    assert res.route.id == "backup" and len(tl) == 2

    turn_span, attempts = by_name(otel.finished())
    assert [s.name for s in attempts] == ["chat gpt-primary", "chat gemini-backup"]
    assert_children(turn_span, attempts)
    # Each send ran with its attempt's span current: the host's HTTP spans would nest under it.
    assert current == [s.context.span_id for s in attempts]
    failed, served = (dict(s.attributes or {}) for s in attempts)
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert attempts[0].status.description == "failed: overloaded (HTTP 503)"
    assert {k: failed[k] for k in (
        "ledger.attempt_id", "ledger.outcome", "ledger.failure.category", "error.type",
        "http.response.status_code", "ledger.debit.state", "ledger.failure.phase",
        "ledger.attempt.kind", "gen_ai.provider.name")} == {
        "ledger.attempt_id": tl[0].attempt_id, "ledger.outcome": "failed",
        "ledger.failure.category": "overloaded", "error.type": "overloaded",
        "http.response.status_code": 503,
        "ledger.debit.state": tl[0].debit_state.value,  # type: ignore[union-attr]
        "ledger.failure.phase": tl[0].fact.phase.value,  # type: ignore[union-attr]
        "ledger.attempt.kind": "first",
        "gen_ai.provider.name": "openai"}
    assert "gen_ai.response.model" not in failed and "gen_ai.usage.input_tokens" not in failed
    assert attempts[1].status.status_code is StatusCode.UNSET
    assert {k: served[k] for k in (
        "ledger.attempt_id", "ledger.outcome", "ledger.attempt.kind", "ledger.route",
        "ledger.capacity_group", "gen_ai.provider.name", "gen_ai.request.model",
        "gen_ai.response.model", "ledger.debit.state")} == {
        "ledger.attempt_id": tl[1].attempt_id, "ledger.outcome": "succeeded",
        "ledger.attempt.kind": "failover", "ledger.route": "backup",
        "ledger.capacity_group": "gb", "gen_ai.provider.name": "gcp.gemini",
        "gen_ai.request.model": "gemini-backup", "gen_ai.response.model": tl[1].model_reported,
        "ledger.debit.state": "posted"}
    assert "error.type" not in served
    turn_attrs = dict(turn_span.attributes or {})
    assert (turn_attrs["ledger.attempts"], turn_attrs["ledger.failovers"],
            turn_attrs["ledger.route"]) == (2, 1, "backup")
    assert_no_content_or_secret(otel)

    assert metric_total(otel, "ledger.attempts") == {("primary", "failed"): 1,
                                                     ("backup", "succeeded"): 1}
    [(move, n)] = otel.points("ledger.failovers")
    assert n.value == 1 and move == {"ledger.route.from": "primary",
                                     "ledger.route.to": "backup",
                                     "ledger.failure.category": "overloaded"}
    lat = {a["ledger.route"]: p for a, p in otel.points("ledger.attempt.duration")}
    assert {r: (p.count, p.sum) for r, p in lat.items()} == {
        "primary": (1, pytest.approx(SEND_S)), "backup": (1, pytest.approx(SEND_S))}


def test_stopped_turn_span_is_an_error_with_the_stop_reason(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    a, b = clean_fakes
    a.enqueue(Fault.CONTEXT_LENGTH, model="gpt-primary")
    clock = ManualClock(1_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        lease = admit(led, routes(a, b))
        with pytest.raises(FailoverExhausted) as stop:
            execute(led, lease, ENVELOPE, advancing(clock, sync_sender(adapter, limits=PATIENT)))
        tl = led.timeline("r")
    assert stop.value.reason == "not_eligible_failure" and len(tl) == 1

    turn, attempts = by_name(otel.finished())
    assert_children(turn, attempts)
    assert turn.status.status_code is StatusCode.ERROR
    assert turn.status.description == "stopped: not_eligible_failure"
    attrs = dict(turn.attributes or {})
    assert (attrs["ledger.outcome"], attrs["ledger.stop.reason"], attrs["error.type"],
            attrs["ledger.attempts"], attrs["ledger.failovers"]) == (
        "stopped", "not_eligible_failure", "FailoverExhausted", 1, 0)
    assert isinstance(attrs["ledger.stop.skipped"], tuple)
    assert "ledger.route" not in attrs  # nothing served the turn
    [span] = attempts
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["ledger.failure.category"] == "context_overflow"
    assert dict(span.attributes or {})["ledger.outcome"] == tl[0].state.value == "failed"
    assert_no_content_or_secret(otel)
    assert metric_total(otel, "ledger.attempts") == {("primary", "failed"): 1}
    assert otel.points("ledger.failovers") == []


def test_attempt_rejected_by_admission_is_a_span_of_its_own_and_no_failover(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    a, b = clean_fakes
    clock = ManualClock(1_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        led.configure_group("ga", max_in_flight=1)
        other = admit(led, routes(a, b), run_id="other")
        led.begin_attempt(other, route="primary", envelope_hash="sha256:x", reserve="0")
        # A Run that may not wait for capacity: a full group refuses it (a rejected Attempt).
        no_wait = preset("failure-domain").model_copy(
            update={"admission": AdmissionPolicy(max_capacity_wait_s=0)})
        lease = admit(led, routes(a, b), policy=no_wait)
        res = execute(led, lease, ENVELOPE, advancing(clock, sync_sender(adapter,
                                                                         limits=PATIENT)))
        tl = led.timeline("r")
    assert res.route.id == "backup" and [a.state.value for a in tl] == ["rejected",
                                                                        "succeeded"]
    turn, attempts = by_name(otel.finished())
    assert_children(turn, attempts)
    rejected, served = attempts
    attrs = dict(rejected.attributes or {})
    assert rejected.status.status_code is StatusCode.ERROR
    assert {k: attrs[k] for k in ("ledger.attempt_id", "ledger.outcome", "error.type",
                                  "ledger.reject_reason", "ledger.debit.state",
                                  "ledger.route")} == {
        "ledger.attempt_id": tl[0].attempt_id, "ledger.outcome": "rejected",
        "error.type": "rejected", "ledger.reject_reason": tl[0].reject_reason,
        "ledger.debit.state": "voided", "ledger.route": "primary"}
    assert dict(served.attributes or {})["ledger.attempt_id"] == tl[1].attempt_id
    assert dict(turn.attributes or {})["ledger.attempts"] == 2
    # Admission refused before anything was sent: no move event, so not a failover.
    assert dict(turn.attributes or {})["ledger.failovers"] == 0
    assert otel.points("ledger.failovers") == []
    assert metric_total(otel, "ledger.attempts") == {("primary", "rejected"): 1,
                                                     ("backup", "succeeded"): 1}
    # The counter's point carries the span's error.type, so a dashboard can split errors by it.
    assert {(a.get("ledger.route"), a.get("error.type"))
            for a, _ in otel.points("ledger.attempts")} == {("primary", "rejected"),
                                                            ("backup", None)}
    assert {a["ledger.route"] for a, _ in otel.points("ledger.attempt.duration")} == {"backup"}


def test_send_that_raises_ends_the_attempt_span_with_its_recorded_outcome_and_no_message(
        db_url: str, otel: Otel) -> None:
    plan = [Route(id="primary", provider="openai", model="gpt-primary", group="ga",
                  recipient="ra", price=Price())]
    clock = ManualClock(1_000.0)

    def broken(d: Dispatch) -> SendResult:
        raise RuntimeError(f"host bug while sending {PROMPT}")

    with Ledger.open(db_url, clock=clock) as led:
        lease = admit(led, plan)
        with pytest.raises(RuntimeError):
            execute(led, lease, ENVELOPE, broken)
        tl = led.timeline("r")
    turn, attempts = by_name(otel.finished())
    assert_children(turn, attempts)
    assert dict(turn.attributes or {})["ledger.outcome"] == "interrupted"
    assert turn.status.description == "RuntimeError"  # never the exception's text by default
    [span] = attempts
    attrs = dict(span.attributes or {})
    assert attrs["ledger.outcome"] == tl[0].state.value == "unknown"  # handed over: may be sent
    assert attrs["error.type"] == "cancelled" and attrs["ledger.debit.state"] == "reserved"
    assert_no_content_or_secret(otel)


def test_cancelled_async_turn_ends_its_spans_with_what_was_recorded(
        db_url: str, otel: Otel) -> None:
    plan = [Route(id="primary", provider="openai", model="gpt-primary", group="ga",
                  recipient="ra", price=Price())]

    async def go() -> tuple[str, Any]:
        with Ledger.open(db_url, clock=ManualClock(1_000.0)) as led:
            lease = admit(led, plan)
            started = asyncio.Event()

            async def hangs(d: Dispatch) -> SendResult:
                started.set()
                await asyncio.Event().wait()
                raise AssertionError("never answered")

            task = asyncio.create_task(aexecute(AsyncLedger(led), lease, ENVELOPE, hangs))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            state = led.timeline("r")[0].state.value
            return state, trace.get_current_span()

    state, current_after = asyncio.run(go())
    assert current_after is INVALID_SPAN
    turn, [span] = by_name(otel.finished())
    assert_children(turn, [span])
    assert dict(turn.attributes or {})["error.type"] == "CancelledError"
    assert dict(turn.attributes or {})["ledger.outcome"] == "interrupted"
    attrs = dict(span.attributes or {})
    assert attrs["ledger.outcome"] == state == "unknown"  # handed over: it may have been sent
    assert attrs["error.type"] == "cancelled" and span.status.status_code is StatusCode.ERROR
    assert metric_total(otel, "ledger.attempts") == {("primary", "unknown"): 1}


def test_content_is_captured_only_when_opted_in_and_then_redacted(
        db_url: str, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    a, b = clean_fakes
    pasted_key = "sk-proj-Pasted0Key1Inside2The3Prompt4567"
    env = Envelope(parts=[Part(role="system", content=SYSTEM),
                          Part(content=f"{PROMPT} (my key is {pasted_key})")],
                   max_output_tokens=64)
    with _capturing() as spans, Ledger.open(db_url, clock=ManualClock(1_000.0)) as led:
        lease = admit(led, routes(a, b))
        execute(led, lease, env, sync_sender(adapter, limits=PATIENT))
    [span] = [s for s in spans.get_finished_spans() if s.name != "ledger.turn"]
    attrs = dict(span.attributes or {})
    assert json.loads(str(attrs["gen_ai.system_instructions"])) == [
        {"type": "text", "content": SYSTEM}]
    assert json.loads(str(attrs["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text",
                                    "content": f"{PROMPT} (my key is [REDACTED])"}]}]
    assert json.loads(str(attrs["gen_ai.output.messages"])) == [
        {"role": "assistant", "parts": [{"type": "text", "content": ANSWER}],
         "finish_reason": "stop"}]
    text = "\n".join(s.to_json() for s in spans.get_finished_spans())
    assert pasted_key not in text and all(s not in text for s in SECRETS.values())


@contextmanager
def _capturing() -> Iterator[InMemorySpanExporter]:
    """Telemetry enabled with content captured, into the spans yielded, until the block ends."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry.enable(tracer_provider=tracer_provider, meter_provider=MeterProvider(),
                     capture_content=True)
    try:
        yield spans
    finally:
        telemetry.disable()


def _captured_on_anthropic(db_url: str, fakes: tuple[FakeProvider, FakeProvider],
                           adapter: SyncAdapter, env: Envelope
                           ) -> tuple[InMemorySpanExporter, Any]:
    """One turn of ``env`` on Anthropic routes with content captured: the spans, and the
    attempt's one input message."""
    a, b = fakes
    with _capturing() as spans, Ledger.open(db_url, clock=ManualClock(1_000.0)) as led:
        lease = admit(led, [r.model_copy(update={"protocol": WireProtocol.ANTHROPIC,
                                                 "endpoint": f.endpoint("anthropic")})
                            for r, f in zip(routes(a, b), (a, b), strict=True)])
        execute(led, lease, env, sync_sender(adapter, limits=PATIENT))
    [span] = [s for s in spans.get_finished_spans() if s.name != "ledger.turn"]
    [message] = json.loads(str(dict(span.attributes or {})["gen_ai.input.messages"]))
    return spans, message


def test_captured_images_and_documents_are_described_never_their_bytes(
        db_url: str, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    from tests.media import pdf, png

    a, b = clean_fakes
    document = pdf(2, text="CONFIDENTIAL-FIGURES")
    image = png(8, 8)
    env = Envelope(parts=[Part(content=PROMPT), Part(data=image, media_type="image/png"),
                          Part(data=document, media_type="application/pdf"),
                          Part(url="https://files.example/r.pdf?token=sk-proj-Link0Key1Is2Here34",
                               media_type="application/pdf")],
                   max_output_tokens=64)
    spans, message = _captured_on_anthropic(db_url, (a, b), adapter, env)
    assert message["parts"][1:] == [
        {"type": "blob", "modality": "image", "mime_type": "image/png", "size": len(image)},
        {"type": "blob", "modality": "pdf", "mime_type": "application/pdf",
         "size": len(document)},
        {"type": "uri", "modality": "pdf", "mime_type": "application/pdf",
         "uri": "https://files.example/r.pdf?token=[REDACTED]"}]
    text = "\n".join(s.to_json() for s in spans.get_finished_spans())
    assert "CONFIDENTIAL-FIGURES" not in text and "Link0Key" not in text


def test_a_captured_links_credentials_are_redacted(
        db_url: str, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    a, b = clean_fakes
    link = "https://files.example/r.pdf?v=2&password=Link99Pass"
    env = Envelope(parts=[Part(content=PROMPT), Part(url=link, media_type="application/pdf")],
                   max_output_tokens=64)
    spans, message = _captured_on_anthropic(db_url, (a, b), adapter, env)
    assert message["parts"][1] == {
        "type": "uri", "modality": "pdf", "mime_type": "application/pdf",
        "uri": "https://files.example/r.pdf?v=2&password=[REDACTED]"}
    assert "Link99Pass" not in "\n".join(s.to_json() for s in spans.get_finished_spans())


def test_a_captured_answers_image_is_described_never_its_bytes(
        db_url: str, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    from tests.media import png

    a, b = clean_fakes
    image = png(16, 16) + b"CONFIDENTIAL-PIXELS"
    a.enqueue(Behavior(image_out=("image/png", image)))  # the primary speaks chat completions
    with _capturing() as spans, Ledger.open(db_url, clock=ManualClock(1_000.0)) as led:
        lease = admit(led, routes(a, b))
        result = execute(led, lease, Envelope(parts=[Part(content=PROMPT)]),
                         sync_sender(adapter, limits=PATIENT))
    assert [p.data for p in result.parts if p.media_type] == [image]
    [span] = [s for s in spans.get_finished_spans() if s.name != "ledger.turn"]
    [message] = json.loads(str(dict(span.attributes or {})["gen_ai.output.messages"]))
    assert message["parts"][1:] == [
        {"type": "blob", "modality": "image", "mime_type": "image/png", "size": len(image)}]
    text = "\n".join(s.to_json() for s in spans.get_finished_spans())
    import base64

    assert "CONFIDENTIAL-PIXELS" not in text
    assert base64.b64encode(image).decode()[:40] not in text


def test_telemetry_off_leaves_the_turn_unobserved(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    telemetry.disable()
    gen = iter(())
    assert telemetry.observed(gen, "r", "t", ENVELOPE) is gen  # type: ignore[arg-type]
    a, b = clean_fakes
    with Ledger.open(db_url, clock=ManualClock(1_000.0)) as led:
        lease = admit(led, routes(a, b))
        execute(led, lease, ENVELOPE, sync_sender(adapter, limits=PATIENT))
    assert otel.spans.get_finished_spans() == ()
    assert otel.points("ledger.attempts") == []


def _py(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60)


def test_the_turn_path_does_not_import_opentelemetry_until_enabled() -> None:
    res = _py("import sys\nimport ledger.api.turn, ledger.telemetry\n"
              "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_enable_without_the_extra_names_it() -> None:
    res = _py("import sys, json\nsys.modules['opentelemetry'] = None\n"
              "from ledger import InvalidArgument, telemetry\n"
              "try:\n    telemetry.enable()\n"
              "except InvalidArgument as e:\n"
              "    print(json.dumps({'field': e.field, 'extra': e.fields['extra'], "
              "'msg': str(e)}))\n")
    assert res.returncode == 0, res.stderr
    err = json.loads(res.stdout)
    assert err["field"] == "telemetry" and err["extra"] == "otel"
    assert "pip install 'failover-ledger[otel]'" in err["msg"]


# -- turns taken through a Run session (led.run(...) / async with) ------------------------

TOOL_ARGS = {"q": "ACME Globex merger premium"}
TOOL_ANSWER = '{"hits": ["confidential memo of 3 March"]}'
TOOLS = [ToolSpec(name="search", description="Search the filings",
                  parameters={"type": "object", "properties": {"q": {"type": "string"}}})]
SESSION_GRANT = Grant(recipients={r: ["user_input", "model_derived", "tool_result",
                                      "tool_description", "system"] for r in ("ra", "rb")})
SESSION_BUDGET = Budget(max_calls=6, max_retries=3, max_cost=Decimal("1"))


def turns_of(spans: list[ReadableSpan]) -> list[tuple[ReadableSpan, list[ReadableSpan]]]:
    """Each turn span with its Attempt spans, in order."""
    turns = [s for s in spans if s.name == "ledger.turn"]
    return [(t, [s for s in spans if s.parent is not None
                 and s.parent.span_id == t.context.span_id]) for t in turns]


def test_session_turns_with_a_started_tool_are_observed_without_tool_content(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider]) -> None:
    a, b = clean_fakes
    a.set_default(Behavior(text=ANSWER, tool_call=("search", TOOL_ARGS)), model="gpt-primary")
    with Ledger.open(db_url) as led, led.run(
            "agent", plan=routes(a, b), budget=SESSION_BUDGET, grant=SESSION_GRANT,
            secrets=StaticSecretProvider(SECRETS)) as run:
        def on_event(ev: object) -> None:
            if isinstance(ev, ToolCallProposal):
                run.tool_started(ev.call.id)  # the host starts its tool while the stream runs

        msgs = [Part(content=PROMPT)]
        r1 = run.turn(Envelope(parts=msgs, tools=TOOLS, stream=True), on_event=on_event)
        [call] = r1.tool_calls
        msgs += [*r1.parts, run.tool_result(call.tool_call_id or "", TOOL_ANSWER)]
        a.set_default(Behavior(text=ANSWER), model="gpt-primary")
        r2 = run.turn(Envelope(parts=msgs, tools=TOOLS), turn_id="turn-2")
        tl = led.timeline("agent")
    assert trace.get_current_span() is INVALID_SPAN

    (t1, [s1]), (t2, [s2]) = turns_of(otel.finished())
    assert_children(t1, [s1])
    assert_children(t2, [s2])
    first, second = dict(s1.attributes or {}), dict(s2.attributes or {})
    assert (first["ledger.attempt_id"], second["ledger.attempt_id"]) == (
        r1.attempt.attempt_id, r2.attempt.attempt_id) == (tl[0].attempt_id, tl[1].attempt_id)
    assert first["ledger.run_id"] == "agent" and first["ledger.outcome"] == "succeeded"
    assert first["ledger.tool_started"] is True and tl[0].tool_started
    assert s1.status.status_code is StatusCode.UNSET and "error.type" not in first
    assert "ledger.tool_started" not in second
    assert first["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert first["gen_ai.usage.output_tokens"] == tl[0].completion_tokens
    assert dict(t1.attributes or {})["ledger.tool_calls"] == 1
    assert dict(t2.attributes or {})["ledger.tool_calls"] == 0
    assert dict(t2.attributes or {})["ledger.turn_id"] == "turn-2"
    assert_no_content_or_secret(otel)
    text = otel.dump()
    assert TOOL_ARGS["q"] not in text and "confidential memo" not in text
    assert metric_total(otel, "ledger.attempts") == {("primary", "succeeded"): 2}


def test_async_session_turn_nests_under_the_hosts_span_and_counts_a_discarding_failover(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider]) -> None:
    a, b = clean_fakes
    # A stream cut nobody watched: its text is discarded, and goclaw moves on to the backup.
    a.enqueue(Behavior(fault=Fault.STREAM_CUT), model="gpt-primary")
    host = TracerProvider()
    host_spans = InMemorySpanExporter()
    host.add_span_processor(SimpleSpanProcessor(host_spans))

    async def main() -> tuple[Any, Any, list[Any]]:
        adapter = HttpAdapter(secrets=StaticSecretProvider(SECRETS), limits=PATIENT)
        async with AsyncLedger.open(db_url) as led, led.run(
                "agent", plan=routes(a, b), budget=SESSION_BUDGET, grant=SESSION_GRANT,
                policy="goclaw", adapter=adapter) as run:
            with host.get_tracer("host").start_as_current_span("agent step") as step:
                res = await run.turn(Envelope(parts=[Part(content=PROMPT)], stream=True))
            return res, step, led.sync.timeline("agent")

    res, step, tl = asyncio.run(main())
    host.shutdown()
    # The cut stream left without a verdict: execution unknown, its hold kept.
    assert res.route.id == "backup" and [t.state.value for t in tl] == ["unknown", "succeeded"]

    [(turn, attempts)] = turns_of(otel.finished())
    assert turn.parent is not None and turn.parent.span_id == step.get_span_context().span_id
    assert turn.context.trace_id == step.get_span_context().trace_id
    failed, served = attempts
    for s in attempts:
        assert s.kind is SpanKind.CLIENT and turn.start_time <= s.start_time  # type: ignore[operator]
    f_attrs = dict(failed.attributes or {})
    assert f_attrs["ledger.output_discarded"] is True
    assert f_attrs["ledger.effective_output"] is False
    assert f_attrs["ledger.outcome"] == "unknown" and failed.status.status_code is StatusCode.ERROR
    assert dict(served.attributes or {})["ledger.attempt.kind"] == "failover"
    t_attrs = dict(turn.attributes or {})
    assert (t_attrs["ledger.attempts"], t_attrs["ledger.failovers"], t_attrs["ledger.route"]) == (
        2, 1, "backup")
    [(move, n)] = otel.points("ledger.failovers")
    assert n.value == 1 and (move["ledger.route.from"], move["ledger.route.to"]) == (
        "primary", "backup")
    assert_no_content_or_secret(otel)


def test_session_stop_after_shown_output_names_the_attempt_not_the_text(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider]) -> None:
    a, b = clean_fakes
    a.enqueue(Behavior(text=ANSWER, fault=Fault.STREAM_CUT, content_before_fault=2),
              model="gpt-primary")
    shown: list[str] = []
    with Ledger.open(db_url) as led, led.run(
            "agent", plan=routes(a, b), budget=SESSION_BUDGET, grant=SESSION_GRANT,
            secrets=StaticSecretProvider(SECRETS)) as run, \
            pytest.raises(FailoverExhausted) as stop:
        run.turn(Envelope(parts=[Part(content=PROMPT)], stream=True), on_text=shown.append)
    partial = stop.value.partial
    assert partial is not None and partial.text == "".join(shown) != ""
    [(turn, [span])] = turns_of(otel.finished())
    attrs = dict(turn.attributes or {})
    assert attrs["ledger.outcome"] == "stopped"
    assert attrs["ledger.stop.partial_attempt_id"] == partial.attempt_id
    assert attrs["ledger.stop.partial_chars"] == len(partial.text)
    assert dict(span.attributes or {})["ledger.effective_output"] is True
    assert partial.text not in otel.dump()
    assert_no_content_or_secret(otel)


def test_captured_input_of_a_session_turn_carries_its_tool_call_and_result(
        db_url: str, clean_fakes: tuple[FakeProvider, FakeProvider]) -> None:
    a, b = clean_fakes
    a.set_default(Behavior(text=ANSWER, tool_call=("search", TOOL_ARGS)), model="gpt-primary")
    with _capturing() as spans, Ledger.open(db_url) as led, led.run(
            "agent", plan=routes(a, b), budget=SESSION_BUDGET, grant=SESSION_GRANT,
            secrets=StaticSecretProvider(SECRETS)) as run:
        msgs = [Part(content=PROMPT)]
        r1 = run.turn(Envelope(parts=msgs, tools=TOOLS))
        [call] = r1.tool_calls
        msgs += [*r1.parts, run.tool_result(call.tool_call_id or "", TOOL_ANSWER)]
        a.set_default(Behavior(text=ANSWER), model="gpt-primary")
        run.turn(Envelope(parts=msgs, tools=TOOLS))
    first, second = [s for s in sorted(spans.get_finished_spans(),
                                       key=lambda s: s.start_time or 0)
                     if s.name != "ledger.turn"]
    [out] = json.loads(str(dict(first.attributes or {})["gen_ai.output.messages"]))
    assert out["finish_reason"] == "tool_calls"
    assert {"type": "tool_call", "id": call.tool_call_id, "name": "search",
            "arguments": TOOL_ARGS} in out["parts"]
    messages = json.loads(str(dict(second.attributes or {})["gen_ai.input.messages"]))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert {"type": "tool_call", "id": call.tool_call_id, "name": "search",
            "arguments": TOOL_ARGS} in messages[1]["parts"]
    assert messages[2]["parts"] == [{"type": "tool_call_response", "id": call.tool_call_id,
                                     "response": TOOL_ANSWER}]


@pytest.mark.parametrize("empty_text", [False, True])
def test_a_captured_tool_result_of_files_alone_is_the_calls_response_described_never_its_bytes(
        db_url: str, clean_fakes: tuple[FakeProvider, FakeProvider], empty_text: bool) -> None:
    """A tool that returned only an image answers its call with it (no text result part, or
    an empty one): the exported conversation shows that call's response, the image described
    as a user's is, never its bytes, rather than a call without a response and a stray file."""
    from tests.media import png

    a, b = clean_fakes
    image = png(8, 8) + b"CONFIDENTIAL-PIXELS"
    a.set_default(Behavior(text=ANSWER, tool_call=("search", TOOL_ARGS)), model="gpt-primary")
    with _capturing() as spans, Ledger.open(db_url) as led, led.run(
            "agent", plan=routes(a, b), budget=SESSION_BUDGET, grant=SESSION_GRANT,
            secrets=StaticSecretProvider(SECRETS)) as run:
        msgs = [Part(content=PROMPT)]
        r1 = run.turn(Envelope(parts=msgs, tools=TOOLS))
        [call] = r1.tool_calls
        msgs += r1.parts
        if empty_text:
            msgs.append(run.tool_result(call, ""))
        msgs.append(run.tool_result(call, Part(data=image, media_type="image/png",
                                               data_class="tool_result")))
        a.set_default(Behavior(text=ANSWER), model="gpt-primary")
        run.turn(Envelope(parts=msgs, tools=TOOLS))
    second = max((s for s in spans.get_finished_spans() if s.name != "ledger.turn"),
                 key=lambda s: s.start_time or 0)
    messages = json.loads(str(dict(second.attributes or {})["gen_ai.input.messages"]))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[2]["parts"] == [{
        "type": "tool_call_response", "id": call.tool_call_id,
        "response": [{"type": "blob", "modality": "image", "mime_type": "image/png",
                      "size": len(image)}]}]
    text = "\n".join(s.to_json() for s in spans.get_finished_spans())
    assert "CONFIDENTIAL-PIXELS" not in text


def test_a_streamed_attempt_reports_time_to_first_chunk_and_token_details(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    a, b = clean_fakes
    clock = ManualClock(1_000.0)
    # The head after 0.5 s of the ledger's time, the first content 1 s later.
    a.enqueue(Behavior(text=ANSWER, usage=(40, 12), cached_tokens=32, reasoning_tokens=5,
                       before_head=lambda: clock.advance(0.5),
                       before_content=lambda: clock.advance(1.0)))
    with Ledger.open(db_url, clock=clock) as led:
        lease = admit(led, routes(a, b))
        env = ENVELOPE.model_copy(update={"stream": True})
        execute(led, lease, env, sync_sender(adapter, limits=PATIENT), turn_id="t")
        [att] = led.timeline("r")
    assert att.first_token_s == pytest.approx(1.5, abs=1e-9)
    assert (att.cached_tokens, att.reasoning_tokens) == (32, 5)
    _turn, [span] = by_name(otel.finished())
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 32
    assert attrs["gen_ai.usage.reasoning.output_tokens"] == 5
    assert attrs["gen_ai.response.time_to_first_chunk"] == att.first_token_s
    assert attrs["ledger.attempt.time_to_first_byte"] == att.first_byte_s
    [(chunk_attrs, chunk)] = otel.points("gen_ai.client.operation.time_to_first_chunk")
    assert chunk.count == 1 and chunk.sum == att.first_token_s
    assert chunk_attrs["gen_ai.provider.name"] == "openai"
    assert chunk_attrs["ledger.route"] == "primary" and "server.port" in chunk_attrs
    assert_no_content_or_secret(otel)


def test_a_registered_secret_in_a_routes_names_is_redacted_in_spans_and_metrics(
        db_url: str, otel: Otel, clean_fakes: tuple[FakeProvider, FakeProvider],
        adapter: SyncAdapter) -> None:
    """A route's model, id, group and recipient are the operator's names, but a registered
    secret pasted into one (a fine-tuned model id carrying an org key) was exported as it is:
    in span names, span attributes and metric attributes, where the ledger's own error message
    for the same Attempt redacted it. Every exported name passes the redaction now."""
    from ledger.redaction import forget_secret, register_secret

    secret = "sk-TOPSECRET-abcdef0123456789XYZ"
    register_secret(secret)
    try:
        a, b = clean_fakes
        plain = routes(a, b)
        leaky = [r.model_copy(update={"model": f"m-{secret}", "id": f"{r.id}-{secret}",
                                      "group": f"{r.group}-{secret}",
                                      "recipient": f"{r.recipient}-{secret}"})
                 for r in plain]
        a.enqueue(Fault.UNAVAILABLE, model=f"m-{secret}")
        with Ledger.open(db_url, clock=ManualClock(1_000.0)) as led:
            led.admit_run("r", plan=leaky, policy="failure-domain",
                          budget=Budget(max_calls=4, max_retries=2, max_cost=Decimal("1")),
                          grant=Grant(recipients={r.recipient: ["user_input"] for r in leaky}))
            lease = led.acquire_lease("r")
            res = execute(led, lease, ENVELOPE, sync_sender(adapter, limits=PATIENT))
        assert res.route.id == leaky[1].id  # failed over: both routes' names were exported
        spans = otel.finished()
        assert [s.name for s in spans if s.name != "ledger.turn"] == ["chat m-[REDACTED]"] * 2
        assert secret not in otel.dump()
        assert "[REDACTED]" in otel.dump()
    finally:
        forget_secret(secret)
