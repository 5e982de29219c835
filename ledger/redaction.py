r"""The one redaction step every string passes before the ledger stores or logs it.

Two layers, applied by :func:`redact` in this order:

1. **Known secrets.** A process-wide, thread-safe registry holds every secret the process resolved
   for its routes: the adapters register each secret their ``SecretProvider`` returns, and a host
   that calls providers itself registers its own keys with :func:`register_secret`. Each known
   secret is matched in these encodings, and in any mix of them inside one occurrence:

   * raw;
   * JSON-escaped: ``\/``, ``\"``, ``\\``, the short control escapes, and ``\uXXXX`` for any
     character (surrogate pairs above the BMP; any hex case; one or more backslashes, so a JSON
     string nested in another JSON string is covered too);
   * URL-encoded: ``%XX`` of the character's UTF-8 bytes (any hex case), and ``+`` for a space;
   * base64 of the whole secret, standard and URL-safe alphabets, with or without padding (and
     those base64 texts again JSON-escaped or URL-encoded). Base64 of a longer text that merely
     *contains* the secret (``user:key`` in Basic auth, say) is shifted by the prefix and is not
     matched: only the whole-secret encodings are.

2. **Key shapes.** Credentials the process never resolved (a gateway echoing another key, a key
   pasted into a prompt) are caught by their shape: ``sk-...`` (OpenAI, Anthropic ``sk-ant-``,
   OpenRouter ``sk-or-``), ``gsk_``, ``xai-``, ``ghp_``..., ``hf_``, ``glpat-``, ``AKIA...``,
   ``AIza...`` (Google), ``Bearer <token>``, ``api_key=...`` style assignments and URL query
   parameters (``?password=``, ``?secret=`` and signed URLs' signatures too, however short),
   the password of a URL's user part (``https://user:password@host``), JWTs, and long opaque
   tokens: 32+ characters of the base64/base64url alphabet (``A-Z a-z 0-9 + / _ - .``) that mix
   upper case, lower case and digits the way random keys do, and 40+ hex digits not labelled as
   a hash (``sha256:...``). Identifiers the ledger itself makes (``a-<32 hex>``), URLs (less
   those credentials), file paths and ordinary prose survive.

Secrets shorter than :data:`MIN_SECRET_CHARS` are not matched verbatim: replacing every short
token would destroy evidence while protecting nothing a real provider issues.

:class:`RedactingFilter` applies the same step to log records; :func:`install_log_redaction`
puts it on the ``ledger``, ``httpx`` and ``httpcore`` loggers and all their descendants (a
logger's filter does not see records of its children, so each one gets it).

This module imports nothing else of the package, so every layer (errors, storage, core,
adapters) can use it.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from ledger.forking import in_child

REDACTED = "[REDACTED]"

#: Secrets shorter than this are not searched for verbatim.
MIN_SECRET_CHARS = 6

#: The registry keeps at most this many secrets; the least recently registered go first.
MAX_SECRETS = 512

#: The loggers :func:`install_log_redaction` covers by default (with their descendants).
DEFAULT_LOGGERS: tuple[str, ...] = ("ledger", "httpx", "httpcore")

# --------------------------------------------------------------------------------------------
# Known secrets


_JSON_SHORT = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r",
               "\t": "t"}


# One to seven backslashes: a JSON escape, nested up to three JSON strings deep. Bounded, so a
# run of backslashes in hostile text costs linear time, never quadratic.
_BACKSLASHES = r"\\{1,7}"


def _hex_ci(digits: str) -> str:
    """A pattern matching ``digits`` (hex) in either case."""
    return "".join(f"[{d.lower()}{d.upper()}]" if d.isalpha() else d for d in digits)


def _char_pattern(ch: str) -> str:
    """Every encoding of one character: raw, JSON escapes, percent-encoding."""
    alts = [re.escape(ch)]
    cp = ord(ch)
    if cp < 0x10000:
        units = [cp]
    else:
        cp -= 0x10000
        units = [0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF)]
    alts.append("".join(_BACKSLASHES + "u" + _hex_ci(f"{u:04x}") for u in units))
    if ch in _JSON_SHORT:
        alts.append(_BACKSLASHES + re.escape(_JSON_SHORT[ch]))
    raw = ch.encode("utf-8", errors="surrogatepass")
    alts.append("".join("%" + _hex_ci(f"{b:02x}") for b in raw))
    if ch == " ":
        alts.append(r"\+")
    return "(?:" + "|".join(alts) + ")"


def _forms(secret: str) -> list[str]:
    """The texts a secret is searched as (each then matched in every character encoding)."""
    raw = secret.encode("utf-8", errors="surrogatepass")
    forms = [secret]
    for enc in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        text = enc.decode("ascii").rstrip("=")
        if len(text) >= MIN_SECRET_CHARS and text not in forms:
            forms.append(text)
    return forms


_ALNUM_RUN = re.compile(r"[A-Za-z0-9]+")
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")


class _Known:
    """A secret's pattern, and the literals that let most texts skip it.

    When a text holds no escape at all, each form of the secret must contain its literal (JSON
    and URL encoding leave letters and digits alone): a cheap test that skips the pattern for
    the texts that cannot contain the secret.
    """

    __slots__ = ("anchors", "pattern")

    def __init__(self, secret: str) -> None:
        forms = _forms(secret)
        self.pattern = re.compile(
            "|".join("".join(_char_pattern(c) for c in form) for form in forms)
        )
        self.anchors = tuple(max(_ALNUM_RUN.findall(f) or [""], key=len) for f in forms)

    def sub(self, text: str, escaped: bool) -> str:
        if not escaped and all(a and a not in text for a in self.anchors):
            return text
        return self.pattern.sub(REDACTED, text)


class _Registry:
    """The process's known secrets, each with its compiled pattern."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_secret: OrderedDict[str, _Known] = OrderedDict()
        # Readers take this tuple without the lock; writers replace it whole.
        self.patterns: tuple[_Known, ...] = ()

    def add(self, secret: str) -> None:
        with self._lock:
            if secret in self._by_secret:
                self._by_secret.move_to_end(secret)
                return
            self._by_secret[secret] = _Known(secret)
            while len(self._by_secret) > MAX_SECRETS:
                self._by_secret.popitem(last=False)
            # Longer secrets first, so a secret containing another is replaced whole.
            ordered = sorted(self._by_secret.items(), key=lambda kv: -len(kv[0]))
            self.patterns = tuple(p for _, p in ordered)

    def remove(self, secret: str) -> None:
        with self._lock:
            if self._by_secret.pop(secret, None) is not None:
                ordered = sorted(self._by_secret.items(), key=lambda kv: -len(kv[0]))
                self.patterns = tuple(p for _, p in ordered)

    def __contains__(self, secret: object) -> bool:
        with self._lock:
            return secret in self._by_secret

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_secret)


