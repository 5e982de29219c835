"""Secrets: lookup by profile id, and never a key in a result, evidence, exception or log."""

from __future__ import annotations

import json
import logging

import pytest

from ledger.adapters import EnvSecretProvider, HttpAdapter, StaticSecretProvider, env_var_name
from ledger.adapters.secrets import EVIDENCE_CAP_BYTES, REDACTED, evidence_excerpt, redact
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Transport, WireProtocol
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import FAST, PROFILE, PROTOCOLS, SECRET, make_route

pytestmark = pytest.mark.anyio


def test_env_variable_naming() -> None:
    assert env_var_name("openai:work") == "LEDGER_SECRET_OPENAI_WORK"
    assert env_var_name("anthropic/team-a.1") == "LEDGER_SECRET_ANTHROPIC_TEAM_A_1"


def test_env_provider_prefers_the_profile_variable_then_the_provider_default() -> None:
    env = {
        "LEDGER_SECRET_OPENAI_WORK": "sk-profile",
        "OPENAI_API_KEY": "sk-default",
        "GOOGLE_API_KEY": "g-key",
    }
    p = EnvSecretProvider(env)
    assert p.get("openai:work", protocol=WireProtocol.OPENAI) == "sk-profile"
    assert p.get("openai:other", protocol=WireProtocol.OPENAI) == "sk-default"
    assert p.get("anthropic:x", protocol=WireProtocol.ANTHROPIC) is None
    assert p.get("gemini:x", protocol=WireProtocol.GEMINI) == "g-key"
    no_fallback = EnvSecretProvider(env, fallback=False)
    assert no_fallback.get("openai:x", protocol=WireProtocol.OPENAI) is None


def test_redact_known_key_and_token_shapes() -> None:
    text = (
        "key=abcdefgh123 sk-proj-AAAAAAAAAAAAAAAA Bearer eyJhbGciOi.payload.sig "
        "AIzaSyA1234567890abcdefghijklmnopqrstu x-api-key: sk-ant-api03-zzzzzzzzzzzz "
        '"api_key": "hunter2hunter2"'
    )
    out = redact(text, ["abcdefgh123"])
    for leaked in (
        "abcdefgh123",
        "sk-proj-AAAA",
        "eyJhbGciOi",
        "AIzaSyA123",
        "sk-ant-api03",
        "hunter2hunter2",
    ):
        assert leaked not in out
    assert REDACTED in out


def test_evidence_is_capped_and_keeps_the_error_structure() -> None:
    body = json.dumps(
        {
            "error": {
                "message": "x" * 50_000,
                "type": "invalid_request_error",
                "code": "context_length_exceeded",
            }
        }
    )
    ev = evidence_excerpt(body, [])
    assert ev is not None and len(ev.encode()) <= EVIDENCE_CAP_BYTES
    assert json.loads(ev)["error"]["code"] == "context_length_exceeded"
    plain = evidence_excerpt("y" * 10_000, [])
    assert plain is not None and len(plain.encode()) <= EVIDENCE_CAP_BYTES


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [False, True])
async def test_an_echoed_key_never_leaves_the_adapter(
    fake: FakeProvider, protocol: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # httpx, httpcore and ours, at their most talkative
    fake.enqueue(Fault.UNAUTHORIZED)
    async with HttpAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=FAST) as a:
        result = await a.send(
            make_route(fake.endpoint(protocol), protocol),
            Envelope(parts=[Part(content="hi")], stream=stream),
            profile_id=PROFILE,
        )
    (req,) = fake.requests
    # The key was really sent (in a header, never in the URL) and the server echoed it back.
    assert SECRET in json.dumps(req.headers) and SECRET not in req.path + req.query
    assert result.observation is not None and result.observation.status == 401
    assert SECRET not in repr(result)
    assert SECRET not in result.observation.model_dump_json()
    assert REDACTED in (result.evidence or "")
    assert SECRET not in caplog.text
    assert any("r-" + protocol in rec.getMessage() for rec in caplog.records)


