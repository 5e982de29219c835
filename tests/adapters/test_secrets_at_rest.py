"""Secrets never enter the ledger, its logs, or its facts, in any encoding, on either backend.

A loopback provider echoes the key it received, for each of the three protocols, streaming and
not: in the status line, in response headers, in the body (JSON-escaped with ``\\/`` and
``\\uXXXX`` so the raw bytes never hold it verbatim, URL-encoded, base64, and as the error code),
inside a stream's error event, and in an HTTP parser exception's message. A real Run is driven
through ``aexecute`` with the shipped adapters; a host also reports failures holding its own key
through the low-level API. Afterwards the whole SQLite file and its WAL (or a ``pg_dump`` of the
PostgreSQL database) and every captured DEBUG log line hold the key in no encoding.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
from decimal import Decimal
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest

from ledger.adapters import HttpAdapter, StaticSecretProvider, async_sender
from ledger.api.facade import AsyncLedger
from ledger.api.turn import aexecute
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Category, FailureFact, Observation, Phase, WireProtocol
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted, LedgerError, ProviderError
from ledger.policy.model import StreamingPolicy
from ledger.redaction import REDACTED, register_secret
from ledger.testing import FakeProvider, Fault

pytestmark = pytest.mark.anyio

# A key with the characters that defeat naive patterns and get escaped or encoded on the way.
KEY = "zk/Qm7+Lp2/x.9Rt_Vw-Yb3Nc8Hd4Jf6"
# A host that calls providers itself registers the keys it uses.
HOST_KEY = "hk+Tq8/Wn3.Ly5_Zc-Rv1/Mb6+Xp0Sd4"
# Never registered anywhere: only its shape can give it away.
STRAY_KEY = "sk-proj-Gh7Tk2Lw9Qx4Vb8Nm3Zr6Yp1Fd5Sa0Jc"
LIMITS = StreamingPolicy(connect_timeout_s=10, read_timeout_s=10, first_token_timeout_s=10,
                         idle_timeout_s=10, total_timeout_s=20)


def encodings(key: str) -> set[str]:
    """Every form of ``key`` a leak could take."""
    raw = key.encode()
    b64 = base64.b64encode(raw).decode()
    b64url = base64.urlsafe_b64encode(raw).decode()
    return {
        key,
        json.dumps(key)[1:-1].replace("/", "\\/"),
        "".join(f"\\u{ord(c):04x}" for c in key),
        "".join(f"\\u{ord(c):04X}" for c in key),
        quote(key, safe=""),
        quote(key),
        quote_plus(key),
        re.sub("%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(key, safe="")),
        b64, b64.rstrip("="), b64url, b64url.rstrip("="),
    }


def leaks(blob: bytes | str, *keys: str) -> list[str]:
    text = blob if isinstance(blob, str) else blob.decode("latin-1")
    return sorted(form for key in keys for form in encodings(key) if form in text)


class _NoWait:
    def sleep(self, seconds: float) -> None:
        pass

    async def asleep(self, seconds: float) -> None:
        pass


def _plan(fake: FakeProvider) -> list[Route]:
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(4))
    routes = []
    for protocol in WireProtocol.OPENAI, WireProtocol.ANTHROPIC, WireProtocol.GEMINI:
        for kind in ("echo", "badheader"):
            # One provider per route: goclaw cools a provider, and the run must reach each.
            routes.append(Route(
                id=f"{kind}-{protocol.value}", provider=f"fake-{kind}-{protocol.value}",
                model=f"{kind}-{protocol.value}",
                group=f"g-{kind}-{protocol.value}", recipient="fake", protocol=protocol,
                endpoint=fake.endpoint(protocol.value), price=price,
                profiles=[Profile(id="p:echo")]))
    routes.append(Route(id="ok", provider="fake", model="ok", group="g-ok", recipient="fake",
                        protocol=WireProtocol.OPENAI, endpoint=fake.endpoint("openai"), price=price,
                        profiles=[Profile(id="p:echo")]))
    for r in routes[:-1]:
        fault = Fault.ECHO_KEY if r.id.startswith("echo") else Fault.ECHO_KEY_BAD_HEADER
        fake.set_default(fault, model=r.model)
    return routes


def _database_bytes(db_url: str, request: pytest.FixtureRequest) -> bytes:
    if db_url.startswith("postgresql"):
        srv = request.getfixturevalue("pg_server")
        database = db_url.rsplit("/", 1)[1]
        dump = subprocess.run(
            [os.path.join(srv.bindir, "pg_dump"), "-h", "127.0.0.1", "-p", str(srv.port),
             "-U", srv.user, "--no-owner", database],
            capture_output=True, check=True, timeout=120,
        )
        assert b"CREATE TABLE" in dump.stdout and b"attempts" in dump.stdout
        return dump.stdout
    blob = b""
    for suffix in ("", "-wal", "-shm", "-journal"):
        p = Path(db_url + suffix)
        if p.exists():
            blob += p.read_bytes()
    assert blob
    return blob


async def test_no_secret_reaches_the_database_the_facts_or_the_logs(
    db_url: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, httpx and httpcore at their most talkative
    errors: list[BaseException] = []
    async with FakeProvider() as fake, HttpAdapter(
        secrets=StaticSecretProvider({"p:echo": KEY}), limits=LIMITS
    ) as adapter:
        routes = _plan(fake)
        led = await AsyncLedger.open(db_url)
        try:
            await led.admit_run(
                "r-secrets", plan=routes, policy="goclaw",
                budget=Budget(max_calls=40, max_retries=40, max_cost=Decimal("10")),
                grant=Grant(recipients={"fake": ["user_input"]}),
            )
            lease = await led.acquire_lease("r-secrets")
            send = async_sender(adapter, limits=LIMITS)
            for turn, stream in (("t1", False), ("t2", True)):
                env = Envelope(parts=[Part(content="What is in the filings?")], stream=stream)
                try:
                    res = await aexecute(led, lease, env, send, turn_id=turn, sleeper=_NoWait())
                    assert res.route.id == "ok" and res.output.ok
                except FailoverExhausted as e:
                    errors.append(e)

            # A host that calls providers itself reports through the low-level API.
            register_secret(HOST_KEY)
            sync = led.sync
            for i, (obs, fact) in enumerate([
                (Observation(status=401, protocol=WireProtocol.OPENAI,
                             message=f"rejected {HOST_KEY} and {STRAY_KEY}",
                             body=json.dumps({"error": {"message": f"bad key {HOST_KEY}",
                                                        "code": STRAY_KEY}})), None),
                (None, FailureFact(category=Category.AUTH, phase=Phase.AFTER_HEADERS,
                                   status=401, provider_code=HOST_KEY,
                                   message=f"key {HOST_KEY} / {STRAY_KEY}")),
            ]):
                att = sync.begin_attempt(lease, route="ok", envelope_hash="sha256:host",
                                         reserve=Decimal("0.01"), turn_id=f"host-{i}")
                done = sync.settle_attempt(
                    lease, att.attempt_id, outcome="failed", observation=obs, fact=fact,
                    events=[("host_note", {"said": f"key was {HOST_KEY}", "stray": STRAY_KEY,
                                           "nested": [{"k": HOST_KEY}]})])
                assert done.fact is not None and REDACTED in (done.fact.message or "")
            sync.append_event(lease, "host_note", {"text": f"{HOST_KEY} {STRAY_KEY}"})
            try:
                raise ProviderError(f"the provider said {KEY} and {HOST_KEY}", key=KEY)
            except LedgerError as e:
                errors.append(e)

            attempts = sync.timeline("r-secrets")
            facts = [a.fact for a in attempts if a.fact is not None]
            # The run really went through every echo: auth facts from the echoed 401s, network
            # facts from the parser errors, and the answer from the last route.
            assert {f.category for f in facts} >= {Category.AUTH, Category.NETWORK}
            assert any(a.route_id == "ok" and a.state.value == "succeeded" for a in attempts)
            assert all(REDACTED in (f.message or "") for f in facts if f.category is Category.AUTH)
            assert not leaks(repr(attempts), KEY, HOST_KEY, STRAY_KEY)
            at_rest = _database_bytes(db_url, request)
        finally:
            await led.close()
        # Every request really carried the key, and the provider echoed it back.
        assert all(KEY in json.dumps(r.headers) for r in fake.requests)
        assert {r.fault for r in fake.requests} >= {Fault.ECHO_KEY, Fault.ECHO_KEY_BAD_HEADER}

    assert not leaks(at_rest, KEY, HOST_KEY, STRAY_KEY)
    if not db_url.startswith("postgresql"):
        assert not leaks(_database_bytes(db_url, request), KEY, HOST_KEY, STRAY_KEY)

    for e in errors:
        text = f"{e!s} {e!r} " + " ".join(f"{x!s} {x!r}" for x in getattr(e, "exceptions", ()))
        assert not leaks(text, KEY, HOST_KEY, STRAY_KEY)

    # The logs saw the echoes (headers, reason phrases, parser errors) and redacted them.
    lines = [caplog.text]
    for rec in caplog.records:
        lines += [rec.getMessage(), rec.exc_text or "", rec.stack_info or ""]
    logged = "\n".join(lines)
    assert "receive_response_headers.complete" in logged  # httpcore printed response headers
    assert "HTTP Request: POST" in logged  # httpx printed status lines
    assert REDACTED in logged
    assert not leaks(logged, KEY, HOST_KEY, STRAY_KEY)
