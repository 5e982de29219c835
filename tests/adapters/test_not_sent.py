"""Never sent is not unknown: every adapter result says whether any byte of the request left.

A route whose configuration cannot make a request is a ``cannot_build`` result (never an
exception), not sent, with a message naming the problem and the fix. Over real loopback, connect
refused, DNS, TLS and connect-timeout failures are not sent; a reset after the request was written
is sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import ClassVar

import pytest

from ledger.adapters import EnvSecretProvider, HttpAdapter, StaticSecretProvider, to_send_result
from ledger.adapters.contract import _CODECS, WireRequest, register_codec
from ledger.adapters.openai import OpenAICodec
from ledger.decide.classify import classify
from ledger.decide.effects import SendProgress
from ledger.domain.envelope import Envelope, Part, ToolSpec
from ledger.domain.facts import Category, Phase, Source, Transport, WireProtocol
from ledger.domain.values import Route
from ledger.errors import InvalidArgument
from ledger.policy.load import PRESETS, preset
from ledger.testing import FakeProvider, Fault
from tests.netfaults import closed_port

from .conftest import FAST, PROFILE, PROTOCOLS, SECRET, make_route

pytestmark = pytest.mark.anyio

ENV = Envelope(parts=[Part(content="hello")])
# Where the outcome must not depend on timing: a loaded machine may pause the fake a while.
PATIENT = FAST.model_copy(update={"read_timeout_s": 10.0, "first_token_timeout_s": 10.0,
                                  "idle_timeout_s": 10.0, "total_timeout_s": 20.0,
                                  "connect_timeout_s": 10.0})


@pytest.fixture
async def patient() -> AsyncIterator[HttpAdapter]:
    async with HttpAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT) as a:
        yield a


def _assert_cannot_build(result: object, *needles: str) -> None:
    from ledger.adapters import AdapterResult

    assert isinstance(result, AdapterResult)
    assert not result.ok and not result.sent
    obs = result.observation
    assert obs is not None
    assert (obs.transport, obs.phase, obs.source) == (
        Transport.CANNOT_BUILD,
        Phase.BEFORE_SEND,
        Source.LOCAL,
    )
    assert obs.status is None and not obs.effective_output
    for needle in needles:
        assert needle in (obs.message or ""), (needle, obs.message)
    assert SECRET not in (obs.message or "")
    for name in PRESETS:
        fact = classify(obs, preset(name))
        assert (fact.category, fact.phase) == (Category.UNUSABLE, Phase.BEFORE_SEND), name
    send = to_send_result(result, "a-1")
    assert not send.ok and not send.sent and send.observation == obs


@pytest.mark.parametrize(
    ("endpoint", "protocol", "needles"),
    [
        (None, "openai", ["has no endpoint", "set Route.endpoint"]),
        ("   ", "openai", ["has no endpoint"]),
        ("api.openai.com/v1", "openai", ["no http:// or https:// scheme", "full URL"]),
        ("ftp://h/v1", "anthropic", ["http:// or https://", "'ftp'"]),
        ("http://", "gemini", ["no http:// or https:// scheme and host"]),
        ("http://u:pw@127.0.0.1:9/v1", "openai", ["credentials in the URL", "credential profile"]),
        ("http://127.0.0.1:99999/v1", "openai", ["invalid port"]),
        ("http://127.0.0.1:9/v1#frag", "openai", ["http://127.0.0.1", "#fragment", "remove it"]),
        ("http://127.0.0.1:9/v1?api-version=1#frag", "gemini", ["#fragment"]),
        ("http://exa mple.com/v1", "openai", ["invalid host name"]),
        ("http://[::1/v1", "anthropic", ["not a usable URL"]),
        ("ENDPOINT", "generic", ["no adapter for protocol 'generic'", "register_codec"]),
    ],
)
async def test_a_route_that_cannot_build_a_request_is_a_not_sent_result(
    adapter: HttpAdapter,
    fake: FakeProvider,
    endpoint: str | None,
    protocol: str,
    needles: list[str],
) -> None:
    ep = fake.endpoint("openai") if endpoint == "ENDPOINT" else endpoint
    route = make_route(ep, protocol)  # type: ignore[arg-type]
    result = await adapter.send(route, ENV, profile_id=PROFILE)
    _assert_cannot_build(result, *needles)
    assert fake.requests == [] and fake.connections == 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_no_secret_names_the_variables_to_set(fake: FakeProvider, protocol: str) -> None:
    async with HttpAdapter(secrets=EnvSecretProvider({}), limits=FAST) as a:
        result = await a.send(make_route(fake.endpoint(protocol), protocol), ENV,
                              profile_id=PROFILE)
    conventional = {"openai": "OPENAI_API_KEY", "openai_responses": "OPENAI_API_KEY",
                    "anthropic": "ANTHROPIC_API_KEY", "gemini": "GEMINI_API_KEY"}[protocol]
    _assert_cannot_build(result, "no secret for credential profile 'fake:default'; set "
                         f"LEDGER_SECRET_FAKE_DEFAULT or {conventional}")
    async with HttpAdapter(secrets=StaticSecretProvider({}), limits=FAST) as a:
        result = await a.send(make_route(fake.endpoint(protocol), protocol), ENV,
                              profile_id=PROFILE)
    _assert_cannot_build(result, "add it to the StaticSecretProvider")
    assert fake.connections == 0


async def test_a_failing_secret_provider_is_not_sent(fake: FakeProvider) -> None:
    class Vault:
        def get(self, profile_id: str, *, protocol: object) -> str | None:
            raise ConnectionError("vault is sealed")

    async with HttpAdapter(secrets=Vault(), limits=FAST) as a:  # type: ignore[arg-type]
        result = await a.send(make_route(fake.endpoint("openai"), "openai"), ENV,
                              profile_id=PROFILE)
    _assert_cannot_build(result, "secret provider Vault failed", "vault is sealed")


@pytest.mark.parametrize("bad", [SECRET + "\n", " " + SECRET, SECRET + "\u00e9", "sk-\x00abcdef"])
async def test_a_secret_that_cannot_go_in_a_header_is_not_sent(
    fake: FakeProvider, bad: str
) -> None:
    async with HttpAdapter(secrets=StaticSecretProvider({PROFILE: bad}), limits=FAST) as a:
        result = await a.send(make_route(fake.endpoint("anthropic"), "anthropic"), ENV,
                              profile_id=PROFILE)
    _assert_cannot_build(result, "cannot go in an HTTP header")
    assert bad.strip() not in (result.observation.message or "")  # type: ignore[union-attr]
    assert fake.connections == 0


@pytest.mark.parametrize(
    ("envelope", "field"),
    [
        # Envelope(...) refuses such params (InvalidArgument naming `params`); built without
        # validation here, the adapter refuses them the same way, as preflight does in a turn.
        (Envelope.model_construct(parts=[Part(content="hi")], params={"seed": {1, 2}},
                                  tools=[], stream=False, max_output_tokens=None),
         "envelope.params.seed"),
        (Envelope.model_construct(parts=[Part(content="hi")],
                                  params={"temperature": float("nan")}, tools=[], stream=False,
                                  max_output_tokens=None),
         "envelope.params.temperature"),
        (Envelope(parts=[Part(content="hi"), Part(content="lone \ud800 surrogate")]),
         "envelope.parts[1].content"),
        # A tool's schema built without validation: before, the codec built it into a body
        # the adapter then could not encode (cannot_build), on every route of a turn.
        (Envelope(parts=[Part(content="hi")], tools=[ToolSpec.model_construct(
            name="t", description="", parameters={"x": float("nan")},
            data_class="tool_description")]), "envelope.tools[0].parameters.x"),
    ],
    ids=["set", "nan", "surrogate", "tool nan"],
)
async def test_a_body_no_json_can_carry_is_caller_misuse_not_sent(
    adapter: HttpAdapter, fake: FakeProvider, envelope: Envelope, field: str
) -> None:
    """Text or params no UTF-8 JSON body carries are the caller's (the rule a turn's
    preflight applies before its begin), refused before anything is sent."""
    with pytest.raises(InvalidArgument) as ei:
        await adapter.send(make_route(fake.endpoint("openai"), "openai"), envelope,
                           profile_id=PROFILE)
    assert ei.value.field == field
    assert fake.connections == 0


class _NaNCodec(OpenAICodec):
    """A host's codec that puts into the body what no envelope holds: a NaN of its own."""

    protocol: ClassVar[WireProtocol] = WireProtocol.GENERIC

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        wire = super().build_request(route, envelope)
        return WireRequest(url=wire.url, headers=wire.headers,
                           body={**wire.body, "x-weight": float("nan")}, notes=wire.notes)


