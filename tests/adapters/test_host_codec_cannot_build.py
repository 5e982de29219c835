"""A host's codec that builds a request the adapter cannot send: ``cannot_build``, never sent.

A codec registered with ``register_codec`` (here a subclass of the shipped OpenAI codec) may
put a header in the request that HTTP cannot carry (a CR or LF, a NUL, a name with a space,
non-ASCII text, a value that is not text, framing the adapter owns) or raise from
``build_request`` or ``auth_headers``. Each is a route that cannot build a request: an
``ok=False``, ``sent=False`` result, transport ``cannot_build``, phase ``before_send``, source
``local``, its message naming the header (or the codec's method) and the fix, never a secret;
the Attempt is ``not_sent`` with its hold voided and the Run moves on to the next route. Never
a request marked sent that left nothing, never an exception out of the turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from decimal import Decimal
from typing import Any, ClassVar

import pytest

from ledger.adapters import (
    AdapterResult,
    HttpAdapter,
    StaticSecretProvider,
    SyncAdapter,
    async_sender,
    register_codec,
    sync_sender,
)
from ledger.adapters.contract import _CODECS, WireRequest
from ledger.adapters.openai import OpenAICodec
from ledger.api.facade import AsyncLedger, Ledger
from ledger.api.turn import aexecute, execute
from ledger.decide.effects import SendProgress
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Category, Phase, Source, Transport, WireProtocol
from ledger.domain.records import AttemptRecord, AttemptState, DebitState
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.testing.fakeprovider import FakeProvider

from .conftest import PATIENT, PROFILE, SECRET, make_route

KEYS = {"p:host": "sk-host-SECRETKEY-0123456789abcdef", "p:backup": "sk-backup-0123456789abcdef"}
HOST_SECRET = KEYS["p:host"]


class _HostCodec(OpenAICodec):
    """A host's own codec: the OpenAI wire format, with whatever ``mode`` adds or breaks."""

    protocol: ClassVar[WireProtocol] = WireProtocol.GENERIC

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def build_request(self, route: Route, envelope: Envelope) -> WireRequest:
        wire = super().build_request(route, envelope)
        extra = _HEADERS.get(self.mode)
        if extra is not None:
            return replace(wire, headers={**wire.headers, **extra})
        if self.mode == "build_raises":
            raise KeyError("tenant")
        return wire

    def auth_headers(self, secret: str) -> dict[str, str]:
        if self.mode == "auth_raises":
            # The worst a codec can do with its secret: put it in its exception's text.
            raise RuntimeError(f"cannot sign with {secret}")
        if self.mode == "auth_crlf":
            return {"Authorization": f"Bearer {secret}\r\nX-Injected: 1"}
        return super().auth_headers(secret)


# The headers each mode adds, and what the message must name.
_HEADERS: dict[str, dict[str, Any]] = {
    "crlf": {"X-Evil": "a\r\nInjected: 1"},
    "lf": {"X-Evil": "a\nInjected: 1"},
    "nul": {"X-Nul": "a\x00b"},
    "space_in_name": {"X Bad": "1"},
    "colon_in_name": {"X-Bad:": "1"},
    "non_ascii_value": {"X-Team": "équipe"},
    "non_ascii_name": {"X-Équipe": "1"},
    "int_value": {"X-Num": 5},
    "padded_value": {"X-Pad": " 1 "},
    "content_length": {"Content-Length": "3"},
    "two_hosts": {"Host": "a.example", "host": "b.example"},
}