_REGISTRY = _Registry()


@in_child
def _forked_registry_lock() -> None:
    # Another thread of the parent may have held it (compiling a new secret's pattern) when the
    # fork came; the secrets known are the child's too.
    _REGISTRY._lock = threading.Lock()


def register_secret(secret: str | None) -> None:
    """Make :func:`redact` remove ``secret`` (in every encoding) from now on, process-wide.

    The adapters call this for each secret they resolve; a host that sends requests itself calls
    it for the keys it uses. ``None``, empty and too-short values are ignored.
    """
    if isinstance(secret, str) and len(secret) >= MIN_SECRET_CHARS:
        _REGISTRY.add(secret)


def forget_secret(secret: str) -> None:
    """Stop matching ``secret`` verbatim (its key shape may still be caught)."""
    _REGISTRY.remove(secret)


def is_registered(secret: str) -> bool:
    """Whether ``secret`` is in the registry."""
    return secret in _REGISTRY


# --------------------------------------------------------------------------------------------
# Key shapes


_PREFIXED: tuple[re.Pattern[str], ...] = (
    # OpenAI (sk-, sk-proj-), Anthropic (sk-ant-), OpenRouter (sk-or-), DeepSeek, ...
    re.compile(r"\bsk-(?=[A-Za-z0-9_\-+/.]{8})(?:[A-Za-z0-9_\-+/]|\.(?=[A-Za-z0-9_\-+/]))+"),
    re.compile(
        r"\b(?:sk_(?:live|test)_|rk_(?:live|test)_|gsk_|xai-|gh[pousr]_|hf_|glpat-)"
        r"[A-Za-z0-9_\-]{16,}"
    ),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key ids
    re.compile(r"\bAIza[0-9A-Za-z_\-]{20,}"),  # Google API keys
    re.compile(r"\beyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{5,}"),  # JWTs
)
# A password hidden already (``***``, as a database URL is shown) or the word in a hint's
# example URL (``postgresql://user:PASSWORD@host/db``): kept as it is.
_PLACEHOLDER = r"(?:\*\*\*|password|pass)"
# (prefix kept) value
_LABELLED: tuple[re.Pattern[str], ...] = (
    re.compile(r"(?i)(\b(?:bearer|basic|token)\s+)[A-Za-z0-9._~+/\-]{8,}=*"),
    re.compile(
        r"(?i)(\b(?:x-api-key|x-goog-api-key|api[_-]?key|apikey|access[_-]?token|auth[_-]?token"
        r"|refresh[_-]?token|client[_-]?secret|secret[_-]?key|authorization)"
        r"[\"']?\s*[:=]\s*[\"']?)(?!\[REDACTED\])[^\s\"',;&}\]]{6,}"
    ),
    re.compile(r"(?i)([?&](?:key|api_key|apikey|token|access_token|sig|signature)=)[^&\s#\"']{6,}"),
    # A password or secret in a URL's query, however short (``?password=``, ``db_password=``,
    # ``client_secret=``, S3's and GCS's signed-URL signatures).
    re.compile(r"(?i)([?&](?:[\w.\-]*password|passwd|pwd|pass|[\w.\-]*secret"
               r"|x-(?:amz|goog)-(?:signature|security-token))=)"
               r"(?!" + _PLACEHOLDER + r"(?:[&\s#\"']|$))[^&\s#\"']+"),
    # The password of a URL's user part (``https://user:password@host``); the scheme is
    # bounded, so a run of dotted words costs linear time.
    re.compile(r"(?i)(\b[a-z][a-z0-9+.\-]{0,30}://[^\s:/?#@\"'<>]*:)(?!" + _PLACEHOLDER
               + r"@)[^\s/?#@\"'<>]+(?=@)"),
)
# One pass for all prefixed shapes (none has a group).
_PREFIXED_ONE = re.compile("|".join(f"(?:{p.pattern})" for p in _PREFIXED))
_LONG = re.compile(r"(?<![A-Za-z0-9+/_\-.])[A-Za-z0-9+/_\-.]{32,}={0,2}")
_SEPARATORS = re.compile(r"[/+._\-]")
_WORD = re.compile(r"[A-Z]?[a-z]+(?:[A-Z][a-z]+)*[0-9]*$|[A-Z]+[0-9]*$")
_HASH_LABEL = re.compile(r"(?i)(?:sha\d*|md5|blake2b?|hash|digest)[:=]$")


