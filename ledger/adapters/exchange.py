"""One HTTP exchange as a generator of typed I/O steps, and the two drivers that run it.

The engine (:mod:`ledger.adapters.base`) decides everything about a call (what to send, what a
byte, a status or a timeout means, what to hand the caller) in a generator that *yields* the
I/O it needs, as the values below, and is *sent* the outcome: a response, a chunk, ``None`` at
the end of a body, or an exception thrown in at the ``yield`` (``TimeoutError`` when the step's
deadline passed, an ``httpx.HTTPError``, or whatever the caller's callback raised). Only the
drivers touch a socket or a clock:

- :func:`arun` awaits each step on the running event loop with ``httpx.AsyncClient``, each
  bounded by ``asyncio.timeout_at`` and not started once its deadline passed, and yields to
  the loop between the pieces one network read inflates to
  (:class:`~ledger.adapters.base.HttpAdapter`);
- :func:`run` performs each step on the calling thread with ``httpx.Client``
  (:class:`~ledger.adapters.sync.SyncAdapter`): no event loop, no thread hop. Its deadlines are
  kept by the blocking clients of :class:`~ledger.adapters.transport.ClientRegistry`, whose every
  socket wait is cut to the deadline of the step in progress (:data:`DEADLINE`).

Deadlines are absolute times on the driver's monotonic clock (:attr:`Driver.now`), which is the
loop's ``time()`` for :func:`arun` and ``time.monotonic`` for :func:`run`.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
import zlib
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from ledger.adapters.contract import EventCallback, StreamEvent


@dataclass(frozen=True, slots=True)
class Open:
    """Send ``request`` and wait for its status line and headers; sent the response.

    ``answer_within``: once the request's body is written, the wait for its answer ends
    that many seconds later (or at ``deadline``, if sooner). ``None``: ``deadline`` alone. An
    upload's own length is not the provider's slowness (a large PDF on a slow uplink).
    """

    client: httpx.Client | httpx.AsyncClient
    request: httpx.Request
    deadline: float
    answer_within: float | None = None


@dataclass(frozen=True, slots=True)
class Read:
    """The next chunk of ``response``'s body; sent ``None`` at its end.

    ``read_limit``: whether the request's own read limit (``read_timeout_s``) bounds each
    socket wait too. A stream's reads are bounded by their ``deadline`` alone (the first
    token's, then the idle limit's), so a model that thinks silently longer than the read
    limit is not cut by it.
    """

    response: httpx.Response
    deadline: float
    read_limit: bool = True


@dataclass(frozen=True, slots=True)
class Drain:
    """Read and drop the rest of ``response``'s body until its end or ``deadline``.

    A transport error or the deadline ends it quietly; sent ``None``.
    """

    response: httpx.Response
    deadline: float


@dataclass(frozen=True, slots=True)
class Close:
    """Close ``response`` (a body not read to its end drops its connection); sent ``None``."""

    response: httpx.Response


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand ``event`` to the caller's ``callback`` (awaited when it returns an awaitable)."""

    callback: EventCallback
    event: StreamEvent


Step = Open | Read | Drain | Close | Deliver
R = TypeVar("R")
#: An exchange: yields steps, is sent their outcomes, returns its result.
Exchange = Generator[Step, Any, R]

#: The deadline of the blocking step in progress on this thread (``None``: none), read by the
#: sockets of the blocking clients to cut every wait short of it.
DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "ledger_adapter_deadline", default=None)
#: Whether the read in progress is bounded by the request's read limit as well as by its
#: step's deadline (:attr:`Read.read_limit`), read by the sockets of both kinds of client.
READ_LIMIT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ledger_adapter_read_limit", default=True)


