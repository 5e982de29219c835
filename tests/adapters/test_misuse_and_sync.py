"""Caller misuse raises typed errors before anything is sent; the sync facade runs the same core.

Route-configuration problems are not misuse: they are ``cannot_build`` results
(tests/adapters/test_not_sent.py).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ledger.adapters import (
    HttpAdapter,
    StaticSecretProvider,
    StreamEvent,
    SyncAdapter,
    TextDelta,
)
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport, WireProtocol
from ledger.domain.values import Capabilities
from ledger.errors import InvalidArgument
from ledger.testing import FakeProvider, Fault

from .conftest import FAST, PATIENT, PROFILE, PROTOCOLS, SECRET, make_route

pytestmark = pytest.mark.anyio

ENV = Envelope(parts=[Part(content="hello")])


async def test_caller_misuse_raises_invalid_argument_naming_the_field(
    adapter: HttpAdapter, fake: FakeProvider
) -> None:
    ep = fake.endpoint("openai")
    cases = [
        (make_route(ep, "openai"), ENV, "someone:else", "profile_id"),
        (make_route(ep, "openai"), ENV, None, "profile_id"),
        # The model refuses an empty envelope; one built without validation still never goes out.
        (make_route(ep, "openai"), Envelope.model_construct(parts=[]), PROFILE, "envelope.parts"),
        (
            make_route(ep, "openai", capabilities=Capabilities(prefill=False)),
            Envelope(parts=[Part(content="q"), Part(role="assistant", content="A:")]),
            PROFILE,
            "envelope.parts",
        ),
        (
            make_route(ep, "openai", capabilities=Capabilities(streaming=False)),
            Envelope(parts=[Part(content="q")], stream=True),
            PROFILE,
            "envelope.stream",
        ),
    ]
    for route, envelope, profile, field in cases:
        with pytest.raises(InvalidArgument) as err:
            await adapter.send(route, envelope, profile_id=profile)
        assert err.value.field == field, (field, str(err.value))
        assert SECRET not in str(err.value)
    assert fake.requests == []  # misuse never sends anything


async def test_keyless_route_sends_no_credential(fake: FakeProvider) -> None:
    async with HttpAdapter(limits=FAST) as a:
        result = await a.send(
            make_route(fake.endpoint("openai"), "openai", profiles=[]), ENV, profile_id=None
        )
    assert result.ok
    assert "authorization" not in fake.requests[0].headers


async def test_async_callback_and_callback_errors_propagate(
    adapter: HttpAdapter, fake: FakeProvider
) -> None:
    seen: list[str] = []

    async def collect(ev: StreamEvent) -> None:
        await asyncio.sleep(0)
        if isinstance(ev, TextDelta):
            seen.append(ev.text)

    route = make_route(fake.endpoint("anthropic"), "anthropic")
    stream = Envelope(parts=[Part(content="hi")], stream=True)
    result = await adapter.send(route, stream, profile_id=PROFILE, on_event=collect)
    assert result.ok and "".join(seen) == result.text

    def broken(ev: StreamEvent) -> None:
        raise RuntimeError("caller bug")

    with pytest.raises(RuntimeError, match="caller bug"):
        await adapter.send(route, stream, profile_id=PROFILE, on_event=broken)


async def test_per_call_limits_override_the_adapter_default(fake: FakeProvider) -> None:
    fake.enqueue(Fault.NO_RESPONSE)
    slow_default = FAST.model_copy(update={"read_timeout_s": 30.0, "total_timeout_s": 60.0})
    async with HttpAdapter(
        secrets=StaticSecretProvider({PROFILE: SECRET}), limits=slow_default
    ) as a:
        result = await a.send(
            make_route(fake.endpoint("gemini"), "gemini"), ENV, profile_id=PROFILE, limits=FAST
        )
    assert result.observation is not None
    assert result.observation.transport is Transport.READ_TIMEOUT


def test_sync_facade_against_a_threaded_fake() -> None:
    with (
        FakeProvider().in_thread() as fake,
        SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=FAST) as adapter,
    ):
        events: list[StreamEvent] = []
        ok = adapter.send(
            make_route(fake.endpoint("openai"), "openai"),
            Envelope(parts=[Part(content="hi")], stream=True),
            profile_id=PROFILE,
            on_event=events.append,
        )
        assert ok.ok and ok.text == "".join(e.text for e in events if isinstance(e, TextDelta))
        fake.enqueue(Fault.STREAM_CUT)
        cut = adapter.send(
            make_route(fake.endpoint("gemini"), "gemini"),
            Envelope(parts=[Part(content="hi")], stream=True),
            profile_id=PROFILE,
        )
        assert cut.observation is not None
        assert (cut.observation.transport, cut.observation.phase) == (
            Transport.STREAM_CUT,
            Phase.MID_STREAM,
        )
        assert cut.observation.protocol is WireProtocol.GEMINI
        with pytest.raises(InvalidArgument):
            adapter.send(make_route(fake.endpoint("openai"), "openai"), ENV, profile_id="x:y")
        unbuildable = adapter.send(make_route(None, "openai"), ENV, profile_id=PROFILE)  # type: ignore[arg-type]
        assert unbuildable.observation is not None and not unbuildable.sent
        assert unbuildable.observation.transport is Transport.CANNOT_BUILD
    with pytest.raises(InvalidArgument, match="closed"):
        adapter.send(make_route("http://h/v1", "openai"), ENV, profile_id=PROFILE)


async def test_fake_provider_header_fault_and_per_model_script(
    adapter: HttpAdapter, fake: FakeProvider
) -> None:
    fake.set_default(Fault.UNAVAILABLE, model="m2")
    fake.enqueue(Fault.RATE_LIMIT, model="m1")
    r1 = await adapter.send(make_route(fake.endpoint("openai"), "openai"), ENV, profile_id=PROFILE)
    r2 = await adapter.send(
        make_route(fake.endpoint("openai"), "openai", model="m2"), ENV, profile_id=PROFILE
    )
    r3 = await adapter.send(make_route(fake.endpoint("openai"), "openai"), ENV, profile_id=PROFILE)
    assert [r.http_status for r in (r1, r2, r3)] == [429, 503, 200]
    assert [(q.model, q.fault) for q in fake.requests] == [
        ("m1", Fault.RATE_LIMIT),
        ("m2", Fault.UNAVAILABLE),
        ("m1", Fault.OK),
    ]
    # A header chooses the fault too (for hosts poking the fake with curl).
    async with httpx.AsyncClient() as client:
        resp = await client.post(
            fake.base_url + "/v1/messages",
            json={"model": "m1"},
            headers={"X-Fake-Fault": "overloaded"},
        )
    assert resp.status_code == 529
    assert resp.json()["error"]["type"] == "overloaded_error"


def test_one_sync_adapter_serves_many_threads_at_once() -> None:
    """Its blocking clients are shared by every thread: 8 threads, every protocol, streamed
    and whole, all at once; each answer is whole and each callback ran on its caller's
    thread."""
    with (
        FakeProvider().in_thread() as fake,
        SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT) as adapter,
    ):
        start = threading.Barrier(8)

        def worker(w: int) -> int:
            start.wait(timeout=30)
            me = threading.get_ident()
            for j in range(6):
                protocol = PROTOCOLS[(w + j) % len(PROTOCOLS)]
                events: list[tuple[int, StreamEvent]] = []
                result = adapter.send(
                    make_route(fake.endpoint(protocol), protocol),
                    Envelope(parts=[Part(content=f"w{w}-{j}")], stream=j % 2 == 1),
                    profile_id=PROFILE,
                    on_event=lambda ev, seen=events: seen.append((threading.get_ident(), ev)),
                )
                assert result.ok, result.observation
                if j % 2 == 1:
                    shown = "".join(e.text for _, e in events if isinstance(e, TextDelta))
                    assert shown == result.text
                    assert {t for t, _ in events} == {me}
            return w

        with ThreadPoolExecutor(8) as pool:
            assert sorted(pool.map(worker, range(8))) == list(range(8))
        assert len(fake.requests) == 48


def test_a_sync_callback_may_send_again_on_the_same_adapter() -> None:
    with (
        FakeProvider().in_thread() as fake,
        SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT) as adapter,
    ):
        route = make_route(fake.endpoint("openai"), "openai")
        inner = []

        def on_event(ev: StreamEvent) -> None:
            if isinstance(ev, TextDelta) and not inner:
                inner.append(adapter.send(route, ENV, profile_id=PROFILE))

        outer = adapter.send(route, Envelope(parts=[Part(content="hi")], stream=True),
                             profile_id=PROFILE, on_event=on_event)
        assert outer.ok and len(inner) == 1 and inner[0].ok
        assert len(fake.requests) == 2


async def test_a_blocking_send_inside_a_running_loop_runs_an_async_callback() -> None:
    """A notebook cell: a blocking send on a thread that runs an event loop, with an async
    callback, which cannot enter that running loop again (it runs on a loop of its own)."""
    seen: list[str] = []

    async def collect(ev: StreamEvent) -> None:
        await asyncio.sleep(0)
        if isinstance(ev, TextDelta):
            seen.append(ev.text)

    asyncio.get_running_loop()  # the case under test: this thread runs a loop
    with (
        FakeProvider().in_thread() as fake,
        SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT) as adapter,
    ):
        result = adapter.send(make_route(fake.endpoint("anthropic"), "anthropic"),
                              Envelope(parts=[Part(content="hi")], stream=True),
                              profile_id=PROFILE, on_event=collect)
    assert result.ok, result.observation
    assert seen and "".join(seen) == result.text