def _random_looking(token: str) -> bool:
    """Whether a long token looks like a random key rather than a word, path or URL."""
    core = token.rstrip("=.")
    if len(core) < 32:
        return False
    if re.fullmatch(r"[0-9a-fA-F]+", core):
        return len(core) >= 40 and any(c.isdigit() for c in core) and any(
            c.isalpha() for c in core)
    has_upper = any(c.isupper() for c in core)
    has_lower = any(c.islower() for c in core)
    has_digit = any(c.isdigit() for c in core)
    if not (has_upper and has_lower and has_digit) or core.startswith("/"):  # a URL or path
        return False
    # Random text switches between upper case, lower case, digits and symbols all the time;
    # words, CamelCase names and paths keep one class for several characters in a row.
    def kind(c: str) -> int:
        return 0 if c.isupper() else 1 if c.islower() else 2 if c.isdigit() else 3

    switches = sum(1 for a, b in itertools.pairwise(core) if kind(a) != kind(b))
    if switches < len(core) * 0.3:
        return False
    # Paths and dotted names are mostly words ("Users/JohnSmith/Projects/Agent2024/base.py").
    wordy = sum(len(seg) for seg in _SEPARATORS.split(core) if len(seg) >= 4 and _WORD.match(seg))
    return wordy < len(core) * 0.5


def _long_token(text: str) -> str:
    def sub(m: re.Match[str]) -> str:
        token = m.group(0)
        if _HASH_LABEL.search(text, max(0, m.start() - 8), m.start()):
            return token
        if not _random_looking(token):
            return token
        tail = token[len(token.rstrip(".")):]  # a sentence's full stop is not the key's
        return REDACTED + tail

    return _LONG.sub(sub, text)


# --------------------------------------------------------------------------------------------
# The step


