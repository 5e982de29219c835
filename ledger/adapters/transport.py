"""Transport errors mapped to observation kinds and phases, and the pooled httpx clients."""

from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
import os
import socket
import ssl
import threading
import time
import urllib.request
import weakref
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from ledger.adapters.exchange import ACCEPT_ENCODING, DEADLINE, READ_LIMIT, BodyCutShort
from ledger.domain.facts import Phase, Transport
from ledger.errors import InvalidArgument
from ledger.forking import abandon, in_child, renew_in_child
from ledger.readiness import peer_spoke
from ledger.redaction import register_secret

# --------------------------------------------------------------------------------------------
# Transport-error mapping (pure)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every cause, context and ExceptionGroup member behind it."""
    seen: list[BaseException] = []
    stack = [exc]
    while stack:
        e = stack.pop()
        if any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        if e.__cause__ is not None:
            stack.append(e.__cause__)
        if e.__context__ is not None:
            stack.append(e.__context__)
    return seen


def _has(chain: list[BaseException], *types: type[BaseException]) -> bool:
    return any(isinstance(e, types) for e in chain)


def _from_module(chain: list[BaseException], prefix: str) -> bool:
    return any(type(e).__module__.split(".")[0] == prefix for e in chain)


# Raised inside every non-blocking TLS handshake (flow control) or when the peer simply hangs
# up during it: neither says anything about certificates or protocol versions.
_NOT_TLS_FAILURES = (
    ssl.SSLWantReadError,
    ssl.SSLWantWriteError,
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
    ssl.SSLSyscallError,
)


def _tls_failure(chain: list[BaseException]) -> bool:
    return any(
        isinstance(e, ssl.SSLError | ssl.CertificateError) and not isinstance(e, _NOT_TLS_FAILURES)
        for e in chain
    )


def _is_reset(chain: list[BaseException]) -> bool:
    if _has(
        chain,
        ConnectionResetError,
        BrokenPipeError,
        ConnectionAbortedError,
        EOFError,
        ssl.SSLEOFError,
        ssl.SSLZeroReturnError,
    ):
        return True
    # anyio reports a peer that went away as EndOfStream / BrokenResourceError.
    return any(type(e).__name__ in ("EndOfStream", "BrokenResourceError") for e in chain)


def map_transport_error(
    exc: BaseException, *, request_sent: bool, headers_received: bool
) -> tuple[Transport, Phase]:
    """The transport kind and phase of an httpx error (the table in the module docstring)."""
    chain = _chain(exc)
    sent_phase = Phase.AFTER_SEND if request_sent else Phase.BEFORE_SEND
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return Transport.CONNECT_TIMEOUT, Phase.BEFORE_SEND
    if isinstance(exc, httpx.ProxyError) and not request_sent:
        # The proxy answered its CONNECT with a refusal: the tunnel to the provider was never
        # opened, as when the provider refuses a connection.
        return Transport.CONNECT_REFUSED, Phase.BEFORE_SEND
    if isinstance(exc, httpx.ConnectError):
        if _has(chain, socket.gaierror):
            return Transport.DNS_FAILURE, Phase.BEFORE_SEND
        if _has(chain, ConnectionRefusedError):
            return Transport.CONNECT_REFUSED, Phase.BEFORE_SEND
        if _tls_failure(chain):
            return Transport.TLS_ERROR, Phase.BEFORE_SEND
        if _is_reset(chain):
            return Transport.CONNECTION_RESET, Phase.BEFORE_SEND
        return Transport.CONNECT_REFUSED, Phase.BEFORE_SEND
    if isinstance(exc, httpx.WriteTimeout):
        return (
            (Transport.READ_TIMEOUT, Phase.AFTER_SEND)
            if request_sent
            else (
                Transport.CONNECT_TIMEOUT,
                Phase.BEFORE_SEND,
            )
        )
    if isinstance(exc, httpx.ReadTimeout):
        if headers_received:
            return Transport.STREAM_STALL, Phase.MID_STREAM
        return Transport.READ_TIMEOUT, sent_phase
    if isinstance(exc, BodyCutShort):
        return Transport.STREAM_CUT, Phase.MID_STREAM  # a body read, so its headers came
    if isinstance(exc, httpx.RemoteProtocolError):
        if headers_received:
            # h11 words an early close of a body as "peer closed connection without sending
            # complete message body"; everything else is a response we cannot parse.
            if "peer closed" in str(exc) or _is_reset(chain):
                return Transport.STREAM_CUT, Phase.MID_STREAM
            return Transport.PROTOCOL_ERROR, Phase.MID_STREAM
        if _from_module(chain, "h11") and not _is_reset(chain):
            return Transport.PROTOCOL_ERROR, sent_phase
        # httpcore raises this without an h11 cause for "Server disconnected without sending a
        # response": the connection was closed on us, which is a reset as far as we can tell.
        return Transport.CONNECTION_RESET, sent_phase
    if isinstance(exc, httpx.ReadError | httpx.WriteError | httpx.CloseError):
        if headers_received:
            return Transport.STREAM_CUT, Phase.MID_STREAM
        return Transport.CONNECTION_RESET, sent_phase
    if isinstance(exc, httpx.DecodingError):
        return Transport.PROTOCOL_ERROR, Phase.MID_STREAM
    if headers_received:
        return Transport.PROTOCOL_ERROR, Phase.MID_STREAM
    return Transport.PROTOCOL_ERROR, sent_phase


