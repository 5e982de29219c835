"""A fault-injecting fake model provider: a raw asyncio HTTP/1.1 server on loopback.

It is raw on purpose: a web framework cannot reset a connection before the status line, stall a
socket mid-body or send a truncated chunked body, and those are the faults adapters must report.
Standard library only, so the demo and any host can use it.

It speaks the four protocols on their real paths:

* ``POST /v1/chat/completions`` (OpenAI-compatible; route endpoint ``fake.endpoint("openai")``)
* ``POST /v1/responses`` (OpenAI's Responses API; ``fake.endpoint("openai_responses")``)
* ``POST /v1/messages`` (Anthropic; endpoint ``fake.endpoint("anthropic")``)
* ``POST /v1beta/models/{model}:generateContent`` and ``:streamGenerateContent?alt=sse``
  (Gemini; endpoint ``fake.endpoint("gemini")``)

What a request gets is chosen per request, first match wins:

1. an ``X-Fake-Fault: <fault>`` request header (handy with curl);
2. the next scripted behaviour for the request's model (:meth:`FakeProvider.enqueue` with
   ``model=``), then the next one for any model (``enqueue`` without ``model``);
3. the sticky default for the model, then the global default (:meth:`FakeProvider.set_default`).

Every request is recorded (:attr:`FakeProvider.requests`) with its headers and body, so a test can
assert what was, or was not, sent. The fake checks what it receives as a provider would: an
image or a document that is not valid base64 or not what its media type says, a file without
its name, a Responses-API reasoning item another model wrote, an Anthropic thinking block or a
Gemini thought signature it did not write (or, where the API requires them, their absence:
see :mod:`ledger.testing.fakewire`), a ``previous_response_id`` it never
stored get a 400 in the protocol's error shape (``ReceivedRequest.problem`` says why), and the
images and documents a request carried are decoded into ``ReceivedRequest.media`` (with the
role of the message that carried them). ``Behavior(image_out=(media_type, bytes))`` answers
with an image as each protocol with image output frames it (Gemini ``inlineData``, the Responses
API's ``image_generation_call``, the chat-completions gateways' ``message.images``), streamed or
not; Anthropic's answers carry none, as the Messages API's do not. ``Behavior(reasoning=...)``
answers with reasoning to carry back, each protocol's way (a Responses reasoning item, an
Anthropic thinking block, a Gemini thought signature).
Connection-level faults that act before any request is read (``reset_next_connections``) are
separate because they cannot be chosen by request content.

Use it in-process: ``async with FakeProvider() as fake:`` on the running loop, or
``with FakeProvider().in_thread() as fake:`` from synchronous code.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import ssl as _ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

from ledger.testing.fakewire import (
    BadRequest,
    ReceivedMedia,
    check,
    reasoning_secret,
    thought_signature,
)

_MAX_HEAD = 64 * 1024
_MAX_BODY = 32 * 1024 * 1024


class Fault(StrEnum):
    """What the fake does with a request."""

    OK = "ok"  # a complete answer, streaming or not, with usage and a reported model
    RATE_LIMIT = "rate_limit"  # 429 without Retry-After
    RATE_LIMIT_RETRY_AFTER = "rate_limit_retry_after"  # 429 with Retry-After (Gemini: RetryInfo)
    SERVER_ERROR = "server_error"  # 500
    SERVER_ERROR_ONCE = "server_error_once"  # as a default: 500 the first time, then OK
    UNAVAILABLE = "unavailable"  # 503
    OVERLOADED = "overloaded"  # 529, Anthropic's overloaded_error
    UNAUTHORIZED = "unauthorized"  # 401 whose message echoes the credential it received
    CONTEXT_LENGTH = "context_length"  # 400 in the protocol's real context-overflow shape
    CONTENT_POLICY = "content_policy"  # 400 content-policy refusal
    PREFILL_REJECTED = "prefill_rejected"  # 400 refusing a trailing assistant message
    HUGE_ERROR = "huge_error"  # 500 with a ~100 KiB error body
    RESET_BEFORE_HEADERS = "reset_before_headers"  # read the request, then TCP RST
    CLOSE_BEFORE_HEADERS = "close_before_headers"  # read the request, then FIN, no response
    GARBAGE = "garbage"  # a response that is not HTTP
    NO_RESPONSE = "no_response"  # read the request, never answer
    SLOW_FIRST_TOKEN = "slow_first_token"  # headers at once, content after delay_s
    STREAM_CUT = "stream_cut"  # some content, then FIN inside the (chunked) body
    STREAM_RESET = "stream_reset"  # some content, then RST
    STREAM_EOF = "stream_eof"  # some content, then a clean end of body: no completion signal
    STALL = "stall"  # some content, then silence
    MALFORMED_EVENT = "malformed_event"  # some content, then an event that is not JSON
    MISSING_DONE = "missing_done"  # a complete answer without the terminator, clean end
    ERROR_EVENT = "error_event"  # some content, then the protocol's in-stream error
    TRICKLE = "trickle"  # content every delay_s, forever
    # The answer stops at the output limit: chat completions finish "length", Anthropic
    # "max_tokens", Gemini "MAX_TOKENS" (answers); the Responses API's status "incomplete"
    # (reason max_output_tokens: response.incomplete in a stream).
    INCOMPLETE = "incomplete"
    # The credential the request carried, echoed in every encoding a leak takes: in the status
    # line's reason, in response headers, and in the body (JSON-escaped with \/ and \uXXXX so
    # the raw bytes never hold it verbatim, URL-encoded, base64), also as the error code/type.
    # A streaming request gets a 200 stream whose in-stream error event echoes it the same way.
    ECHO_KEY = "echo_key"
    # A response head with an illegal header line holding the credential: the client's HTTP
    # parser fails with an exception whose message quotes that line.
    ECHO_KEY_BAD_HEADER = "echo_key_bad_header"
    # Behavior.raw verbatim (status line, headers and body, each item one socket write), then
    # close, or hold the connection open when Behavior.raw_hold: for hostile framing tests.
    RAW = "raw"


@dataclass(frozen=True)
class Behavior:
    """A fault and the details of the answer around it."""

    fault: Fault = Fault.OK
    text: str = "Hello from the fake provider, streaming in pieces."
    model: str | None = None  # the reported model; default: "<requested>-fake-001"
    usage: tuple[int, int] = (11, 7)  # prompt, completion tokens
    retry_after: str = "7"  # for RATE_LIMIT_RETRY_AFTER (seconds or an HTTP date)
    delay_s: float = 1.0  # SLOW_FIRST_TOKEN wait; TRICKLE interval
    # Content events sent before a mid-stream fault; 0 strikes before any content (after the
    # protocol's prelude, e.g. Anthropic's message_start): an error event then is the provider
    # refusing the request once the stream opened.
    content_before_fault: int = 2
    # Fire a mid-stream cut or reset only after every content event and its block's end (an
    # Anthropic tool_use block is then a complete proposal), before the completion signal:
    # the answer is never finished.
    fault_after_content: bool = False
    tool_call: tuple[str, dict[str, Any]] | None = None  # answer with this call if tools were sent
    # The Responses API: answer with a custom_tool_call item (a custom tool's name and its
    # free-text input) if tools were sent, after the message and any function call (streamed
    # as response.custom_tool_call_input.delta / .done). Other protocols: ignored.
    custom_tool_call: tuple[str, str] | None = None
    raw: tuple[bytes, ...] = ()  # RAW: the bytes to write, one write per item
    raw_hold: bool = False  # RAW: keep the connection open (sending nothing) after writing
    # Answer with reasoning, "encrypted" or signed for the requested model (only that model's
    # requests may carry it back): the Responses API a reasoning item whose summary is this
    # text; Anthropic a thinking block of this text, signed, before the text (and before the
    # tool_use); Gemini a thoughtSignature on the first functionCall part (on the last text
    # part without a call; in a stream, on an empty text part of the last chunk). Chat
    # completions: ignored.
    reasoning: str | None = None
    # Anthropic, with reasoning: a redacted_thinking block too, after the thinking block.
    redacted_thinking: bool = False
    # The parts of the prompt read from the cache and of the completion spent reasoning, as each
    # protocol reports them (the Responses API's input_tokens_details.cached_tokens and
    # output_tokens_details.reasoning_tokens, chat completions' prompt_tokens_details and
    # completion_tokens_details, Anthropic's cache_read_input_tokens, Gemini's
    # cachedContentTokenCount and thoughtsTokenCount); the totals include them.
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    # Answer with this image too, (media type, bytes), as each protocol that has image output
    # frames it: Gemini an inlineData part (its own chunk in a stream), the Responses API an
    # image_generation_call item, chat completions message.images (delta.images in a stream:
    # the gateways' extension). Anthropic's Messages API returns no images: ignored there.
    image_out: tuple[str, bytes] | None = None
    # Called on the fake's loop just before the response's head is written, and before a
    # stream's first content event: a test moves its ManualClock there, so the times the
    # client marks (first byte, first token) are exact without waiting.
    before_head: Callable[[], None] | None = field(default=None, compare=False)
    before_content: Callable[[], None] | None = field(default=None, compare=False)


def _behavior(item: Fault | str | Behavior) -> Behavior:
    if isinstance(item, Behavior):
        return item
    return Behavior(fault=Fault(item))


@dataclass(frozen=True)
class ReceivedRequest:
    """One request as the fake received it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    protocol: str | None  # "openai", "openai_responses", "anthropic", "gemini", or None
    model: str | None
    stream: bool
    fault: Fault
    received_at: float = field(default_factory=time.monotonic)
    # The images and documents it carried; what a provider would refuse in it, if anything.
    media: tuple[ReceivedMedia, ...] = ()
    problem: str | None = None

    @property
    def json(self) -> Any:
        """The body parsed as JSON, or ``None`` when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class _NotHttp(Exception):
    pass


class FakeProvider:
    """The fake provider server. See the module docstring.

    Args:
        host: The loopback address to listen on.
        port: The port (0: a free one, known once started; see :attr:`base_url`).
        ssl: A server TLS context, to serve https.
        default: What a request gets when nothing is scripted (a :class:`Fault`, its name, or
            a :class:`Behavior`).

    Example:
        >>> with FakeProvider().in_thread() as fake:  # doctest: +SKIP
        ...     fake.enqueue(Fault.UNAVAILABLE)  # the next request gets a 503, then OK
        ...     route = Route(..., endpoint=fake.endpoint("openai"))
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl: _ssl.SSLContext | None = None,
        default: Fault | str | Behavior = Fault.OK,
    ) -> None:
        self.host = host
        self.port = port
        self._ssl = ssl
        self._lock = threading.Lock()
        # Notified as each request is recorded (wait_for_requests), under the same lock.
        self._arrived = threading.Condition(self._lock)
        self._default = _behavior(default)
        self._model_default: dict[str, Behavior] = {}
        self._queue: deque[Behavior] = deque()
        self._model_queue: dict[str, deque[Behavior]] = {}
        self._conn_resets = 0
        self._requests: list[ReceivedRequest] = []
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- scripting (thread-safe) -------------------------------------------------------------

    def enqueue(self, *items: Fault | str | Behavior, model: str | None = None) -> None:
        """One-shot behaviours, consumed in order by the next requests (for ``model``)."""
        with self._lock:
            q = self._queue if model is None else self._model_queue.setdefault(model, deque())
            q.extend(_behavior(i) for i in items)

    def set_default(self, item: Fault | str | Behavior, *, model: str | None = None) -> None:
        """The sticky behaviour when nothing is queued (for ``model``, or for every model)."""
        with self._lock:
            if model is None:
                self._default = _behavior(item)
            else:
                self._model_default[model] = _behavior(item)

    def reset_next_connections(self, n: int = 1) -> None:
        """Reset the next ``n`` connections on accept, before reading anything (TCP RST)."""
        with self._lock:
            self._conn_resets += n

    @property
    def requests(self) -> list[ReceivedRequest]:
        """Every request received so far, in order (a copy)."""
        with self._lock:
            return list(self._requests)

    def wait_for_requests(self, n: int = 1, *, timeout: float = 10.0) -> bool:
        """Block until ``n`` requests have been received (and recorded) in all; False on timeout.

        The request is recorded once its body was read, so it was sent in full: a test that
        cancels its caller after this knows the request left (``asyncio.to_thread`` it from a
        coroutine). It waits for the event, not for time to pass.
        """
        with self._arrived:
            return self._arrived.wait_for(lambda: len(self._requests) >= n, timeout=timeout)

    def clear(self) -> None:
        """Forget recorded requests and scripted behaviours; defaults go back to OK."""
        with self._lock:
            self._requests.clear()
            self._queue.clear()
            self._model_queue.clear()
            self._model_default.clear()
            self._default = Behavior()
            self._conn_resets = 0

    def _choose(self, model: str | None, header: str | None) -> Behavior:
        with self._lock:
            if header:
                try:
                    return Behavior(fault=Fault(header.strip().lower()))
                except ValueError:
                    pass  # an unknown fault name falls through to the script
            if model is not None and self._model_queue.get(model):
                return self._model_queue[model].popleft()
            if self._queue:
                return self._queue.popleft()
            if model is not None and model in self._model_default:
                chosen = self._model_default[model]
                if chosen.fault is Fault.SERVER_ERROR_ONCE:
                    self._model_default[model] = replace(chosen, fault=Fault.OK)
                return chosen
            chosen = self._default
            if chosen.fault is Fault.SERVER_ERROR_ONCE:
                self._default = replace(chosen, fault=Fault.OK)
            return chosen

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http(s)://host:port`` of the running server."""
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def endpoint(self, protocol: str) -> str:
        """The ``Route.endpoint`` for ``protocol``.

        ``"openai"``, ``"openai_responses"``, ``"anthropic"`` or ``"gemini"``.
        """
        if protocol in ("openai", "openai_responses"):
            return self.base_url + "/v1"
        return self.base_url

    async def start(self) -> None:
        """Listen on the running loop (``async with`` does this)."""
        self._server = await asyncio.start_server(
            self._connection, self.host, self.port, ssl=self._ssl, limit=_MAX_HEAD
        )
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and cancel the connections being served."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FakeProvider:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[FakeProvider]:
        """Run the server on a private loop in a background thread (for synchronous tests)."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fake-provider", daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result(timeout=10)
            yield self
        finally:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()

    # -- connection handling -----------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self.connections += 1
            reset_now = self._conn_resets > 0
            if reset_now:
                self._conn_resets -= 1
        try:
            if reset_now:
                _reset(writer)
                return
            buf = bytearray()
            while True:
                try:
                    head = await self._read_request(reader, buf)
                except _NotHttp:
                    # e.g. a TLS ClientHello sent to this plain-HTTP server: answer in plain
                    # HTTP, which the client's TLS layer rejects as not-TLS.
                    await _write(writer, _head(400, {"content-length": "0", "connection": "close"}))
                    break
                if head is None:
                    break
                if not await self._respond(*head, reader, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            # stop() cancels open connections; ending quietly keeps asyncio's stream callback
            # from logging the cancellation as an error.
            pass
        finally:
            self._tasks.discard(task)
            if not writer.is_closing():
                writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_request(
        self, reader: asyncio.StreamReader, buf: bytearray
    ) -> tuple[ReceivedRequest, Behavior] | None:
        while b"\r\n\r\n" not in buf:
            if buf and not buf[:1].isalpha():
                raise _NotHttp()
            if len(buf) > _MAX_HEAD:
                raise _NotHttp()
            data = await reader.read(65536)
            if not data:
                return None
            buf.extend(data)
        if not buf[:1].isalpha():
            raise _NotHttp()
        end = buf.index(b"\r\n\r\n")
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        del buf[: end + 4]
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            raise _NotHttp() from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = bytearray()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                while b"\r\n" not in buf:
                    buf.extend(await _read_some(reader))
                i = buf.index(b"\r\n")
                size = int(bytes(buf[:i]).split(b";")[0], 16)
                del buf[: i + 2]
                while len(buf) < size + 2:
                    buf.extend(await _read_some(reader))
                body.extend(buf[:size])
                del buf[: size + 2]
                if size == 0:
                    break
        else:
            length = int(headers.get("content-length", "0") or 0)
            if length > _MAX_BODY:
                raise _NotHttp()
            while len(buf) < length:
                buf.extend(await _read_some(reader))
            body.extend(buf[:length])
            del buf[:length]
        parts = urlsplit(target)
        path = unquote(parts.path)
        protocol, model, stream = _classify(path, bytes(body))
        behavior = self._choose(model, headers.get("x-fake-fault"))
        media: list[ReceivedMedia] = []
        problem = None
        try:
            media = check(protocol, bytes(body), model)
        except BadRequest as e:
            problem = str(e)
        req = ReceivedRequest(
            method=method,
            path=path,
            query=parts.query,
            headers=headers,
            body=bytes(body),
            protocol=protocol,
            model=model,
            stream=stream,
            fault=behavior.fault,
            media=tuple(media),
            problem=problem,
        )
        with self._lock:
            self._requests.append(req)
            self._arrived.notify_all()
        return req, behavior

    async def _respond(
        self,
        req: ReceivedRequest,
        behavior: Behavior,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer one request; False when the connection must not be reused."""
        if req.protocol is None:
            await _write(writer, _json_response(404, {"error": {"message": "unknown path"}}))
            return True
        f = behavior.fault
        if f is Fault.RESET_BEFORE_HEADERS:
            _reset(writer)
            return False
        if f is Fault.CLOSE_BEFORE_HEADERS:
            return False
        if f is Fault.GARBAGE:
            await _write(writer, b"THIS IS NOT HTTP\r\n\r\n")
            return False
        if f is Fault.NO_RESPONSE:
            await _until_closed(reader)
            return False
        if f is Fault.RAW:
            for piece in behavior.raw:
                await _write(writer, piece)
            if behavior.raw_hold:
                await _until_closed(reader)
            return False
        if f is Fault.ECHO_KEY:
            await _write(writer, _echo_key_response(req))
            return True
        if f is Fault.ECHO_KEY_BAD_HEADER:
            key = _received_key(req).encode("latin-1", errors="replace")
            await _write(writer, b"HTTP/1.1 200 OK\r\nX-Echo " + key + b"\r\n\r\n")
            return False
        status_body = _error_response(req, behavior)
        if status_body is not None:
            status, obj, extra = status_body
            if behavior.before_head is not None:
                behavior.before_head()
            await _write(writer, _json_response(status, obj, extra))
            return True
        if req.problem is not None:
            await _write(writer, _json_response(400, _invalid_request(req.protocol,
                                                                      req.problem)))
            return True
        answer = _Answer.build(req, behavior)
        if req.stream:
            return await self._stream(req, behavior, answer, reader, writer)
        return await self._whole(req, behavior, answer, reader, writer)

    async def _whole(
        self,
        req: ReceivedRequest,
        behavior: Behavior,
        answer: _Answer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        f = behavior.fault
        body = json.dumps(answer.whole(req.protocol or "")).encode()
        if f is Fault.SLOW_FIRST_TOKEN:
            await asyncio.sleep(behavior.delay_s)
        if behavior.before_head is not None:
            behavior.before_head()
        if f is Fault.MALFORMED_EVENT:
            await _write(
                writer, _raw_response(200, b'{"id": "broken", "choices": [', "application/json")
            )
            return True
        if f is Fault.ERROR_EVENT:
            if req.protocol == "openai_responses":
                failed = {**answer.whole("openai_responses"), "status": "failed", "output": [],
                          "error": _stream_error("openai_responses")["response"]["error"]}
                await _write(writer, _json_response(200, failed))
            else:
                await _write(writer, _json_response(200, _stream_error(req.protocol or "")))
            return True
        half = body[: len(body) // 2]
        if f in (Fault.STREAM_CUT, Fault.STREAM_RESET, Fault.STALL, Fault.TRICKLE):
            await _write(
                writer,
                _head(200, {"content-type": "application/json", "content-length": str(len(body))})
                + half,
            )
            if f is Fault.STREAM_CUT:
                return False
            if f is Fault.STREAM_RESET:
                _reset(writer)
                return False
            if f is Fault.STALL:
                await _until_closed(reader)
                return False
            while True:  # TRICKLE: whitespace is valid JSON padding, and never ends the body
                await asyncio.sleep(behavior.delay_s)
                await _write(writer, b" ")
        if f is Fault.STREAM_EOF:
            # A close-delimited body that ends early: clean at the HTTP level, truncated JSON.
            await _write(
                writer,
                _head(200, {"content-type": "application/json", "connection": "close"}) + half,
            )
            return False
        await _write(writer, _raw_response(200, body, "application/json"))
        return True

    async def _stream(
        self,
        req: ReceivedRequest,
        behavior: Behavior,
        answer: _Answer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        f = behavior.fault
        protocol = req.protocol or ""
        events = answer.events(protocol, include_usage=_wants_usage(req))
        if behavior.before_head is not None:
            behavior.before_head()
        await _write(
            writer,
            _head(
                200,
                {
                    "content-type": "text/event-stream",
                    "cache-control": "no-cache",
                    "transfer-encoding": "chunked",
                },
            ),
        )
        sent_content = 0
        prelude_done = False
        events = list(events)
        last_content = max((i for i, e in enumerate(events) if e[1]), default=-1)
        for index, (data, is_content, is_terminator) in enumerate(events):
            if is_content and not prelude_done:
                prelude_done = True
                if f is Fault.SLOW_FIRST_TOKEN:
                    await asyncio.sleep(behavior.delay_s)
                if behavior.before_content is not None:
                    behavior.before_content()
                if f is Fault.TRICKLE:
                    while True:
                        await _write(writer, _chunk(data))
                        await asyncio.sleep(behavior.delay_s)
            if (behavior.fault_after_content and index > last_content >= 0
                    # the block (a tool_use, a function_call item) completes
                    and not any(end in data for end in _ITEM_ENDS)
                    and f in (Fault.STREAM_CUT, Fault.STREAM_RESET)):
                if f is Fault.STREAM_RESET:
                    _reset(writer)
                return False
            if (is_content and not behavior.fault_after_content
                    and sent_content >= behavior.content_before_fault):
                if f is Fault.STREAM_CUT:
                    return False  # FIN inside the chunked body
                if f is Fault.STREAM_RESET:
                    _reset(writer)
                    return False
                if f is Fault.STALL:
                    await _until_closed(reader)
                    return False
                if f is Fault.STREAM_EOF:
                    await _write(writer, b"0\r\n\r\n")
                    return True
                if f is Fault.MALFORMED_EVENT:
                    await _write(writer, _chunk(b'data: {"broken": \n\n'))
                    await _write(writer, b"0\r\n\r\n")
                    return True
                if f is Fault.ERROR_EVENT:
                    err = _stream_error(protocol)
                    name = _ERROR_EVENT_NAME.get(protocol, b"")
                    await _write(
                        writer, _chunk(name + b"data: " + json.dumps(err).encode() + b"\n\n")
                    )
                    await _write(writer, b"0\r\n\r\n")
                    return True
            if is_terminator and f is Fault.MISSING_DONE:
                continue
            await _write(writer, _chunk(data))
            if is_content:
                sent_content += 1
        await _write(writer, b"0\r\n\r\n")
        return True


# ------------------------------------------------------------------------------------------
# wire helpers


async def _read_some(reader: asyncio.StreamReader) -> bytes:
    data = await reader.read(65536)
    if not data:
        raise asyncio.IncompleteReadError(b"", None)
    return data


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Hold the connection open, sending nothing, until the client goes away."""
    while await reader.read(65536):
        pass


async def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
    529: "Overloaded",
}


def _head(status: int, headers: dict[str, str], reason: str | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason or _REASONS.get(status, 'Status')}"]
    lines.extend(f"{k}: {v}" for k, v in headers.items())
    lines.append(f"x-request-id: req_fake_{time.monotonic_ns()}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _raw_response(
    status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None
) -> bytes:
    headers = {"content-type": ctype, "content-length": str(len(body))}
    headers.update(extra or {})
    return _head(status, headers) + body


def _json_response(status: int, obj: Any, extra: dict[str, str] | None = None) -> bytes:
    return _raw_response(status, json.dumps(obj).encode(), "application/json", extra)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _classify(path: str, body: bytes) -> tuple[str | None, str | None, bool]:
    try:
        obj = json.loads(body) if body else {}
    except ValueError:
        obj = {}
    if not isinstance(obj, dict):
        obj = {}
    model = obj.get("model") if isinstance(obj.get("model"), str) else None
    if path.endswith("/chat/completions"):
        return "openai", model, bool(obj.get("stream"))
    if path.endswith("/responses"):
        return "openai_responses", model, bool(obj.get("stream"))
    if path.endswith("/messages"):
        return "anthropic", model, bool(obj.get("stream"))
    if "/models/" in path and ":" in path.rsplit("/", 1)[-1]:
        name, _, method = path.rsplit("/", 1)[-1].partition(":")
        if method in ("generateContent", "streamGenerateContent"):
            return "gemini", name, method == "streamGenerateContent"
    return None, model, False


def _wants_usage(req: ReceivedRequest) -> bool:
    obj = req.json
    if req.protocol != "openai" or not isinstance(obj, dict):
        return True
    opts = obj.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


# The SSE event name of each protocol's in-stream error (the others send data only).
_ERROR_EVENT_NAME = {"anthropic": b"event: error\n",
                     "openai_responses": b"event: response.failed\n"}
# Events that complete an output item: a mid-stream fault after the last content lets them
# through, so the tool call is a complete proposal when the stream breaks.
_ITEM_ENDS = (b"content_block_stop", b"response.function_call_arguments.done",
              b"response.output_item.done")


def _invalid_request(protocol: str | None, message: str) -> dict[str, Any]:
    """A 400 body in the protocol's shape for a request a provider would refuse."""
    if protocol == "anthropic":
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    if protocol == "gemini":
        return {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_value"}}


def _stream_error(protocol: str) -> dict[str, Any]:
    if protocol == "openai_responses":
        return {"type": "response.failed", "sequence_number": 9, "response": {
            "id": "resp_fake", "object": "response", "status": "failed", "output": [],
            "error": {"code": "server_error",
                      "message": "The server had an error while processing your request."},
            "usage": None}}
    if protocol == "anthropic":
        return {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    if protocol == "gemini":
        return {
            "error": {
                "code": 503,
                "message": "The model is overloaded. Please try again later.",
                "status": "UNAVAILABLE",
            }
        }
    return {
        "error": {
            "message": "The server had an error while processing your request.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


def _received_key(req: ReceivedRequest) -> str:
    """The credential the request carried, in whichever header its protocol uses."""
    return (
        req.headers.get("authorization", "").removeprefix("Bearer ")
        or req.headers.get("x-api-key", "")
        or req.headers.get("x-goog-api-key", "")
    )


def _echo_key_response(req: ReceivedRequest) -> bytes:
    """The ECHO_KEY answer: the request's credential in every encoding (see :class:`Fault`)."""
    key = _received_key(req)
    raw = key.encode("utf-8")
    every_char = "".join(f"\\u{ord(c):04x}" for c in key)  # no byte of the key verbatim
    slashed = json.dumps(key)[1:-1].replace("/", "\\/")
    message = (
        f"Incorrect API key provided: {slashed}. As escapes: {every_char}. URL-encoded: "
        f"{quote(key, safe='')} or {quote_plus(key)}. Base64: "
        f"{base64.b64encode(raw).decode()} or {base64.urlsafe_b64encode(raw).decode()}."
    )
    p = req.protocol
    if p == "anthropic":
        body = f'{{"type": "error", "error": {{"type": "{every_char}", "message": "{message}"}}}}'
    elif p == "gemini":
        body = f'{{"error": {{"code": 401, "message": "{message}", "status": "{every_char}"}}}}'
    else:
        body = (f'{{"error": {{"message": "{message}", "type": "invalid_request_error", '
                f'"param": null, "code": "{every_char}"}}}}')
    echo = {
        "x-echo-key": key,
        "x-echo-key-url": quote(key, safe=""),
        "x-echo-key-b64": base64.b64encode(raw).decode(),
        "www-authenticate": f'Bearer error="invalid_token", key="{key}"',
    }
    data = body.encode()
    if not req.stream:
        headers = {"content-type": "application/json", "content-length": str(len(data)), **echo}
        return _head(401, headers, reason=f"Unauthorized {key}") + data
    headers = {"content-type": "text/event-stream", "transfer-encoding": "chunked", **echo}
    events = _Answer.build(req, Behavior(text="partial")).events(p or "", include_usage=False)
    prelude = b""
    for ev, is_content, _ in events:  # up to and including the first piece of content
        prelude += _chunk(ev)
        if is_content:
            break
    name = b"event: error\n" if p in ("anthropic", "openai_responses") else b""
    return (
        _head(200, headers) + prelude + _chunk(name + b"data: " + data + b"\n\n") + b"0\r\n\r\n"
    )


def _error_response(
    req: ReceivedRequest, b: Behavior
) -> tuple[int, dict[str, Any], dict[str, str]] | None:
    """Status, body and headers for the faults that are an HTTP error; None otherwise."""
    p = req.protocol
    f = b.fault
    key = _received_key(req)

    def oai(
        status: int, message: str, type_: str, code: str | None, param: str | None = None
    ) -> dict[str, Any]:
        return {"error": {"message": message, "type": type_, "param": param, "code": code}}

    def ant(type_: str, message: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": type_, "message": message}}

    def gem(
        code: int, status: str, message: str, details: list[Any] | None = None
    ) -> dict[str, Any]:
        err: dict[str, Any] = {"code": code, "message": message, "status": status}
        if details:
            err["details"] = details
        return {"error": err}

    prefill_msg = (
        "This model does not support assistant message prefill. The conversation "
        "must end with a user message."
    )
    table: dict[Fault, tuple[int, dict[str, Any], dict[str, Any], dict[str, Any]]] = {
        Fault.RATE_LIMIT: (
            429,
            oai(429, "Rate limit reached for requests per min.", "requests", "rate_limit_exceeded"),
            ant(
                "rate_limit_error",
                "Number of request tokens has exceeded your per-minute rate limit.",
            ),
            gem(429, "RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
        ),
        Fault.RATE_LIMIT_RETRY_AFTER: (
            429,
            oai(429, "Rate limit reached for requests per min.", "requests", "rate_limit_exceeded"),
            ant(
                "rate_limit_error",
                "Number of request tokens has exceeded your per-minute rate limit.",
            ),
            gem(
                429,
                "RESOURCE_EXHAUSTED",
                "Resource has been exhausted (e.g. check quota).",
                [
                    {
                        "@type": "type.googleapis.com/google.rpc.RetryInfo",
                        "retryDelay": f"{b.retry_after}s",
                    }
                ],
            ),
        ),
        Fault.SERVER_ERROR: (
            500,
            oai(
                500, "The server had an error while processing your request.", "server_error", None
            ),
            ant("api_error", "Internal server error"),
            gem(500, "INTERNAL", "An internal error has occurred."),
        ),
        Fault.UNAVAILABLE: (
            503,
            oai(
                503,
                "The engine is currently overloaded, please try again later.",
                "server_error",
                None,
            ),
            ant("api_error", "Service unavailable"),
            gem(503, "UNAVAILABLE", "The model is overloaded. Please try again later."),
        ),
        Fault.OVERLOADED: (
            529,
            oai(529, "Overloaded", "server_error", "overloaded"),
            ant("overloaded_error", "Overloaded"),
            gem(503, "UNAVAILABLE", "The model is overloaded. Please try again later."),
        ),
        Fault.UNAUTHORIZED: (
            401,
            oai(
                401,
                f"Incorrect API key provided: {key}.",
                "invalid_request_error",
                "invalid_api_key",
            ),
            ant("authentication_error", f"invalid x-api-key: {key}"),
            gem(401, "UNAUTHENTICATED", f"API key not valid: {key}"),
        ),
        Fault.CONTEXT_LENGTH: (
            400,
            oai(
                400,
                "This model's maximum context length is 128000 tokens. However, your "
                "messages resulted in 131072 tokens. Please reduce the length of the messages.",
                "invalid_request_error",
                "context_length_exceeded",
                "messages",
            ),
            ant("invalid_request_error", "prompt is too long: 215000 tokens > 200000 maximum"),
            gem(
                400,
                "INVALID_ARGUMENT",
                "The input token count (1200000) exceeds the maximum "
                "number of tokens allowed (1048576).",
            ),
        ),
        Fault.CONTENT_POLICY: (
            400,
            oai(
                400,
                "Your request was rejected as a result of our safety system.",
                "invalid_request_error",
                "content_policy_violation",
            ),
            ant("invalid_request_error", "Output blocked by content filtering policy"),
            gem(400, "INVALID_ARGUMENT", "The request was blocked by the content policy (SAFETY)."),
        ),
        Fault.PREFILL_REJECTED: (
            400,
            oai(400, prefill_msg, "invalid_request_error", None, "messages"),
            ant("invalid_request_error", prefill_msg),
            gem(
                400,
                "INVALID_ARGUMENT",
                "Please ensure that multiturn requests end with a "
                "user role or a function response.",
            ),
        ),
        Fault.HUGE_ERROR: (
            500,
            oai(500, "internal error " + "x" * 100_000, "server_error", None),
            ant("api_error", "internal error " + "x" * 100_000),
            gem(500, "INTERNAL", "internal error " + "x" * 100_000),
        ),
    }
    row = table.get(Fault.SERVER_ERROR if f is Fault.SERVER_ERROR_ONCE else f)
    if row is None:
        return None
    status, o, a, g = row
    body = a if p == "anthropic" else g if p == "gemini" else o  # Responses: OpenAI's errors
    if p == "gemini" and f is Fault.OVERLOADED:
        status = 503
    extra = {"retry-after": b.retry_after} if f is Fault.RATE_LIMIT_RETRY_AFTER else {}
    return status, body, extra


@dataclass
class _Answer:
    """The answer the fake gives, in each protocol's whole-body and stream shapes."""

    pieces: list[str]
    model: str
    usage: tuple[int, int]
    tool: tuple[str, dict[str, Any]] | None
    incomplete: bool = False  # stopped at the output limit (Fault.INCOMPLETE)
    reasoning: str | None = None  # a Responses reasoning item's summary
    secret: str = ""  # its "encrypted" content, readable by the requested model only
    requested: str | None = None  # the model the request named (signatures are for it)
    redacted: bool = False  # Anthropic: a redacted_thinking block after the thinking block
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    image: tuple[str, bytes] | None = None  # (media type, bytes) of an image in the answer
    custom: tuple[str, str] | None = None  # Responses: a custom_tool_call (name, input)

    @classmethod
    def build(cls, req: ReceivedRequest, b: Behavior) -> _Answer:
        obj = req.json if isinstance(req.json, dict) else {}
        has_tools = bool(obj.get("tools"))
        words = b.text.split(" ")
        size = max(1, len(words) // 4)
        pieces = [" ".join(words[i : i + size]) for i in range(0, len(words), size)]
        pieces = [p + (" " if i < len(pieces) - 1 else "") for i, p in enumerate(pieces)]
        return cls(
            pieces=pieces,
            model=b.model or f"{req.model or 'fake'}-fake-001",
            usage=b.usage,
            tool=b.tool_call if has_tools else None,
            custom=b.custom_tool_call if has_tools else None,
            incomplete=b.fault is Fault.INCOMPLETE,
            reasoning=b.reasoning,
            secret=reasoning_secret(req.model, b.reasoning) if b.reasoning else "",
            requested=req.model,
            redacted=b.redacted_thinking,
            cached_tokens=b.cached_tokens,
            reasoning_tokens=b.reasoning_tokens,
            image=b.image_out,
        )

    def _thinking_blocks(self) -> list[dict[str, Any]]:
        """Anthropic: the answer's thinking block (signed: its text is checked unchanged)."""
        if not self.reasoning:
            return []
        blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": self.reasoning,
                                         "signature": self.secret}]
        if self.redacted:
            blocks.append({"type": "redacted_thinking",
                           "data": reasoning_secret(self.requested, "redacted")})
        return blocks

    def _signature(self, part: str) -> dict[str, str]:
        """Gemini: the thoughtSignature of the answer's ``part`` (a function name, ``text``)."""
        if not self.reasoning:
            return {}
        return {"thoughtSignature": thought_signature(self.requested, part, self.reasoning)}

    @property
    def image_b64(self) -> str:
        return base64.b64encode(self.image[1]).decode("ascii") if self.image else ""

    def _gemini_image(self) -> dict[str, Any]:
        assert self.image is not None
        return {"inlineData": {"mimeType": self.image[0], "data": self.image_b64}}

    def _chat_images(self) -> list[dict[str, Any]]:
        assert self.image is not None
        return [{"type": "image_url", "index": 0, "image_url": {
            "url": f"data:{self.image[0]};base64,{self.image_b64}"}}]

    def finish(self, protocol: str) -> str:
        """The answer's finish (stop) reason in ``protocol``'s words."""
        if protocol == "anthropic":
            return "max_tokens" if self.incomplete else "tool_use" if self.tool else "end_turn"
        if protocol == "gemini":
            return "MAX_TOKENS" if self.incomplete else "STOP"
        return "length" if self.incomplete else "tool_calls" if self.tool else "stop"

    def _responses_usage(self) -> dict[str, Any]:
        pt, ct = self.usage
        return {"input_tokens": pt, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": ct,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": pt + ct}

    # The other protocols report the cached and reasoning parts only when there are some, as
    # their usage objects are written without them otherwise.
    def _chat_usage(self) -> dict[str, Any]:
        pt, ct = self.usage
        out: dict[str, Any] = {"prompt_tokens": pt, "completion_tokens": ct,
                               "total_tokens": pt + ct}
        if self.cached_tokens:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return out

    def _anthropic_usage(self, output_tokens: int) -> dict[str, Any]:
        # Anthropic counts the prompt tokens read from its cache apart from input_tokens.
        pt, _ct = self.usage
        out: dict[str, Any] = {"input_tokens": pt - self.cached_tokens,
                               "output_tokens": output_tokens}
        if self.cached_tokens:
            out["cache_read_input_tokens"] = self.cached_tokens
        return out

    def _gemini_usage(self) -> dict[str, Any]:
        # Gemini counts thinking tokens apart from the candidates' tokens.
        pt, ct = self.usage
        out: dict[str, Any] = {"promptTokenCount": pt,
                               "candidatesTokenCount": ct - self.reasoning_tokens,
                               "totalTokenCount": pt + ct}
        if self.cached_tokens:
            out["cachedContentTokenCount"] = self.cached_tokens
        if self.reasoning_tokens:
            out["thoughtsTokenCount"] = self.reasoning_tokens
        return out

    def _responses_items(self) -> list[dict[str, Any]]:
        """The answer's output items (reasoning, message, function call)."""
        items: list[dict[str, Any]] = []
        if self.reasoning:
            items.append({"type": "reasoning", "id": "rs_fake_1",
                          "summary": [{"type": "summary_text", "text": self.reasoning}],
                          "encrypted_content": self.secret})
        if self.image:
            item: dict[str, Any] = {"type": "image_generation_call", "id": "ig_fake_1",
                                    "status": "completed", "result": self.image_b64}
            fmt = {"image/png": "png", "image/jpeg": "jpeg",
                   "image/webp": "webp"}.get(self.image[0])
            if fmt:  # the tool writes png, jpeg or webp; another type is told by its bytes
                item["output_format"] = fmt
            items.append(item)
        items.append({"type": "message", "id": "msg_fake_1", "status": "completed",
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": self.text, "annotations": []}]})
        if self.tool:
            items.append({"type": "function_call", "id": "fc_fake_1", "call_id": "call_fake_1",
                          "name": self.tool[0], "arguments": json.dumps(self.tool[1]),
                          "status": "completed"})
        if self.custom:
            items.append({"type": "custom_tool_call", "id": "ctc_fake_1",
                          "call_id": "call_fake_2", "name": self.custom[0],
                          "input": self.custom[1], "status": "completed"})
        return items

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        done = status in ("completed", "incomplete")
        return {"id": "resp_fake", "object": "response", "created_at": 0, "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "model": self.model, "output": output, "store": False,
                "usage": self._responses_usage() if done else None}

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def whole(self, protocol: str) -> dict[str, Any]:
        _pt, ct = self.usage
        if protocol == "openai_responses":
            return self._response("incomplete" if self.incomplete else "completed",
                                  self._responses_items())
        if protocol == "anthropic":
            content: list[dict[str, Any]] = [*self._thinking_blocks(),
                                             {"type": "text", "text": self.text}]
            if self.tool:
                content.append(
                    {
                        "type": "tool_use",
                        "id": "toolu_fake_1",
                        "name": self.tool[0],
                        "input": self.tool[1],
                    }
                )
            return {
                "id": "msg_fake",
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": content,
                "stop_reason": self.finish(protocol),
                "usage": self._anthropic_usage(ct),
            }
        if protocol == "gemini":
            parts: list[dict[str, Any]] = [
                {"text": self.text, **({} if self.tool else self._signature("text"))}]
            if self.image:
                parts.append(self._gemini_image())
            if self.tool:
                parts.append({"functionCall": {"name": self.tool[0], "args": self.tool[1]},
                              **self._signature(self.tool[0])})
            return {
                "candidates": [
                    {
                        "content": {"role": "model", "parts": parts},
                        "finishReason": self.finish(protocol),
                        "index": 0,
                    }
                ],
                "usageMetadata": self._gemini_usage(),
                "modelVersion": self.model,
            }
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.image:
            message["images"] = self._chat_images()
        if self.tool:
            message["tool_calls"] = [
                {
                    "id": "call_fake_1",
                    "type": "function",
                    "function": {"name": self.tool[0], "arguments": json.dumps(self.tool[1])},
                }
            ]
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": self.finish(protocol),
                }
            ],
            "usage": self._chat_usage(),
        }

    def _responses_events(self) -> list[tuple[bytes, bool, bool]]:
        """The Responses stream: every event named by its ``type``; no terminator event."""
        out: list[tuple[bytes, bool, bool]] = []
        seq = 0

        def ev(obj: dict[str, Any], content: bool = False) -> None:
            nonlocal seq
            obj = {**obj, "sequence_number": seq}
            seq += 1
            out.append((f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode(),
                        content, False))

        ev({"type": "response.created", "response": self._response("in_progress", [])})
        ev({"type": "response.in_progress", "response": self._response("in_progress", [])})
        items = self._responses_items()
        for index, item in enumerate(items):
            if item["type"] == "reasoning":
                ev({"type": "response.output_item.added", "output_index": index,
                    "item": {**item, "summary": [], "encrypted_content": None}})
                ev({"type": "response.reasoning_summary_text.delta", "item_id": item["id"],
                    "output_index": index, "summary_index": 0, "delta": self.reasoning})
                ev({"type": "response.output_item.done", "output_index": index, "item": item})
            elif item["type"] == "image_generation_call":
                ref = {"item_id": item["id"], "output_index": index}
                ev({"type": "response.output_item.added", "output_index": index,
                    "item": {**item, "status": "in_progress", "result": None}})
                ev({"type": "response.image_generation_call.in_progress", **ref})
                ev({"type": "response.image_generation_call.generating", **ref})
                ev({"type": "response.image_generation_call.partial_image", **ref,
                    "partial_image_index": 0, "partial_image_b64": item["result"]})
                ev({"type": "response.image_generation_call.completed", **ref})
                ev({"type": "response.output_item.done", "output_index": index, "item": item},
                   True)
            elif item["type"] == "message":
                ev({"type": "response.output_item.added", "output_index": index,
                    "item": {**item, "status": "in_progress", "content": []}})
                ev({"type": "response.content_part.added", "item_id": item["id"],
                    "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}})
                for piece in self.pieces:
                    ev({"type": "response.output_text.delta", "item_id": item["id"],
                        "output_index": index, "content_index": 0, "delta": piece}, True)
                ev({"type": "response.output_text.done", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "text": self.text})
                ev({"type": "response.content_part.done", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "part": item["content"][0]})
                ev({"type": "response.output_item.done", "output_index": index, "item": item})
            elif item["type"] == "custom_tool_call":
                ev({"type": "response.output_item.added", "output_index": index,
                    "item": {**item, "input": "", "status": "in_progress"}}, True)
                ev({"type": "response.custom_tool_call_input.delta", "item_id": item["id"],
                    "output_index": index, "delta": item["input"]}, True)
                ev({"type": "response.custom_tool_call_input.done", "item_id": item["id"],
                    "output_index": index, "input": item["input"]})
                ev({"type": "response.output_item.done", "output_index": index, "item": item})
            else:
                args = item["arguments"]
                half = len(args) // 2
                ev({"type": "response.output_item.added", "output_index": index,
                    "item": {**item, "arguments": "", "status": "in_progress"}}, True)
                for frag in (args[:half], args[half:]):
                    ev({"type": "response.function_call_arguments.delta",
                        "item_id": item["id"], "output_index": index, "delta": frag}, True)
                ev({"type": "response.function_call_arguments.done", "item_id": item["id"],
                    "output_index": index, "arguments": args})
                ev({"type": "response.output_item.done", "output_index": index, "item": item})
        if self.incomplete:
            ev({"type": "response.incomplete", "response": self._response("incomplete", items)})
        else:
            ev({"type": "response.completed", "response": self._response("completed", items)})
        return out

    def events(self, protocol: str, *, include_usage: bool) -> list[tuple[bytes, bool, bool]]:
        """SSE events as (bytes, carries content, is the terminator)."""

        def sse(obj: Any, name: str | None = None) -> bytes:
            head = f"event: {name}\n" if name else ""
            return (head + "data: " + json.dumps(obj) + "\n\n").encode()

        _pt, ct = self.usage
        out: list[tuple[bytes, bool, bool]] = []
        if protocol == "openai_responses":
            return self._responses_events()
        if protocol == "anthropic":
            out.append(
                (
                    sse(
                        {
                            "type": "message_start",
                            "message": {
                                "id": "msg_fake",
                                "type": "message",
                                "role": "assistant",
                                "model": self.model,
                                "content": [],
                                "stop_reason": None,
                                "usage": self._anthropic_usage(1),
                            },
                        },
                        "message_start",
                    ),
                    False,
                    False,
                )
            )
            # Thinking blocks first, as the Messages API streams them: the thinking text in
            # deltas, then its signature in a signature_delta (not content: not answer text).
            thinking = self._thinking_blocks()
            for n, block in enumerate(thinking):
                if block["type"] == "redacted_thinking":
                    out.append((sse({"type": "content_block_start", "index": n,
                                     "content_block": block}, "content_block_start"),
                                False, False))
                else:
                    text = block["thinking"]
                    out.append((sse({"type": "content_block_start", "index": n,
                                     "content_block": {"type": "thinking", "thinking": ""}},
                                    "content_block_start"), False, False))
                    for frag in (text[: len(text) // 2], text[len(text) // 2:]):
                        out.append((sse({"type": "content_block_delta", "index": n,
                                         "delta": {"type": "thinking_delta", "thinking": frag}},
                                        "content_block_delta"), False, False))
                    out.append((sse({"type": "content_block_delta", "index": n,
                                     "delta": {"type": "signature_delta",
                                               "signature": block["signature"]}},
                                    "content_block_delta"), False, False))
                out.append((sse({"type": "content_block_stop", "index": n},
                                "content_block_stop"), False, False))
            k = len(thinking)
            out.append(
                (
                    sse(
                        {
                            "type": "content_block_start",
                            "index": k,
                            "content_block": {"type": "text", "text": ""},
                        },
                        "content_block_start",
                    ),
                    False,
                    False,
                )
            )
            out.append((b'event: ping\ndata: {"type": "ping"}\n\n', False, False))
            for piece in self.pieces:
                out.append(
                    (
                        sse(
                            {
                                "type": "content_block_delta",
                                "index": k,
                                "delta": {"type": "text_delta", "text": piece},
                            },
                            "content_block_delta",
                        ),
                        True,
                        False,
                    )
                )
            out.append(
                (
                    sse({"type": "content_block_stop", "index": k}, "content_block_stop"),
                    False,
                    False,
                )
            )
            if self.tool:
                args = json.dumps(self.tool[1])
                out.append(
                    (
                        sse(
                            {
                                "type": "content_block_start",
                                "index": k + 1,
                                "content_block": {
                                    "type": "tool_use",
                                    "id": "toolu_fake_1",
                                    "name": self.tool[0],
                                    "input": {},
                                },
                            },
                            "content_block_start",
                        ),
                        True,
                        False,
                    )
                )
                half = len(args) // 2
                for frag in (args[:half], args[half:]):
                    out.append(
                        (
                            sse(
                                {
                                    "type": "content_block_delta",
                                    "index": k + 1,
                                    "delta": {"type": "input_json_delta", "partial_json": frag},
                                },
                                "content_block_delta",
                            ),
                            True,
                            False,
                        )
                    )
                out.append(
                    (
                        sse({"type": "content_block_stop", "index": k + 1}, "content_block_stop"),
                        False,
                        False,
                    )
                )
            out.append(
                (
                    sse(
                        {
                            "type": "message_delta",
                            "delta": {
                                "stop_reason": self.finish(protocol),
                                "stop_sequence": None,
                            },
                            "usage": {"output_tokens": ct},
                        },
                        "message_delta",
                    ),
                    False,
                    False,
                )
            )
            out.append((sse({"type": "message_stop"}, "message_stop"), False, True))
            return out
        if protocol == "gemini":
            for i, piece in enumerate(self.pieces):
                if self.image and i == len(self.pieces) - 1:
                    # The image arrives whole, in a chunk of its own.
                    out.append((sse({"candidates": [{"content": {
                        "role": "model", "parts": [self._gemini_image()]}, "index": 0}],
                        "modelVersion": self.model}), True, False))
                chunk: dict[str, Any] = {
                    "candidates": [
                        {"content": {"role": "model", "parts": [{"text": piece}]}, "index": 0}
                    ],
                    "modelVersion": self.model,
                }
                last = i == len(self.pieces) - 1
                if last and self.tool:
                    chunk["candidates"][0]["content"]["parts"].append(
                        {"functionCall": {"name": self.tool[0], "args": self.tool[1]},
                         **self._signature(self.tool[0])}
                    )
                elif last and self.reasoning:
                    # Without a call, the signature comes on an empty text part at the end.
                    chunk["candidates"][0]["content"]["parts"].append(
                        {"text": "", **self._signature("text")})
                if last:
                    chunk["candidates"][0]["finishReason"] = self.finish(protocol)
                    chunk["usageMetadata"] = self._gemini_usage()
                out.append((sse(chunk), True, False))
            return out

        def oai(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }

        out.append((sse(oai({"role": "assistant", "content": ""})), False, False))
        for piece in self.pieces:
            out.append((sse(oai({"content": piece})), True, False))
        if self.image:
            out.append((sse(oai({"images": self._chat_images()})), True, False))
        if self.tool:
            args = json.dumps(self.tool[1])
            half = len(args) // 2
            out.append(
                (
                    sse(
                        oai(
                            {
                                "tool_calls": [
                                    {
                                        "index": 0,
                                        "id": "call_fake_1",
                                        "type": "function",
                                        "function": {
                                            "name": self.tool[0],
                                            "arguments": args[:half],
                                        },
                                    }
                                ]
                            }
                        )
                    ),
                    True,
                    False,
                )
            )
            out.append(
                (
                    sse(
                        oai({"tool_calls": [{"index": 0, "function": {"arguments": args[half:]}}]})
                    ),
                    True,
                    False,
                )
            )
        out.append((sse(oai({}, self.finish(protocol))), False, False))
        if include_usage:
            out.append(
                (
                    sse(
                        {
                            "id": "chatcmpl-fake",
                            "object": "chat.completion.chunk",
                            "created": 0,
                            "model": self.model,
                            "choices": [],
                            "usage": self._chat_usage(),
                        }
                    ),
                    False,
                    False,
                )
            )
        out.append((b"data: [DONE]\n\n", False, True))
        return out


__all__ = ["Behavior", "FakeProvider", "Fault", "ReceivedMedia", "ReceivedRequest"]
