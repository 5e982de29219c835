"""Compressed answers are inflated only as far as the adapter's byte limits read them.

A provider (or anything between) may gzip its answer; a few KiB of gzip are megabytes of text.
The request accepts only the codings the adapter inflates piece by piece (gzip, deflate), so
``max_body_bytes`` and ``max_stream_bytes`` bound the bytes held in memory after inflating, and
an answer in a coding it did not accept is refused. A compressed answer whose coding never
ended (no gzip trailer, no final deflate block) is cut short, however well what arrived parses.
Raw answers from the fake provider on loopback, both drivers.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import time
import tracemalloc
import zlib
from collections.abc import Iterator

import pytest

from ledger.adapters import HttpAdapter, StaticSecretProvider, SyncAdapter
from ledger.adapters.exchange import MAX_CODINGS, _Inflate
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import PATIENT, PROFILE, SECRET, BlockingInLoop, make_route

pytestmark = pytest.mark.anyio

MIB = 1 << 20
LIMIT = MIB  # the adapter's max_body_bytes and max_stream_bytes here
BOMB = 256 * MIB  # what the bomb inflates to, all of it zeros: about 256 KiB of gzip


@functools.cache
def _bomb() -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    block = bytes(MIB)
    return b"".join([*(packer.compress(block) for _ in range(BOMB // MIB)), packer.flush()])


def _answer(body: bytes, *, coding: str, stream: bool) -> Behavior:
    ctype = "text/event-stream" if stream else "application/json"
    head = (f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Encoding: {coding}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return Behavior(fault=Fault.RAW, raw=(head, body))


def _adapter(driver: str) -> HttpAdapter:
    options = {"secrets": StaticSecretProvider({PROFILE: SECRET}), "limits": PATIENT,
               "max_body_bytes": LIMIT, "max_stream_bytes": LIMIT,
               "max_event_bytes": 2 * LIMIT}  # the stream's limit is the one reached
    if driver == "async":
        return HttpAdapter(**options)  # type: ignore[arg-type]
    return BlockingInLoop(SyncAdapter(**options))  # type: ignore[arg-type, return-value]


async def _send(driver: str, fake: FakeProvider, behavior: Behavior, *, stream: bool) -> object:
    fake.enqueue(behavior)
    adapter = _adapter(driver)
    try:
        return await adapter.send(make_route(fake.endpoint("openai"), "openai"),
                                  Envelope(parts=[Part(content="hi")], stream=stream),
                                  profile_id=PROFILE)
    finally:
        if isinstance(adapter, BlockingInLoop):
            adapter.sync.close()
        else:
            await adapter.aclose()


@pytest.mark.parametrize(("stream", "limit"), [(False, "max_body_bytes"),
                                               (True, "max_stream_bytes")])
async def test_a_compressed_answer_is_held_in_memory_only_up_to_the_byte_limits(
        driver: str, fake: FakeProvider, stream: bool, limit: str) -> None:
    bomb = _bomb()
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        result = await _send(driver, fake, _answer(bomb, coding="gzip", stream=stream),
                             stream=stream)
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (
        Transport.PROTOCOL_ERROR, Phase.MID_STREAM if stream else Phase.AFTER_HEADERS)
    assert f"{limit}={LIMIT}" in obs.message
    # Inflated whole per network read (64 KiB of this gzip is 64 MiB), or at all (256 MiB),
    # it would hold far more than the limit.
    assert peak < 16 * MIB, peak
    assert elapsed < 10.0


ANSWER = json.dumps({"model": "m1", "choices": [{"index": 0, "finish_reason": "stop", "message": {
    "role": "assistant", "content": "hey"}}], "usage": {"prompt_tokens": 3,
                                                        "completion_tokens": 1}}).encode()
EVENTS = (b'data: {"model":"m1","choices":[{"index":0,"delta":{"content":"hey"},'
          b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("coding", "pack"), [
    ("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", _raw_deflate),
    ("GZIP", gzip.compress), ("gzip, gzip", lambda d: gzip.compress(gzip.compress(d))),
    ("identity", bytes)])
async def test_an_answer_in_an_accepted_coding_is_read_whole(
        driver: str, fake: FakeProvider, stream: bool, coding: str, pack: object) -> None:
    body = pack(EVENTS if stream else ANSWER)  # type: ignore[operator]
    result = await _send(driver, fake, _answer(body, coding=coding, stream=stream),
                         stream=stream)
    assert result.ok and result.text == "hey", result.observation  # type: ignore[attr-defined]
    assert fake.requests[0].headers["accept-encoding"] == "gzip, deflate"


@pytest.mark.parametrize("coding", ["zstd", "br", "gzip, zstd"])
async def test_an_answer_in_a_coding_the_request_did_not_accept_is_refused(
        driver: str, fake: FakeProvider, coding: str) -> None:
    result = await _send(driver, fake, _answer(b"\x28\xb5\x2f\xfd" + bytes(64), coding=coding,
                                               stream=False), stream=False)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok and obs.transport is Transport.PROTOCOL_ERROR  # type: ignore[attr-defined]
    assert "did not accept" in obs.message and "gzip, deflate" in obs.message


async def test_a_corrupt_gzip_answer_is_a_protocol_error(driver: str, fake: FakeProvider) -> None:
    result = await _send(driver, fake, _answer(b"\x1f\x8b\x08\x00garbage-garbage", coding="gzip",
                                               stream=False), stream=False)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok and obs.transport is Transport.PROTOCOL_ERROR  # type: ignore[attr-defined]


def _stacked(data: bytes, stages: int) -> bytes:
    for _ in range(stages):
        data = gzip.compress(data, 1)
    return data


@pytest.mark.parametrize("stages", [MAX_CODINGS + 1, 600])
async def test_an_answer_stacking_more_codings_than_max_codings_is_a_protocol_error(
        driver: str, fake: FakeProvider, stages: int) -> None:
    # One inflater and one generator per stage, nested: 600 of them used to exhaust the
    # interpreter's recursion limit and raise RecursionError out of send().
    body = _stacked(ANSWER, stages)
    result = await _send(driver, fake, _answer(body, coding=", ".join(["gzip"] * stages),
                                               stream=False), stream=False)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok and result.sent  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.PROTOCOL_ERROR, Phase.MID_STREAM)
    assert f"{stages} content codings" in obs.message
    assert f"at most {MAX_CODINGS}" in obs.message


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_stacking_max_codings_is_read_whole(
        driver: str, fake: FakeProvider, stream: bool) -> None:
    body = _stacked(EVENTS if stream else ANSWER, MAX_CODINGS)
    result = await _send(driver, fake, _answer(body, coding=", ".join(["gzip"] * MAX_CODINGS),
                                               stream=stream), stream=stream)
    assert result.ok and result.text == "hey", result.observation  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error", [RecursionError("deep"), zlib.error("odd"), ValueError("x")])
async def test_whatever_decoding_raises_is_a_protocol_error_not_an_exception(
        driver: str, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, stream: bool,
        error: Exception) -> None:
    def broken(self: object, data: bytes) -> Iterator[bytes]:
        raise error
        yield b""

    monkeypatch.setattr(_Inflate, "feed", broken)
    result = await _send(driver, fake, _answer(gzip.compress(EVENTS if stream else ANSWER),
                                               coding="gzip", stream=stream), stream=stream)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok and obs.transport is Transport.PROTOCOL_ERROR  # type: ignore[attr-defined]
    assert type(error).__name__ in obs.message


@functools.cache
def _comment_bomb() -> bytes:
    """A gzip stream: one content event, then 60 MiB of SSE comment lines (about 60 KiB)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    out = [packer.compress(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')]
    block = b":\n" * (MIB // 2)
    out += [packer.compress(block) for _ in range(60)]
    return b"".join([*out, packer.flush(zlib.Z_SYNC_FLUSH)])


async def test_a_small_chunk_inflating_to_much_data_keeps_total_timeout_and_the_loop_running(
        driver: str, fake: FakeProvider) -> None:
    # Parsing 60 MiB of comment lines takes several seconds; every byte arrives at once, so no
    # read waits on the socket. The asyncio driver used to hand out everything one network
    # read inflated to without suspending: the loop stalled for the whole parse and the
    # total limit was kept only after it (an 8 s limit at 24 s).
    limits = PATIENT.model_copy(update={"total_timeout_s": 2.0})
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Encoding: gzip\r\n\r\n")
    fake.enqueue(Behavior(fault=Fault.RAW, raw=(head, _comment_bomb()), raw_hold=True))
    options = {"secrets": StaticSecretProvider({PROFILE: SECRET}), "limits": limits}
    adapter = (HttpAdapter(**options) if driver == "async"  # type: ignore[arg-type]
               else BlockingInLoop(SyncAdapter(**options)))  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    longest_gap, last_tick = 0.0, loop.time()

    async def ticker() -> None:
        nonlocal longest_gap, last_tick
        while True:
            await asyncio.sleep(0.01)
            longest_gap = max(longest_gap, loop.time() - last_tick)
            last_tick = loop.time()

    ticks = asyncio.create_task(ticker())
    try:
        t0 = time.monotonic()
        result = await adapter.send(make_route(fake.endpoint("openai"), "openai"),
                                    Envelope(parts=[Part(content="hi")], stream=True),
                                    profile_id=PROFILE)
        elapsed = time.monotonic() - t0
        # A stall that lasted until send() returned ends without another tick.
        longest_gap = max(longest_gap, loop.time() - last_tick)
    finally:
        ticks.cancel()
        if isinstance(adapter, BlockingInLoop):
            adapter.sync.close()
        else:
            await adapter.aclose()
    obs = result.observation
    assert obs is not None and obs.transport is Transport.TOTAL_TIMEOUT, obs
    # Generous slack for a loaded machine: either bound is one 64 KiB piece's parse (a few
    # hundredths of a second), and the loop stalled for the whole limit without the pacing; a
    # process descheduled on a busy machine has gone over 0.5 s between two ticks.
    assert elapsed < 2.0 + 2.0, elapsed
    assert longest_gap < limits.total_timeout_s / 2, longest_gap


def _sync_flushed(data: bytes, wbits: int) -> bytes:
    """``data`` deflated and flushed, but never finished: no final block (nor trailer)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return packer.compress(data) + packer.flush(zlib.Z_SYNC_FLUSH)


# Each inflates to the whole answer (a valid JSON body, or every event): only the coding's
# end is missing.
TRUNCATED = {
    "gzip-no-trailer": ("gzip", lambda d: gzip.compress(d)[:-8]),
    "gzip-no-final-block": ("gzip", lambda d: _sync_flushed(d, zlib.MAX_WBITS | 16)),
    "deflate-no-checksum": ("deflate", lambda d: zlib.compress(d)[:-4]),
    "raw-deflate-no-final-block": ("deflate", lambda d: _sync_flushed(d, -zlib.MAX_WBITS)),
    "gzip-gzip-inner-cut": ("gzip, gzip", lambda d: gzip.compress(gzip.compress(d)[:-8])),
}


def _cut_short(body: bytes, *, stream: bool) -> Behavior:
    """``body`` uncompressed, its Content-Length promising more than is sent."""
    ctype = "text/event-stream" if stream else "application/json"
    head = (f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {len(body) + 10}"
            "\r\nConnection: close\r\n\r\n").encode()
    return Behavior(fault=Fault.RAW, raw=(head, body))


@pytest.mark.parametrize("cut", list(TRUNCATED))
async def test_a_compressed_body_cut_before_its_end_is_a_stream_cut_though_it_parses(
        driver: str, fake: FakeProvider, cut: str) -> None:
    # The framing is complete (Content-Length is what was sent) and what inflates is the whole
    # JSON answer, but the server never finished the coding: the answer is incomplete, and it
    # fails as a body shorter than its Content-Length does.
    coding, pack = TRUNCATED[cut]
    short = await _send(driver, fake, _cut_short(ANSWER, stream=False), stream=False)
    expected = short.observation  # type: ignore[attr-defined]
    assert (expected.transport, expected.phase) == (Transport.STREAM_CUT, Phase.MID_STREAM)
    result = await _send(driver, fake, _answer(pack(ANSWER), coding=coding, stream=False),
                         stream=False)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok and result.text == "", obs  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase, obs.status) == (Transport.STREAM_CUT, Phase.MID_STREAM,
                                                      200)
    assert "ended before its" in obs.message and "incomplete" in obs.message
    assert not obs.effective_output


EVENTS_NO_DONE = EVENTS.replace(b"data: [DONE]\n\n", b"")


@pytest.mark.parametrize("cut", ["gzip-no-trailer", "raw-deflate-no-final-block"])
async def test_a_compressed_stream_cut_before_its_terminator_and_its_end_is_a_stream_cut(
        driver: str, fake: FakeProvider, cut: str) -> None:
    # Chat Completions' answer is complete at its finish_reason, and a clean end of the body
    # then ends it (no [DONE] needed); an end the coding did not reach is no clean end.
    coding, pack = TRUNCATED[cut]
    whole = await _send(driver, fake, _answer(gzip.compress(EVENTS_NO_DONE), coding="gzip",
                                              stream=True), stream=True)
    assert whole.ok and whole.text == "hey", whole.observation  # type: ignore[attr-defined]
    result = await _send(driver, fake, _answer(pack(EVENTS_NO_DONE), coding=coding,
                                               stream=True), stream=True)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok, obs  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.STREAM_CUT, Phase.MID_STREAM)


async def test_a_compressed_stream_whose_terminator_came_before_the_cut_is_complete(
        driver: str, fake: FakeProvider) -> None:
    # As for a stream cut after its terminator: nothing after [DONE] is part of the answer.
    result = await _send(driver, fake, _answer(gzip.compress(EVENTS)[:-8], coding="gzip",
                                               stream=True), stream=True)
    assert result.ok and result.text == "hey", result.observation  # type: ignore[attr-defined]


async def test_an_empty_body_marked_gzip_is_the_empty_body_not_a_cut(
        driver: str, fake: FakeProvider) -> None:
    # No byte of the coding came, so none is missing: the framing's end is the body's end,
    # and the empty body fails as it does uncompressed (no answer in it), not as a cut whose
    # request may have run.
    plain = await _send(driver, fake, _answer(b"", coding="identity", stream=False),
                        stream=False)
    expected = plain.observation  # type: ignore[attr-defined]
    result = await _send(driver, fake, _answer(b"", coding="gzip", stream=False), stream=False)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (expected.transport, expected.phase)
    assert obs.transport is not Transport.STREAM_CUT


def _members(data: bytes, n: int) -> bytes:
    """``data`` in ``n`` gzip members one after another (RFC 1952 allows it)."""
    step = -(-len(data) // n)
    return b"".join(gzip.compress(data[i:i + step]) for i in range(0, len(data), step))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("members", [2, 3])
async def test_a_gzip_body_of_several_members_is_read_whole(
        driver: str, fake: FakeProvider, stream: bool, members: int) -> None:
    # Only the first member was inflated: the JSON answer came out cut in half (a format
    # failure), a stream lost every event after the first member.
    body = _members(EVENTS if stream else ANSWER, members)
    result = await _send(driver, fake, _answer(body, coding="gzip", stream=stream),
                         stream=stream)
    assert result.ok and result.text == "hey", result.observation  # type: ignore[attr-defined]


def test_a_member_boundary_split_across_reads_is_found() -> None:
    # The next member's magic bytes may arrive one read apart; bytes after the end that start
    # no member are ignored, as before.
    first, second = gzip.compress(b'{"a":'), gzip.compress(b' 1}')
    inflate = _Inflate("gzip")
    out = b"".join([*inflate.feed(first + second[:1]), *inflate.feed(second[1:]),
                    *inflate.feed(b"trailing bytes"), *inflate.end()])
    assert out == b'{"a": 1}'