class Driver:
    """What an exchange needs of its driver: the clock its deadlines are on."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now


class _Resumed(Generic[R]):
    """An exchange and the outcome of its last step: a value to send or an error to throw."""

    def __init__(self, exchange: Exchange[R]) -> None:
        self.exchange = exchange
        self.value: Any = None
        self.error: BaseException | None = None
        self.result: R

    def next(self) -> Step | None:
        """The next step, or ``None`` when the exchange returned (:attr:`result`)."""
        value, error, self.value, self.error = self.value, self.error, None, None
        try:
            return self.exchange.send(value) if error is None else self.exchange.throw(error)
        except StopIteration as done:
            self.result = done.value
            return None


# -- the body, decoded in bounded pieces --------------------------------------------------------

#: The content codings a request accepts: those :class:`BodyDecoder` inflates piece by piece.
ACCEPT_ENCODING = "gzip, deflate"
#: The most bytes one piece of a decoded body holds.
PIECE_BYTES = 64 * 1024
#: The most content codings one response may stack (``Content-Encoding: gzip, gzip``). Real
#: servers send one, rarely two; each stage is an inflater and a generator nested in the next,
#: so a header naming hundreds would exhaust the interpreter's recursion depth mid-read.
MAX_CODINGS = 4
#: The two bytes every gzip member starts with.
_GZIP_MAGIC = b"\x1f\x8b"


class BodyCutShort(httpx.RemoteProtocolError):
    """A compressed body ended before its coding did (a gzip stream without its trailer).

    What arrived may still parse (a JSON answer cut after its last brace), but the answer is
    incomplete, as a body shorter than its ``Content-Length`` is: a ``stream_cut``.
    """


class _Inflate:
    """One ``gzip`` or ``deflate`` coding, inflated at most :data:`PIECE_BYTES` at a time.

    A gzip body may hold several members one after another (RFC 1952); each is inflated in
    turn. Bytes after the coding's end that start no member are ignored, as decoders do.
    """

    def __init__(self, coding: str) -> None:
        self._coding = coding
        self._obj = zlib.decompressobj(zlib.MAX_WBITS | 16 if coding == "gzip" else zlib.MAX_WBITS)
        # "deflate" is meant to be zlib-wrapped, but some servers send it raw (as httpx allows).
        self._raw_allowed = coding == "deflate"
        self._fed = False  # an empty body has no coding to end: it is the empty body
        self._left = b""  # after a member's end, a lone first byte of what may start another

    def _next_member(self, data: bytes) -> bytes | None:
        """What to inflate as the next gzip member, after a member's end.

        ``data`` with what was left before it, or ``None`` when it starts no member (yet).
        """
        data, self._left = self._left + data, b""
        if self._coding != "gzip" or not data:
            return None
        if len(data) < len(_GZIP_MAGIC):
            self._left = data if _GZIP_MAGIC.startswith(data) else b""
            return None
        if not data.startswith(_GZIP_MAGIC):
            return None
        self._obj = zlib.decompressobj(zlib.MAX_WBITS | 16)
        return data

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        if self._obj.eof:
            more = self._next_member(data)
            if more is None:
                return
            data = more
        while True:
            try:
                out = self._obj.decompress(data, PIECE_BYTES)
            except zlib.error as exc:
                if not self._raw_allowed:
                    raise httpx.DecodingError(f"the response body is not valid: {exc}") from exc
                self._raw_allowed = False
                self._obj = zlib.decompressobj(-zlib.MAX_WBITS)
                continue
            self._raw_allowed = False
            if out:
                yield out
            if self._obj.eof:
                more = self._next_member(self._obj.unused_data)
                if more is None:
                    return
                data = more
                continue
            data = self._obj.unconsumed_tail
            # A full piece may leave more output pending on input already taken.
            if not data and len(out) < PIECE_BYTES:
                return

    def end(self) -> Iterator[bytes]:
        if out := self._obj.flush():
            yield out
        if self._fed and not self._obj.eof:
            # Only the coding's own end (gzip's trailer, deflate's final block) proves that
            # the server sent the whole body: the framing's end does not, when the server
            # counted (or chunked) what it had compressed so far.
            raise BodyCutShort(f"the response body ended before its {self._coding} stream "
                               "did: the answer is incomplete")


class BodyDecoder:
    """A response body's content codings undone lazily, in pieces of :data:`PIECE_BYTES`.

    httpx inflates each network read whole before the engine can count it: a few KiB of gzip
    are megabytes, so the engine's byte limits (``max_body_bytes``, ``max_stream_bytes``)
    would bound nothing. Here no piece is made before the engine asks for it, so an answer
    is inflated only as far as those limits let it be read. Codings that were not asked for
    (:data:`ACCEPT_ENCODING`), more than :data:`MAX_CODINGS` of them, and a body that does not
    decode are refused: ``httpx.DecodingError``, a ``protocol_error``. A body whose coding did
    not end (:class:`BodyCutShort`) is cut short: a ``stream_cut``. Nothing else is raised
    by decoding, so a hostile body can never surface as an untyped exception out of ``send()``.
    """

    def __init__(self, content_encoding: str | None) -> None:
        codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if len(codings) > MAX_CODINGS:
            raise httpx.DecodingError(
                f"the response names {len(codings)} content codings; at most {MAX_CODINGS} "
                f"are decoded (accept-encoding: {ACCEPT_ENCODING})")
        self._stages: list[_Inflate] = []
        for coding in reversed(codings):
            if coding not in ("gzip", "deflate"):
                raise httpx.DecodingError(
                    f"the response is {coding[:32]!r}-encoded, which the request did not "
                    f"accept (accept-encoding: {ACCEPT_ENCODING})")
            self._stages.append(_Inflate(coding))

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decoded pieces of the next raw ``data``."""
        pieces: Iterable[bytes] = (data,)
        for stage in self._stages:
            pieces = _through(stage, pieces)
        return _guarded(pieces)

    def end(self) -> Iterator[bytes]:
        """What is left once the raw body ended."""
        pieces: Iterator[bytes] = iter(())
        for stage in self._stages:
            pieces = _chained(_through(stage, pieces), stage.end())
        return _guarded(pieces)


