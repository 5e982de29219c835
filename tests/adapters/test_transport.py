"""Transport errors mapped to exact kinds and phases, with real sockets on loopback."""

from __future__ import annotations

import json
import ssl
import time
from pathlib import Path

import pytest

from ledger.adapters import ClientRegistry, HttpAdapter, StaticSecretProvider
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport
from ledger.testing import Behavior, FakeProvider, Fault
from tests.netfaults import closed_port

from .conftest import FAST, PATIENT, PROFILE, PROTOCOLS, SECRET, adapter_for, make_route

pytestmark = pytest.mark.anyio

ENV = Envelope(parts=[Part(content="hello")])


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_dns_failure_is_before_send(adapter: HttpAdapter, protocol: str) -> None:
    route = make_route("http://no-such-provider.invalid/v1", protocol)
    result = await adapter.send(route, ENV, profile_id=PROFILE)
    obs = result.observation
    assert obs is not None and not result.ok
    assert (obs.transport, obs.phase, obs.status) == (
        Transport.DNS_FAILURE,
        Phase.BEFORE_SEND,
        None,
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_connection_refused_is_before_send(adapter: HttpAdapter, protocol: str) -> None:
    route = make_route(f"http://127.0.0.1:{closed_port()}", protocol)
    result = await adapter.send(route, ENV, profile_id=PROFILE)
    obs = result.observation
    assert obs is not None
    assert (obs.transport, obs.phase) == (Transport.CONNECT_REFUSED, Phase.BEFORE_SEND)


async def test_connect_timeout_is_before_send(fast_adapter: HttpAdapter,
                                              full_backlog: int) -> None:
    route = make_route(f"http://127.0.0.1:{full_backlog}", "openai")
    t0 = time.monotonic()
    result = await fast_adapter.send(route, ENV, profile_id=PROFILE)
    elapsed = time.monotonic() - t0
    obs = result.observation
    assert obs is not None
    assert (obs.transport, obs.phase) == (Transport.CONNECT_TIMEOUT, Phase.BEFORE_SEND)
    assert FAST.connect_timeout_s * 0.9 <= elapsed < FAST.connect_timeout_s + 3.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_tls_to_a_plain_http_server_is_a_tls_error(
    adapter: HttpAdapter, fake: FakeProvider, protocol: str
) -> None:
    route = make_route(fake.endpoint(protocol).replace("http://", "https://"), protocol)
    result = await adapter.send(route, ENV, profile_id=PROFILE)
    obs = result.observation
    assert obs is not None
    assert (obs.transport, obs.phase) == (Transport.TLS_ERROR, Phase.BEFORE_SEND)
    assert fake.requests == []  # no HTTP request ever reached the server


async def test_reset_during_tls_handshake_is_a_reset_before_send(
    adapter: HttpAdapter, fake: FakeProvider
) -> None:
    fake.reset_next_connections(1)
    route = make_route(fake.endpoint("openai").replace("http://", "https://"), "openai")
    result = await adapter.send(route, ENV, profile_id=PROFILE)
    obs = result.observation
    assert obs is not None
    assert (obs.transport, obs.phase) == (Transport.CONNECTION_RESET, Phase.BEFORE_SEND)
    assert fake.requests == []


async def test_self_signed_certificate_is_a_tls_error_and_trusted_ca_works(
    self_signed: tuple[Path, Path],
) -> None:
    cert, key = self_signed
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    secrets = StaticSecretProvider({PROFILE: SECRET})
    async with FakeProvider(ssl=server_ctx) as fake:
        route = make_route(fake.endpoint("anthropic"), "anthropic")
        assert route.endpoint is not None and route.endpoint.startswith("https://")
        async with HttpAdapter(secrets=secrets, limits=FAST) as untrusting:
            result = await untrusting.send(route, ENV, profile_id=PROFILE)
        obs = result.observation
        assert obs is not None
        assert (obs.transport, obs.phase) == (Transport.TLS_ERROR, Phase.BEFORE_SEND)
        assert "CERTIFICATE_VERIFY_FAILED" in (obs.message or "")
        trusting_ctx = ssl.create_default_context(cafile=str(cert))
        async with HttpAdapter(secrets=secrets, limits=FAST, verify=trusting_ctx) as trusting:
            ok = await trusting.send(route, ENV, profile_id=PROFILE)
        assert ok.ok and ok.text
        assert len(fake.requests) == 1


@pytest.mark.parametrize("trust_env", [True, False])
async def test_ssl_cert_file_is_trusted_only_with_the_environment(
    self_signed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, trust_env: bool
) -> None:
    # httpx's rule: with verify=True, SSL_CERT_FILE names the authorities to trust (a
    # company's TLS-inspecting proxy); ClientRegistry(trust_env=False) ignores it with the
    # proxy variables.
    cert, key = self_signed
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    async with FakeProvider(ssl=server_ctx) as fake:
        route = make_route(fake.endpoint("openai"), "openai")
        async with HttpAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=FAST,
                               clients=ClientRegistry(trust_env=trust_env)) as adapter:
            result = await adapter.send(route, ENV, profile_id=PROFILE)
    if trust_env:
        assert result.ok and len(fake.requests) == 1
    else:
        obs = result.observation
        assert obs is not None and (obs.transport, obs.phase) == (Transport.TLS_ERROR,
                                                                  Phase.BEFORE_SEND)
        assert fake.requests == []


