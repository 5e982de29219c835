"""The TLS context: built once per process per TLS configuration, off the event loop, only for
``https://`` origins.

Building one loads a whole bundle of certificate authorities (some 50 ms): built by every Run
session's first turn on the loop, it held every other task of the process up that long, under
a storm of Runs for up to a second. The counts are httpx's ``create_ssl_context`` calls (the
library boundary the registry builds through) and the standard library's
``ssl.create_default_context``; each test trusts a copy of the self-signed certificate of its
own (``SSL_CERT_FILE``), a configuration no other test used, so its counts start at zero.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Part, Price, Route
from ledger.adapters import ClientRegistry, HttpAdapter, StaticSecretProvider, SyncAdapter
from ledger.testing import FakeProvider

from .conftest import PATIENT, PROFILE, SECRET, make_route

BUDGET = Budget(max_calls=5, max_retries=2, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
HELLO = Envelope(parts=[Part(content="hello")])
SESSIONS = 6


class Builds:
    """Every TLS context built, with the thread that built it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.contexts: list[ssl.SSLContext] = []
        self.threads: list[threading.Thread] = []
        self.defaults = 0
        real, default = httpx.create_ssl_context, ssl.create_default_context

        def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
            context = real(*args, **kwargs)
            self.contexts.append(context)
            self.threads.append(threading.current_thread())
            return context

        def counted_default(*args: Any, **kwargs: Any) -> ssl.SSLContext:
            self.defaults += 1
            return default(*args, **kwargs)

        monkeypatch.setattr(httpx, "create_ssl_context", counted)
        monkeypatch.setattr(ssl, "create_default_context", counted_default)


def _trust(cert: Path, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trust a copy of ``cert`` of this test's own (``SSL_CERT_FILE``, as httpx reads it)."""
    copy = tmp_path / name
    shutil.copyfile(cert, copy)
    monkeypatch.setenv("SSL_CERT_FILE", str(copy))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)


def _server_context(self_signed: tuple[Path, Path]) -> ssl.SSLContext:
    cert, key = self_signed
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # not counted: the fake's side
    server.load_cert_chain(cert, key)
    return server


def _route(fake: FakeProvider) -> Route:
    return Route(id="r", provider="fake", model="m1", group="g", recipient="fake",
                 endpoint=fake.endpoint("openai"),
                 price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(1)))


async def _sessions(db: str, fake: FakeProvider) -> threading.Thread:
    """SESSIONS Run sessions of one turn each, half of them at once; the loop's thread."""
    async with AsyncLedger.open(db) as led:

        async def one(n: int) -> None:
            async with led.run(f"r{n}", plan=[_route(fake)], budget=BUDGET,
                               grant=GRANT) as run:
                assert (await run.turn(HELLO)).text

        await asyncio.gather(*(one(n) for n in range(SESSIONS // 2)))
        for n in range(SESSIONS // 2, SESSIONS):
            await one(n)
    assert len(fake.requests) == SESSIONS
    return threading.current_thread()


def test_sessions_over_https_build_one_tls_context_off_the_loop(
        self_signed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _trust(self_signed[0], tmp_path, "ca.pem", monkeypatch)
    builds = Builds(monkeypatch)

    async def main() -> threading.Thread:
        async with FakeProvider(ssl=_server_context(self_signed)) as fake:
            return await _sessions(str(tmp_path / "ledger.db"), fake)

    loop_thread = asyncio.run(main())
    assert len(builds.contexts) == 1, "one TLS context for every session of the process"
    assert builds.threads[0] is not loop_thread, "built on the event loop, holding it up"


def test_sessions_over_http_build_no_tls_context(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = Builds(monkeypatch)

    async def main() -> None:
        async with FakeProvider() as fake:
            await _sessions(str(tmp_path / "ledger.db"), fake)

    asyncio.run(main())
    assert (builds.contexts, builds.defaults) == ([], 0)


def test_two_tls_settings_build_two_contexts_each_once(
        self_signed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each registry (and each adapter of its own) reads its settings: a second bundle is a
    # second context, a third registry of the first settings (blocking clients too) reuses it.
    builds = Builds(monkeypatch)
    secrets = StaticSecretProvider({PROFILE: SECRET})

    async def send(fake: FakeProvider) -> None:
        async with HttpAdapter(secrets=secrets, limits=PATIENT,
                               clients=ClientRegistry()) as adapter:
            result = await adapter.send(make_route(fake.endpoint("openai"), "openai"), HELLO,
                                        profile_id=PROFILE)
            assert result.ok, result.observation

    async def main() -> None:
        async with FakeProvider(ssl=_server_context(self_signed)) as fake:
            _trust(self_signed[0], tmp_path, "a.pem", monkeypatch)
            await send(fake)
            _trust(self_signed[0], tmp_path, "b.pem", monkeypatch)
            await send(fake)
            _trust(self_signed[0], tmp_path, "a.pem", monkeypatch)
            await send(fake)
            route = make_route(fake.endpoint("openai"), "openai")
            with SyncAdapter(secrets=secrets, limits=PATIENT) as blocking:
                result = await asyncio.to_thread(blocking.send, route, HELLO,
                                                 profile_id=PROFILE)
            assert result.ok, result.observation

    asyncio.run(main())
    a, b = builds.contexts
    assert a is not b


def test_a_ca_bundle_path_as_verify_is_refused_not_shared_as_the_default_context() -> None:
    # The process shares one TLS context per configuration; a path would have been built and
    # kept under the default's key, so every later verify=True client trusted only that CA.
    from ledger.adapters.transport import ClientRegistry
    from ledger.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as got:
        ClientRegistry(verify="/etc/ssl/private-ca.pem")  # type: ignore[arg-type]
    assert got.value.field == "verify" and "cafile" in str(got.value)
