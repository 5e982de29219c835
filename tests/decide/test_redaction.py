"""The one redaction step: known secrets in every encoding, key shapes, prose left alone."""

from __future__ import annotations

import base64
import json
import logging
import re
import threading
import time
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.errors import InvalidArgument
from ledger.redaction import (
    MIN_SECRET_CHARS,
    REDACTED,
    RedactingFilter,
    forget_secret,
    install_log_redaction,
    is_registered,
    redact,
    redact_data,
    register_secret,
)

KEY = "zk/Qm7+Lp2/x.9Rt_Vw-Yb3Nc8Hd4Jf6"


@pytest.fixture(autouse=True)
def _key() -> None:
    register_secret(KEY)


def _forms(key: str) -> dict[str, str]:
    raw = key.encode()
    return {
        "raw": key,
        "json_slash": json.dumps(key)[1:-1].replace("/", "\\/"),
        "json_u_lower": "".join(f"\\u{ord(c):04x}" for c in key),
        "json_u_upper": "".join(f"\\u{ord(c):04X}" for c in key),
        "json_mixed": "".join(f"\\u{ord(c):04x}" if i % 2 else c for i, c in enumerate(key)),
        "json_nested": json.dumps(json.dumps(key.replace("/", "\\/")))[1:-1],
        "url": quote(key, safe=""),
        "url_keep_slash": quote(key),
        "url_lower_hex": re.sub("%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(key, safe="")),
        "url_plus": quote_plus(key),
        "b64": base64.b64encode(raw).decode(),
        "b64_nopad": base64.b64encode(raw).decode().rstrip("="),
        "b64url": base64.urlsafe_b64encode(raw).decode(),
        "b64_json_escaped": base64.b64encode(raw).decode().replace("/", "\\/"),
        "b64_url_encoded": quote(base64.b64encode(raw).decode(), safe=""),
        "bytes_repr": repr(raw),
    }


@pytest.mark.parametrize("form", list(_forms(KEY)))
def test_a_known_secret_is_removed_in_every_encoding(form: str) -> None:
    encoded = _forms(KEY)[form]
    out = redact(f"Incorrect API key provided: {encoded}. Check your key.")
    assert REDACTED in out
    for other in _forms(KEY).values():
        assert other not in out
    assert out.startswith("Incorrect API key provided: ") and out.endswith("Check your key.")


def test_secrets_beyond_the_bmp_and_with_spaces() -> None:
    secret = "pass phrase \U0001f511 with \u00e9 accents"
    register_secret(secret)
    try:
        for text in (secret, json.dumps(secret), json.dumps(secret, ensure_ascii=False),
                     quote(secret), quote_plus(secret)):
            assert redact(f"[{text}]").count(REDACTED) == 1, text
    finally:
        forget_secret(secret)
    assert not is_registered(secret)


def test_short_values_are_not_registered() -> None:
    register_secret("abc")
    register_secret(None)
    register_secret("")
    assert not is_registered("abc")
    assert redact("abc abc") == "abc abc"
    assert MIN_SECRET_CHARS >= 6


def test_secrets_passed_for_one_call_are_matched_without_registering() -> None:
    assert redact("value=Sixchr-one-off", ["Sixchr-one-off"]) == f"value={REDACTED}"
    assert not is_registered("Sixchr-one-off")


@pytest.mark.parametrize(
    "token",
    [
        "sk-proj-AAAAAAAAAAAAAAAA",
        "sk-ant-api03-zzzzzzzzzzzz-Qq9",
        "sk-or-v1-" + "ab12" * 16,
        "sk-Ab/Cd+Ef.Gh1234567890",
        "gsk_" + "Ab3" * 10,
        "xai-" + "Zq7" * 10,
        "ghp_" + "A1b2" * 9,
        "hf_" + "Qw9" * 8,
        "AKIAIOSFODNN7EXAMPLE",
        "AIzaSyA1234567890abcdefghijklmnopqrstu",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        "k3F9xQ2mZ7pL0vR8tY6wN4bH1cJ5dG2sA9eU3iO7",
        "Zx8/Lq3+Vt6.Mn1_Rb4-Kp7/Wd2+Yh5.Cf9_Js0Gs",
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    ],
)
def test_key_shapes_are_caught_without_being_known(token: str) -> None:
    out = redact(f"the gateway said: {token}, please retry")
    assert token not in out and REDACTED in out
    assert out.startswith("the gateway said: ") and out.endswith(", please retry")


@pytest.mark.parametrize(
    "text",
    [
        "Bearer abcdefghijklmno",
        "Authorization: Basic dXNlcjpwYXNzd29yZA==",
        'x-api-key: "hunter2hunter2"',
        "api_key=abcdefgh123",
        '{"access_token": "ya29-zzzzzzzz"}',
        "GET /v1beta/models?key=AIzaShortish1234 HTTP/1.1",
    ],
)
def test_labelled_credentials_are_caught(text: str) -> None:
    out = redact(text)
    assert REDACTED in out
    for leaked in ("abcdefghijklmno", "dXNlcjpwYXNzd29yZA", "hunter2hunter2", "abcdefgh123",
                   "ya29-zzzzzzzz", "AIzaShortish1234"):
        assert leaked not in out


@pytest.mark.parametrize(
    ("text", "leaked"),
    [
        ("https://bob:LinkPassword99@files.example/doc.pdf", "LinkPassword99"),
        ("fetch failed: ftp://:pw@10.0.0.1/x (timed out)", ":pw@"),
        ("https://x.example/doc.pdf?password=abcdefghij", "abcdefghij"),
        ("https://x.example/doc.pdf?a=1&pwd=hunter&b=2", "hunter"),
        ("https://x.example/doc.pdf?passwd=p4", "p4"),
        ("https://x.example/doc.pdf?db_password=s3cr&x=y", "s3cr"),
        ("https://x.example/cb?client_secret=abc", "abc"),
        ("https://bucket.s3.example/o?X-Amz-Signature=0a1b2c&X-Amz-Security-Token=Fw0gZX",
         "0a1b2c"),
    ],
)
def test_credentials_in_a_url_are_caught(text: str, leaked: str) -> None:
    out = redact(text)
    assert leaked not in out and REDACTED in out, out
    assert redact(out) == out


PROSE = [
    "Rate limit reached for gpt-4o-mini in organization org-abc123 on tokens per min (TPM): "
    "Limit 30000, Used 29876, Requested 512. Please try again in 20ms. Visit "
    "https://platform.openai.com/account/rate-limits to learn more.",
    "The model `gpt-4-32k-0613` does not exist or you do not have access to it.",
    "models/gemini-1.5-pro-002 is not found for API version v1beta, or is not supported for "
    "generateContent. Call ListModels to see the list of available models.",
    "https://generativelanguage.googleapis.com/v1beta/models/gemini-1.5-Pro-latest:"
    "streamGenerateContent?alt=sse",
    "prompt is too long: 215000 tokens > 200000 maximum",
    "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
    "This model's maximum context length is 128000 tokens. However, your messages resulted in "
    "131072 tokens. Please reduce the length of the messages.",
    "ConnectError: [Errno 111] Connection refused; caused by ConnectionRefusedError",
    "unknown attempt id 'a-3f2a9c1e8b7d4e6fa1b2c3d4e5f60718' in run 'r-2024-05-01-research'",
    "envelope hash sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 "
    "differs from the recorded one",
    'File "/Users/JohnSmith/Projects/ResearchAgent2024/ledger/adapters/base.py", line 10',
    "request_id=req_011CPGsdgjYXyzYZ6vTZxXJj x-request-id: 7f3c2a1b-9d8e-4f6a-b5c4-d3e2f1a0b9c8",
    "Please ensure that multiturn requests end with a user role or a function response.",
    "HTTP 503 (error body not read: ReadTimeout: timed out)",
    "the api key is missing; set OPENAI_API_KEY or LEDGER_SECRET_OPENAI_DEFAULT",
    "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing.",
    "capacity group 'anthropic-prod' refused attempt 'a-1' (cooling until 1717171717.5)",
    # URLs with a user name, a port, an '@' in the path, or a password word that is no label.
    "cloning ssh://git@github.com:22/acme/agents.git failed; see http://localhost:8080/@alice",
    "https://example.com/search?q=password&passwords_match=true&bypass=cache&page=2",
    # A database URL as the storage shows it, its secrets hidden already, and a hint's example.
    "database postgresql+psycopg://u:***@127.0.0.1/db?sslpassword=*** is unavailable",
    "put it in the URL (postgresql+psycopg://app:PASSWORD@127.0.0.1:5432/postgres) or use "
    "postgresql+psycopg://user:pass@host:port/dbname",
]


@pytest.mark.parametrize("text", PROSE)
def test_ordinary_error_messages_survive(text: str) -> None:
    assert redact(text) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=400))