@pytest.fixture
def nan_codec() -> Iterator[None]:
    assert WireProtocol.GENERIC not in _CODECS
    register_codec(_NaNCodec())
    try:
        yield
    finally:
        del _CODECS[WireProtocol.GENERIC]


async def test_a_body_a_codec_makes_unencodable_is_not_sent(
    adapter: HttpAdapter, fake: FakeProvider, nan_codec: None
) -> None:
    """What the envelope rules cannot see (here a codec of the host's own that adds a NaN)
    still never leaves: the adapter's encoding is the last defence."""
    result = await adapter.send(make_route(fake.endpoint("openai"), "generic"), ENV,
                                profile_id=PROFILE)
    _assert_cannot_build(result, "cannot be JSON-encoded", "Envelope.params")
    assert fake.connections == 0


# -- over real loopback ------------------------------------------------------------------------


async def test_connect_refused_is_not_sent(patient: HttpAdapter) -> None:
    route = make_route(f"http://127.0.0.1:{closed_port()}/v1", "openai")
    result = await patient.send(route, ENV, profile_id=PROFILE)
    obs = result.observation
    assert obs is not None and not result.sent
    assert (obs.transport, obs.phase) == (Transport.CONNECT_REFUSED, Phase.BEFORE_SEND)


async def test_dns_failure_is_not_sent(patient: HttpAdapter) -> None:
    result = await patient.send(make_route("http://nonexistent.invalid/v1", "openai"), ENV,
                                profile_id=PROFILE)
    obs = result.observation
    assert obs is not None and not result.sent
    assert (obs.transport, obs.phase) == (Transport.DNS_FAILURE, Phase.BEFORE_SEND)