# mode -> what the cannot_build message must say: the header (or the method) and the fix
_BUILD_FIX = "fix _HostCodec.build_request to make a valid header"
CASES: dict[str, tuple[str, ...]] = {
    "crlf": ("header 'X-Evil'", "CR or LF", _BUILD_FIX),
    "lf": ("header 'X-Evil'", "CR or LF", _BUILD_FIX),
    "nul": ("header 'X-Nul'", "control character", _BUILD_FIX),
    "space_in_name": ("header 'X Bad'", "not an HTTP token", _BUILD_FIX),
    "colon_in_name": ("header 'X-Bad:'", "not an HTTP token", _BUILD_FIX),
    "non_ascii_value": ("header 'X-Team'", "non-ASCII", "percent-encode", _BUILD_FIX),
    "non_ascii_name": ("header 'X-Équipe'", "not an HTTP token", _BUILD_FIX),
    "int_value": ("header 'X-Num'", "type int, not text", _BUILD_FIX),
    "padded_value": ("header 'X-Pad'", "whitespace", _BUILD_FIX),
    "content_length": ("header 'Content-Length'", "the adapter sets itself", _BUILD_FIX),
    "build_raises": ("_HostCodec.build_request", "failed (KeyError: 'tenant')",
                     "fix the codec"),
    "auth_raises": ("_HostCodec.auth_headers", "failed (RuntimeError: cannot sign with",
                    "fix the codec"),
    "auth_crlf": ("header 'Authorization'", "CR or LF",
                  "fix _HostCodec.auth_headers to make a valid header"),
}
# Each header is valid, the pair is not: h11 refuses the request's head as it writes it.
_TWO_HOSTS = ("_HostCodec.build_request", "Host", "refused before sending",
              "fix the codec's headers")


@pytest.fixture
def host_codec() -> Iterator[_HostCodec]:
    assert WireProtocol.GENERIC not in _CODECS
    codec = _HostCodec("plain")
    register_codec(codec)
    try:
        yield codec
    finally:
        del _CODECS[WireProtocol.GENERIC]


def _assert_cannot_build(result: AdapterResult, needles: tuple[str, ...]) -> None:
    assert not result.ok and not result.sent
    obs = result.observation
    assert obs is not None
    assert (obs.transport, obs.phase, obs.source) == (
        Transport.CANNOT_BUILD, Phase.BEFORE_SEND, Source.LOCAL)
    message = obs.message or ""
    for needle in needles:
        assert needle in message, (needle, message)
    assert SECRET not in message and HOST_SECRET not in message
    assert "Route.endpoint" not in message  # a header's problem is not the endpoint's


# -- the adapter, called directly ---------------------------------------------------------------


pytest_anyio = pytest.mark.anyio


@pytest_anyio
@pytest.mark.parametrize("mode", sorted(CASES))
async def test_a_request_a_host_codec_cannot_make_sendable_is_cannot_build_and_never_sent(
    fake: FakeProvider, host_codec: _HostCodec, mode: str
) -> None:
    host_codec.mode = mode
    progress = SendProgress(handed_over=True)
    async with HttpAdapter(secrets=StaticSecretProvider({PROFILE: HOST_SECRET}),
                           limits=PATIENT) as a:
        result = await a.send(make_route(fake.endpoint("openai"), "generic"),
                              Envelope(parts=[Part(content="hi")]), profile_id=PROFILE,
                              attempt_id="att-1", progress=progress)
    _assert_cannot_build(result, CASES[mode])
    assert progress.provably_unsent
    assert fake.requests == [] and fake.connections == 0


@pytest.mark.parametrize("mode", sorted(CASES))
def test_the_blocking_adapter_says_the_same_of_a_host_codecs_unsendable_request(
    host_codec: _HostCodec, mode: str
) -> None:
    host_codec.mode = mode
    with FakeProvider().in_thread() as fake, \
            SyncAdapter(secrets=StaticSecretProvider({PROFILE: HOST_SECRET}),
                        limits=PATIENT) as a:
        result = a.send(make_route(fake.endpoint("openai"), "generic"),
                        Envelope(parts=[Part(content="hi")]), profile_id=PROFILE,
                        attempt_id="att-1")
        _assert_cannot_build(result, CASES[mode])
        assert fake.requests == [] and fake.connections == 0


@pytest_anyio
@pytest.mark.parametrize("driver", ["async", "blocking"])
async def test_a_request_refused_as_its_head_is_written_never_left_and_is_cannot_build(
    fake: FakeProvider, host_codec: _HostCodec, driver: str
) -> None:
    """Two ``Host`` headers: each is a valid header, the pair is not, and h11 refuses the
    request's head as it serialises it, before any byte is written. The request never left:
    not sent, not ``after_send``, and no network failure of the provider's."""
    host_codec.mode = "two_hosts"
    route = make_route(fake.endpoint("openai"), "generic")
    env = Envelope(parts=[Part(content="hi")])
    progress = SendProgress(handed_over=True)
    secrets = StaticSecretProvider({PROFILE: HOST_SECRET})
    if driver == "async":
        async with HttpAdapter(secrets=secrets, limits=PATIENT) as a:
            result = await a.send(route, env, profile_id=PROFILE, progress=progress)
    else:
        with SyncAdapter(secrets=secrets, limits=PATIENT) as s:
            result = await asyncio.to_thread(s.send, route, env, profile_id=PROFILE,
                                             progress=progress)
    _assert_cannot_build(result, _TWO_HOSTS)
    assert progress.provably_unsent
    assert fake.requests == []