def describe_exception(exc: BaseException) -> str:
    """A one-line description of an exception and its root cause (to be redacted by callers)."""
    parts = [f"{type(exc).__name__}: {exc}".rstrip(": ")]
    # Our own deadlines cancel httpx internally; the CancelledError behind them says nothing.
    chain = [e for e in _chain(exc) if not isinstance(e, asyncio.CancelledError)]
    root = chain[-1] if len(chain) > 1 else None
    if root is not None and root is not exc and str(root) and str(root) != str(exc):
        parts.append(f"caused by {type(root).__name__}: {root}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# Pooled clients


def _cut(timeout: float | None) -> float | None:
    """``timeout`` cut to what is left before the step's deadline.

    Never zero: a zero timeout would make the socket non-blocking instead of timing out.
    """
    deadline = DEADLINE.get()
    if deadline is None:
        return timeout
    left = max(deadline - time.monotonic(), 1e-4)
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose every wait ends by the deadline of the blocking step in progress.

    httpcore reads a response body with the one read limit it took when the body began; a
    stream's idle and total limits move with every chunk, so they are applied here, per wait.
    A stream's reads wait for that deadline alone (:attr:`~ledger.adapters.exchange.Read.
    read_limit`).
    """

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner
        self._closed = False

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = self._inner.read(max_bytes, _cut(timeout if READ_LIMIT.get() else None))
        if not data and self._closed:
            # The end of the stream our own close made (below), not the peer's: a body that
            # ends with its connection would otherwise end cleanly, as if the provider had
            # ended it.
            raise httpcore.ReadError("the connection was closed under this read")
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _cut(timeout))

    def close(self) -> None:
        # The client closing its pool (SyncAdapter.close, a Run session's block left) closes
        # connections other threads are still reading: a close alone does not wake a thread
        # blocked in a socket wait, which then waits out its read limit. Shutting the socket
        # down first ends that wait at once: the reader sees an error, or an end of stream
        # that read() turns into one, and by then the client is closed, so the call is a
        # local cancellation. The base class's shutdown, also on a TLS socket:
        # SSLSocket.shutdown would drop its SSL object under the reader.
        self._closed = True
        sock = self._inner.get_extra_info("socket")
        if isinstance(sock, socket.socket):
            # OSError: not connected any more (the peer reset it, or it is closed already).
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname,
                                                     _cut(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's blocking sockets, each wrapped in a :class:`_DeadlineStream`."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _cut(timeout),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _cut(timeout),
                                                               socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _PolledStream(httpcore.AsyncNetworkStream):
    """httpcore's asyncio socket, whose "is it readable" polls the socket it keeps.

    httpcore's pool asks every idle connection whether its server closed it at every request it
    places and every response it ends. anyio's stream answers by building all of its typed
    attributes, a ``getpeername`` among them, every time: 9.6 µs, asked 26 times a turn with
    16 connections in the pool (docs/benchmarks.md). The answer is the same poll of the same
    socket (:func:`ledger.readiness.peer_spoke`, 1.0 µs).
    """

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._sock: socket.socket | None = inner.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        # A stream's reads wait for their step's deadline alone (exchange.Read.read_limit).
        return await self._inner.read(max_bytes, timeout if READ_LIMIT.get() else None)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return _PolledStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and self._sock is not None:
            return peer_spoke(self._sock)
        return self._inner.get_extra_info(info)


class _PolledBackend(httpcore.AsyncNetworkBackend):
    """httpcore's asyncio sockets (anyio), each wrapped in a :class:`_PolledStream`."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None
                          ) -> httpcore.AsyncNetworkStream:
        return _PolledStream(await self._inner.connect_tcp(host, port, timeout, local_address,
                                                           socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        return _PolledStream(await self._inner.connect_unix_socket(path, timeout,
                                                                   socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _NoCookies(http.cookiejar.CookieJar):
    """A cookie jar that keeps nothing.

    One client per origin serves every Run and every tenant, so a cookie kept from one answer
    (a CDN's bot or affinity cookie, as providers' edges set) would go out with every later
    request to that origin, whoever made it. Provider APIs authenticate each request by its
    credential; none needs a cookie back.
    """

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        pass

    def extract_cookies(self, response: Any, request: Any) -> None:
        pass


def _proxy(url: str, field: str) -> httpx.Proxy:
    """``url`` as an HTTP(S) proxy (``field``: where it came from, for the error)."""
    fault = InvalidArgument(
        f"proxy {url!r} is not an http:// or https:// URL with a host (SOCKS proxies are not "
        f"supported); set {field} to one such as http://proxy.internal:3128", field=field)
    try:
        proxy = httpx.Proxy(url)
    except (ValueError, TypeError, httpx.InvalidURL) as e:
        raise fault from e
    if proxy.url.scheme not in ("http", "https") or not proxy.url.host:
        raise fault
    # A proxy refusing them may echo its credentials (a 407's body or Proxy-Authenticate):
    # known, they are redacted from what the adapter reports, in every encoding.
    # A user name alone is the credential of proxies that take a token there.
    user, password = proxy.auth or ("", "")
    register_secret(password or user)
    if user and password:
        register_secret(f"{user}:{password}")
    return proxy


def _via(proxy: httpx.Proxy, tls: Callable[[], ssl.SSLContext]) -> dict[str, Any]:
    """The arguments of httpcore's pool through ``proxy``, as httpx gives them.

    An ``https://`` proxy's own connection is verified with ``tls()``, the registry's
    (:meth:`ClientRegistry._proxy_tls`), unless ``proxy`` carries a context of its own. Given
    none, httpcore would build its default for every connection to the proxy, on the event
    loop, trusting certifi's authorities and OpenSSL's default paths whatever ``verify`` and
    ``trust_env`` say: an authority given as ``verify`` would not reach the proxy, nor
    ``verify=False``.
    """
    url = proxy.url
    context = proxy.ssl_context
    if context is None and url.scheme == "https":
        context = tls()
    return {"proxy_url": httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                                      target=url.raw_path),
            "proxy_auth": proxy.raw_auth, "proxy_headers": proxy.headers.raw,
            "proxy_ssl_context": context}


# Built once per process for each TLS configuration: building one loads a whole bundle of
# certificate authorities (some 50 ms, the event loop held all the while when built on it), and
# an SSLContext is safe to share between clients, loops and threads.
_TLS_CONTEXTS: dict[tuple[str, ...], ssl.SSLContext] = {}
_TLS_LOCK = threading.Lock()


@in_child
def _forked_tls() -> None:
    # Another thread of the parent may have held it, building a context, when the fork came:
    # nothing in the child would ever release it. The contexts built are the child's too.
    global _TLS_LOCK
    _TLS_LOCK = threading.Lock()


# The default configuration's proxy hop (ClientRegistry._proxy_key).
_PROXY_DEFAULT = ("proxy-default",)


def _built(key: tuple[str, ...], build: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """The process's TLS context for ``key``, made by ``build`` once.

    Whichever threads ask at once: building one loads a whole bundle of certificates.
    """
    with _TLS_LOCK:
        context = _TLS_CONTEXTS.get(key)
        if context is None:
            context = build()
            _TLS_CONTEXTS[key] = context
    return context


def _tls_key(verify: bool, trust_env: bool) -> tuple[str, ...]:
    """What the context httpx builds for these settings depends on.

    httpx reads ``SSL_CERT_FILE``, else ``SSL_CERT_DIR``, with ``verify=True`` and
    ``trust_env`` (``httpx.create_ssl_context``); nothing else reaches the context (a proxy is
    chosen per origin, and an ``https://`` proxy's own connection is verified with this same
    context, :func:`_via`).
    """
    if not verify:
        return ("unverified",)
    if trust_env and os.environ.get("SSL_CERT_FILE"):
        return ("cafile", os.environ["SSL_CERT_FILE"])
    if trust_env and os.environ.get("SSL_CERT_DIR"):
        return ("capath", os.environ["SSL_CERT_DIR"])
    return ("certifi",)


class _AsyncTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a pool of ours (see :meth:`ClientRegistry._pool_args`).

    httpx's own constructor is not run: it would build a pool, and a TLS context even for an
    ``http://`` origin, only for them to be replaced.
    """

    def __init__(self, pool: httpcore.AsyncConnectionPool) -> None:
        self._pool = pool


class _Transport(httpx.HTTPTransport):
    """The blocking :class:`_AsyncTransport`."""

    def __init__(self, pool: httpcore.ConnectionPool) -> None:
        self._pool = pool


# Only the codings the engine inflates piece by piece (exchange.BodyDecoder), not httpx's
# default list: with zstd a few KiB on the wire are gigabytes in memory.
_HEADERS = {"Accept-Encoding": ACCEPT_ENCODING}


def _secure(origin: str) -> bool:
    return origin.startswith("https:")


def _verified_by_us(proxy: httpx.Proxy | None) -> bool:
    """Whether ``proxy``'s own connection is TLS verified with the registry's context."""
    return proxy is not None and proxy.url.scheme == "https" and proxy.ssl_context is None


class ClientRegistry:
    """One pooled httpx client per endpoint origin (scheme, host, port) and kind.

    Async clients (:meth:`get`) belong to the event loop they were first used on, so the
    registry keeps one set per running loop; blocking clients (:meth:`get_sync`, for
    :class:`~ledger.adapters.sync.SyncAdapter`) are one set shared by every thread, and each of
    their socket waits ends by the deadline of the call's step in progress. Transports have
    ``retries=0``: no request is ever sent twice by us, and redirects are not followed. No
    client keeps a cookie: what one answer sets never goes out with another request.

    Only ``https://`` origins' clients, and those going through an ``https://`` proxy, have a
    TLS context: one per process for each TLS configuration (``verify``, and with
    ``trust_env`` the ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` it names), shared by every
    registry of that configuration and built when a client first needs it; :meth:`aget`
    builds it on a worker thread, never on the loop. An ``https://`` proxy's own connection
    (the hop to the proxy) trusts what the settings say: ``verify``'s ``SSLContext`` as
    given, nothing with ``verify=False``, ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` with
    ``trust_env``, certifi's authorities with ``trust_env=False``; with the defaults (none of
    those said), httpcore's default as with httpx, certifi's authorities and the system's
    store, so that a company proxy trusted through the system store stays trusted (httpx gives
    the proxy that default whatever the settings say).

    Requests to an origin go through an HTTP(S) proxy when ``proxy`` names one, or else, with
    ``trust_env``, when the environment does (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``,
    less the hosts of ``NO_PROXY``, read when the origin's first client is made), as httpx and
    the providers' own SDKs do; through a proxy every time limit holds as it does without one.

    Args:
        verify: TLS verification of every client and of an ``https://`` proxy's own
            connection (``True``, ``False`` or an ``SSLContext``).
        max_connections: httpx's pool limit, per origin and loop.
        max_keepalive_connections: Idle connections kept, per origin and loop.
        proxy: An ``http://`` or ``https://`` proxy URL for every origin (credentials in it
            go to the proxy only); ``None``: the environment's, with ``trust_env``.
        trust_env: Take proxies from the environment when ``proxy`` is ``None``, and with
            ``verify=True`` the certificate authorities of ``SSL_CERT_FILE`` or
            ``SSL_CERT_DIR`` (as httpx does) instead of certifi's, for the origins and an
            ``https://`` proxy alike.

    Raises:
        InvalidArgument: ``proxy`` is not an ``http://`` or ``https://`` URL, or ``verify`` is
            not ``True``, ``False`` or an ``SSLContext``.
    """

    def __init__(
        self,
        *,
        verify: ssl.SSLContext | bool = True,
        max_connections: int = 100,
        max_keepalive_connections: int = 20,
        proxy: str | None = None,
        trust_env: bool = True,
    ) -> None:
        if not isinstance(verify, bool | ssl.SSLContext):
            # The process shares one TLS context per configuration: a CA bundle's path given
            # here would have been built under the default's key and served to every client.
            raise InvalidArgument(
                f"verify is True, False or an ssl.SSLContext (got {type(verify).__name__}); for "
                "a bundle of certificate authorities pass "
                "ssl.create_default_context(cafile=path)", field="verify")
        self._verify = verify
        self._proxy = None if proxy is None else _proxy(proxy, "proxy")
        self._trust_env = trust_env
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_keepalive_connections
        )
        self._by_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, httpx.AsyncClient]
        ] = weakref.WeakKeyDictionary()
        self._sync: dict[str, httpx.Client] = {}
        self._sync_lock = threading.Lock()
        renew_in_child(self)

    def _forked(self) -> None:
        """Let go of the parent's clients in a forked child (:mod:`ledger.forking`).

        They keep the parent's connections to the providers open, and a socket used from both
        processes interleaves their requests, each reading the other's answers. They are
        abandoned, never closed (closing would shut the parent's connections) nor used; the
        child makes its own.
        """
        abandon(self._sync, *self._by_loop.values())
        self._by_loop = weakref.WeakKeyDictionary()
        self._sync = {}
        self._sync_lock = threading.Lock()

    @staticmethod
    def origin(url: str) -> str:
        """``scheme://host:port`` of ``url``, lower-cased: the key clients are shared by."""
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}".lower()

    def get(self, url: str) -> httpx.AsyncClient:
        """The running loop's client for ``url``'s origin, created on first use.

        An ``https://`` origin's first client may build the process's TLS context for the
        registry's settings on the calling thread, the loop held meanwhile: :meth:`aget`
        builds it on a worker thread instead.
        """
        loop = asyncio.get_running_loop()
        key = self.origin(url)
        client = self._by_loop.get(loop, {}).get(key)
        if client is None:
            client = self._make(loop, key, url, self.proxy_for(url))
        return client

    async def aget(self, url: str) -> httpx.AsyncClient:
        """:meth:`get`, building a TLS context the process does not have yet off the loop.

        Only an ``https://`` origin, or an origin reached through an ``https://`` proxy, needs
        one, and the process builds one per TLS configuration (``verify``, and with
        ``trust_env`` the ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` it names), however many
        registries, sessions and loops use it.
        """
        loop = asyncio.get_running_loop()
        key = self.origin(url)
        client = self._by_loop.get(loop, {}).get(key)
        if client is not None:
            return client
        proxy = self.proxy_for(url)
        if _secure(key) and self._known_tls() is None:
            await asyncio.to_thread(self._tls)  # _make finds it built
        if _verified_by_us(proxy) and self._known_proxy_tls() is None:
            await asyncio.to_thread(self._proxy_tls)
        # Another task may have made the origin's client while the context was built.
        client = self._by_loop.get(loop, {}).get(key)
        return client if client is not None else self._make(loop, key, url, proxy)

    def _make(self, loop: asyncio.AbstractEventLoop, key: str, url: str,
              proxy: httpx.Proxy | None) -> httpx.AsyncClient:
        args = self._pool_args(self._tls() if _secure(key) else None, _PolledBackend())
        transport = _AsyncTransport(httpcore.AsyncConnectionPool(**args) if proxy is None
                                    else httpcore.AsyncHTTPProxy(**_via(proxy, self._proxy_tls),
                                                                 **args))
        # follow_redirects stays off: a redirect is an answer we report, not one we chase
        # (following it could send the request, and its credential, somewhere else).
        client = httpx.AsyncClient(transport=transport, follow_redirects=False,
                                   cookies=_NoCookies(), headers=_HEADERS)
        self._by_loop.setdefault(loop, {})[key] = client
        return client

    def get_sync(self, url: str) -> httpx.Client:
        """The blocking client for ``url``'s origin, created on first use (thread-safe)."""
        key = self.origin(url)
        client = self._sync.get(key)
        if client is not None:
            return client
        with self._sync_lock:
            client = self._sync.get(key)
            if client is None:
                client = httpx.Client(transport=self._sync_transport(url),
                                      follow_redirects=False, cookies=_NoCookies(),
                                      headers=_HEADERS)
                self._sync[key] = client
        return client

    def proxy_for(self, url: str) -> httpx.Proxy | None:
        """The proxy requests to ``url``'s origin go through, or ``None`` (see the class).

        Raises:
            InvalidArgument: the environment's proxy for it is not an ``http://`` or
                ``https://`` URL (the field names the variable to fix).
        """
        if self._proxy is not None or not self._trust_env:
            return self._proxy
        parts = urlsplit(url)
        found = urllib.request.getproxies()
        if urllib.request.proxy_bypass(parts.netloc.rpartition("@")[2]):
            return None
        for name in (parts.scheme.lower(), "all"):
            if found.get(name):
                return _proxy(found[name], f"{name.upper()}_PROXY")
        return None

    def _sync_transport(self, url: str) -> httpx.HTTPTransport:
        args = self._pool_args(self._tls() if _secure(self.origin(url)) else None,
                               _DeadlineBackend())
        proxy = self.proxy_for(url)
        return _Transport(httpcore.ConnectionPool(**args) if proxy is None
                          else httpcore.HTTPProxy(**_via(proxy, self._proxy_tls), **args))

    def _known_tls(self) -> ssl.SSLContext | None:
        """The TLS context of the registry's settings if the process has it, else ``None``."""
        if isinstance(self._verify, ssl.SSLContext):
            return self._verify
        return _TLS_CONTEXTS.get(_tls_key(self._verify, self._trust_env))

    def _proxy_key(self) -> tuple[str, ...] | None:
        """The key of the proxy hop's own context, or ``None``: the hop uses :meth:`_tls`.

        With ``verify=True``, ``trust_env`` and neither ``SSL_CERT_FILE`` nor
        ``SSL_CERT_DIR``, the hop gets httpcore's default (certifi's authorities and the
        system's), as httpx gives it, so that a proxy whose authority only the system store
        holds stays trusted.
        """
        if self._verify is True and self._trust_env and _tls_key(True, True) == ("certifi",):
            return _PROXY_DEFAULT
        return None

    def _known_proxy_tls(self) -> ssl.SSLContext | None:
        """The proxy hop's TLS context if the process has it, else ``None``."""
        key = self._proxy_key()
        return self._known_tls() if key is None else _TLS_CONTEXTS.get(key)

    def _proxy_tls(self) -> ssl.SSLContext:
        """The TLS context of an ``https://`` proxy's own connection, built on first use."""
        key = self._proxy_key()
        return self._tls() if key is None else _built(key, httpcore.default_ssl_context)

    def _tls(self) -> ssl.SSLContext:
        """The process's TLS context for the registry's settings, built on first use."""
        if isinstance(self._verify, ssl.SSLContext):
            return self._verify
        verify, trust_env = self._verify, self._trust_env
        return _built(_tls_key(verify, trust_env),
                      lambda: httpx.create_ssl_context(verify=verify, trust_env=trust_env))

    def _pool_args(self, ssl_context: ssl.SSLContext | None, backend: Any) -> dict[str, Any]:
        # httpx offers no public way to give its transport a network backend, so the pool is
        # rebuilt as httpx builds it, on sockets of ours: blocking ones that cut every wait to
        # the step's deadline (httpcore reads a body with the one read limit it took when the
        # body began; a stream's idle and total limits move with every chunk), asyncio ones
        # whose readiness check is cheap (tests/adapters hold both). A proxy's pool is rebuilt
        # the same way, so that every limit holds through it too.
        limits = self._limits
        return {"ssl_context": ssl_context, "max_connections": limits.max_connections,
                "max_keepalive_connections": limits.max_keepalive_connections,
                "keepalive_expiry": limits.keepalive_expiry, "retries": 0,
                "network_backend": backend}

    def close(self) -> None:
        """Close the blocking clients.

        Their connections are shut down first, so a thread blocked reading one (another
        thread's call in flight) wakes at once and ends as a local cancellation.
        """
        with self._sync_lock:
            clients, self._sync = list(self._sync.values()), {}
        for client in clients:
            client.close()

    async def aclose(self) -> None:
        """Close the clients of the running loop."""
        loop = asyncio.get_running_loop()
        clients = self._by_loop.pop(loop, {})
        for client in clients.values():
            await client.aclose()
