"""Credentials by profile id, and the redaction every adapter output goes through.

The ledger stores credential *profile ids* only. The secret behind a profile id is looked up at
send time from a :class:`SecretProvider`, used for one request header, and never copied into an
:class:`~ledger.domain.facts.Observation`, an adapter result, an exception message, an evidence
excerpt or a log line. Everything an adapter reports that came from the wire or from an exception
passes through :func:`redact` first (the one step of :mod:`ledger.redaction`), and every secret
the adapters resolve is registered there, so storage and logging remove it too.

Environment naming (:class:`EnvSecretProvider`, the default):

* ``LEDGER_SECRET_<PROFILE_ID>``: the profile id upper-cased, every character that is not an
  ASCII letter or digit replaced by ``_`` (``openai:work`` -> ``LEDGER_SECRET_OPENAI_WORK``).
* When that is unset, the provider's conventional variable, chosen by the route's protocol:
  ``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``, ``GEMINI_API_KEY`` (then ``GOOGLE_API_KEY``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ledger.domain.facts import WireProtocol
from ledger.redaction import REDACTED as REDACTED
from ledger.redaction import redact as _redact

#: Size cap, in bytes of UTF-8, of an error body kept as evidence or in an observation.
EVIDENCE_CAP_BYTES = 2048


class SecretProvider(Protocol):
    """Looks up the secret of a credential profile. ``None`` when it has none."""

    def get(self, profile_id: str, *, protocol: WireProtocol) -> str | None:
        """The secret of ``profile_id``, or ``None`` when there is none.

        ``protocol`` is the route's, for providers that fall back to a conventional variable.
        """
        ...


_FALLBACK_ENV: dict[WireProtocol, tuple[str, ...]] = {
    WireProtocol.OPENAI: ("OPENAI_API_KEY",),
    WireProtocol.ANTHROPIC: ("ANTHROPIC_API_KEY",),
    WireProtocol.GEMINI: ("GEMINI_API_KEY", "GOOGLE_API_KEY"),
}


def env_var_name(profile_id: str) -> str:
    """The environment variable that holds ``profile_id``'s secret."""
    return "LEDGER_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", profile_id).upper()


class EnvSecretProvider:
    """Reads secrets from the environment (see the module docstring for the naming).

    Args:
        environ: Where to read (default :data:`os.environ`, read at every lookup so a rotated
            key is picked up by the next request).
        fallback: Whether an unset ``LEDGER_SECRET_<PROFILE_ID>`` falls back to the
            protocol's conventional variable (``OPENAI_API_KEY``, ...).

    Example:
        >>> EnvSecretProvider({"LEDGER_SECRET_OPENAI_WORK": "sk-1"}).get(
        ...     "openai:work", protocol=WireProtocol.OPENAI)
        'sk-1'
    """

    def __init__(self, environ: Mapping[str, str] | None = None, *, fallback: bool = True) -> None:
        self._environ = environ
        self._fallback = fallback

    def candidates(self, profile_id: str, *, protocol: WireProtocol) -> list[str]:
        """The variables looked at for ``profile_id``, in order."""
        names = [env_var_name(profile_id)]
        if self._fallback:
            names.extend(_FALLBACK_ENV.get(protocol, ()))
        return names

    def get(self, profile_id: str, *, protocol: WireProtocol) -> str | None:
        """The first non-empty value among :meth:`candidates`, else ``None``."""
        env = os.environ if self._environ is None else self._environ
        for name in self.candidates(profile_id, protocol=protocol):
            value = env.get(name)
            if value:
                return value
        return None


class StaticSecretProvider:
    """Secrets from a mapping of profile id to secret (tests, or a host's own vault loader).

    Args:
        secrets: Profile id -> secret (copied; the protocol is not consulted).
    """

    def __init__(self, secrets: Mapping[str, str]) -> None:
        self._secrets = dict(secrets)

    def get(self, profile_id: str, *, protocol: WireProtocol) -> str | None:
        """The secret given for ``profile_id``, else ``None``."""
        return self._secrets.get(profile_id)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` through :func:`ledger.redaction.redact`, with ``secrets`` matched too.

    The adapters register every secret they resolve, so passing it here is belt and braces.
    """
    return _redact(text, secrets)


def cap_text(text: str, cap_bytes: int = EVIDENCE_CAP_BYTES) -> str:
    """``text`` cut to at most ``cap_bytes`` of UTF-8, marking the cut."""
    raw = text.encode("utf-8")
    if len(raw) <= cap_bytes:
        return text
    marker = "...[truncated]"
    keep = max(0, cap_bytes - len(marker))
    return raw[:keep].decode("utf-8", errors="ignore") + marker


def _shrink(value: Any, limit: int, items: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "..."
    if isinstance(value, list):
        return [_shrink(v, limit, items) for v in value[:items]]
    if isinstance(value, dict):
        return {k: _shrink(v, limit, items) for k, v in list(value.items())[: items * 4]}
    return value


def evidence_excerpt(
    body: str | bytes | None,
    secrets: Iterable[str | None] = (),
    cap_bytes: int = EVIDENCE_CAP_BYTES,
) -> str | None:
    """A redacted excerpt of an error body of at most ``cap_bytes``.

    A JSON body that is too large is shrunk by shortening its long strings and lists, so the
    structured fields a classifier reads (``error.code``, ``error.type``, ``error.status``,
    ``RetryInfo``) survive the cap; anything else is cut at the cap.
    """
    if body is None:
        return None
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    text = redact(text, secrets)
    if len(text.encode("utf-8")) <= cap_bytes:
        return text
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return cap_text(text, cap_bytes)
    for limit, items in ((512, 8), (200, 4), (80, 3), (40, 2)):
        shrunk = json.dumps(_shrink(data, limit, items), ensure_ascii=False)
        if len(shrunk.encode("utf-8")) <= cap_bytes:
            return shrunk
    return cap_text(text, cap_bytes)


__all__ = [
    "EVIDENCE_CAP_BYTES",
    "REDACTED",
    "EnvSecretProvider",
    "SecretProvider",
    "StaticSecretProvider",
    "cap_text",
    "env_var_name",
    "evidence_excerpt",
    "redact",
]
