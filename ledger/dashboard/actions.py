"""Operator actions on the dashboard: deliberate, and only where the operator turned them on.

The dashboard is read-only unless it is started with actions enabled *and* a token
(``failover-ledger dashboard --allow-actions`` with ``--token-file`` or
``$LEDGER_DASHBOARD_TOKEN``; ``create_app(actions=True, token=...)``). Without that no route
here exists: a POST to one of them answers 404 (to a page, 405). With it, three POST routes,
each a form (an HTML answer) and a JSON twin under ``/api``:

- ``/actions/clear-cooldown`` (``key``, ``group``): :meth:`ledger.Ledger.clear_cooldown`;
- ``/actions/runs/{id}/close`` (``status``): :meth:`ledger.Ledger.close_run`;
- ``/actions/attempts/{id}/settle`` (``outcome``, ``prompt_tokens``, ``completion_tokens``,
  ``cost``): :meth:`ledger.Ledger.settle_unknown`;

each with ``by`` (who) and ``reason`` (why), both required and recorded in the action's event.
``{id}`` is the id percent-encoded (:mod:`ledger.dashboard.links`); in JSON, text fields must be
strings (a list is not recorded as its repr), counts integers, ``cost`` a string or a number.
The token travels in the ``X-Ledger-Token`` header (or ``Authorization: Bearer``) or in the
form's ``token`` field, never in a cookie, so a page of another site cannot act on an
operator's behalf: it cannot read the token, and a request from another origin (its
``Origin`` or ``Sec-Fetch-Site`` says so) is refused before the token is even looked at. An
``Origin`` and the request's scheme and ``Host`` are compared with the scheme's default port
implied (``https://name`` is ``name:443``); behind a TLS proxy the scheme is what the proxy's
``X-Forwarded-Proto`` says, from a proxy the server trusts (``--forwarded-allow-ips``). A
missing or wrong token is 403 and nothing is recorded. What the headers refuse (another
origin, a wrong token in a header) is refused before the body is read; the body is read up
to 64 KiB only (413 for a larger ``Content-Length`` at once, or as soon as a body without
one passes it), and JSON the parser cannot read, however deep, is 400. Bad input is the
ledger's typed error: 400 (``InvalidArgument``), 404 (``NotFound``), 409 (``InvalidState``,
``LeaseHeld``: a Run or key not in a state that allows it), each recording nothing. A
dashboard whose role may not write (a reader's role: ``DatabaseReadOnly``) answers 403, its
message naming the fix; 503 is left to a database that is away or busy (retry later), and any
other error of the ledger (a set-up error: a schema older or newer than the code) is 500.
"""

from __future__ import annotations

import hmac
import html
import json
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qsl

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ledger.api.facade import Ledger
from ledger.dashboard.links import run_href, segment
from ledger.domain.timefmt import iso, relative
from ledger.errors import (
    Conflict,
    DatabaseReadOnly,
    DatabaseUnavailable,
    InvalidArgument,
    LeaseHeld,
    LedgerError,
    NotFound,
)
from ledger.ops.audit import Audit, HealthReport, OperatorAction, RunTimeline

#: The request header that carries the token (``Authorization: Bearer`` is read as well).
TOKEN_HEADER = "X-Ledger-Token"
#: The shortest token accepted: a guessable token would make the write routes an open door.
MIN_TOKEN_LENGTH = 16
_MAX_BODY = 64 * 1024
_ENDED = ("succeeded", "failed", "stopped", "cancelled")


def check_token(token: Any) -> str:
    """A usable action token: printable ASCII, no spaces, at least :data:`MIN_TOKEN_LENGTH`
    long.

    ASCII because a header carries it: a request's header value is read as Latin-1, so a token
    of other characters would match in the form's field and never in ``X-Ledger-Token`` or
    ``Authorization``.
    """
    if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH or not token.isprintable() \
            or not token.isascii() or any(c.isspace() for c in token) or len(token) > 1024:
        raise InvalidArgument(
            f"the dashboard's action token must be {MIN_TOKEN_LENGTH} to 1024 printable ASCII "
            "characters without spaces; make one with `python -c \"import secrets; "
            "print(secrets.token_urlsafe(32))\"`", field="token")
    return token


def _e(v: Any) -> str:
    if v is None:
        return '<span class="muted">-</span>'
    return html.escape(str(v))


def _attr(v: str) -> str:
    return html.escape(v, quote=True)


# -- reading a request ---------------------------------------------------------------------


