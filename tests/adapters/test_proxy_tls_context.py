"""An ``https://`` proxy's TLS context: built once per process, off the event loop.

Given no context for the proxy, httpcore builds its default one (certifi's authorities, some
50 ms) for every connection to the proxy, on the event loop for the asyncio driver: a proxy
that closes each connection after its answer (the forwarding proxy here does) cost one build
per request. The adapter hands httpcore the process's one for the registry's TLS
configuration, the context its origins have (what that context trusts:
``tests/adapters/test_proxy_tls_trust.py``).

A real TLS forwarding proxy on loopback with a self-signed certificate (``openssl``), which the
registry's default context trusts through certifi's bundle (``certifi.where``, as
``httpx.create_ssl_context`` reads it, ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` unset); the
provider behind it is plain HTTP, so the proxy's is the only context built. The counts are the
standard library's ``ssl.create_default_context`` calls, which every such build makes; each
test starts from a process with no TLS context (the registry's cache is the test's own).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import certifi
import pytest

from ledger import AsyncLedger, Budget, Envelope, Grant, Part, Route
from ledger.adapters import ClientRegistry, StaticSecretProvider, SyncAdapter
from ledger.adapters import transport as transport_module
from ledger.domain.values import Price
from ledger.testing import FakeProvider

from .conftest import PATIENT, PROFILE, SECRET, make_route
from .test_proxy import _Proxy

BUDGET = Budget(max_calls=5, max_retries=2, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
HELLO = Envelope(parts=[Part(content="hello")])
SESSIONS = 4


class _TLSProxy(_Proxy):
    """:class:`_Proxy` served over TLS: an ``https://`` proxy."""

    def __init__(self, served: ssl.SSLContext) -> None:
        self.served = served
        super().__init__()
        self.url = f"https://127.0.0.1:{self.port}"

    def serve(self, conn: socket.socket) -> None:
        try:
            tls = self.served.wrap_socket(conn, server_side=True)
        except OSError:
            conn.close()
            return
        super().serve(tls)


class Builds:
    """Every TLS context built by the standard library, with the thread that built it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[threading.Thread] = []
        real = ssl.create_default_context

        def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
            self.threads.append(threading.current_thread())
            return real(*args, **kwargs)

        monkeypatch.setattr(ssl, "create_default_context", counted)


@pytest.fixture
def tls_proxy(self_signed: tuple[Path, Path], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[_TLSProxy]:
    """An https:// proxy the default context trusts; a process with no TLS context yet."""
    cert, key = self_signed
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # built before the counting starts
    served.load_cert_chain(cert, key)
    bundle = tmp_path / "proxy-ca.pem"
    bundle.write_bytes(cert.read_bytes())
    monkeypatch.setattr(certifi, "where", lambda: str(bundle))
    monkeypatch.setattr(transport_module, "_TLS_CONTEXTS", {})
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "SSL_CERT_FILE",
                 "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    proxy = _TLSProxy(served)
    yield proxy
    proxy.close()


def _route(fake: FakeProvider) -> Route:
    return Route(id="r", provider="fake", model="m1", group="g", recipient="fake",
                 endpoint=fake.endpoint("openai"),
                 price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(1)))


def test_sessions_through_an_https_proxy_build_one_proxy_tls_context_off_the_loop(
        tls_proxy: _TLSProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HTTP_PROXY", tls_proxy.url)
    builds = Builds(monkeypatch)

    async def main() -> threading.Thread:
        async with FakeProvider() as fake, AsyncLedger.open(str(tmp_path / "l.db")) as led:

            async def one(n: int) -> None:
                async with led.run(f"r{n}", plan=[_route(fake)], budget=BUDGET,
                                   grant=GRANT) as run:
                    assert (await run.turn(HELLO)).text

            await asyncio.gather(*(one(n) for n in range(SESSIONS // 2)))
            for n in range(SESSIONS // 2, SESSIONS):
                await one(n)
            assert len(fake.requests) == SESSIONS
        return threading.current_thread()

    loop_thread = asyncio.run(main())
    assert len(tls_proxy.heads) == SESSIONS, "every request went through the proxy"
    assert len(builds.threads) == 1, "one TLS context for the proxy, not one per connection"
    assert builds.threads[0] is not loop_thread, "built on the event loop, holding it up"


def test_blocking_adapters_through_an_https_proxy_build_its_tls_context_once(
        tls_proxy: _TLSProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = Builds(monkeypatch)
    with FakeProvider().in_thread() as fake:
        for _ in range(3):  # three registries: three pools, three connections to the proxy
            with SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT,
                             clients=ClientRegistry(proxy=tls_proxy.url)) as adapter:
                result = adapter.send(make_route(fake.endpoint("openai"), "openai"), HELLO,
                                      profile_id=PROFILE)
                assert result.ok, result.observation
    assert len(tls_proxy.heads) == 3
    assert len(builds.threads) == 1, "one TLS context for the proxy, not one per connection"