async def test_credential_and_cookie_headers_never_reach_an_observation(
        adapter: HttpAdapter, fake: FakeProvider) -> None:
    # Short values that look like no key (which redaction alone would keep), in every header
    # a credential or a cookie travels in.
    dropped = {"set-cookie": "s=1", "set-cookie2": "s2=1", "cookie": "c=1",
               "authorization": "Bearer t0k", "proxy-authorization": "Basic cHJveHk=",
               "x-api-key": "k1", "x-goog-api-key": "k2", "api-key": "azure1",
               "x-amz-security-token": "tok"}
    body = b'{"error": {"message": "slow down", "type": "rate_limit"}}'
    head = "".join(f"{k}: {v}\r\n" for k, v in dropped.items()).encode()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        b"x-request-id: req-7\r\n" + head
        + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body,)))
    result = await adapter.send(make_route(fake.endpoint("openai"), "openai"),
                                Envelope(parts=[Part(content="hi")]), profile_id=PROFILE)
    obs = result.observation
    assert obs is not None and obs.status == 429
    assert obs.headers["x-request-id"] == "req-7"  # the rest is kept
    assert not set(dropped) & set(obs.headers), obs.headers
    assert not any(v in obs.model_dump_json() for v in ("azure1", "t0k", "s2=1", "c=1"))


async def test_huge_error_body_is_capped(adapter: HttpAdapter, fake: FakeProvider) -> None:
    for protocol in PROTOCOLS:
        fake.enqueue(Fault.HUGE_ERROR)
        result = await adapter.send(
            make_route(fake.endpoint(protocol), protocol),
            Envelope(parts=[Part(content="hi")]),
            profile_id=PROFILE,
        )
        obs = result.observation
        assert obs is not None and obs.status == 500
        assert isinstance(obs.body, str) and len(obs.body.encode()) <= EVIDENCE_CAP_BYTES
        assert "error" in json.loads(obs.body)  # still structured for the classifier


async def test_missing_secret_names_the_variable_not_a_value(fake: FakeProvider) -> None:
    async with HttpAdapter(secrets=EnvSecretProvider({}), limits=FAST) as a:
        result = await a.send(
            make_route(fake.endpoint("openai"), "openai"),
            Envelope(parts=[Part(content="hi")]),
            profile_id=PROFILE,
        )
    assert not result.ok and not result.sent
    obs = result.observation
    assert obs is not None and obs.transport is Transport.CANNOT_BUILD
    assert obs.message == (
        "no secret for credential profile 'fake:default'; "
        "set LEDGER_SECRET_FAKE_DEFAULT or OPENAI_API_KEY"
    )
    assert fake.requests == [] and fake.connections == 0


async def test_transport_messages_are_redacted(adapter: HttpAdapter) -> None:
    # A DNS failure's message includes the host; a key-shaped host must not survive it.
    route = make_route("http://sk-abcdefghijklmnop.invalid/v1", "openai")
    result = await adapter.send(route, Envelope(parts=[Part(content="hi")]), profile_id=PROFILE)
    assert result.observation is not None
    assert "sk-abcdefghijklmnop" not in (result.observation.message or "")


@pytest.mark.parametrize("status", [200, 401])
async def test_a_key_echoed_in_the_request_id_or_the_model_never_reaches_the_result(
        adapter: HttpAdapter, fake: FakeProvider, status: int) -> None:
    body = json.dumps({"model": f"gpt-x/{SECRET}", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}
        if status == 200 else {"error": {"message": "bad key"}}).encode()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\nx-request-id: {SECRET}\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode() + body,)))
    result = await adapter.send(make_route(fake.endpoint("openai"), "openai"),
                                Envelope(parts=[Part(content="hi")]), profile_id=PROFILE)
    assert result.ok is (status == 200)
    assert result.request_id == REDACTED
    if status == 200:
        assert result.model_reported == f"gpt-x/{REDACTED}"
    assert SECRET not in repr(result)
