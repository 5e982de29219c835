"""Fixtures for adapter tests: a fake provider on loopback and routes that point at it.

Tests run on asyncio through anyio's pytest plugin (installed with httpx). Time limits are small
(tenths of a second) where the behaviour under test is a wall-clock limit.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ledger.adapters import HttpAdapter, StaticSecretProvider, SyncAdapter
from ledger.domain.facts import WireProtocol
from ledger.domain.values import Price, Profile, Route
from ledger.policy.model import StreamingPolicy
from ledger.testing import FakeProvider

SECRET = "sk-test-SECRETKEY-0123456789abcdef"
PROFILE = "fake:default"
PROTOCOLS = ["openai", "openai_responses", "anthropic", "gemini"]

# Small limits: the tests that exercise a time limit wait this long, and no longer.
FAST = StreamingPolicy(
    connect_timeout_s=0.5,
    read_timeout_s=0.4,
    first_token_timeout_s=0.3,
    idle_timeout_s=0.25,
    total_timeout_s=3.0,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_route(endpoint: str, protocol: str, **overrides: Any) -> Route:
    fields: dict[str, Any] = {
        "id": f"r-{protocol}",
        "provider": "fake",
        "model": "m1",
        "group": "fake",
        "recipient": "fake",
        "protocol": WireProtocol(protocol),
        "endpoint": endpoint,
        "profiles": [Profile(id=PROFILE)],
        "price": Price(input_per_mtok=Decimal("3"), output_per_mtok=Decimal("15")),
    }
    fields.update(overrides)
    return Route(**fields)


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    async with FakeProvider() as server:
        yield server


# Limits no healthy loopback call comes near, even with the machine's cores busy: a test that
# is not about a time limit must not depend on how fast the machine is.
PATIENT = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=10.0,
                          first_token_timeout_s=10.0, idle_timeout_s=10.0, total_timeout_s=20.0)


class BlockingInLoop:
    """A :class:`SyncAdapter` behind :class:`HttpAdapter`'s face, for the tests that hold
    both drivers to one behaviour: each ``send`` blocks on a worker thread while this loop
    serves the fake provider. Every other attribute is the engine's (``clients``, limits)."""

    def __init__(self, sync: SyncAdapter) -> None:
        self.sync = sync

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.sync.send, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync.adapter, name)


async def adapter_for(driver: str, limits: StreamingPolicy) -> AsyncIterator[HttpAdapter]:
    if driver == "async":
        async with HttpAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}),
                               limits=limits) as a:
            yield a
        return
    with SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=limits) as s:
        yield BlockingInLoop(s)  # type: ignore[misc]


# Both drivers of the one engine (ledger.adapters.exchange): every test of an outcome holds
# the blocking one (httpx.Client on the calling thread) to what the asyncio one reports.
DRIVERS = ["async", "blocking"]


@pytest.fixture(params=DRIVERS)
def driver(request: pytest.FixtureRequest) -> str:
    """The driver of a test's adapters: one for every adapter fixture the test takes."""
    return str(request.param)


@pytest.fixture
async def adapter(driver: str) -> AsyncIterator[HttpAdapter]:
    async for a in adapter_for(driver, PATIENT):
        yield a


@pytest.fixture
async def fast_adapter(driver: str) -> AsyncIterator[HttpAdapter]:
    """An adapter with :data:`FAST` limits, for the tests of those limits."""
    async for a in adapter_for(driver, FAST):
        yield a


@pytest.fixture(scope="session")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by itself, and its key (made by ``openssl``)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; the self-signed TLS tests need it")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
