"""The Attempt on the wire: every request names its Attempt, and the ledger records the names.

Real turns over loopback HTTP (the fake provider records every request it received, headers
included) on both backends: each request's ``X-Ledger-Attempt`` is the id of an Attempt row, the
headers the ledger recorded with that Attempt (its ``select`` event, written before the send) are
exactly the ones that arrived, a failover's or a retry's requests carry one id each, and the
provider's own client-request-id header (OpenAI's ``X-Client-Request-Id``) arrives exactly on the
protocols whose provider documents one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, ClassVar
from urllib.parse import unquote

import httpx
import pytest

from ledger.adapters import (
    ATTEMPT_HEADER,
    HttpAdapter,
    StaticSecretProvider,
    SyncAdapter,
    async_sender,
    attempt_headers,
    register_codec,
    sync_sender,
)
from ledger.adapters.contract import _CODECS, WireRequest
from ledger.adapters.openai import OpenAICodec
from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.turn import aexecute, execute
from ledger.decide.effects import Dispatch, SendResult
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport, WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState, EventRecord
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted, InvalidArgument
from ledger.policy.model import StreamingPolicy
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault, ReceivedRequest
from tests.netfaults import closed_port

from .conftest import PROFILE, SECRET, make_route

PATIENT = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=10.0,
                          first_token_timeout_s=10.0, idle_timeout_s=10.0, total_timeout_s=20.0)
KEYS = {"p:a": "key-a-0123456789", "p:b": "key-b-0123456789"}

# Written out, not derived from the library's table: which headers name the Attempt on each
# protocol. OpenAI documents X-Client-Request-Id (API reference, "Debugging requests");
# Anthropic and Google document no client request id and no idempotency key.
NAMING_HEADERS = {
    "openai": {"x-ledger-attempt", "x-client-request-id"},
    "openai_responses": {"x-ledger-attempt", "x-client-request-id"},
    "anthropic": {"x-ledger-attempt"},
    "gemini": {"x-ledger-attempt"},
}
EVERY_NAMING_HEADER = set().union(*NAMING_HEADERS.values())


class _NoWait:
    def sleep(self, seconds: float) -> None:
        pass

    async def asleep(self, seconds: float) -> None:
        pass


def _plan(a: FakeProvider, b: FakeProvider, protocol: str,
          primary_endpoint: str | None = None) -> list[Route]:
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(4))
    proto = WireProtocol(protocol)
    return [
        Route(id="primary", provider="pa", model="m-primary", group="ga", recipient="ra",
              protocol=proto, endpoint=primary_endpoint or a.endpoint(protocol), price=price,
              profiles=[Profile(id="p:a")]),
        Route(id="backup", provider="pb", model="m-backup", group="gb", recipient="rb",
              protocol=proto, endpoint=b.endpoint(protocol), price=price,
              profiles=[Profile(id="p:b")]),
    ]


_BUDGET = Budget(max_calls=6, max_retries=4, max_cost=Decimal("1"))
_GRANT = Grant(recipients={"ra": ["user_input"], "rb": ["user_input"]})


def _turn(mode: str, db_url: str, protocol: str, *, stream: bool, policy: str = "failure-domain",
          primary_fault: Fault | None = None, primary_closed: bool = False
          ) -> tuple[list[AttemptRecord], list[EventRecord], list[ReceivedRequest], str]:
    """One turn of Run ``r`` through the real adapters (sync or async driver, adapter and
    ledger); what the ledger recorded, what the providers received, and who served."""
    closed = f"http://127.0.0.1:{closed_port()}/v1" if primary_closed else None
    env = Envelope(parts=[Part(content="What changed in the filings?")], stream=stream,
                   max_output_tokens=64)
    shown: list[object] = []
    on_event = shown.append if stream else None

    def outcome_of(result: Any) -> str:
        return str(result.route.id)

    if mode == "sync":
        with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b, \
                SyncAdapter(secrets=StaticSecretProvider(KEYS), limits=PATIENT) as adapter, \
                Ledger.open(db_url) as led:
            if primary_fault is not None:
                a.enqueue(Behavior(fault=primary_fault), model="m-primary")
            led.admit_run("r", plan=_plan(a, b, protocol, closed), policy=policy,
                          budget=_BUDGET, grant=_GRANT)
            lease = led.acquire_lease("r")
            try:
                served = outcome_of(execute(led, lease, env,
                                            sync_sender(adapter, limits=PATIENT,
                                                        on_event=on_event),
                                            sleeper=_NoWait()))
            except FailoverExhausted as e:
                served = f"stop:{e.reason}"
            requests = sorted(a.requests + b.requests, key=lambda r: r.received_at)
            return led.timeline("r"), led.events("r", ["select"]), requests, served

    async def run() -> tuple[list[AttemptRecord], list[EventRecord], list[ReceivedRequest], str]:
        async with FakeProvider() as a, FakeProvider() as b, \
                HttpAdapter(secrets=StaticSecretProvider(KEYS), limits=PATIENT) as adapter:
            if primary_fault is not None:
                a.enqueue(Behavior(fault=primary_fault), model="m-primary")
            async with AsyncLedger.open(db_url) as led:
                await led.admit_run("r", plan=_plan(a, b, protocol, closed), policy=policy,
                                    budget=_BUDGET, grant=_GRANT)
                lease = await led.acquire_lease("r")
                try:
                    served = outcome_of(await aexecute(
                        led, lease, env,
                        async_sender(adapter, limits=PATIENT, on_event=on_event),
                        sleeper=_NoWait()))
                except FailoverExhausted as e:
                    served = f"stop:{e.reason}"
                requests = sorted(a.requests + b.requests, key=lambda r: r.received_at)
                return (await led.timeline("r"), await led.events("r", ["select"]), requests,
                        served)

    return asyncio.run(run())


def _joined(attempts: list[AttemptRecord], selects: list[EventRecord],
            requests: list[ReceivedRequest], protocol: str) -> list[tuple[AttemptRecord, str]]:
    """Join the providers' request log to the ledger's rows by ``X-Ledger-Attempt``.

    Asserts the join is exact: every request names an Attempt of the Run (none twice), every
    Attempt the ledger says may have been sent has its request, and the headers recorded with
    each Attempt are exactly the naming headers its request arrived with. Returns each request's
    Attempt with the route that received it.
    """
    by_id = {a.attempt_id: a for a in attempts}
    recorded = {e.attempt_id: e.data["headers"] for e in selects}
    assert set(recorded) == set(by_id)  # every Attempt recorded its headers at begin
    joined: list[tuple[AttemptRecord, str]] = []
    for req in requests:
        named = req.headers.get(ATTEMPT_HEADER.lower())
        assert named is not None, f"a request to {req.path} names no Attempt"
        att = by_id.get(named)
        assert att is not None, f"request names {named!r}, which is no Attempt of the Run"
        arrived = {k: v for k, v in req.headers.items() if k in EVERY_NAMING_HEADER}
        assert set(arrived) == NAMING_HEADERS[protocol]
        assert {k.lower(): v for k, v in recorded[named].items()} == arrived
        assert set(arrived.values()) == {att.attempt_id}
        joined.append((att, req.model or ""))
    ids = [a.attempt_id for a, _ in joined]
    assert len(ids) == len(set(ids)), "an Attempt was sent twice"
    maybe_sent = [a.attempt_id for a in attempts
                  if a.state not in (AttemptState.NOT_SENT, AttemptState.REJECTED)]
    assert sorted(ids) == sorted(maybe_sent)
    return joined


MODES = ["sync", "async"]
PROTOCOLS = list(NAMING_HEADERS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", MODES)
def test_every_request_names_its_attempt_so_provider_logs_join_the_ledger(
    db_url: str, mode: str, protocol: str, stream: bool
) -> None:
    attempts, selects, requests, served = _turn(mode, db_url, protocol, stream=stream)
    assert served == "primary"
    assert len(requests) == 1 and requests[0].stream is stream
    ((att, model),) = _joined(attempts, selects, requests, protocol)
    assert att.route_id == "primary" and model == "m-primary"
    assert att.state is AttemptState.SUCCEEDED


FAILOVERS = [
    # policy, what the primary does, who serves, routes the requests reached in order
    ("failure-domain", Fault.UNAVAILABLE, "backup", ["m-primary", "m-backup"]),
    # goclaw retries an overload on the same route: the same route, a new Attempt, a new id.
    ("goclaw", Fault.OVERLOADED, "primary", ["m-primary", "m-primary"]),
]


@pytest.mark.parametrize(("policy", "fault", "served_by", "reached"), FAILOVERS,
                         ids=["failover", "same-route-retry"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", MODES)
def test_a_failover_turns_two_requests_carry_two_ids_each_its_own_attempts(
    db_url: str, mode: str, protocol: str, policy: str, fault: Fault, served_by: str,
    reached: list[str],
) -> None:
    attempts, selects, requests, served = _turn(mode, db_url, protocol, stream=False,
                                                policy=policy, primary_fault=fault)
    assert served == served_by
    joined = _joined(attempts, selects, requests, protocol)
    assert [model for _, model in joined] == reached
    first, second = (att for att, _ in joined)
    assert first.attempt_id != second.attempt_id
    assert [first.attempt_id, second.attempt_id] == [a.attempt_id for a in attempts]
    assert first.state is AttemptState.FAILED and second.state is AttemptState.SUCCEEDED


@pytest.mark.parametrize("mode", MODES)
def test_an_attempt_that_never_left_has_its_headers_recorded_and_no_request(
    db_url: str, mode: str
) -> None:
    """A refused connection sends nothing: the Attempt is recorded (with the headers it would
    have carried) and joins no request; the next Attempt's request carries its own id."""
    attempts, selects, requests, served = _turn(mode, db_url, "openai", stream=False,
                                                primary_closed=True)
    assert served == "backup"
    ((att, model),) = _joined(attempts, selects, requests, "openai")
    refused = attempts[0]
    assert refused.route_id == "primary" and refused.fact is not None
    assert refused.fact.phase is Phase.BEFORE_SEND
    assert refused.fact.transport is Transport.CONNECT_REFUSED
    assert att.attempt_id == attempts[1].attempt_id != refused.attempt_id
    assert model == "m-backup"


