"""OpenTelemetry for the retry owner: a span per turn, a span per Attempt under it, and metrics.

Off until the host turns it on, and then it reads only what the turn already produces::

    from ledger import telemetry
    telemetry.enable()            # the global tracer and meter providers the host configured
    telemetry.enable(tracer_provider=tp, meter_provider=mp, capture_content=True)
    telemetry.disable()

``enable`` needs the ``otel`` extra (``pip install 'failover-ledger[otel]'``, which brings only
``opentelemetry-api``; the host brings the SDK and its exporters). Nothing here imports
OpenTelemetry until ``enable`` is called, and while telemetry is off the turn drivers pay one
``None`` check per turn (:func:`observed` hands the turn's generator back untouched).

How it sees a turn: the drivers (:func:`ledger.api.turn.execute`, :func:`ledger.api.turn.aexecute`)
pass the turn's effect generator through :func:`observed`, which wraps it in a generator that yields
the same effects and passes back the same results and errors, unchanged and in the same order,
so a driver's shielding and interruption handling work exactly as without it. On the way it
watches each effect and its answer: a ``Begin`` answered with a record (or refused by
admission) opens the Attempt's span, the ``Send`` adds what the provider reported, the
``Settle`` answered with the settled record closes it, a ``stop`` record tells why the turn
stopped. An observer failure is logged and never changes the turn.

Names follow the OpenTelemetry semantic conventions for generative AI as of semconv **v1.37.0**
(the release that renamed ``gen_ai.system`` to ``gen_ai.provider.name`` and moved chat content
to the opt-in ``gen_ai.input.messages`` / ``gen_ai.output.messages`` attributes; the GenAI
conventions have since moved to their own repository and are still in development). The
ledger's own facts are under ``ledger.*``. The full list is in ``docs/telemetry.md``.

No secret and no message content goes on a span or a metric unless the host asks for content
(``capture_content=True``); even then every text passes :func:`ledger.redaction.redact`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from ledger.decide.effects import Begin, Effect, Record, Send, SendResult, Settle
from ledger.domain.carried import files_alone, lacking_results
from ledger.domain.media import kind_of
from ledger.domain.records import DURATION_BUCKETS, AttemptRecord, AttemptState
from ledger.errors import CapacityUnavailable, InvalidArgument
from ledger.redaction import redact, redact_data

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.metrics import Counter, Histogram, Meter, MeterProvider
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from ledger.domain.envelope import Envelope
    from ledger.domain.values import Route

log = logging.getLogger("ledger.telemetry")
R = TypeVar("R")

#: The semantic-conventions release whose GenAI names the spans and metrics follow.
SEMCONV_VERSION = "1.37.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
INSTRUMENTATION_NAME = "ledger"

#: The process's telemetry, or ``None`` (off). Read by the turn drivers once per turn.
active: Telemetry | None = None

# Semconv's advised buckets for token counts: powers of 4.
_TOKEN_BUCKETS = tuple(float(4 ** i) for i in range(14))

# Provider labels as routes (and genai-prices) spell them -> semconv's well-known values;
# any other label is reported as it is.
_PROVIDER_NAMES = {
    "google": "gcp.gemini", "gemini": "gcp.gemini", "vertex": "gcp.vertex_ai",
    "vertex_ai": "gcp.vertex_ai", "google-vertex": "gcp.vertex_ai", "aws": "aws.bedrock",
    "bedrock": "aws.bedrock", "azure": "azure.ai.openai", "mistral": "mistral_ai",
    "x-ai": "x_ai", "xai": "x_ai", "watsonx": "ibm.watsonx.ai",
}

# Envelope parameters reported as gen_ai.request.* (numbers only: they are settings, not text).
_REQUEST_PARAMS = ("temperature", "top_p", "top_k", "seed", "frequency_penalty",
                   "presence_penalty")


def provider_name(route: Route) -> str:
    """The ``gen_ai.provider.name`` of a route.

    Semconv's well-known value where the route's provider label has one (``google`` ->
    ``gcp.gemini``, ``aws`` -> ``aws.bedrock``, ...), else the label itself.
    """
    label = route.provider.lower()
    if label == "google" and route.endpoint and "aiplatform.googleapis.com" in route.endpoint:
        return "gcp.vertex_ai"
    return _PROVIDER_NAMES.get(label) or redact(label)


def enable(*, tracer_provider: TracerProvider | None = None,
           meter_provider: MeterProvider | None = None,
           capture_content: bool = False) -> Telemetry:
    """Turn telemetry on for every turn this process drives from now on, and return it.

    ``tracer_provider`` / ``meter_provider`` default to OpenTelemetry's global providers (what
    the host configured with ``trace.set_tracer_provider``; no-op ones when it configured
    none). ``capture_content`` puts the prompt and the answer (redacted) on Attempt spans as
    ``gen_ai.input.messages``, ``gen_ai.system_instructions`` and ``gen_ai.output.messages``;
    it is off by default because they are the user's data. Calling ``enable`` again replaces
    the previous setting.
    """
    global active
    if not isinstance(capture_content, bool):
        raise InvalidArgument("capture_content must be True or False", field="capture_content")
    try:
        from opentelemetry import metrics, trace
    except ImportError as e:
        raise InvalidArgument(
            "telemetry needs OpenTelemetry: pip install 'failover-ledger[otel]'",
            field="telemetry", extra="otel") from e
    from ledger import __version__

    tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider,
                              schema_url=SCHEMA_URL)
    meter = (meter_provider or metrics.get_meter_provider()).get_meter(
        INSTRUMENTATION_NAME, __version__, schema_url=SCHEMA_URL)
    active = Telemetry(tracer, _Instruments(meter), capture_content=capture_content)
    return active


def disable() -> None:
    """Turn telemetry off: turns that start from now on are not observed."""
    global active
    active = None


def observed(steps: Generator[Effect[Any], Any, R], run_id: str, turn_id: str,
             envelope: Envelope) -> Generator[Effect[Any], Any, R]:
    """The turn's effect generator, observed when telemetry is on; else ``steps`` itself."""
    tel = active
    if tel is None:
        return steps
    return tel.observe(steps, run_id, turn_id, envelope)