def test_redact_is_total_and_idempotent(text: str) -> None:
    once = redact(text)
    assert redact(once) == once
    assert KEY not in redact(text + KEY + text)


@pytest.mark.parametrize("blob", ["\\" * 200_000, "%" * 100_000, "a" * 300_000,
                                  "aB3/" * 60_000, "sk-" * 50_000, "\\u00" * 50_000])
def test_hostile_text_costs_linear_time(blob: str) -> None:
    started = time.perf_counter()
    redact(blob)
    assert time.perf_counter() - started < 5.0


def test_redact_data_walks_keys_values_and_unknown_objects() -> None:
    class Opaque:
        def __str__(self) -> str:
            return f"opaque {KEY}"

    out = redact_data({"a": [KEY, {"k": (1, KEY)}], KEY: 1.5, "o": Opaque(), "n": None})
    text = json.dumps(out)
    assert KEY not in text and KEY.replace("/", "\\/") not in text
    assert out["n"] is None and out[REDACTED] == 1.5


def test_registry_is_safe_under_concurrent_registration() -> None:
    secrets = [f"conc-{i:04d}-Qx7/Zp" for i in range(64)]

    def work(chunk: list[str]) -> None:
        for s in chunk:
            register_secret(s)
            assert s not in redact(f"x {s} y")

    threads = [threading.Thread(target=work, args=(secrets[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(is_registered(s) for s in secrets)
    for s in secrets:
        forget_secret(s)


def test_ledger_errors_never_carry_a_secret() -> None:
    err = InvalidArgument(f"bad value {KEY!r} for field", field="x")
    assert KEY not in str(err) and KEY not in repr(err) and KEY not in err.message
    assert REDACTED in str(err)


def test_log_filter_covers_descendants_made_before_and_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    install_log_redaction()
    caplog.set_level(logging.DEBUG)
    # httpcore makes its connection loggers lazily; they are covered before they exist.
    for name in ("httpcore.http11", "httpcore.connection", "httpx", "ledger"):
        assert any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters)
    late = logging.getLogger("ledger.some_new_module")
    install_log_redaction()
    assert any(isinstance(f, RedactingFilter) for f in late.filters)
    late.debug("header %s and %r", KEY, {"k": KEY})
    logging.getLogger("httpcore.http11").debug("headers %s", [(b"x-key", KEY.encode())])
    try:
        raise RuntimeError(f"boom {KEY}")
    except RuntimeError:
        logging.getLogger("httpx").exception("failed")
    assert KEY not in caplog.text
    assert caplog.text.count(REDACTED) >= 4
    clean = logging.LogRecord("ledger", logging.INFO, __file__, 1, "n=%d", (3,), None)
    assert RedactingFilter().filter(clean) and clean.args == (3,)  # clean records kept as they are


def test_a_text_found_clean_is_checked_again_once_a_secret_it_holds_is_registered() -> None:
    """Clean texts are remembered (they recur in every event), never past a new secret."""
    from ledger.redaction import forget_secret, redact, register_secret

    secret = "zk-Qm7Lp2Xv9Rt4Wn8Bc3Hd6Jf1"
    text = f"route r1 said: unexpected value {secret} in the reply"
    assert redact(text) == redact(text)  # remembered or not, the same answer
    register_secret(secret)
    try:
        assert secret not in redact(text)
        assert secret not in redact(text)  # and not remembered as clean meanwhile
    finally:
        forget_secret(secret)


def test_the_clean_text_memo_keeps_only_short_texts() -> None:
    # Texts found clean are remembered so recurring names cost a look-up; a long one (a
    # provider's 300,000-character model string) was kept too, each of up to 8,192 of them.
    from ledger import redaction

    long_text = "model-" + "x y " * 75_000
    short_text = "route-a-primary-model-name"
    assert redact(long_text) == long_text and redact(short_text) == short_text
    assert long_text not in redaction._CLEAN
    assert short_text in redaction._CLEAN


def test_a_providers_text_keeps_a_secret_straddling_its_cut_redacted_however_long() -> None:
    # provider_text redacts a head with room past the 200 characters it keeps (it redacted
    # the whole text: a 16 MiB tool-call id took seconds); a key that begins before the cut
    # is still matched whole, and nothing of it is kept.
    from ledger.decide.stops import provider_text

    token = "sk-proj-" + "Ab3dE5gH7jK9mN1pQ3sT5vW7yZ9" * 3
    text = "x" * 189 + " " + token + " " + "y" * 4_000_000
    kept = provider_text(text)
    assert kept is not None and len(kept) <= 200
    assert "sk-proj" not in kept and token[8:20] not in kept
    assert kept.startswith("x" * 189) and REDACTED in kept