# -- the headers themselves -------------------------------------------------------------------


def test_the_attempt_headers_are_the_id_on_every_protocol_and_the_providers_own_where_documented(
) -> None:
    for protocol, names in NAMING_HEADERS.items():
        headers = attempt_headers("att-7", protocol)
        assert {k.lower() for k in headers} == names
        assert set(headers.values()) == {"att-7"}
    assert attempt_headers("att-7", WireProtocol.GENERIC) == {"X-Ledger-Attempt": "att-7"}


def test_an_id_that_is_not_visible_ascii_is_percent_encoded_and_no_two_ids_share_a_value(
) -> None:
    ids = ["a b", "a%20b", "a%b", "café", "caf%C3%A9", "déjà vu ~!", "att-1"]
    values = [attempt_headers(i, "openai")["X-Ledger-Attempt"] for i in ids]
    assert len(set(values)) == len(ids)
    for i, v in zip(ids, values, strict=True):
        assert v.isascii() and " " not in v and unquote(v) == i
    assert values[-1] == "att-1"  # the ledger's own ids go as they are


def test_openais_header_is_left_out_rather_than_sent_longer_than_openai_accepts() -> None:
    long_id = "é" * 200  # 1,200 characters once percent-encoded; OpenAI accepts 512
    headers = attempt_headers(long_id, "openai")
    assert set(headers) == {"X-Ledger-Attempt"}
    assert unquote(headers["X-Ledger-Attempt"]) == long_id
    assert set(attempt_headers("x" * 200, "openai")) == {"X-Ledger-Attempt",
                                                         "X-Client-Request-Id"}


