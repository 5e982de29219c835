"""The adapters through an HTTP proxy: the environment's (``HTTP_PROXY``, ``HTTPS_PROXY``,
``ALL_PROXY``, less ``NO_PROXY``), as httpx and the providers' SDKs take it, or the registry's
own ``proxy``; every request goes through it, credentials in its URL go to the proxy alone, and
every time limit holds through it as it does without one.

A real forwarding proxy on loopback (absolute-form requests, one per connection) records the
request lines and headers it forwarded; the fake provider behind it records what arrived. Both
drivers (asyncio and blocking) run every case. The session's own proxy variables are cleared by
``tests/conftest.py``; each test sets its own.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ledger.adapters import ClientRegistry, HttpAdapter, StaticSecretProvider, SyncAdapter
from ledger.api.facade import Ledger
from ledger.decide.effects import SendProgress
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import Phase, Transport
from ledger.domain.records import AttemptState
from ledger.domain.values import Budget, Grant
from ledger.errors import InvalidArgument, LedgerError
from ledger.policy.model import StreamingPolicy
from ledger.testing import FakeProvider, Fault
from tests.netfaults import closed_port

from .conftest import PATIENT, PROFILE, SECRET, BlockingInLoop, make_route
from .loopback import LoopbackServer
from .test_secrets_at_rest import _database_bytes, leaks

pytestmark = pytest.mark.anyio

ENV = Envelope(parts=[Part(content="hello")])
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


class _Proxy(LoopbackServer):
    """A forwarding HTTP proxy on loopback: each connection carries one absolute-form request,
    sent on in origin form with ``Connection: close``, the answer piped back as it comes; or a
    ``CONNECT`` tunnel."""

    def __init__(self) -> None:
        self.heads: list[tuple[str, dict[str, str]]] = []  # request line, lower-case headers
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def serve(self, conn: socket.socket) -> None:
        with conn:
            got = self.read_head(conn)
            if got is None:
                return
            head, rest = got
            line, *fields = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (f.partition(":") for f in fields)}
            self.heads.append((line, headers))
            method, target, version = line.split(" ")
            if method == "CONNECT":  # a tunnel: what passes through is the client's TLS
                host, _, port = target.rpartition(":")
                with socket.create_connection((host, int(port))) as up:
                    conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    threading.Thread(target=self._pipe, args=(conn, up), daemon=True).start()
                    self._pipe(up, conn)
                return
            dest = urlsplit(target)
            kept = [f for f in fields
                    if f.partition(":")[0].strip().lower() not in ("connection",
                                                                    "proxy-authorization")]
            out = "\r\n".join([f"{method} {dest.path or '/'}"
                               + (f"?{dest.query}" if dest.query else "") + f" {version}",
                               *kept, "Connection: close", "", ""]).encode("latin-1")
            with socket.create_connection((dest.hostname or "", dest.port or 80)) as up:
                up.sendall(out + rest)
                threading.Thread(target=self._pipe, args=(conn, up), daemon=True).start()
                self._pipe(up, conn)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s side too."""
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class _RefusingProxy(_Proxy):
    r"""A proxy whose next ``CONNECT``\ s are answered as ``script`` says, each with a fixed
    answer (a status line, or a 200 then bytes that are not TLS, or a 200 then a close);
    later ones tunnel as :class:`_Proxy` does."""

    # Each a series of writes, a pause after each: the client starts TLS once it has read
    # the 200, so what is not TLS must come after it.
    ANSWERS = {
        "502": (b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n",),
        "403": (b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n",),
        "not_tls": (b"HTTP/1.1 200 Connection established\r\n\r\n",
                    b"this is not TLS at all\r\n" * 20),
        "close": (b"HTTP/1.1 200 Connection established\r\n\r\n",),
    }

    def __init__(self, *script: str) -> None:
        self.script = list(script)
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        if not self.script:
            super().serve(conn)
            return
        with conn:
            got = self.read_head(conn)
            if got is None:
                return
            self.heads.append((got[0].decode("latin-1").split("\r\n")[0], {}))
            for piece in self.ANSWERS[self.script.pop(0)]:
                conn.sendall(piece)
                time.sleep(0.1)


@pytest.fixture
def proxy() -> Iterator[_Proxy]:
    p = _Proxy()
    yield p
    p.close()


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


def _adapter(driver: str, limits: StreamingPolicy = PATIENT,
             clients: ClientRegistry | None = None) -> HttpAdapter:
    secrets = StaticSecretProvider({PROFILE: SECRET})
    if driver == "async":
        return HttpAdapter(secrets=secrets, limits=limits, clients=clients)
    return BlockingInLoop(SyncAdapter(secrets=secrets, limits=limits,  # type: ignore[return-value]
                                      clients=clients))


async def _close(adapter: HttpAdapter) -> None:
    if isinstance(adapter, BlockingInLoop):
        adapter.sync.close()
    else:
        await adapter.aclose()


async def _send(adapter: HttpAdapter, fake: FakeProvider, *, stream: bool = False) -> object:
    env = ENV.model_copy(update={"stream": stream})
    try:
        return await adapter.send(make_route(fake.endpoint("openai"), "openai"), env,
                                  profile_id=PROFILE)
    finally:
        await _close(adapter)


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
@pytest.mark.parametrize("stream", [False, True])
async def test_every_request_goes_through_the_environments_proxy(
        driver: str, fake: FakeProvider, proxy: _Proxy, no_proxy_env: pytest.MonkeyPatch,
        variable: str, stream: bool) -> None:
    no_proxy_env.setenv(variable, proxy.url)
    result = await _send(_adapter(driver), fake, stream=stream)
    assert result.ok, result.observation  # type: ignore[attr-defined]
    (line, headers), = proxy.heads
    assert line == f"POST {fake.endpoint('openai')}/chat/completions HTTP/1.1"
    assert headers["authorization"] == f"Bearer {SECRET}"
    assert len(fake.requests) == 1


async def test_an_https_endpoint_is_tunnelled_through_the_proxy(
        driver: str, proxy: _Proxy, no_proxy_env: pytest.MonkeyPatch,
        self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    no_proxy_env.setenv("HTTPS_PROXY", proxy.url)
    clients = ClientRegistry(verify=ssl.create_default_context(cafile=str(cert)))
    async with FakeProvider(ssl=server) as fake:
        assert fake.endpoint("openai").startswith("https://")
        result = await _send(_adapter(driver, clients=clients), fake, stream=True)
        assert result.ok, result.observation  # type: ignore[attr-defined]
        (line, headers), = proxy.heads
        port = urlsplit(fake.endpoint("openai")).port
        assert line == f"CONNECT 127.0.0.1:{port} HTTP/1.1"
        assert "authorization" not in headers  # the credential went inside the tunnel
        (arrived,) = fake.requests
        assert arrived.headers["authorization"] == f"Bearer {SECRET}"


async def test_no_proxy_sends_straight_to_the_provider(
        driver: str, fake: FakeProvider, no_proxy_env: pytest.MonkeyPatch) -> None:
    no_proxy_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")
    no_proxy_env.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert (await _send(_adapter(driver), fake)).ok  # type: ignore[attr-defined]
    assert len(fake.requests) == 1


async def test_an_unreachable_environment_proxy_is_a_refused_connection_before_send(
        driver: str, fake: FakeProvider, no_proxy_env: pytest.MonkeyPatch) -> None:
    no_proxy_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")
    result = await _send(_adapter(driver), fake)
    obs = result.observation  # type: ignore[attr-defined]
    assert not result.ok  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.CONNECT_REFUSED, Phase.BEFORE_SEND)
    assert fake.requests == []


async def test_trust_env_false_ignores_the_environments_proxy(
        driver: str, fake: FakeProvider, no_proxy_env: pytest.MonkeyPatch) -> None:
    no_proxy_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{closed_port()}")
    clients = ClientRegistry(trust_env=False)
    assert (await _send(_adapter(driver, clients=clients), fake)).ok  # type: ignore[attr-defined]
    assert len(fake.requests) == 1


async def test_the_registrys_proxy_gets_its_credentials_and_the_provider_never_does(
        driver: str, fake: FakeProvider, proxy: _Proxy, no_proxy_env: pytest.MonkeyPatch
) -> None:
    no_proxy_env.setenv("NO_PROXY", "127.0.0.1")  # the registry's own proxy wins over it
    port = urlsplit(proxy.url).port
    clients = ClientRegistry(proxy=f"http://egress:p%40ss@127.0.0.1:{port}")
    assert (await _send(_adapter(driver, clients=clients), fake)).ok  # type: ignore[attr-defined]
    (_, headers), = proxy.heads
    assert headers["proxy-authorization"] == "Basic " + base64.b64encode(b"egress:p@ss").decode()
    (arrived,) = fake.requests
    assert "proxy-authorization" not in arrived.headers


async def test_the_idle_limit_holds_through_a_proxy(
        driver: str, fake: FakeProvider, proxy: _Proxy, no_proxy_env: pytest.MonkeyPatch
) -> None:
    # Every other limit is far: only the idle limit can end this stall in time. The blocking
    # clients cut each socket wait to it themselves, through the proxy's connection too.
    limits = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=10.0,
                             first_token_timeout_s=10.0, idle_timeout_s=0.3,
                             total_timeout_s=20.0)
    no_proxy_env.setenv("HTTP_PROXY", proxy.url)
    fake.enqueue(Fault.STALL)
    t0 = time.monotonic()
    result = await _send(_adapter(driver, limits), fake, stream=True)
    elapsed = time.monotonic() - t0
    obs = result.observation  # type: ignore[attr-defined]
    assert (obs.transport, obs.phase) == (Transport.STREAM_STALL, Phase.MID_STREAM)
    assert len(proxy.heads) == 1
    assert 0.27 <= elapsed < 5.0


@pytest.mark.parametrize("url", ["socks5://127.0.0.1:1080", "ftp://127.0.0.1:21", "http://",
                                 "not a url"])
def test_a_proxy_that_is_not_http_is_refused_by_name(url: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        ClientRegistry(proxy=url)
    assert e.value.field == "proxy" and "http://" in str(e.value)


async def test_an_environment_proxy_that_is_not_http_is_refused_before_anything_is_sent(
        driver: str, fake: FakeProvider, no_proxy_env: pytest.MonkeyPatch) -> None:
    no_proxy_env.setenv("HTTPS_PROXY", "socks5://127.0.0.1:1080")
    no_proxy_env.setenv("HTTP_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(InvalidArgument) as e:
        await _send(_adapter(driver), fake)
    assert e.value.field == "HTTP_PROXY" and "socks" in str(e.value).lower()
    assert fake.requests == []


TUNNEL_FAILURES = [("502", Transport.CONNECT_REFUSED), ("403", Transport.CONNECT_REFUSED),
                   ("not_tls", Transport.TLS_ERROR), ("close", Transport.CONNECTION_RESET)]


@pytest.mark.parametrize(("answer", "transport"), TUNNEL_FAILURES)
async def test_nothing_before_the_tunnel_and_its_tls_stand_counts_as_sent(
        driver: str, no_proxy_env: pytest.MonkeyPatch, answer: str, transport: Transport
) -> None:
    # The CONNECT is the proxy's exchange: its answer is no response of the provider's, and a
    # tunnel that fails (refused, or no TLS through it) has carried nothing of the request.
    proxy = _RefusingProxy(answer)
    clients = ClientRegistry(proxy=proxy.url)
    progress = SendProgress()
    adapter = _adapter(driver, clients=clients)
    try:
        result = await adapter.send(
            make_route(f"https://127.0.0.1:{closed_port()}/v1", "openai"), ENV,
            profile_id=PROFILE, progress=progress)
    finally:
        await _close(adapter)
        proxy.close()
    obs = result.observation
    assert not result.ok and obs is not None
    assert (obs.transport, obs.phase, result.sent) == (transport, Phase.BEFORE_SEND, False)
    assert (result.http_status, progress.sent, progress.first_byte_at) == (None, False, None)
    assert [line.split(" ")[0] for line, _ in proxy.heads] == ["CONNECT"]


def test_a_run_fails_over_when_the_proxy_refuses_the_tunnel(
        db_url: str, no_proxy_env: pytest.MonkeyPatch, self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    proxy = _RefusingProxy("502")
    clients = ClientRegistry(proxy=proxy.url,
                             verify=ssl.create_default_context(cafile=str(cert)))
    with FakeProvider(ssl=server).in_thread() as fake, Ledger.open(db_url) as led, \
            SyncAdapter(secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT,
                        clients=clients) as adapter:
        first = make_route(fake.endpoint("openai"), "openai", id="first", group="a")
        second = make_route(fake.endpoint("openai"), "openai", id="second", group="b")
        with led.run("px", plan=[first, second], adapter=adapter,
                     budget=Budget(max_calls=3, max_retries=2, max_cost=Decimal("1")),
                     grant=Grant(recipients={"fake": ["user_input"]})) as run:
            assert run.turn(ENV).text
        refused, served = led.timeline("px")
        assert (refused.route_id, refused.state, refused.first_byte_s) == (
            "first", AttemptState.NOT_SENT, None)
        assert refused.fact is not None and refused.fact.phase is Phase.BEFORE_SEND
        assert (served.route_id, served.state) == ("second", AttemptState.SUCCEEDED)
        assert len(fake.requests) == 1
    proxy.close()


class _EchoingProxy(LoopbackServer):
    """A proxy that refuses every request with a 407 echoing the credentials it was sent."""

    def serve(self, conn: socket.socket) -> None:
        with conn:
            got = self.read_head(conn)
            if got is None:
                return
            fields = got[0].decode("latin-1").split("\r\n")[1:]
            sent = next((v.strip().removeprefix("Basic ") for k, _, v in
                         (f.partition(":") for f in fields)
                         if k.strip().lower() == "proxy-authorization"), "")
            said = base64.b64decode(sent).decode() if sent else "nothing"
            body = json.dumps({"error": {"message": f"proxy authentication failed for {said}",
                                         "code": "proxy_auth"}}).encode()
            conn.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Proxy-Authenticate: Basic realm=\"" + said.encode() + b"\"\r\n"
                         b"X-Request-Id: " + said.encode() + b"\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n"
                         b"Connection: close\r\n\r\n" + body)


def test_a_proxys_credentials_it_echoes_reach_neither_the_ledger_nor_the_result(
        db_url: str, no_proxy_env: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    password = "proxyPassw0rdXyz"
    proxy = _EchoingProxy()
    clients = ClientRegistry(proxy=f"http://egress:{password}@127.0.0.1:{proxy.port}")
    route = make_route(f"http://127.0.0.1:{closed_port()}/v1", "openai")
    with Ledger.open(db_url) as led, SyncAdapter(
            secrets=StaticSecretProvider({PROFILE: SECRET}), limits=PATIENT,
            clients=clients) as adapter:
        result = adapter.send(route, ENV, profile_id=PROFILE)
        with pytest.raises(LedgerError) as raised, led.run(
                "p407", plan=[route], adapter=adapter,
                budget=Budget(max_calls=2, max_retries=1, max_cost=Decimal("1")),
                grant=Grant(recipients={"fake": ["user_input"]})) as run:
            run.turn(ENV)
        [att] = led.timeline("p407")
        assert att.fact is not None and att.fact.status == 407
        stored = _database_bytes(db_url, request)
    proxy.close()
    assert result.http_status == 407 and result.observation is not None
    assert "proxy authentication failed" in (result.evidence or "")
    assert leaks(repr(result), password, f"egress:{password}") == []
    assert leaks(att.fact.model_dump_json(), password) == []
    assert leaks(str(raised.value), password) == []
    assert leaks(stored, password) == []


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "ALL_PROXY"])
async def test_the_environments_proxy_credentials_it_echoes_are_redacted(
        driver: str, no_proxy_env: pytest.MonkeyPatch, variable: str) -> None:
    password = f"envPassw0rd{variable.split('_')[0].title()}Qrs"
    proxy = _EchoingProxy()
    no_proxy_env.setenv(variable, f"http://egress:{password}@127.0.0.1:{proxy.port}")
    adapter = _adapter(driver)
    try:
        result = await adapter.send(make_route(f"http://127.0.0.1:{closed_port()}/v1",
                                               "openai"), ENV, profile_id=PROFILE)
    finally:
        await _close(adapter)
        proxy.close()
    assert result.http_status == 407 and "proxy-authenticate" in result.observation.headers
    assert leaks(repr(result), password) == []