async def test_connections_are_pooled_per_endpoint(
    adapter: HttpAdapter, fake: FakeProvider
) -> None:
    for protocol in PROTOCOLS:  # four protocols, one origin: one client, one connection
        for stream in (False, True):
            envelope = Envelope(parts=[Part(content="hi")], stream=stream)
            r = await adapter.send(
                make_route(fake.endpoint(protocol), protocol), envelope, profile_id=PROFILE
            )
            assert r.ok
    assert len(fake.requests) == 2 * len(PROTOCOLS)
    assert fake.connections == 1


async def test_a_failed_stream_is_never_reused(driver: str, fake: FakeProvider) -> None:
    # The stall ends at the first-token limit: 2 s, not the patient 10 (the second send's first
    # token still has all of 2 s on a loaded machine).
    limits = PATIENT.model_copy(update={"first_token_timeout_s": 2.0, "idle_timeout_s": 2.0})
    fake.enqueue(Fault.STALL)
    route = make_route(fake.endpoint("openai"), "openai")
    stream = Envelope(parts=[Part(content="hi")], stream=True)
    async for adapter in adapter_for(driver, limits):
        assert not (await adapter.send(route, stream, profile_id=PROFILE)).ok
        assert (await adapter.send(route, stream, profile_id=PROFILE)).ok
    assert fake.connections == 2


@pytest.mark.parametrize(
    "fault", [Fault.RESET_BEFORE_HEADERS, Fault.CLOSE_BEFORE_HEADERS, Fault.SERVER_ERROR]
)
async def test_nothing_is_retried_underneath(
    adapter: HttpAdapter, fake: FakeProvider, fault: Fault
) -> None:
    route = make_route(fake.endpoint("openai"), "openai")
    assert (await adapter.send(route, ENV, profile_id=PROFILE)).ok  # a pooled connection now
    fake.enqueue(fault)
    result = await adapter.send(route, ENV, profile_id=PROFILE)
    assert not result.ok
    assert len(fake.requests) == 2  # the failed request was sent exactly once


def test_client_registry_keys_by_origin() -> None:
    assert ClientRegistry.origin("https://API.example.com:8443/v1/chat") == (
        "https://api.example.com:8443"
    )
    assert ClientRegistry.origin("http://h/v1") != ClientRegistry.origin("https://h/v1")


async def test_a_providers_cookie_never_rides_on_another_request(
    adapter: HttpAdapter, fake: FakeProvider
) -> None:
    # One client per origin serves every Run and tenant: a cookie one answer set (a CDN's bot
    # or affinity cookie, as OpenAI's edge sends) would otherwise go out with every later
    # request to that origin, whoever made it.
    body = json.dumps({
        "id": "c1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }).encode()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"set-cookie: __cf_bm=tenant-a-session; path=/; HttpOnly\r\n"
        b"set-cookie: affinity=backend-7; path=/v1; max-age=3600\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body,)))
    route = make_route(fake.endpoint("openai"), "openai")
    assert (await adapter.send(route, ENV, profile_id=PROFILE)).ok
    for protocol in PROTOCOLS:
        r = await adapter.send(make_route(fake.endpoint(protocol), protocol), ENV,
                               profile_id=PROFILE)
        assert r.ok
    assert len(fake.requests) == 1 + len(PROTOCOLS)
    assert [r.headers.get("cookie") for r in fake.requests] == [None] * len(fake.requests)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_endpoints_query_stays_on_the_url_after_the_protocols_path(
        adapter: HttpAdapter, fake: FakeProvider, protocol: str, stream: bool) -> None:
    # Azure OpenAI's endpoints need ?api-version=: the path goes before it, not into it.
    plain = await adapter.send(make_route(fake.endpoint(protocol), protocol),
                               ENV.model_copy(update={"stream": stream}), profile_id=PROFILE)
    queried = await adapter.send(
        make_route(fake.endpoint(protocol) + "/?api-version=2024-10-21&x=a%2Fb", protocol),
        ENV.model_copy(update={"stream": stream}), profile_id=PROFILE)
    assert plain.ok and queried.ok, queried.observation
    before, after = fake.requests
    assert after.path == before.path
    assert after.query == "&".join(q for q in (before.query, "api-version=2024-10-21&x=a%2Fb")
                                   if q)