class _Refused(Exception):
    """A request refused before it reached the ledger (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_of(scheme: str, netloc: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) with the scheme's default port written out: ``https://name`` and
    a Host of ``name:443`` are one origin (a proxy may send either). None when malformed."""
    scheme = scheme.lower()
    if netloc.startswith("["):
        host, sep, rest = netloc[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
        host = f"[{host}]"
    else:
        host, _, port_text = netloc.partition(":")
    if port_text and not port_text.isdigit():
        return None
    port = int(port_text) if port_text else _DEFAULT_PORTS.get(scheme)
    return scheme, host.rstrip(".").lower(), port


def _same_origin(request: Request) -> None:
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise _Refused(403, "a request from another site may not act; use the dashboard's own "
                       "page (nothing was changed)")
    origin = request.headers.get("origin")
    if origin is None:
        return
    scheme, sep, netloc = origin.partition("://")
    mine = _origin_of(request.url.scheme, request.url.netloc)
    if not sep or "/" in netloc or _origin_of(scheme, netloc) != mine or mine is None:
        raise _Refused(403, f"a request from origin {origin[:200]!r} may not act; use the "
                       "dashboard's own page (nothing was changed); behind a TLS proxy, the "
                       "proxy must send X-Forwarded-Proto and the dashboard trust it "
                       "(--forwarded-allow-ips)")


def _header_token(request: Request) -> str | None:
    given = request.headers.get(TOKEN_HEADER.lower())
    auth = request.headers.get("authorization", "")
    if given is None and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given


async def _body(request: Request) -> bytes:
    """The body, at most :data:`_MAX_BODY` bytes read: a larger one is refused as soon as it
    is known to be larger (its Content-Length, else the running total), so a large upload
    never sits in memory whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > _MAX_BODY:
        raise _Refused(413, "the request body is too large (nothing was changed)")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > _MAX_BODY:
            raise _Refused(413, "the request body is too large (nothing was changed)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _fields(request: Request) -> dict[str, Any]:
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind not in ("application/json", "application/x-www-form-urlencoded", ""):
        raise _Refused(415, "send the fields as a form (application/x-www-form-urlencoded) or "
                       "as JSON (nothing was changed)")
    body = await _body(request)
    if kind == "application/json":
        try:
            # Numbers with a fraction as Decimal: a cost is money, exact as it was written.
            doc = json.loads(body or b"{}", parse_float=Decimal)
        except (ValueError, RecursionError):
            # RecursionError: nesting deeper than the parser's stack, in a body under the limit.
            raise _Refused(400, "the body is not JSON (nothing was changed)") from None
        if not isinstance(doc, dict):
            raise _Refused(400, "the JSON body must be an object of fields (nothing was "
                           "changed)")
        return doc
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True,
                              strict_parsing=False))
    except UnicodeDecodeError:
        raise _Refused(400, "the form is not UTF-8 (nothing was changed)") from None


def _authorized(given: str | None, token: str) -> None:
    if not given or not hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                            token.encode("utf-8")):
        raise _Refused(403, "the action token is missing or wrong (nothing was changed)")


def _form_token(fields: Mapping[str, Any]) -> str | None:
    value = fields.get("token")
    return value if isinstance(value, str) else None


def _kind(v: Any) -> str:
    """What a JSON value is, in JSON's words (for a message about a field of the wrong type)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float | Decimal):
        return "a number"
    if isinstance(v, list):
        return "an array"
    return "an object" if isinstance(v, dict) else type(v).__name__


def _text(fields: Mapping[str, Any], name: str) -> str | None:
    """A text field, None when absent or blank. Anything but a string is refused: its repr
    recorded as who acted or why would be a record nobody wrote."""
    v = fields.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise InvalidArgument(f"{name} must be text (a JSON string), not {_kind(v)}",
                              field=name)
    return v if v.strip() else None


def _who(fields: Mapping[str, Any]) -> str:
    who = _text(fields, "by")
    if who is None:
        raise InvalidArgument("by is empty; say who acts (your name or team), it is kept with "
                              "the action", field="by")
    return who


def _why(fields: Mapping[str, Any]) -> str:
    # Checked here, not left to the action: settling calls it "note", the form "reason".
    why = _text(fields, "reason")
    if why is None:
        raise InvalidArgument("reason is missing or empty; say why (it is kept with the action "
                              "for the audit)", field="reason")
    return why


def _count(fields: Mapping[str, Any], name: str) -> int | None:
    v = fields.get(name)
    if v is None or v == "":
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if not isinstance(v, str | Decimal):
        raise InvalidArgument(f"{name} must be a whole number of tokens (a JSON integer or its "
                              f"digits as text), not {_kind(v)}", field=name)
    try:
        return int(v.strip()) if isinstance(v, str) else int(str(v))
    except ValueError:
        raise InvalidArgument(f"{name} {str(v)[:40]!r} is not a whole number of tokens; pass "
                              "e.g. 812", field=name) from None


def _amount(fields: Mapping[str, Any], name: str) -> str | None:
    """Money as text: a string, or a JSON number read exactly (the body's floats are parsed as
    :class:`~decimal.Decimal`, so 0.1 is 0.1)."""
    v = fields.get(name)
    if isinstance(v, int | Decimal) and not isinstance(v, bool):
        return str(v)
    if v is not None and not isinstance(v, str):
        raise InvalidArgument(f"{name} must be an amount, e.g. \"0.0123\" (a JSON string or "
                              f"number), not {_kind(v)}", field=name)
    return _text(fields, name)


_YES = ("1", "true", "on", "yes")
_NO = ("", "0", "false", "off", "no")


def _flag(fields: Mapping[str, Any], name: str) -> bool:
    v = fields.get(name)
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _YES + _NO:
        return v.strip().lower() in _YES
    # Anything else read as "no" would clear the key of the same name instead of the group.
    raise InvalidArgument(f"{name} must be true or false (or 1, 0), not {_kind(v)} "
                          f"{str(v)[:40]!r}", field=name)


# -- the actions --------------------------------------------------------------------------


def _clear(led: Ledger, fields: Mapping[str, Any], _path: Mapping[str, str]
           ) -> tuple[dict[str, Any], str, str]:
    key = fields.get("key")
    group = _flag(fields, "group")
    ev = led.clear_cooldown(key, reason=_why(fields), by=_who(fields), group=group)  # type: ignore[arg-type]
    d = ev.data
    return ({"event_id": ev.event_id, "kind": ev.kind, "data": d},
            f"cleared {d.get('kind')} {d.get('key')} by {d.get('by')}: {d.get('reason')}", "/")


def _close(led: Ledger, fields: Mapping[str, Any], path: Mapping[str, str]
           ) -> tuple[dict[str, Any], str, str]:
    run_id = path["run_id"]
    before = led.get_run(run_id)
    rec = led.close_run(run_id, status=fields.get("status"),  # type: ignore[arg-type]
                        reason=_why(fields), by=_who(fields))
    # A close always moves the fence on; a Run its block ended keeps its status.
    changed = before.fence != rec.fence
    text = (f"closed run {rec.run_id}: {before.status.value} -> {rec.status.value}"
            if changed else f"run {rec.run_id} was already closed {rec.status.value}; "
            "nothing changed")
    return ({"run_id": rec.run_id, "status": rec.status.value,
             "previous_status": before.status.value, "changed": changed}, text,
            run_href(rec.run_id))


def _settle(led: Ledger, fields: Mapping[str, Any], path: Mapping[str, str]
            ) -> tuple[dict[str, Any], str, str]:
    attempt_id = path["attempt_id"]
    att = led.settle_unknown(
        attempt_id, outcome=fields.get("outcome"),  # type: ignore[arg-type]
        prompt_tokens=_count(fields, "prompt_tokens"),
        completion_tokens=_count(fields, "completion_tokens"),
        cost=_amount(fields, "cost"), note=_why(fields), by=_who(fields))
    debit = led.debit(att.debit_id)
    return ({"attempt_id": att.attempt_id, "run_id": att.run_id, "state": att.state.value,
             "debit_state": debit.state.value, "posted": str(debit.posted),
             "reserved": str(debit.reserved)},
            f"attempt {att.attempt_id} of run {att.run_id}: unknown -> {att.state.value}; "
            f"debit {debit.state.value}, posted {debit.posted} of the hold {debit.reserved}",
            run_href(att.run_id))


_Action = Callable[[Ledger, Mapping[str, Any], Mapping[str, str]],
                   tuple[dict[str, Any], str, str]]


def action_routes(audit: Callable[[], Audit], token: str,
                  page: Callable[[str, str, int], HTMLResponse]) -> list[Route]:
    """The write routes, for a dashboard started with actions and ``token``.

    ``audit`` gives the app's audit (its ``ledger`` writes); ``page`` renders an HTML page.
    """
    token = check_token(token)

    def endpoint(action: _Action, as_json: bool) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            try:
                # Everything the headers can refuse is refused before the body is read: a
                # request that may not act never costs the body's bytes.
                _same_origin(request)
                given = _header_token(request)
                if given is not None:
                    _authorized(given, token)
                fields = await _fields(request)
                if given is None:
                    _authorized(_form_token(fields), token)
                led = audit().ledger
                doc, text, back = await run_in_threadpool(
                    action, led, fields, dict(request.path_params))
            except _Refused as e:
                return _answer(as_json, e.status, e.message, None, page)
            except InvalidArgument as e:
                return _answer(as_json, 400, str(e), None, page, field=e.field)
            except NotFound as e:
                return _answer(as_json, 404, str(e), None, page)
            except (Conflict, LeaseHeld) as e:
                return _answer(as_json, 409, str(e), None, page)
            except DatabaseReadOnly as e:
                # The dashboard's role may not write: not a state a retry waits out (503).
                return _answer(as_json, 403, f"{e} (the dashboard's role may not record "
                               "actions: start it with the URL of the role that writes the "
                               "ledger, or without --allow-actions)", None, page)
            except DatabaseUnavailable as e:
                return _answer(as_json, 503, str(e), None, page)
            except LedgerError as e:
                # A set-up error (a schema too old or too new, tables gone) or a defect: a
                # retry will not help, as a 503 would have told the client.
                return _answer(as_json, 500, str(e), None, page)
            if as_json:
                return JSONResponse({"ok": True, "message": text, **doc})
            return _answer(False, 200, text, back, page)
        return handle

    routes = []
    for path, action in (("/clear-cooldown", _clear),
                         ("/runs/{run_id:path}/close", _close),
                         ("/attempts/{attempt_id:path}/settle", _settle)):
        routes.append(Route("/actions" + path, endpoint(action, False), methods=["POST"]))
        routes.append(Route("/api/actions" + path, endpoint(action, True), methods=["POST"]))
    return routes


def _answer(as_json: bool, status: int, message: str, back: str | None,
            page: Callable[[str, str, int], HTMLResponse], field: str | None = None) -> Response:
    if as_json:
        doc: dict[str, Any] = {"ok": status == 200, "error": message}
        if field is not None:
            doc["field"] = field
        return JSONResponse(doc, status_code=status)
    title = "done" if status == 200 else "refused"
    link = back or "/"
    body = (f'<section id="action-result"><h2>{title}</h2>'
            f'<p class="{"succeeded" if status == 200 else "failed"}">{_e(message)}</p>'
            f'<p><a href="{_attr(link)}">back</a></p></section>')
    resp = page(title, body, 0)
    resp.status_code = status
    return resp


# -- forms and the record of actions ---------------------------------------------------------


def _who_why_token(example: str) -> str:
    return ('<label>by <input name="by" required size="14" placeholder="your name"></label> '
            '<label>why <input name="reason" required size="36" '
            f'placeholder="{_attr(example)}"></label> '
            '<label>token <input name="token" type="password" required size="14" '
            'autocomplete="off"></label> ')


def clear_forms_html(rep: HealthReport) -> str:
    """Forms to clear what cools now: keys cooling, disabled or counting failures; groups
    not open (only on a dashboard started with actions)."""
    keys = [k for k in rep.routes + rep.profiles
            if k.status != "ok" or k.error_count or k.recent_failures]
    groups = [g for g in rep.groups if g.mode != "open"]
    out = ['<section id="clear-cooldown"><h2>Clear a cooldown '
           '<span class="muted">(recorded with who and why)</span></h2>']
    if not keys and not groups:
        out.append('<p class="muted" id="clear-nothing">nothing is cooling, disabled or '
                   "counting failures</p>")
    if keys:
        opts = "".join(f'<option value="{_attr(k.key)}">{_e(k.key)} ({_e(k.kind)}, '
                       f"{_e(k.status)})</option>" for k in keys)
        out.append('<form id="clear-key-form" method="post" action="/actions/clear-cooldown">'
                   f'<label>key <select name="key">{opts}</select></label> '
                   + _who_why_token("e.g. provider confirmed the incident is over")
                   + "<button>clear</button></form>")
    if groups:
        opts = "".join(f'<option value="{_attr(g.group)}">{_e(g.group)} ({_e(g.mode)})'
                       "</option>" for g in groups)
        out.append('<form id="clear-group-form" method="post" action="/actions/clear-cooldown">'
                   '<input type="hidden" name="group" value="1">'
                   f'<label>group <select name="key">{opts}</select></label> '
                   + _who_why_token("e.g. the provider raised our quota")
                   + "<button>open</button></form>")
    out.append("</section>")
    return "".join(out)


def run_actions_html(tl: RunTimeline, now: float, *, forms: bool) -> str:
    """The Run's closes (who, why), and with ``forms`` (a dashboard started with actions)
    forms to close it while it is not closed and to settle each unknown Attempt with
    evidence. (Settles with evidence show as ``late_receipt`` events on their Attempt.)"""
    out = []
    for e in tl.run_events:
        if e.kind == "close":
            d = e.data
            out.append(f'<p class="closed">closed <span title="{_attr(iso(e.created_at))}">'
                       f"{_e(relative(e.created_at, now))}</span> by "
                       f"<b>{_e(d.get('by') or d.get('executor'))}</b>: {_e(d.get('reason'))} "
                       f"({_e(d.get('previous_status'))} &rarr; {_e(d.get('status'))})</p>")
    rid = tl.run.run_id
    closed = any(e.kind == "close" for e in tl.run_events)
    if forms and not closed:
        # A Run its block ended is not closed yet (the same id continues it); it is closed
        # with the status it ended with.
        ended = tl.run.status in _ENDED
        opts = "".join(f'<option value="{s}">{s}</option>' for s in
                       ((tl.run.status,) if ended else
                        ("failed", "cancelled", "stopped", "succeeded")))
        out.append('<form id="close-form" method="post" '
                   f'action="/actions/runs/{_attr(segment(rid))}/close">'
                   f'<b>Close this run</b> (nobody will resume it) <label>as <select '
                   f'name="status">{opts}</select></label> '
                   + _who_why_token("e.g. host crashed; the user retried as task-8")
                   + "<button>close</button></form>")
    for a in tl.attempts:
        if not forms or a.state != "unknown":
            continue
        out.append(
            f'<form class="settle-form" method="post" '
            f'action="/actions/attempts/{_attr(segment(a.attempt_id))}/settle">'
            f"<b>Settle #{a.seq}</b> <code>{_e(a.attempt_id)}</code> with evidence: "
            '<label>outcome <select name="outcome"><option>succeeded</option><option>failed'
            "</option><option>not_sent</option></select></label> "
            '<label>prompt tokens <input name="prompt_tokens" size="6" inputmode="numeric">'
            '</label> <label>completion tokens <input name="completion_tokens" size="6" '
            'inputmode="numeric"></label> <label>cost <input name="cost" size="8"></label> '
            + _who_why_token("e.g. provider console, request 7a1")
            + "<button>settle</button></form>")
    if not out:
        return ""
    return ('<section id="run-actions"><h2>Operator actions '
            '<span class="muted">(recorded with who and why)</span></h2>'
            + "".join(f if f.startswith("<p") else f"<div>{f}</div>" for f in out)
            + "</section>")


def _target(a: OperatorAction) -> str:
    d = a.data
    if a.kind == "clear_cooldown":
        return f"{_e(d.get('kind'))} <b>{_e(a.key)}</b>"
    if a.kind == "close":
        run = a.run_id or ""
        return (f'run <a href="{_attr(run_href(run))}">{_e(run)}</a> '
                f"{_e(d.get('previous_status'))} &rarr; {_e(d.get('status'))}")
    if a.kind == "retention":
        rows = d.get("rows") or {}
        return (f"history before {_e(iso(d.get('cutoff')))}: {_e(rows.get('attempts', 0))} "
                f"attempt(s), {_e(rows.get('events', 0))} event(s) dropped")
    run = a.run_id or ""
    return (f'attempt <code>{_e(a.attempt_id)}</code> of <a href="{_attr(run_href(run))}">'
            f"{_e(run)}</a> {_e(d.get('previous_state'))} &rarr; {_e(d.get('outcome'))}")


def actions_html(items: list[OperatorAction], now: float, *, title: str = "Operator actions",
                 table_id: str = "actions-table") -> str:
    """What operators did, newest first: when, what, on what, who and why."""
    if not items:
        return (f'<section id="{table_id}-section"><h2>{_e(title)}</h2><p class="muted" '
                f'id="{table_id}-empty">no operator actions recorded</p></section>')
    rows = "".join(
        f'<tr><td class="nowrap"><span title="{_attr(iso(a.at))}">{_e(relative(a.at, now))}'
        f"</span></td><td>{_e(a.kind)}</td><td>{_target(a)}</td><td>{_e(a.by)}</td>"
        f"<td>{_e(a.reason)}</td></tr>" for a in items)
    return (f'<section id="{table_id}-section"><h2>{_e(title)}</h2><div class="scroll">'
            f'<table id="{table_id}"><thead><tr><th>when</th><th>action</th><th>on</th>'
            f"<th>by</th><th>why</th></tr></thead><tbody>{rows}</tbody></table></div>"
            "</section>")


__all__ = ["MIN_TOKEN_LENGTH", "TOKEN_HEADER", "action_routes", "actions_html",
           "check_token", "clear_forms_html", "run_actions_html"]