async def test_tls_to_a_plain_http_server_is_not_sent(
    patient: HttpAdapter, fake: FakeProvider
) -> None:
    route = make_route(fake.endpoint("gemini").replace("http://", "https://"), "gemini")
    result = await patient.send(route, ENV, profile_id=PROFILE)
    obs = result.observation
    assert obs is not None and not result.sent
    assert (obs.transport, obs.phase) == (Transport.TLS_ERROR, Phase.BEFORE_SEND)
    assert fake.requests == []  # the server saw a ClientHello, never a request


async def test_connect_timeout_is_not_sent(fast_adapter: HttpAdapter, full_backlog: int) -> None:
    # The connect limit is what ends it: the fast one (a patient one made this test wait 10 s).
    route = make_route(f"http://127.0.0.1:{full_backlog}/v1", "anthropic")
    result = await fast_adapter.send(route, ENV, profile_id=PROFILE)
    obs = result.observation
    assert obs is not None and not result.sent
    assert (obs.transport, obs.phase) == (Transport.CONNECT_TIMEOUT, Phase.BEFORE_SEND)


@pytest.mark.parametrize("fault", [Fault.RESET_BEFORE_HEADERS, Fault.CLOSE_BEFORE_HEADERS])
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_reset_after_the_request_was_written_is_sent(
    patient: HttpAdapter, fake: FakeProvider, protocol: str, fault: Fault
) -> None:
    fake.enqueue(fault)
    result = await patient.send(make_route(fake.endpoint(protocol), protocol), ENV,
                                profile_id=PROFILE)
    obs = result.observation
    assert obs is not None and result.sent
    assert (obs.transport, obs.phase) == (Transport.CONNECTION_RESET, Phase.AFTER_SEND)
    assert len(fake.requests) == 1  # the server really read the request
    assert to_send_result(result, "a-1").sent


async def test_answers_and_provider_errors_are_sent(
    patient: HttpAdapter, fake: FakeProvider
) -> None:
    ok = await patient.send(make_route(fake.endpoint("openai"), "openai"), ENV,
                            profile_id=PROFILE)
    fake.enqueue(Fault.SERVER_ERROR)
    failed = await patient.send(make_route(fake.endpoint("openai"), "openai"), ENV,
                                profile_id=PROFILE)
    assert ok.ok and ok.sent and to_send_result(ok, "a-1").sent
    assert not failed.ok and failed.sent and failed.http_status == 500


async def test_the_callers_progress_says_whether_a_byte_left(
    patient: HttpAdapter, fake: FakeProvider
) -> None:
    unbuildable = SendProgress(handed_over=True)
    await patient.send(make_route(None, "openai"), ENV, profile_id=PROFILE,  # type: ignore[arg-type]
                       progress=unbuildable)
    misuse = SendProgress(handed_over=True)
    with pytest.raises(InvalidArgument):
        await patient.send(make_route(fake.endpoint("openai"), "openai"), ENV,
                           profile_id="not:mine", progress=misuse)
    refused = SendProgress(handed_over=True)
    await patient.send(make_route(f"http://127.0.0.1:{closed_port()}/v1", "openai"), ENV,
                       profile_id=PROFILE, progress=refused)
    fake.enqueue(Fault.RESET_BEFORE_HEADERS)
    reset = SendProgress(handed_over=True)
    await patient.send(make_route(fake.endpoint("openai"), "openai"), ENV, profile_id=PROFILE,
                       progress=reset)
    assert [p.provably_unsent for p in (unbuildable, misuse, refused, reset)] == [
        True, True, True, False]
