"""An ``https://`` proxy's own connection (the hop to the proxy) trusts what the registry's
origins trust: ``verify``'s ``SSLContext`` as given, nothing with ``verify=False``, and with
``trust_env`` (only) the authorities ``SSL_CERT_FILE`` names. It had httpcore's default
context instead, whatever the user set: certifi's authorities and OpenSSL's default paths
(the system's store, and ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` even with ``trust_env=False``),
so a company proxy signed by an authority given through ``verify`` could not be trusted, and
``verify=False`` did not reach it.

A real TLS forwarding proxy on loopback (:class:`_TLSProxy`) whose certificate a throwaway
authority made here signed (``openssl``, as the self-signed fixture is made); the provider
behind it is plain HTTP, or HTTPS under the same authority (tunnelled, TLS inside TLS). Both
drivers run every case. Each test starts from a process with no TLS context (the registry's
cache is the test's own), so no context built for another configuration is served.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from ledger.adapters import ClientRegistry
from ledger.adapters import transport as transport_module
from ledger.domain.facts import Phase, Transport
from ledger.testing import FakeProvider

from .test_proxy import PROXY_VARS, _adapter, _send
from .test_proxy_tls_context import _TLSProxy

pytestmark = pytest.mark.anyio


class Authority(NamedTuple):
    """A throwaway certificate authority's certificate, and a certificate for 127.0.0.1 it
    signed with that certificate's key."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def company(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    """A company's own authority and the certificate of its proxy (made by ``openssl``)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; the proxy TLS trust tests need it")
    d = tmp_path_factory.mktemp("company-ca")
    ca, ca_key = d / "ca.pem", d / "ca-key.pem"
    cert, key, csr, ext = d / "proxy.pem", d / "proxy-key.pem", d / "proxy.csr", d / "ext.cnf"
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *curve, "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
             "-subj", "/CN=ledger test company authority",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl("req", "-new", *curve, "-keyout", str(key), "-out", str(csr),
             "-subj", "/CN=127.0.0.1")
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-set_serial", "2", "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return Authority(ca, cert, key)


def _served(company: Authority) -> ssl.SSLContext:
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(company.cert, company.key)
    return served


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No proxy and no authority from the machine's environment; no TLS context built yet."""
    for name in (*PROXY_VARS, "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    monkeypatch.setattr(transport_module, "_TLS_CONTEXTS", {})
    return monkeypatch


@pytest.fixture
def company_proxy(company: Authority) -> Iterator[_TLSProxy]:
    """An ``https://`` proxy whose certificate the company's authority signed."""
    proxy = _TLSProxy(_served(company))
    yield proxy
    proxy.close()


@pytest.fixture(params=["http", "https"])
async def provider(request: pytest.FixtureRequest,
                   company: Authority) -> AsyncIterator[FakeProvider]:
    """The provider behind the proxy: plain HTTP, or HTTPS under the company's authority."""
    async with FakeProvider(ssl=_served(company) if request.param == "https" else None) as fake:
        yield fake


def _went_through(proxy: _TLSProxy, fake: FakeProvider) -> None:
    (line, _), = proxy.heads
    endpoint = fake.endpoint("openai")
    assert line.startswith("CONNECT " if endpoint.startswith("https:") else f"POST {endpoint}")
    assert len(fake.requests) == 1


async def test_an_https_proxys_own_connection_trusts_the_authority_verify_gives(
        driver: str, env: pytest.MonkeyPatch, company: Authority, company_proxy: _TLSProxy,
        provider: FakeProvider) -> None:
    clients = ClientRegistry(proxy=company_proxy.url,
                             verify=ssl.create_default_context(cafile=str(company.ca)))
    result = await _send(_adapter(driver, clients=clients), provider)
    assert result.ok, result.observation  # type: ignore[attr-defined]
    _went_through(company_proxy, provider)


async def test_an_https_proxys_own_connection_trusts_ssl_cert_file_with_the_environment(
        driver: str, env: pytest.MonkeyPatch, company: Authority, company_proxy: _TLSProxy,
        provider: FakeProvider) -> None:
    env.setenv("SSL_CERT_FILE", str(company.ca))
    secure = provider.endpoint("openai").startswith("https:")
    env.setenv("HTTPS_PROXY" if secure else "HTTP_PROXY", company_proxy.url)
    result = await _send(_adapter(driver), provider)  # the default registry: trust_env
    assert result.ok, result.observation  # type: ignore[attr-defined]
    _went_through(company_proxy, provider)


async def test_an_https_proxys_own_connection_ignores_ssl_cert_file_without_the_environment(
        driver: str, env: pytest.MonkeyPatch, company: Authority, company_proxy: _TLSProxy,
        fake: FakeProvider) -> None:
    env.setenv("SSL_CERT_FILE", str(company.ca))
    clients = ClientRegistry(proxy=company_proxy.url, trust_env=False)
    result = await _send(_adapter(driver, clients=clients), fake)
    obs = result.observation  # type: ignore[attr-defined]
    assert obs is not None and (obs.transport, obs.phase) == (Transport.TLS_ERROR,
                                                              Phase.BEFORE_SEND)
    assert fake.requests == []


async def test_an_https_proxy_signed_by_an_authority_not_trusted_is_a_tls_error_before_send(
        driver: str, env: pytest.MonkeyPatch, company_proxy: _TLSProxy,
        fake: FakeProvider) -> None:
    result = await _send(_adapter(driver, clients=ClientRegistry(proxy=company_proxy.url)),
                         fake)
    obs = result.observation  # type: ignore[attr-defined]
    assert obs is not None and (obs.transport, obs.phase) == (Transport.TLS_ERROR,
                                                              Phase.BEFORE_SEND)
    assert "CERTIFICATE_VERIFY_FAILED" in (obs.message or "")
    assert company_proxy.heads == [] and fake.requests == []


async def test_verify_false_leaves_an_https_proxys_own_connection_unverified(
        driver: str, env: pytest.MonkeyPatch, company_proxy: _TLSProxy,
        fake: FakeProvider) -> None:
    clients = ClientRegistry(proxy=company_proxy.url, verify=False)
    result = await _send(_adapter(driver, clients=clients), fake)
    assert result.ok, result.observation  # type: ignore[attr-defined]
    _went_through(company_proxy, fake)
