"""Streams that lie are never a success.

A raw loopback server (the fake provider's ``raw`` fault) sends a complete answer in hostile
framing, encodings, JSON and headers, to all four adapters, streaming and not. Every call ends
as a complete success with the complete text, or as a clean failure observation: never an
exception, never a hang (each call is bounded by the adapter's own limits), and never truncated
text reported as a success. Framing the standard allows (a byte-order mark, CR-only or mixed line
endings, comments, unknown fields, any split of the bytes, UTF-8 characters cut across chunks,
any HTTP body framing) must succeed with the exact text.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.adapters import AdapterResult, ClientRegistry, StaticSecretProvider, SyncAdapter
from ledger.decide.classify import classify
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport
from ledger.policy.load import PRESETS, preset
from ledger.policy.model import StreamingPolicy
from ledger.testing import Behavior, FakeProvider, Fault

from .conftest import PROFILE, PROTOCOLS, SECRET, make_route

PIECES = ["HÉLLO", " WÖRLD", " \U0001f30d", " — «ok»"]  # multi-byte UTF-8 in every piece
EXPECTED = "".join(PIECES)
# Generous limits where the outcome must not depend on timing (a loaded machine may pause the
# server for a while); tight ones where a stalled stream must be cut by the limits.
LIMITS = StreamingPolicy(connect_timeout_s=5.0, read_timeout_s=5.0, first_token_timeout_s=5.0,
                         idle_timeout_s=5.0, total_timeout_s=10.0)
TIGHT = StreamingPolicy(connect_timeout_s=1.0, read_timeout_s=0.5, first_token_timeout_s=0.5,
                        idle_timeout_s=0.3, total_timeout_s=2.0)
EVENT_BOUND = 1 << 20  # the adapter's max_event_bytes here (32 MiB by default: images)
HUGE = EVENT_BOUND + 64  # beyond the SSE parser's line bound
MODES = [(p, s) for p in PROTOCOLS for s in (False, True)]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeProvider, SyncAdapter]]:
    with (
        FakeProvider().in_thread() as fake,
        SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=LIMITS,
                    max_event_bytes=EVENT_BOUND) as adapter,
    ):
        # Every raw answer closes its connection; without keep-alive each call gets a fresh one
        # (a pooled connection the server already closed fails before the server reads it).
        adapter.adapter.clients = ClientRegistry(max_keepalive_connections=0)
        yield fake, adapter


# -- a correct answer, as data -----------------------------------------------------------------


def sse_events(protocol: str) -> list[tuple[str | None, str]]:
    """(event name, data) of a complete stream that answers EXPECTED."""
    def js(obj: Any) -> str:
        return json.dumps(obj, ensure_ascii=False)

    if protocol == "anthropic":
        out: list[tuple[str | None, str]] = [
            ("message_start", js({"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "model": "m1-fake",
                "content": [], "stop_reason": None,
                "usage": {"input_tokens": 3, "output_tokens": 1}}})),
            ("content_block_start", js({"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}})),
            ("ping", js({"type": "ping"})),
        ]
        out += [("content_block_delta", js({"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": p}}))
                for p in PIECES]
        out += [
            ("content_block_stop", js({"type": "content_block_stop", "index": 0})),
            ("message_delta", js({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                  "usage": {"output_tokens": 5}})),
            ("message_stop", js({"type": "message_stop"})),
        ]
        return out
    if protocol == "openai_responses":
        def resp(status: str) -> dict[str, Any]:
            return {"id": "resp_1", "object": "response", "status": status, "model": "m1-fake",
                    "output": [], "usage": {"input_tokens": 3, "output_tokens": 5}
                    if status == "completed" else None}
        out = [("response.created", js({"type": "response.created",
                                         "response": resp("in_progress")}))]
        out += [("response.output_text.delta", js({"type": "response.output_text.delta",
                                                    "item_id": "msg_1", "output_index": 0,
                                                    "content_index": 0, "delta": p}))
                for p in PIECES]
        out += [("response.completed", js({"type": "response.completed",
                                            "response": resp("completed")}))]
        return out
    if protocol == "gemini":
        out = []
        for i, p in enumerate(PIECES):
            cand: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": p}]},
                                    "index": 0}
            chunk: dict[str, Any] = {"candidates": [cand], "modelVersion": "m1-fake"}
            if i == len(PIECES) - 1:
                cand["finishReason"] = "STOP"
                chunk["usageMetadata"] = {"promptTokenCount": 3, "candidatesTokenCount": 5}
            out.append((None, js(chunk)))
        return out

    def oai(delta: dict[str, Any], finish: str | None = None) -> str:
        return js({"id": "c1", "object": "chat.completion.chunk", "model": "m1-fake",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    out = [(None, oai({"role": "assistant", "content": ""}))]
    out += [(None, oai({"content": p})) for p in PIECES]
    out += [(None, oai({}, "stop")),
            (None, js({"id": "c1", "choices": [], "model": "m1-fake",
                       "usage": {"prompt_tokens": 3, "completion_tokens": 5}})),
            (None, "[DONE]")]
    return out


def whole_body(protocol: str) -> bytes:
    if protocol == "anthropic":
        obj: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant",
                               "model": "m1-fake", "stop_reason": "end_turn",
                               "content": [{"type": "text", "text": EXPECTED}],
                               "usage": {"input_tokens": 3, "output_tokens": 5}}
    elif protocol == "openai_responses":
        obj = {"id": "resp_1", "object": "response", "status": "completed", "model": "m1-fake",
               "output": [{"type": "message", "role": "assistant", "content": [
                   {"type": "output_text", "text": EXPECTED, "annotations": []}]}],
               "usage": {"input_tokens": 3, "output_tokens": 5}}
    elif protocol == "gemini":
        obj = {"candidates": [{"content": {"role": "model", "parts": [{"text": EXPECTED}]},
                               "finishReason": "STOP", "index": 0}],
               "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 5},
               "modelVersion": "m1-fake"}
    else:
        obj = {"id": "c1", "object": "chat.completion", "model": "m1-fake",
               "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": EXPECTED}}],
               "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    return json.dumps(obj, ensure_ascii=False).encode()


@dataclass(frozen=True)
class Framing:
    """How a correct answer is put on the wire; every choice here is allowed by the standards."""

    ending: str = "\n"  # "\n", "\r\n", "\r", or "mixed"
    bom: bool = False
    comments: bool = False
    extras: bool = False  # id:, retry:, unknown fields, blank lines between events
    no_space: bool = False  # "data:x" instead of "data: x"
    http: str = "chunked"  # "chunked", "length", "close"
    chunk_sizes: tuple[int, ...] = ()  # HTTP chunk sizes (chunked framing)
    writes: tuple[int, ...] = ()  # socket write sizes of the whole response
    header_case: bool = False  # upper-case header names, a charset parameter
    content_first: bool = False  # OpenAI: no role-only chunk, the first event carries text


def sse_text(protocol: str, f: Framing) -> bytes:
    endings = ["\n", "\r\n", "\r"]
    lines: list[str] = []
    if f.comments:
        lines.append(": keep-alive")
    events = sse_events(protocol)
    if f.content_first and protocol == "openai":
        events = events[1:]
    for i, (name, data) in enumerate(events):
        if f.extras:
            lines += [f"id: {i}", "retry: 3000", "x-unknown: ignored"]
        if f.comments and i % 2:
            lines.append(":" + "ping")
        if name is not None:
            lines.append(f"event:{name}" if f.no_space else f"event: {name}")
        lines.append(("data:" if f.no_space else "data: ") + data)
        lines.append("")
        if f.extras and i % 3 == 0:
            lines.append("")  # an empty event: nothing is dispatched
    text, prev = "", ""
    for i, line in enumerate(lines):
        ending = endings[i % 3] if f.ending == "mixed" else f.ending
        if prev == "\r" and line == "" and ending == "\n":
            ending = "\r"  # LF right after CR is one CRLF line end, not a blank line
        text += line + ending
        prev = ending
    raw = text.encode()
    return (b"\xef\xbb\xbf" + raw) if f.bom else raw


def frame(status: int, headers: list[tuple[str, str]], body: bytes, f: Framing) -> bytes:
    head = [f"HTTP/1.1 {status} X"]
    hs = list(headers)
    if f.http == "length":
        hs.append(("content-length", str(len(body))))
    elif f.http == "chunked":
        hs.append(("transfer-encoding", "chunked"))
    else:
        hs.append(("connection", "close"))
    for k, v in hs:
        head.append(f"{k.upper() if f.header_case else k}: {v}")
    out = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
    if f.http != "chunked":
        return out + body
    pieces, i = [], 0
    for n in f.chunk_sizes:
        if i >= len(body):
            break
        pieces.append(body[i : i + n])
        i += n
    if i < len(body):
        pieces.append(body[i:])
    for p in pieces:
        out += f"{len(p):x}\r\n".encode() + p + b"\r\n"
    return out + b"0\r\n\r\n"


def response(protocol: str, stream: bool, f: Framing) -> bytes:
    if stream:
        ctype = "text/event-stream; charset=utf-8" if f.header_case else "text/event-stream"
        return frame(200, [("content-type", ctype)], sse_text(protocol, f), f)
    body = whole_body(protocol)
    ctype = "application/json; charset=UTF-8" if f.header_case else "application/json"
    return frame(200, [("content-type", ctype)], (b"\xef\xbb\xbf" + body) if f.bom else body, f)


def split(raw: bytes, sizes: tuple[int, ...]) -> tuple[bytes, ...]:
    out, i = [], 0
    for n in sizes:
        if i >= len(raw):
            break
        out.append(raw[i : i + n])
        i += n
    if i < len(raw):
        out.append(raw[i:])
    return tuple(out)


# -- the oracle --------------------------------------------------------------------------------


def call(server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool,
         raw: tuple[bytes, ...] | bytes, *, hold: bool = False) -> AdapterResult:
    fake, adapter = server
    pieces = (raw,) if isinstance(raw, bytes) else raw
    fake.clear()
    fake.enqueue(Behavior(fault=Fault.RAW, raw=pieces, raw_hold=hold))
    limits = TIGHT if hold else LIMITS
    started = time.monotonic()
    result = adapter.send(make_route(fake.endpoint(protocol), protocol),
                          Envelope(parts=[Part(content="hi")], stream=stream),
                          profile_id=PROFILE, limits=limits)
    # Bounded by the adapter's own total limit (plus scheduling slack).
    assert time.monotonic() - started < limits.total_timeout_s + 2.0, "the call was not bounded"
    assert [r.fault for r in fake.requests] == [Fault.RAW]  # the server answered this request
    check(result)
    return result


def check(result: AdapterResult) -> None:
    """A complete success with the complete text, or a clean failure observation."""
    if result.ok:
        assert result.text == EXPECTED, f"truncated or altered text reported as success: {result}"
        assert result.observation is None
        return
    obs = result.observation
    assert obs is not None and obs.phase is not None
    assert result.text == "" and result.sent
    for name in PRESETS:
        fact = classify(obs, preset(name), now=1_700_000_000.0)
        hint = fact.retry_after_s
        limit = preset(name).classification.retry_after_limit_s
        assert hint is None or (math.isfinite(hint) and 0 <= hint <= limit), hint


def assert_success(result: AdapterResult) -> None:
    assert result.ok, result.observation


def assert_failure(result: AdapterResult) -> None:
    assert not result.ok, "a broken response was reported as a success"


# -- allowed framing: always a complete success ------------------------------------------------

CLEAN = [
    Framing(bom=True),
    Framing(ending="\r"),
    Framing(ending="\r\n", bom=True, comments=True),
    Framing(ending="mixed", extras=True, no_space=True),
    Framing(http="length", writes=tuple([1] * 400)),  # one byte per write: UTF-8 cut everywhere
    Framing(http="close", chunk_sizes=(), writes=(3, 5, 7, 11, 13)),
    Framing(http="chunked", chunk_sizes=(1, 2, 3, 1, 5, 8, 13, 21, 1, 1, 1)),
    Framing(header_case=True, ending="\r", bom=True),
]


@pytest.mark.parametrize(("protocol", "stream"), MODES)
@pytest.mark.parametrize("framing", CLEAN, ids=[f"clean{i}" for i in range(len(CLEAN))])
def test_allowed_framing_is_a_complete_success(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool, framing: Framing
) -> None:
    raw = response(protocol, stream, framing)
    assert_success(call(server, protocol, stream, split(raw, framing.writes)))


def test_a_bom_never_loses_the_first_event(server: tuple[FakeProvider, SyncAdapter]) -> None:
    for protocol in PROTOCOLS:
        framing = Framing(bom=True, http="chunked", chunk_sizes=(1, 1, 1), content_first=True)
        raw = response(protocol, True, framing)
        result = call(server, protocol, True, split(raw, (len(raw) - 200, 1, 1, 1)))
        assert result.ok and result.text == EXPECTED  # "HÉLLO" is the first content event


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from(MODES),
    framing=st.builds(
        Framing,
        ending=st.sampled_from(["\n", "\r\n", "\r", "mixed"]),
        bom=st.booleans(), comments=st.booleans(), extras=st.booleans(), no_space=st.booleans(),
        http=st.sampled_from(["chunked", "length", "close"]),
        chunk_sizes=st.lists(st.integers(1, 40), max_size=30).map(tuple),
        writes=st.lists(st.integers(1, 60), max_size=30).map(tuple),
        header_case=st.booleans(),
        content_first=st.booleans(),
    ),
)
def test_any_allowed_framing_is_a_complete_success(
    server: tuple[FakeProvider, SyncAdapter], mode: tuple[str, bool], framing: Framing
) -> None:
    protocol, stream = mode
    raw = response(protocol, stream, framing)
    assert_success(call(server, protocol, stream, split(raw, framing.writes)))


# -- hostile bytes: a success only with the complete text, else a clean failure ---------------


def _corrupt(raw: bytes, how: str, at: float, protocol: str, stream: bool) -> tuple[bytes, bool]:
    """``raw`` corrupted; and whether the call must then fail (False: it may also succeed)."""
    head_end = raw.index(b"\r\n\r\n") + 4
    head, body = raw[:head_end], raw[head_end:]
    pos = int(at * len(body))
    if how == "invalid_utf8":
        return head + body[:pos] + b"\xff\xc3(" + body[pos:], False
    if how == "truncate":
        return head + body[:pos], False
    if how == "garbage_in_chunk_size":
        return head + b"zz\r\n" + body, True
    if how == "short_chunk":
        return head + b"fffff\r\n" + body[:-5], True
    return raw, False


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from(MODES),
    how=st.sampled_from(["invalid_utf8", "truncate", "garbage_in_chunk_size", "short_chunk"]),
    at=st.floats(0, 1),
    http=st.sampled_from(["chunked", "length", "close"]),
    writes=st.lists(st.integers(1, 80), max_size=20).map(tuple),
)
def test_hostile_bytes_are_a_clean_failure_or_the_complete_answer(
    server: tuple[FakeProvider, SyncAdapter], mode: tuple[str, bool], how: str, at: float,
    http: str, writes: tuple[int, ...],
) -> None:
    protocol, stream = mode
    if how in ("garbage_in_chunk_size", "short_chunk"):
        http = "close"  # the corruption brings its own chunk header
    framing = Framing(http=http)
    raw = response(protocol, stream, framing)
    if how in ("garbage_in_chunk_size", "short_chunk"):
        raw = raw.replace(b"connection: close", b"transfer-encoding: chunked")
    bad, must_fail = _corrupt(raw, how, at, protocol, stream)
    result = call(server, protocol, stream, split(bad, writes))
    if must_fail:
        assert_failure(result)


@pytest.mark.parametrize(("protocol", "stream"), MODES)
def test_invalid_utf8_inside_the_answer_fails(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool
) -> None:
    raw = response(protocol, stream, Framing(http="length"))
    assert_failure(call(server, protocol, stream, raw.replace("WÖRLD".encode(), b"W\xd6RLD")))


@pytest.mark.parametrize(("protocol", "stream"), MODES)
def test_an_answer_of_unpaired_surrogates_is_refused_whole_at_the_usage_it_reported(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool
) -> None:
    """Escaped lone surrogates parse, but are no text a caller could store: the answer is
    refused once complete, streamed or not, as the provider's verdict on it (never a stream
    that broke off), at the usage it reported rather than the whole hold."""
    f = Framing(http="length")
    body = (sse_text(protocol, f) if stream else whole_body(protocol)).replace(
        "WÖRLD".encode(), b"W\\ud800RLD")
    ctype = "text/event-stream" if stream else "application/json"
    result = call(server, protocol, stream, frame(200, [("content-type", ctype)], body, f))
    obs = result.observation
    assert not result.ok and obs is not None
    assert (obs.transport, obs.phase) == (Transport.MALFORMED_EVENT, Phase.AFTER_HEADERS)
    assert "unpaired surrogate" in (obs.message or "")
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 5)
    assert result.cost == make_route("", protocol).cost(3, 5)


@pytest.mark.parametrize(("protocol", "stream"), MODES)
def test_truncated_json_fails(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool
) -> None:
    if stream:
        f = Framing(http="chunked")
        body = sse_text(protocol, f).replace(b'"text": " W\xc3\x96RLD"', b'"text": " W\xc3\x96R')
        body = body.replace(b'"content": " W\xc3\x96RLD"', b'"content": " W\xc3\x96R')
        body = body.replace(b'"delta": " W\xc3\x96RLD"', b'"delta": " W\xc3\x96R')
        raw = frame(200, [("content-type", "text/event-stream")], body, f)
    else:
        body = whole_body(protocol)
        raw = frame(200, [("content-type", "application/json")], body[: len(body) // 2],
                    Framing(http="length"))
    assert_failure(call(server, protocol, stream, raw))


@pytest.mark.parametrize(("protocol", "stream"), MODES)
def test_deeply_nested_json_fails_cleanly(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool
) -> None:
    nested = b"[" * 200_000 + b"]" * 200_000
    if stream:
        body = b"data: " + nested + b"\n\n"
        raw = frame(200, [("content-type", "text/event-stream")], body, Framing(http="length"))
    else:
        raw = frame(200, [("content-type", "application/json")], nested, Framing(http="length"))
    assert_failure(call(server, protocol, stream, raw))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("shape", ["unterminated", "terminated", "endless_event"])
def test_huge_lines_are_a_clean_bounded_failure(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, shape: str
) -> None:
    if shape == "unterminated":
        body = b"data: " + b"x" * HUGE
    elif shape == "terminated":
        body = b"data: " + b"x" * HUGE + b"\n\n"
    else:
        body = b"data: " + b"y" * 60_000 + b"\n"
        body = body * 80  # one event, 4.8 MB of data lines, no blank line
    raw = frame(200, [("content-type", "text/event-stream")], body, Framing(http="chunked",
                chunk_sizes=(65536,) * 200))
    result = call(server, protocol, True, raw)
    assert_failure(result)
    assert "exceeded" in (result.observation.message or "")  # type: ignore[union-attr]


@pytest.mark.parametrize(("protocol", "stream"), MODES)
@pytest.mark.parametrize(
    "broken",
    [
        b"zz\r\n",  # not a hex size
        b"5\r\nabc",  # the chunk ends early, then the connection closes
        b"3\r\nabcdef\r\n",  # no CRLF where the chunk should end
        b"-1\r\n",  # a negative size
    ],
    ids=["bad-size", "short", "no-crlf", "negative"],
)
def test_chunked_framing_errors_fail(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool, broken: bytes
) -> None:
    ok = response(protocol, stream, Framing(http="chunked", chunk_sizes=(10,)))
    head_end = ok.index(b"\r\n\r\n") + 4
    assert_failure(call(server, protocol, stream, ok[:head_end] + ok[head_end:][:30] + broken))


@pytest.mark.parametrize(("protocol", "stream"), MODES)
@pytest.mark.parametrize(
    "head",
    [
        b"content-length: 10\r\ncontent-length: 99\r\n",  # contradicting lengths
        b"content-length: 999999\r\n",  # longer than what comes
        b"this is not a header\r\n",
        b"x-big: " + b"v" * 200_000 + b"\r\n",  # beyond the HTTP parser's bound on a head
        b"content-length: 12abc\r\n",
    ],
    ids=["two-lengths", "long-length", "no-colon", "huge-header", "bad-length"],
)
def test_hostile_headers_fail(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool, head: bytes
) -> None:
    ctype = b"text/event-stream" if stream else b"application/json"
    body = sse_text(protocol, Framing()) if stream else whole_body(protocol)
    raw = b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\n" + head + b"\r\n" + body
    result = call(server, protocol, stream, raw)
    if not (stream and head.startswith(b"content-length: 999999")):
        # (A stream whose terminator arrived before the short body ended is a complete answer.)
        assert_failure(result)


def test_a_stalled_hostile_stream_is_bounded(server: tuple[FakeProvider, SyncAdapter]) -> None:
    for protocol in PROTOCOLS:
        raw = response(protocol, True, Framing(http="chunked"))
        head_end = raw.index(b"\r\n\r\n") + 4
        # The head and one partial chunk, then silence with the connection held open.
        result = call(server, protocol, True, raw[: head_end + 40], hold=True)
        assert_failure(result)


@pytest.mark.parametrize(("protocol", "stream"), MODES)
@pytest.mark.parametrize(
    "retry_after",
    ["-1", "1e309", "NaN", "inf", "Thu, 01 Jan 1970 00:00:00 GMT",
     "Fri, 31 Dec 9999 23:59:59 GMT", "99999999999999999999999999999999", "", "soon", "1.5"],
)
@pytest.mark.parametrize("status", [429, 503])
def test_hostile_retry_after_values(
    server: tuple[FakeProvider, SyncAdapter], protocol: str, stream: bool, retry_after: str,
    status: int,
) -> None:
    body = json.dumps({"error": {"message": "slow down", "type": "rate_limit_error",
                                 "code": "rate_limit_exceeded", "status": "RESOURCE_EXHAUSTED"}})
    raw = (f"HTTP/1.1 {status} Busy\r\ncontent-type: application/json\r\n"
           f"retry-after: {retry_after}\r\ndate: Tue, 14 Nov 2023 22:13:20 GMT\r\n"
           f"content-length: {len(body)}\r\n\r\n{body}").encode()
    result = call(server, protocol, stream, raw)
    assert_failure(result)
    assert result.observation is not None and result.observation.status == status