def test_a_header_of_the_request_never_silently_replaces_or_is_replaced_by_the_attempts() -> None:
    own = {"content-type": "application/json", "x-trace": "t1"}
    assert attempt_headers("att-1", "openai", onto=own) == {
        **own, "X-Ledger-Attempt": "att-1", "X-Client-Request-Id": "att-1"}
    for clash in ("X-Ledger-Attempt", "x-ledger-attempt", "X-CLIENT-REQUEST-ID"):
        with pytest.raises(InvalidArgument) as err:
            attempt_headers("att-1", "openai", onto={**own, clash: "mine"})
        assert err.value.fields["field"] == "headers" and clash in err.value.message
    # Anthropic has no client-request-id header: a host's own is its own business.
    assert attempt_headers("att-1", "anthropic", onto={"x-client-request-id": "mine"}) == {
        "x-client-request-id": "mine", "X-Ledger-Attempt": "att-1"}


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"attempt_id": "", "protocol": "openai"}, "attempt_id"),
    ({"attempt_id": "a\nb", "protocol": "openai"}, "attempt_id"),
    ({"attempt_id": 7, "protocol": "openai"}, "attempt_id"),
    ({"attempt_id": "att-1", "protocol": "smtp"}, "protocol"),
])
def test_bad_attempt_header_arguments_are_typed_errors_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        attempt_headers(**kwargs)
    assert err.value.fields["field"] == field


# -- the adapter, called directly ---------------------------------------------------------------


pytest_anyio = pytest.mark.anyio