# -- a Run's turn -------------------------------------------------------------------------------


def _plan(primary: FakeProvider, backup: FakeProvider) -> list[Route]:
    price = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(4))
    return [
        Route(id="primary", provider="host", model="m-primary", group="ga", recipient="ra",
              protocol=WireProtocol.GENERIC, endpoint=primary.endpoint("openai"), price=price,
              profiles=[Profile(id="p:host")]),
        Route(id="backup", provider="openai", model="m-backup", group="gb", recipient="rb",
              protocol=WireProtocol.OPENAI, endpoint=backup.endpoint("openai"), price=price,
              profiles=[Profile(id="p:backup")]),
    ]


_BUDGET = Budget(max_calls=6, max_retries=4, max_cost=Decimal("1"))
_GRANT = Grant(recipients={"ra": ["user_input"], "rb": ["user_input"]})
_ENV = Envelope(parts=[Part(content="What changed in the filings?")], max_output_tokens=64)


class _NoWait:
    def sleep(self, seconds: float) -> None:
        pass

    async def asleep(self, seconds: float) -> None:
        pass


def _turn(mode: str, db_url: str) -> tuple[str, list[AttemptRecord], int, int]:
    """One turn of Run ``r``: who served it, its Attempts, what each provider received."""
    if mode == "sync":
        with FakeProvider().in_thread() as a, FakeProvider().in_thread() as b, \
                SyncAdapter(secrets=StaticSecretProvider(KEYS), limits=PATIENT) as adapter, \
                Ledger.open(db_url) as led:
            led.admit_run("r", plan=_plan(a, b), budget=_BUDGET, grant=_GRANT)
            result = execute(led, led.acquire_lease("r"), _ENV,
                             sync_sender(adapter, limits=PATIENT), sleeper=_NoWait())
            return result.route.id, led.timeline("r"), len(a.requests), len(b.requests)

    async def run() -> tuple[str, list[AttemptRecord], int, int]:
        async with FakeProvider() as a, FakeProvider() as b, \
                HttpAdapter(secrets=StaticSecretProvider(KEYS), limits=PATIENT) as adapter, \
                AsyncLedger.open(db_url) as led:
            await led.admit_run("r", plan=_plan(a, b), budget=_BUDGET, grant=_GRANT)
            result = await aexecute(led, await led.acquire_lease("r"), _ENV,
                                    async_sender(adapter, limits=PATIENT), sleeper=_NoWait())
            return result.route.id, await led.timeline("r"), len(a.requests), len(b.requests)

    return asyncio.run(run())


@pytest.mark.parametrize("case", sorted([*CASES, "two_hosts"]))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_route_whose_codec_cannot_build_is_skipped_not_sent_and_the_next_route_serves(
    db_url: str, host_codec: _HostCodec, mode: str, case: str
) -> None:
    host_codec.mode = case
    served, attempts, primary_got, backup_got = _turn(mode, db_url)
    assert served == "backup"
    assert (primary_got, backup_got) == (0, 1)
    first, second = attempts
    assert first.route_id == "primary" and first.state is AttemptState.NOT_SENT
    assert first.debit_state is DebitState.VOIDED
    assert first.fact is not None
    assert (first.fact.category, first.fact.transport, first.fact.phase) == (
        Category.UNUSABLE, Transport.CANNOT_BUILD, Phase.BEFORE_SEND)
    needles = CASES.get(case, _TWO_HOSTS)
    for needle in needles:
        assert needle in (first.fact.message or ""), (needle, first.fact.message)
    assert HOST_SECRET not in (first.fact.message or "")
    assert second.route_id == "backup" and second.state is AttemptState.SUCCEEDED