class _Instruments:
    """The metric instruments, created once per :func:`enable`."""

    def __init__(self, meter: Meter) -> None:
        self.attempts: Counter = meter.create_counter(
            "ledger.attempts", unit="{attempt}",
            description="Attempts settled or rejected, by route and outcome (attempt state).")
        self.failovers: Counter = meter.create_counter(
            "ledger.failovers", unit="{failover}",
            description="Moves of a turn's request to another route after a failure.")
        self.attempt_duration: Histogram = meter.create_histogram(
            "ledger.attempt.duration", unit="s",
            description="Attempt latency: from its begin to its settle, by the ledger's clock.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.operation_duration: Histogram = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s",
            description="GenAI operation duration: the send of an Attempt.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.token_usage: Histogram = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS)
        # Semconv v1.41's name (the release that added it); streamed attempts only.
        self.first_chunk: Histogram = meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk", unit="s",
            description="Time to a streamed answer's first content, from the Attempt's begin, "
            "by the ledger's clock.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.first_byte: Histogram = meter.create_histogram(
            "ledger.attempt.time_to_first_byte", unit="s",
            description="Time to the response's first byte, from the Attempt's begin, by the "
            "ledger's clock.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)


class Telemetry:
    """What :func:`enable` set up: the tracer, the instruments, whether content is captured."""

    def __init__(self, tracer: Tracer, instruments: _Instruments, *,
                 capture_content: bool = False) -> None:
        self.tracer = tracer
        self.instruments = instruments
        self.capture_content = capture_content

    def observe(self, steps: Generator[Effect[Any], Any, R], run_id: str, turn_id: str,
                envelope: Envelope) -> Generator[Effect[Any], Any, R]:
        """``steps``, yielding the same effects and receiving the same answers, observed."""
        return _TurnObserver(self, run_id, turn_id, envelope).wrap(steps)


class _AttemptSpan:
    """An open Attempt span and what is known of its attempt so far."""

    __slots__ = ("attrs", "send_error", "send_s", "server", "span", "token")

    def __init__(self, span: Span, token: Token[Context], attrs: dict[str, Any],
                 server: dict[str, Any]) -> None:
        self.span = span
        self.token = token
        self.attrs = attrs  # the metric attributes shared by this attempt's measurements
        self.server = server  # server.address / server.port, for the operation duration
        self.send_s: float | None = None
        self.send_error: str | None = None


class _TurnObserver:
    """One turn's spans. Every hook is guarded: telemetry never changes what the turn does."""

    def __init__(self, tel: Telemetry, run_id: str, turn_id: str, envelope: Envelope) -> None:
        self.tel = tel
        self.run_id = run_id
        self.turn_id = turn_id
        self.envelope = envelope
        self.turn: Span | None = None
        self.turn_ctx: Context | None = None
        self.turn_token: Token[Context] | None = None
        self.open: dict[str, _AttemptSpan] = {}
        self.closed: set[str] = set()  # attempts whose span has ended: never opened again
        self.begin: Begin | None = None
        self.begin_ns = 0
        self.send_t0 = 0.0
        self.attempts = 0
        self.failovers = 0
        self.stop: Mapping[str, Any] | None = None

    # -- the wrapper -------------------------------------------------------------------------

    def wrap(self, steps: Generator[Effect[Any], Any, R]) -> Generator[Effect[Any], Any, R]:
        self._guard(self._start)
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    eff = steps.throw(error) if error is not None else steps.send(value)
                except StopIteration as stop:
                    result: R = stop.value
                    self._guard(self._finish, result, None)
                    return result
                except BaseException as e:
                    self._guard(self._finish, None, e)
                    raise
                self._guard(self._before, eff)
                try:
                    value, error = (yield eff), None
                except BaseException as e:
                    value, error = None, e
                self._guard(self._after, eff, value, error)
        finally:
            # Only when this generator is closed or collected mid-turn: leave no context behind.
            self._guard(self._release)

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.warning("telemetry of turn %s of run %s failed; the turn is not affected",
                        self.turn_id, self.run_id, exc_info=True)

    # -- hooks -------------------------------------------------------------------------------

    def _start(self) -> None:
        from opentelemetry import context, trace

        self.turn = self.tel.tracer.start_span(
            "ledger.turn", kind=trace.SpanKind.INTERNAL,
            attributes={"ledger.run_id": self.run_id, "ledger.turn_id": self.turn_id})
        self.turn_ctx = trace.set_span_in_context(self.turn)
        self.turn_token = context.attach(self.turn_ctx)

    def _before(self, eff: Effect[Any]) -> None:
        if isinstance(eff, Begin):
            self.begin, self.begin_ns = eff, time.time_ns()
        elif isinstance(eff, Send):
            self.send_t0 = time.perf_counter()

    def _after(self, eff: Effect[Any], value: Any, error: BaseException | None) -> None:
        if isinstance(eff, Begin):
            if error is None and isinstance(value, AttemptRecord):
                self._count_moves(eff)
                self._open(eff, value)
            elif isinstance(error, CapacityUnavailable):
                self._count_moves(eff)
                self._rejected(eff, error)
            elif error is not None and self.turn is not None:
                self.turn.add_event("ledger.begin_refused", {
                    "ledger.attempt_id": eff.attempt_id, "ledger.route": redact(eff.route.id),
                    "error.type": type(error).__name__})
        elif isinstance(eff, Send):
            att = self.open.get(eff.dispatch.attempt_id)
            if att is not None:
                att.send_s = time.perf_counter() - self.send_t0
                if error is not None:
                    att.send_error = type(error).__name__
                elif isinstance(value, SendResult):
                    self._sent(att, value)
        elif isinstance(eff, Settle):
            if eff.attempt_id not in self.open and eff.attempt_id not in self.closed and (
                    error is None and isinstance(value, AttemptRecord)
                    and self.begin is not None and self.begin.attempt_id == eff.attempt_id):
                # An interrupted begin that had committed, settled on the way out.
                self._open(self.begin, value)
            att = self.open.pop(eff.attempt_id, None)
            if att is not None:
                self.closed.add(eff.attempt_id)
                if any(kind == "discarded" for kind, _ in eff.events):
                    # Streamed text nobody was shown, dropped so the turn could move on.
                    att.span.set_attribute("ledger.output_discarded", True)
                self._close(att, value if isinstance(value, AttemptRecord) else None, error)
        elif isinstance(eff, Record) and eff.kind == "stop":
            self.stop = eff.data

    def _finish(self, result: Any, error: BaseException | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        for att in list(self.open.values()):
            self._close(att, None, error, unsettled=True)
        self.open.clear()
        turn = self.turn
        if turn is None:
            return
        attrs: dict[str, Any] = {"ledger.attempts": self.attempts,
                                 "ledger.failovers": self.failovers}
        if error is None:
            attrs["ledger.outcome"] = "succeeded"
            served = getattr(result, "attempt", None)
            if isinstance(served, AttemptRecord):
                attrs["ledger.route"] = redact(served.route_id)
                attrs["ledger.attempt_id"] = served.attempt_id
            attrs["ledger.resets"] = int(getattr(result, "resets", 0) or 0)
            calls = getattr(result, "tool_calls", None)
            if isinstance(calls, list):
                attrs["ledger.tool_calls"] = len(calls)
        else:
            from ledger.errors import FailoverExhausted

            etype = type(error).__name__
            attrs["error.type"] = etype
            if isinstance(error, FailoverExhausted):
                attrs["ledger.outcome"] = "stopped"
                attrs["ledger.stop.reason"] = error.reason
                stop = self.stop or {}
                detail = stop.get("detail") or error.fields.get("detail") or ""
                if detail:
                    attrs["ledger.stop.detail"] = redact(str(detail))
                skipped = stop.get("skipped") or error.fields.get("skipped") or []
                attrs["ledger.stop.skipped"] = [
                    f"{s.get('route')}: {s.get('reason')}" for s in skipped
                    if isinstance(s, Mapping)]
                partial = error.partial
                if partial is not None:
                    # The caller was shown part of an answer: which Attempt, never the text.
                    attrs["ledger.stop.partial_attempt_id"] = partial.attempt_id
                    attrs["ledger.stop.partial_chars"] = len(partial.text)
                description = f"stopped: {error.reason}"
            else:
                attrs["ledger.outcome"] = "interrupted"
                description = etype
            if self.tel.capture_content:
                description = redact(str(error))[:1000] or etype
            turn.set_status(Status(StatusCode.ERROR, description))
        turn.set_attributes(attrs)
        self._release()
        turn.end()

    def _release(self) -> None:
        from opentelemetry import context

        for att in self.open.values():
            context.detach(att.token)
            att.span.end()
        self.open.clear()
        if self.turn_token is not None:
            token, self.turn_token = self.turn_token, None
            context.detach(token)

    # -- attempts ----------------------------------------------------------------------------

    def _count_moves(self, begin: Begin) -> None:
        """Count the failovers of a begin, once it is written.

        Failovers are the turn's move events (as the audit and the dashboard count them), and
        only those to another route: a credential rotated on the same route is a retry, not a
        failover.
        """
        for kind, data in begin.events:
            if kind != "move" or data.get("from_route") == data.get("to_route"):
                continue
            self.failovers += 1
            cause = data.get("cause") or {}
            attrs = {"ledger.route.from": redact(str(data.get("from_route"))),
                     "ledger.route.to": redact(str(data.get("to_route")))}
            if isinstance(cause, Mapping) and cause.get("category"):
                attrs["ledger.failure.category"] = str(cause["category"])
            self.tel.instruments.failovers.add(1, attrs)

    def _base_attrs(self, begin: Begin) -> dict[str, Any]:
        route = begin.route
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider_name(route),
            "gen_ai.request.model": redact(route.model),
            "ledger.run_id": self.run_id,
            "ledger.turn_id": begin.turn_id,
            "ledger.attempt_id": begin.attempt_id,
            "ledger.attempt.kind": begin.kind.value,
            "ledger.route": redact(route.id),
            "ledger.capacity_group": redact(route.group),
            "ledger.recipient": redact(route.recipient),
            "ledger.protocol": route.protocol.value,
            "ledger.debit.reserved": float(begin.reserve),
        }
        if begin.profile_id:
            attrs["ledger.profile_id"] = begin.profile_id  # the profile's name, never its secret
        if route.endpoint:
            parts = urlsplit(route.endpoint)
            if parts.hostname:
                attrs["server.address"] = parts.hostname
                port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
                if port:
                    attrs["server.port"] = port
        env = self.envelope
        if env.max_output_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = env.max_output_tokens
        for name in _REQUEST_PARAMS:
            v = env.params.get(name)
            if isinstance(v, int | float) and not isinstance(v, bool):
                attrs[f"gen_ai.request.{name}"] = v
        if self.tel.capture_content:
            system, messages = _input_messages(env)
            if system:
                attrs["gen_ai.system_instructions"] = json.dumps(system, ensure_ascii=False)
            attrs["gen_ai.input.messages"] = json.dumps(messages, ensure_ascii=False)
        return attrs

    @staticmethod
    def _metric_attrs(begin: Begin) -> dict[str, Any]:
        route = begin.route
        return {"gen_ai.operation.name": "chat", "gen_ai.provider.name": provider_name(route),
                "gen_ai.request.model": redact(route.model), "ledger.route": redact(route.id),
                "ledger.capacity_group": redact(route.group),
                "ledger.attempt.kind": begin.kind.value}

    def _open(self, begin: Begin, record: AttemptRecord) -> None:
        from opentelemetry import context, trace

        self.attempts += 1
        attrs = self._base_attrs(begin)
        attrs["ledger.attempt.seq"] = record.seq
        attrs["ledger.debit_id"] = record.debit_id
        span = self.tel.tracer.start_span(
            f"chat {redact(begin.route.model)}", context=self.turn_ctx, kind=trace.SpanKind.CLIENT,
            attributes=attrs, start_time=self.begin_ns or None)
        # Current while it is sent: spans of the host's HTTP instrumentation nest under it.
        token = context.attach(trace.set_span_in_context(span, self.turn_ctx))
        server: dict[str, Any] = {k: attrs[k] for k in ("server.address", "server.port")
                                  if k in attrs}
        self.open[begin.attempt_id] = _AttemptSpan(span, token, self._metric_attrs(begin),
                                                   server)

    def _rejected(self, begin: Begin, error: CapacityUnavailable) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        self.attempts += 1
        attrs = self._base_attrs(begin)
        reason = str(error.fields.get("reason") or "")
        attrs.update({"ledger.outcome": AttemptState.REJECTED.value, "error.type": "rejected",
                      "ledger.debit.state": "voided"})
        if error.fields.get("seq"):
            attrs["ledger.attempt.seq"] = int(error.fields["seq"])
        if reason:
            attrs["ledger.reject_reason"] = redact(reason)
        span = self.tel.tracer.start_span(
            f"chat {redact(begin.route.model)}", context=self.turn_ctx, kind=trace.SpanKind.CLIENT,
            attributes=attrs, start_time=self.begin_ns or None)
        span.set_status(Status(StatusCode.ERROR, "rejected by admission: nothing was sent"))
        span.end()
        self.tel.instruments.attempts.add(1, {**self._metric_attrs(begin),
                                              "ledger.outcome": AttemptState.REJECTED.value,
                                              "error.type": "rejected"})

    def _sent(self, att: _AttemptSpan, result: SendResult) -> None:
        """What the send reported, before the settle: the answer's shape, and (opted in) text."""
        out = result.output
        finish = getattr(out, "finish_reason", None)
        if isinstance(finish, str) and finish:
            att.span.set_attribute("gen_ai.response.finish_reasons", [redact(finish)])
        if self.tel.capture_content and result.ok:
            att.span.set_attribute("gen_ai.output.messages", json.dumps(
                _output_messages(out, finish), ensure_ascii=False))

    def _close(self, att: _AttemptSpan, record: AttemptRecord | None,
               error: BaseException | None, *, unsettled: bool = False) -> None:
        from opentelemetry import context
        from opentelemetry.trace import Status, StatusCode

        span, inst = att.span, self.tel.instruments
        metric = dict(att.attrs)
        if record is not None:
            state = record.state.value
            attrs: dict[str, Any] = {"ledger.outcome": state}
            if record.model_reported:
                attrs["gen_ai.response.model"] = redact(record.model_reported)
                metric["gen_ai.response.model"] = attrs["gen_ai.response.model"]
            if record.prompt_tokens is not None:
                attrs["gen_ai.usage.input_tokens"] = record.prompt_tokens
            if record.completion_tokens is not None:
                attrs["gen_ai.usage.output_tokens"] = record.completion_tokens
            # Semconv v1.41's names for the parts of those totals.
            if record.cached_tokens is not None:
                attrs["gen_ai.usage.cache_read.input_tokens"] = record.cached_tokens
            if record.reasoning_tokens is not None:
                attrs["gen_ai.usage.reasoning.output_tokens"] = record.reasoning_tokens
            if record.first_token_s is not None:
                attrs["gen_ai.response.time_to_first_chunk"] = record.first_token_s
            if record.first_byte_s is not None:
                attrs["ledger.attempt.time_to_first_byte"] = record.first_byte_s
            if record.debit_state is not None:
                attrs["ledger.debit.state"] = record.debit_state.value
            if record.cost is not None:
                attrs["ledger.cost"] = float(record.cost)
            fact = record.fact
            etype: str | None = None
            if record.category:
                attrs["ledger.failure.category"] = record.category
                etype = record.category
            if fact is not None:
                attrs["ledger.failure.phase"] = fact.phase.value
                attrs["ledger.failure.scope"] = fact.scope.value
                if fact.message and self.tel.capture_content:
                    attrs["ledger.failure.message"] = redact(fact.message)
            if record.http_status is not None:
                attrs["http.response.status_code"] = record.http_status
            if record.state is not AttemptState.SUCCEEDED:
                # Whether a failed attempt had delivered output (then it ran, may be billed).
                attrs["ledger.effective_output"] = record.effective_output
                etype = etype or att.send_error or state
                attrs["error.type"] = etype
                span.set_status(Status(StatusCode.ERROR, _describe(record)))
            if record.tool_started:
                # The host started a tool this Attempt proposed: the turn may not move on.
                attrs["ledger.tool_started"] = True
            span.set_attributes(attrs)
            metric["ledger.outcome"] = state
            if etype is not None:
                metric["error.type"] = etype
            if record.category:
                metric["ledger.failure.category"] = record.category
            inst.attempts.add(1, metric)
            if record.latency_s is not None:
                inst.attempt_duration.record(record.latency_s, metric)
            elif record.settled_at is not None:
                inst.attempt_duration.record(max(0.0, record.settled_at - record.created_at),
                                             metric)
            if record.first_token_s is not None:
                inst.first_chunk.record(record.first_token_s, {
                    **{k: v for k, v in metric.items() if k in _OPERATION_KEYS}, **att.server})
            if record.first_byte_s is not None:
                inst.first_byte.record(record.first_byte_s, metric)
            _record_usage(inst, att, record, metric)
        else:
            # The settle was refused or never came: the row stays as it was (dispatching, for
            # recovery to resolve); the span says so rather than guessing an outcome.
            etype = type(error).__name__ if error is not None else "unsettled"
            span.set_attributes({"ledger.outcome": AttemptState.DISPATCHING.value,
                                 "ledger.settle.error": etype, "error.type": etype})
            span.set_status(Status(StatusCode.ERROR, "the turn ended before this attempt was "
                                   "settled" if unsettled else f"settle not written: {etype}"))
        context.detach(att.token)
        span.end()


def _record_usage(inst: _Instruments, att: _AttemptSpan, record: AttemptRecord,
                  metric: Mapping[str, Any]) -> None:
    if att.send_s is not None and record.state is not AttemptState.NOT_SENT:
        op = {**{k: v for k, v in metric.items() if k in _OPERATION_KEYS}, **att.server}
        inst.operation_duration.record(att.send_s, op)
    base = {k: v for k, v in metric.items() if k in _TOKEN_KEYS}
    if record.prompt_tokens is not None:
        inst.token_usage.record(record.prompt_tokens, {**base, "gen_ai.token.type": "input"})
    if record.completion_tokens is not None:
        inst.token_usage.record(record.completion_tokens,
                                {**base, "gen_ai.token.type": "output"})


_OPERATION_KEYS = frozenset({"gen_ai.operation.name", "gen_ai.provider.name",
                             "gen_ai.request.model", "gen_ai.response.model", "error.type",
                             "ledger.route"})
_TOKEN_KEYS = frozenset({"gen_ai.operation.name", "gen_ai.provider.name",
                         "gen_ai.request.model", "gen_ai.response.model", "ledger.route"})


def _describe(record: AttemptRecord) -> str:
    what = record.category or record.state.value
    status = f" (HTTP {record.http_status})" if record.http_status else ""
    return f"{record.state.value}: {what}{status}"


def _input_messages(env: Envelope) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The envelope as semconv's system instructions and input messages, every text redacted.

    Consecutive parts of one role form one message. A tool result that is files alone
    (:func:`~ledger.domain.carried.files_alone`: an empty ``tool`` part beside them, or none)
    is a ``tool_call_response`` whose response is those files, described as a user's are: the
    call's result, as the codecs send it, rather than an empty text or no response at all.
    """
    parts = env.parts
    # Files answer a call only as a tool's files, beside the call's results: the usual
    # conversation has none, and is not read again for them.
    alone = (files_alone(parts) if any(p.provenance is not None and p.media_type is not None
                                       and p.role == "user" for p in parts) else {})
    # The first file of a call no tool part answers stands for its result; its other files go
    # in that result, as the files of an empty one do.
    stands_for = lacking_results(parts, alone)
    claimed = {j for files in alone.values() for j in files}
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for i, part in enumerate(parts):
        role = part.role
        if role == "system":
            system.append({"type": "text", "content": redact(part.content)})
            continue
        if i in stands_for:
            k, role = stands_for[i], "tool"
            item: dict[str, Any] = {"type": "tool_call_response", "id": parts[k].tool_call_id,
                                    "response": [_media_item(parts[j]) for j in alone[k]]}
        elif i in claimed:
            continue  # in its call's tool_call_response
        elif role == "tool":
            response: Any = redact(part.content)
            if i in alone:
                response = [_media_item(parts[j]) for j in alone[i]]
            item = {"type": "tool_call_response", "id": part.tool_call_id, "response": response}
        elif part.media_type is not None:
            item = _media_item(part)
        elif role == "assistant" and part.tool_call_id is not None:
            # A tool call of an earlier turn carried back (its arguments as JSON text).
            item = {"type": "tool_call", "id": part.tool_call_id,
                    "name": redact(part.name or ""), "arguments": _arguments(part.content)}
        else:
            item = {"type": "text", "content": redact(part.content)}
        if messages and messages[-1]["role"] == role:
            messages[-1]["parts"].append(item)
        else:
            messages.append({"role": role, "parts": [item]})
    return system, messages


def _media_item(part: Any) -> dict[str, Any]:
    """An image, document or reasoning item as semconv describes it, without its bytes."""
    kind = part.kind.value if part.kind is not None else "file"
    if kind == "reasoning":
        return {"type": "reasoning"}  # opaque, encrypted: nothing to show
    if part.link is not None:
        return {"type": "uri", "modality": kind, "mime_type": part.media_type,
                "uri": redact(part.link)}
    # The bytes stay out of telemetry (size, and what a document holds); their size is shown.
    return {"type": "blob", "modality": kind, "mime_type": part.media_type,
            "size": len(part.payload or b"")}


def _arguments(text: str) -> Any:
    """Tool-call arguments as semconv wants them (an object), redacted; text if not JSON."""
    try:
        return redact_data(json.loads(text))
    except ValueError:
        return redact(text)


def _output_messages(out: Any, finish: Any) -> list[dict[str, Any]]:
    """The answer as semconv's output messages (redacted).

    Its text, the images and documents it returned (described, never their bytes) and its
    tool-call proposals.
    """
    text = out if isinstance(out, str) else getattr(out, "text", None)
    parts: list[dict[str, Any]] = []
    if isinstance(text, str) and text:
        parts.append({"type": "text", "content": redact(text)})
    for media in getattr(out, "media", None) or ():  # images a model returned: described
        kind = kind_of(media.media_type)
        modality = kind.value if kind is not None else "file"
        if media.url is not None:
            parts.append({"type": "uri", "modality": modality, "mime_type": media.media_type,
                          "uri": redact(media.url)})
        else:
            parts.append({"type": "blob", "modality": modality,
                          "mime_type": media.media_type, "size": len(media.data or b"")})
    calls: Sequence[Any] = getattr(out, "tool_calls", None) or ()
    for call in calls:
        args = getattr(call, "arguments", None)
        parts.append({"type": "tool_call", "id": getattr(call, "id", None),
                      "name": redact(str(getattr(call, "name", ""))),
                      "arguments": redact_data(args) if args is not None
                      else redact(str(getattr(call, "arguments_json", "")))})
    message: dict[str, Any] = {"role": "assistant", "parts": parts}
    if isinstance(finish, str) and finish:
        message["finish_reason"] = finish
    return [message]


__all__ = [
    "INSTRUMENTATION_NAME",
    "SCHEMA_URL",
    "SEMCONV_VERSION",
    "Telemetry",
    "active",
    "disable",
    "enable",
    "observed",
    "provider_name",
]