@pytest_anyio
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_adapter_sends_the_attempt_headers_only_for_an_attempt(
    fake: FakeProvider, adapter: HttpAdapter, protocol: str
) -> None:
    route = make_route(fake.endpoint(protocol), protocol)
    env = Envelope(parts=[Part(content="hi")])
    assert (await adapter.send(route, env, profile_id=PROFILE, attempt_id="att-direct")).ok
    assert (await adapter.send(route, env, profile_id=PROFILE)).ok
    named, plain = fake.requests
    assert {k for k in named.headers if k in EVERY_NAMING_HEADER} == NAMING_HEADERS[protocol]
    assert named.headers["x-ledger-attempt"] == "att-direct"
    assert not {k for k in plain.headers if k in EVERY_NAMING_HEADER}
    # The credential is still the codec's; the id is no secret and is not redacted.
    assert SECRET in named.headers.get("authorization", "") + named.headers.get(
        "x-api-key", "") + named.headers.get("x-goog-api-key", "")


@pytest_anyio
async def test_an_attempt_id_that_is_not_an_id_is_refused_before_anything_is_sent(
    fake: FakeProvider, adapter: HttpAdapter
) -> None:
    route = make_route(fake.endpoint("openai"), "openai")
    with pytest.raises(InvalidArgument) as err:
        await adapter.send(route, Envelope(parts=[Part(content="hi")]), profile_id=PROFILE,
                           attempt_id="a\r\nX-Injected: 1")
    assert err.value.fields["field"] == "attempt_id"
    assert fake.requests == []


class _ForgingCodec(OpenAICodec):
    """A host's codec that sets a header the ledger reserves (in another letter case)."""

    protocol: ClassVar[WireProtocol] = WireProtocol.GENERIC

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        wire = super().build_request(route, envelope)
        return WireRequest(url=wire.url, headers={**wire.headers, "x-LEDGER-attempt": "forged"},
                           body=wire.body, notes=wire.notes)


@pytest.fixture
def forging_codec() -> Iterator[None]:
    assert WireProtocol.GENERIC not in _CODECS
    register_codec(_ForgingCodec())
    try:
        yield
    finally:
        del _CODECS[WireProtocol.GENERIC]


@pytest_anyio
async def test_a_codec_header_that_would_replace_the_attempts_makes_the_call_cannot_build(
    fake: FakeProvider, adapter: HttpAdapter, forging_codec: None
) -> None:
    route = make_route(fake.endpoint("openai"), "generic")
    env = Envelope(parts=[Part(content="hi")])
    res = await adapter.send(route, env, profile_id=PROFILE, attempt_id="att-real")
    assert not res.ok and not res.sent and res.observation is not None
    assert res.observation.transport is Transport.CANNOT_BUILD
    assert res.observation.phase is Phase.BEFORE_SEND
    assert "x-LEDGER-attempt" in res.observation.message
    assert fake.requests == []
    # Without an Attempt the codec's header is the request's own and goes out as it is.
    assert (await adapter.send(route, env, profile_id=PROFILE)).ok
    assert fake.requests[0].headers["x-ledger-attempt"] == "forged"


# -- a host's own send function -----------------------------------------------------------------


def test_a_host_sender_gets_the_attempt_and_its_headers_on_the_dispatch(db_url: str) -> None:
    """A host that sends with its own HTTP client takes the id and the headers from the
    Dispatch; the provider's log then joins the ledger's rows the same way."""
    dispatches: list[Dispatch] = []
    with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b, \
            Ledger.open(db_url) as led, httpx.Client() as client:
        routes = _plan(a, b, "openai")

        def send(d: Dispatch) -> SendResult:
            dispatches.append(d)
            headers = attempt_headers(d.attempt_id, d.route.protocol, onto={
                "authorization": f"Bearer {KEYS[d.profile_id or '']}",
                "x-host-trace": "trace-1"})
            assert headers == {"authorization": headers["authorization"],
                               "x-host-trace": "trace-1", **d.headers}
            assert d.route.endpoint is not None
            r = client.post(d.route.endpoint + "/chat/completions", headers=headers, json={
                "model": d.route.model, "messages": [{"role": "user", "content": "hi"}]})
            return SendResult(ok=r.status_code == 200, output=r.json())

        led.admit_run("r", plan=routes, policy="failure-domain", budget=_BUDGET, grant=_GRANT)
        res = execute(led, led.acquire_lease("r"),
                      Envelope(parts=[Part(content="hi")]), send, sleeper=_NoWait())
        assert res.route.id == "primary"
        attempts, selects = led.timeline("r"), led.events("r", ["select"])
        ((att, _),) = _joined(attempts, selects, a.requests, "openai")
    (d,) = dispatches
    assert d.attempt_id == att.attempt_id
    assert d.headers == {"X-Ledger-Attempt": att.attempt_id,
                         "X-Client-Request-Id": att.attempt_id}
    assert a.requests[0].headers["x-host-trace"] == "trace-1"