def _guarded(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The non-empty ``pieces``; whatever decoding them raises, as ``httpx.DecodingError``.

    The engine turns transport errors into failures; any other exception thrown into it would
    leave ``send()`` as itself (a ``RecursionError``, a ``zlib.error``), against the adapter's
    promise never to raise for what a provider sent. Memory exhaustion is the process's, not
    the answer's, and stays itself.
    """
    try:
        for piece in pieces:
            if piece:
                yield piece
    except (httpx.HTTPError, MemoryError):
        raise
    except Exception as exc:
        raise httpx.DecodingError(
            f"the response body does not decode: {type(exc).__name__}: {exc}"[:300]) from exc


def _through(stage: _Inflate, pieces: Iterable[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        yield from stage.feed(piece)


def _chained(first: Iterator[bytes], then: Iterator[bytes]) -> Iterator[bytes]:
    yield from first
    yield from then


async def _adecoded(response: httpx.Response) -> AsyncIterator[bytes]:
    decoder = BodyDecoder(response.headers.get("content-encoding"))
    async for data in response.aiter_raw():
        async for piece in _paced(decoder.feed(data)):
            yield piece
    async for piece in _paced(decoder.end()):
        yield piece


async def _paced(pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``pieces``, yielding to the event loop before each one after the first.

    One raw chunk of a few KiB may inflate to megabytes, handed out without a socket wait: the
    loop would never run, so other tasks stall and ``asyncio.timeout_at`` never fires (an
    audit saw an 8 s ``total_timeout_s`` kept at 24 s, the loop blocked throughout).
    """
    first = True
    for piece in pieces:
        if not first:
            await asyncio.sleep(0)
        first = False
        yield piece


def _decoded(response: httpx.Response) -> Iterator[bytes]:
    decoder = BodyDecoder(response.headers.get("content-encoding"))
    for data in response.iter_raw():
        yield from decoder.feed(data)
    yield from decoder.end()


def _when_written(request: httpx.Request, written: Callable[[], object], *,
                  awaited: bool) -> None:
    """Call ``written`` once httpcore has written ``request``'s whole body.

    Through the request's ``trace`` extension, which httpcore calls in the task (or thread)
    that sends; the trace already there is called first. ``awaited``: the async client's
    trace (a coroutine function).
    """
    inner = request.extensions.get("trace")
    tunnel = [False]  # a proxy's CONNECT is being sent: its body is not the request's

    def seen(name: str, info: Mapping[str, Any]) -> None:
        if name.endswith("send_request_headers.started"):
            tunnel[0] = getattr(info.get("request"), "method", None) == b"CONNECT"
        elif name.endswith("send_request_body.complete") and not tunnel[0]:
            written()

    if awaited:
        async def atrace(name: str, info: Mapping[str, Any]) -> None:
            if inner is not None:
                await inner(name, info)
            seen(name, info)
        request.extensions["trace"] = atrace
    else:
        def trace(name: str, info: Mapping[str, Any]) -> None:
            if inner is not None:
                inner(name, info)
            seen(name, info)
        request.extensions["trace"] = trace


# -- asyncio ------------------------------------------------------------------------------------


def _achunks(response: httpx.Response, chunks: dict[int, AsyncIterator[bytes]]
             ) -> AsyncIterator[bytes]:
    """The one iterator over ``response``'s body that every step of the exchange reads."""
    it = chunks.get(id(response))
    if it is None:
        it = chunks[id(response)] = _adecoded(response).__aiter__()
    return it


async def _aperform(step: Step, chunks: dict[int, AsyncIterator[bytes]]) -> Any:
    if isinstance(step, Open | Read | Drain) and asyncio.get_running_loop().time() >= step.deadline:
        # A step whose deadline passed while the engine worked (parsing a large piece) is not
        # started: a read answered from data already inflated would not suspend, so
        # ``timeout_at`` alone could not cut it. The blocking driver checks the same way.
        if isinstance(step, Drain):
            return None
        raise TimeoutError
    if isinstance(step, Open):
        assert isinstance(step.client, httpx.AsyncClient)
        async with asyncio.timeout_at(step.deadline) as limit:
            if step.answer_within is not None:
                within, loop = step.answer_within, asyncio.get_running_loop()

                def written() -> None:
                    if not limit.expired():  # one that fired is being raised: keep it
                        limit.reschedule(min(step.deadline, loop.time() + within))
                _when_written(step.request, written, awaited=True)
            return await step.client.send(step.request, stream=True)
    if isinstance(step, Read):
        it = _achunks(step.response, chunks)
        token = READ_LIMIT.set(step.read_limit)
        try:
            async with asyncio.timeout_at(step.deadline):
                return await it.__anext__()
        except StopAsyncIteration:
            return None
        finally:
            READ_LIMIT.reset(token)
    if isinstance(step, Drain):
        it = _achunks(step.response, chunks)
        try:
            async with asyncio.timeout_at(step.deadline):
                async for _ in it:
                    pass
        except (TimeoutError, httpx.HTTPError):
            pass  # the answer is complete; the connection is simply not reused
        return None
    if isinstance(step, Close):
        await step.response.aclose()
        return None
    ret = step.callback(step.event)
    if inspect.isawaitable(ret):
        await ret
    return None


async def arun(exchange: Exchange[R]) -> R:
    """Run ``exchange`` on the running event loop (its clock: the loop's ``time()``)."""
    run_ = _Resumed(exchange)
    chunks: dict[int, AsyncIterator[bytes]] = {}
    while (step := run_.next()) is not None:
        try:
            run_.value = await _aperform(step, chunks)
        except BaseException as exc:  # thrown into the exchange, which decides
            run_.error = exc
    return run_.result


def async_driver() -> Driver:
    """The clock of :func:`arun` on the running loop."""
    return Driver(asyncio.get_running_loop().time)


# -- blocking -------------------------------------------------------------------------------------


def _timed_out(exc: httpx.TimeoutException, deadline: float) -> BaseException:
    """A socket wait cut at the step's deadline, as the deadline's ``TimeoutError``.

    One that ran out first by its own limit (``read_timeout_s``, ...) stays the transport's.
    """
    return TimeoutError() if time.monotonic() >= deadline else exc


def _capped(request: httpx.Request, deadline: float) -> None:
    """Every limit of ``request`` (connect, write, read, pool) cut to the time left.

    The pool's wait is not a socket wait, so the blocking clients cannot cut it themselves.
    """
    left = max(deadline - time.monotonic(), 1e-3)
    limits = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {
        k: (left if v is None else min(v, left)) for k, v in limits.items()
    } or {"connect": left, "read": left, "write": left, "pool": left}


def _perform(step: Step, chunks: dict[int, Iterator[bytes]]) -> Any:
    if isinstance(step, Deliver):
        ret = step.callback(step.event)
        if inspect.isawaitable(ret):
            _await(ret)
        return None
    if isinstance(step, Close):
        step.response.close()
        return None
    if time.monotonic() >= step.deadline:
        if isinstance(step, Drain):
            return None
        raise TimeoutError
    token = DEADLINE.set(step.deadline)
    try:
        if isinstance(step, Open):
            assert isinstance(step.client, httpx.Client)
            _capped(step.request, step.deadline)
            if step.answer_within is not None:
                # Set in httpcore's trace, on this thread and in this context: every later
                # socket wait of the send is cut to it (_DeadlineStream).
                within = step.answer_within
                _when_written(step.request, lambda: DEADLINE.set(
                    min(step.deadline, time.monotonic() + within)), awaited=False)
            return step.client.send(step.request, stream=True)
        it = chunks.get(id(step.response))
        if it is None:
            it = chunks[id(step.response)] = _decoded(step.response)
        if isinstance(step, Read):
            limit = READ_LIMIT.set(step.read_limit)
            try:
                return next(it, None)
            finally:
                READ_LIMIT.reset(limit)
        try:
            for _ in it:
                if time.monotonic() >= step.deadline:
                    break
        except (TimeoutError, httpx.HTTPError):
            pass  # the answer is complete; the connection is simply not reused
        return None
    except httpx.TimeoutException as exc:
        converted = _timed_out(exc, DEADLINE.get() or step.deadline)  # as moved by the trace
        if converted is exc:
            raise
        raise converted from exc
    finally:
        DEADLINE.reset(token)


def _await(awaitable: Any) -> None:
    """An async ``on_event`` callback under the blocking driver, run to its end.

    On this thread; or, when this thread already runs an event loop (a blocking send made
    from async code, as in a notebook), on a fresh loop of a helper thread, since a running
    loop cannot be entered again.
    """
    async def wait() -> None:
        await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(wait())
        return
    with ThreadPoolExecutor(1, thread_name_prefix="ledger-callback") as helper:
        helper.submit(asyncio.run, wait()).result()


def run(exchange: Exchange[R]) -> R:
    """Run ``exchange`` on the calling thread (its clock: ``time.monotonic``)."""
    run_ = _Resumed(exchange)
    chunks: dict[int, Iterator[bytes]] = {}
    while (step := run_.next()) is not None:
        try:
            run_.value = _perform(step, chunks)
        except BaseException as exc:  # thrown into the exchange, which decides
            run_.error = exc
    return run_.result


def blocking_driver() -> Driver:
    """The clock of :func:`run`."""
    return Driver(time.monotonic)


__all__ = ["DEADLINE", "BodyCutShort", "Close", "Deliver", "Drain", "Driver", "Exchange", "Open",
           "Read", "Step", "arun", "async_driver", "blocking_driver", "run"]