def _extra(secrets: Iterable[str | None]) -> list[_Known]:
    out = []
    for s in secrets:
        if isinstance(s, str) and len(s) >= MIN_SECRET_CHARS and s not in _REGISTRY:
            out.append(_Known(s))
    return out


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with every known secret and every credential-shaped token made ``[REDACTED]``.

    Known secrets are the registered ones (:func:`register_secret`) and those given in
    ``secrets`` for this call only, matched in every encoding the module docstring lists.

    Args:
        text: The text to clean (anything else is converted with ``str`` first).
        secrets: Secrets to remove from this text without registering them (``None`` and
            too-short values are ignored).

    Returns:
        The text, with ``[REDACTED]`` in place of each match.

    Example:
        >>> redact("key=sk-live-0123456789abcdef0123", ["sk-live-0123456789abcdef0123"])
        'key=[REDACTED]'
    """
    if not isinstance(text, str):
        text = str(text)
    if len(text) < MIN_SECRET_CHARS:
        return text  # too short to hold a known secret in any encoding, or any key shape
    extra = _extra(secrets) if secrets else ()
    patterns = _REGISTRY.patterns
    if not extra and _CLEAN.get(text) is patterns:
        return text  # found clean before, under the very same registered secrets
    original = text
    escaped = "\\" in text or _PERCENT.search(text) is not None
    for known in (*patterns, *extra):
        text = known.sub(text, escaped)
    text = _PREFIXED_ONE.sub(REDACTED, text)
    for pattern in _LABELLED:
        text = pattern.sub(lambda m: m.group(1) + REDACTED, text)
    text = _long_token(text) if len(text) >= 32 else text
    if not extra and text == original:
        _remember_clean(text, patterns)
    return text


# Texts already found clean (ids, reasons, route names recur in every event), with the
# registry's patterns they were checked against: a secret registered later makes them miss.
# Only clean texts are kept, so the memo never holds a secret.
_CLEAN: dict[str, tuple[_Known, ...]] = {}
_CLEAN_MAX = 8192
# Only short texts are remembered: the recurring ones are names and reasons, and a long text
# (a provider's model string, an error body) kept 8,192 times would hold megabytes.
_CLEAN_TEXT_MAX = 512


def _remember_clean(text: str, patterns: tuple[_Known, ...]) -> None:
    if len(text) > _CLEAN_TEXT_MAX:
        return
    if len(_CLEAN) >= _CLEAN_MAX:
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            del _CLEAN[next(iter(_CLEAN))]  # the oldest; a lost race only evicts less
    _CLEAN[text] = patterns


def redact_data(value: Any, *, _depth: int = 0) -> Any:
    """A JSON-ready copy of ``value`` with every string (keys included) redacted.

    Mappings become dicts, sequences lists; any other object is turned into its ``str`` (as
    ``json.dumps(default=str)`` would) and redacted.
    """
    # Strings first: they are most of what an event holds; ids and reasons recur, and a text
    # found clean before costs a dictionary look-up in redact().
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if _depth > 64:
        return redact(str(value))
    if isinstance(value, Mapping):
        return {redact(k) if isinstance(k, str) else _other_key(k):
                redact_data(v, _depth=_depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_data(v, _depth=_depth + 1) for v in value]
    return redact(str(value))


def _other_key(k: Any) -> Any:
    """A mapping's non-string key as :func:`redact_data` keeps it.

    A JSON scalar stays as it is; anything else becomes its redacted ``str``.
    """
    return k if k is None or isinstance(k, bool | int | float) else redact(str(k))


# --------------------------------------------------------------------------------------------
# Logging


class RedactingFilter(logging.Filter):
    """Redacts a record's message (with its arguments), exception text and stack in place.

    It never drops a record. The record is rewritten only when redaction changed something, so
    handlers that read ``record.args`` still get them for clean records.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact ``record`` in place; always True (the record is kept)."""
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: log what there is
            message = f"{record.msg} {record.args!r}"
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_FILTER = RedactingFilter()
# Loggers the HTTP stack creates only when a connection is first made (httpcore imports its
# connection modules lazily): made here in advance, so the first request's records are covered.
_LAZY_CHILDREN: dict[str, tuple[str, ...]] = {
    "httpcore": ("connection", "connection_pool", "http11", "http2", "proxy", "socks"),
}
_install_lock = threading.Lock()


@in_child
def _forked_install_lock() -> None:
    global _install_lock
    _install_lock = threading.Lock()
_installed_for: dict[tuple[str, ...], int] = {}


def install_log_redaction(names: Iterable[str] = DEFAULT_LOGGERS) -> None:
    """Put the redacting filter on each named logger and every descendant it has now.

    Idempotent and cheap to call again: it rescans only when new loggers were created since the
    last call, so callers (the adapters) call it before each request to cover late-made loggers.
    """
    key = tuple(names)
    manager = logging.Logger.manager
    count = len(manager.loggerDict)
    if _installed_for.get(key) == count:
        return
    with _install_lock:
        targets = [logging.getLogger(n) for n in key]
        targets += [logging.getLogger(f"{n}.{c}") for n in key for c in _LAZY_CHILDREN.get(n, ())]
        for name in list(manager.loggerDict):
            if any(name.startswith(n + ".") for n in key):
                obj = manager.loggerDict[name]
                if isinstance(obj, logging.Logger):
                    targets.append(obj)
        for logger in targets:
            if _FILTER not in logger.filters:
                logger.addFilter(_FILTER)
        _installed_for[key] = len(manager.loggerDict)


__all__ = [
    "DEFAULT_LOGGERS",
    "MAX_SECRETS",
    "MIN_SECRET_CHARS",
    "REDACTED",
    "RedactingFilter",
    "forget_secret",
    "install_log_redaction",
    "is_registered",
    "redact",
    "redact_data",
    "register_secret",
]
