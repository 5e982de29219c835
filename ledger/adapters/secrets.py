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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ledger.domain.facts import WireProtocol
from ledger.errors import InvalidArgument
from ledger.redaction import REDACTED as REDACTED
from ledger.redaction import redact as _redact
from ledger.redaction import register_secret

if TYPE_CHECKING:
    from ledger.domain.values import Route

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
    WireProtocol.OPENAI_RESPONSES: ("OPENAI_API_KEY",),
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


@dataclass(frozen=True)
class KeyProblem:
    """Why the key of one route (or of one of its credential profiles) cannot be used.

    Attributes:
        route: The route's id.
        profile: The credential profile whose secret is missing (``None``: the route's own
            ``api_key_env``).
        variables: The environment variables that would hold the key, in the order they are
            read (empty when the secret provider is not the environment).
        message: What is wrong and the fix, as a ``cannot_build`` observation says it.
    """

    route: str
    profile: str | None
    variables: tuple[str, ...]
    message: str


def _header_problem(secret: str, whose: str) -> str | None:
    if secret != secret.strip() or not all(0x20 <= ord(c) <= 0x7E for c in secret):
        return (f"the secret for {whose} cannot go in an HTTP header (it has surrounding "
                "whitespace, control or non-ASCII characters); store the key exactly as the "
                "provider issued it")
    return None


def lookup_key(route: Route, profile_id: str | None, secrets: SecretProvider
               ) -> tuple[str | None, KeyProblem | None]:
    """The key a request on ``route`` with ``profile_id`` is sent with, or why there is none.

    The one resolution the adapters send with and a Run session checks on entering: a profile's
    secret comes from ``secrets``; a route without a profile reads its ``api_key_env`` from the
    environment; a route with neither is keyless (``(None, None)``: no credential header, a
    local server). A secret found is registered with :mod:`ledger.redaction` before anything
    else happens to it, and never appears in a :class:`KeyProblem`.

    Returns:
        ``(secret, None)``, or ``(None, problem)``.
    """
    if profile_id is None and route.api_key_env:
        var = route.api_key_env
        secret = os.environ.get(var)
        if not secret:
            return None, KeyProblem(route.id, None, (var,), (
                f"no API key for route {route.id!r}: the environment variable {var} is not "
                "set; set it, or change Route.api_key_env"))
        register_secret(secret)
        bad = _header_problem(secret, f"route {route.id!r} ({var})")
        return (secret, None) if bad is None else (None, KeyProblem(route.id, None, (var,), bad))
    if profile_id is None:
        return None, None
    names = (tuple(secrets.candidates(profile_id, protocol=route.protocol))
             if isinstance(secrets, EnvSecretProvider) else ())
    try:
        secret = secrets.get(profile_id, protocol=route.protocol)
    except Exception as exc:  # a vault that is down is a route we cannot use right now
        return None, KeyProblem(route.id, profile_id, names, (
            f"the secret provider {type(secrets).__name__} failed for credential profile "
            f"{profile_id!r} ({type(exc).__name__}: {exc}); fix the provider or the profile"))
    if not secret:
        fix = ("set " + " or ".join(names) if names
               else f"add it to the {type(secrets).__name__}")
        return None, KeyProblem(route.id, profile_id, names,
                                f"no secret for credential profile {profile_id!r}; {fix}")
    register_secret(secret)
    bad = _header_problem(secret, f"credential profile {profile_id!r}")
    return (secret, None) if bad is None else (None, KeyProblem(route.id, profile_id, names,
                                                                bad))


def missing_keys(plan: Sequence[Route], secrets: SecretProvider | None, *,
                 keyless_ok: Iterable[str] = ()) -> list[KeyProblem]:
    """Every key of ``plan`` that cannot be resolved now, in plan order.

    A route's key sources are its credential profiles (each one, resolved through
    ``secrets``), else its ``api_key_env``; a route with neither needs no key. With
    ``secrets=None`` the profiles are not looked at (their secret provider is the sender's,
    unknown here): only the variables the routes name themselves are. A route id or a profile
    id in ``keyless_ok`` is allowed to lack its key.
    """
    allowed = set(keyless_ok)
    out: list[KeyProblem] = []
    for route in plan:
        if route.id in allowed:
            continue
        if route.profiles:
            if secrets is None:
                continue
            for p in route.profiles:
                if p.id not in allowed:
                    _secret, problem = lookup_key(route, p.id, secrets)
                    if problem is not None:
                        out.append(problem)
        elif route.api_key_env:
            _secret, problem = lookup_key(route, None, EnvSecretProvider())
            if problem is not None:
                out.append(problem)
    return out


def check_keys(plan: Sequence[Route], secrets: SecretProvider | None, *,
               keyless_ok: Iterable[str] = ()) -> None:
    """Raise :class:`~ledger.errors.InvalidArgument` naming every key of ``plan`` that is missing.

    See :func:`missing_keys`. The error names each route and the variable (or the profile and
    its secret provider), and the two fixes: provide the key, or allow the route to lack it
    with ``keyless_ok``.
    """
    problems = missing_keys(plan, secrets, keyless_ok=keyless_ok)
    if not problems:
        return
    index = {r.id: i for i, r in enumerate(plan)}
    routes = list(dict.fromkeys(p.route for p in problems))
    errors = []
    lines = []
    for p in problems:
        i = index[p.route]
        if p.profile is None:
            path = f"plan[{i}].api_key_env"
            fix = f"export {p.variables[0]}=<the key>"
        else:
            j = next(k for k, prof in enumerate(plan[i].profiles) if prof.id == p.profile)
            path = f"plan[{i}].profiles[{j}]"
            fix = ("export " + " or ".join(p.variables) if p.variables
                   else f"give the secret provider a key for {p.profile!r}")
        errors.append((path, p.message, f"{fix}, or pass keyless_ok={{{p.route!r}}}"))
        lines.append(p.message)
    shown = "{" + ", ".join(repr(r) for r in routes) + "}"
    head = (f"route {routes[0]!r} has no usable key" if len(routes) == 1
            else f"routes {', '.join(repr(r) for r in routes)} have no usable key")
    raise InvalidArgument(
        f"{head} (checked as the Run starts; nothing was recorded): " + "; ".join(lines)
        + f". Either provide the key before the Run starts, or pass keyless_ok={shown} if "
        "the route may lack it (a turn then skips it as unusable and sends nothing on it)",
        field=errors[0][0], errors=errors, routes=routes,
        variables=sorted({v for p in problems for v in p.variables}))


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
    ``error.details``: Anthropic's ``error_code``, Gemini's ``RetryInfo`` and ``ErrorInfo``)
    survive the cap; anything else is cut at the cap.
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
    "KeyProblem",
    "SecretProvider",
    "StaticSecretProvider",
    "cap_text",
    "check_keys",
    "env_var_name",
    "evidence_excerpt",
    "lookup_key",
    "missing_keys",
    "redact",
]
