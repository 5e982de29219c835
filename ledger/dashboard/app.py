"""The dashboard's Starlette app: HTML pages, JSON endpoints and Prometheus metrics over the
audit API.

Pages: ``/`` (what is cooling now at a glance; attempts, per-route success rate and latency over
the window as charts; route, profile and group health; latency percentiles per route and group;
costs by tenant, route and day; recent failovers and runs; spend against budgets by tenant;
recent operator actions), ``/latency`` (p50/p95/p99 of latency, time to first token and first
byte, filtered by route, group, category, tenant and outcome), ``/runs/{id}`` (a run's attempt
timeline, with each attempt's times and tokens, why it stopped, who closed it), ``/budgets``
(spend against budgets by tenant or label, :mod:`ledger.dashboard.spend`) and ``/replay`` (what
another policy would have done over the window: :mod:`ledger.dashboard.replay`, computed on
request, ``/api/replay`` its JSON). All but ``/replay`` refresh themselves
(``<meta http-equiv="refresh">``, no script) every ``refresh_s`` seconds, ``?refresh=N`` per
page, 0 to stop. JSON: ``/api/health``, ``/api/failovers``, ``/api/runs``, ``/api/runs/{id}``,
``/api/costs``, ``/api/costs/days``, ``/api/activity``, ``/api/routes``, ``/api/latency``,
``/api/budgets``, ``/api/actions``. ``/metrics``: Prometheus metrics
(:mod:`ledger.dashboard.metrics`). Started with actions and a token, it also serves the
operator's actions as POST routes (:mod:`ledger.dashboard.actions`); otherwise nothing it
serves writes.

Every endpoint is a plain function: Starlette runs it in its thread pool, so the blocking
database reads never stall the event loop. Every value printed into HTML is escaped, and times
are ISO-8601 UTC or relative ("in 4 m", "12 s ago").
"""

from __future__ import annotations

import contextlib
import errno
import html
import ipaddress
import logging
import math
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.clock import Clock
from ledger.dashboard.actions import (
    action_routes,
    actions_html,
    check_token,
    clear_forms_html,
    run_actions_html,
)
from ledger.dashboard.charts import (
    axis_number,
    chart_svg,
    chart_window,
    cost_days_svg,
    latency_top,
    sparkline_svg,
)
from ledger.dashboard.links import run_href
from ledger.dashboard.metrics import encode
from ledger.dashboard.replay import replay_form, replay_html
from ledger.dashboard.spend import spend_section
from ledger.domain.timefmt import data_text, iso, relative
from ledger.errors import (
    DatabaseReadOnly,
    DatabaseUnavailable,
    InvalidArgument,
    LedgerError,
    NotFound,
)
from ledger.ops.audit import (
    ACTION_KINDS,
    Audit,
    HealthReport,
    LatencyReport,
    LatencyStats,
    MetricsSnapshot,
    Percentiles,
    RouteSeries,
    RunSummary,
    RunTimeline,
    TimelineEntry,
    Totals,
    to_jsonable,
)
from ledger.policy import PRESETS

log = logging.getLogger(__name__)

DAY = 86400.0
#: The longest ``?hours=`` window: 366 days.
MAX_HOURS = 366 * 24.0
#: The names a dashboard always answers to: loopback's (``allowed_hosts`` adds others).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_REFRESH_S = 30
#: The proxies whose X-Forwarded-Proto is trusted unless ``forwarded_allow_ips`` says others.
TRUSTED_PROXIES = ("127.0.0.1", "::1")
#: The slowest auto-refresh a page takes (``?refresh=``, ``refresh_s``): a day.
MAX_REFRESH_S = 86400
DEFAULT_METRICS_TTL_S = 10.0

_PAGE = frozenset({"limit", "cursor"})
_WINDOW = frozenset({"since", "until"})
#: The query parameters each JSON route takes; any other is refused (400, naming it).
API_PARAMETERS: dict[str, frozenset[str]] = {
    "/api/latency": _WINDOW | {"hours", "route", "group", "category", "tenant", "state"},
    "/api/health": frozenset(),
    "/api/runs": _WINDOW | _PAGE | {"status", "tenant"},
    "/api/runs/{run_id:path}": frozenset(),
    "/api/failovers": _WINDOW | _PAGE,
    "/api/costs": _WINDOW | _PAGE | {"by", "label"},
    "/api/costs/days": frozenset({"days"}),
    "/api/activity": _WINDOW | {"buckets"},
    "/api/routes": _WINDOW | {"buckets", "routes"},
    "/api/budgets": _WINDOW | _PAGE | {"by", "label", "every"},
    "/api/actions": _WINDOW | _PAGE | {"kind"},
    "/api/replay": _WINDOW | {"policy", "hours", "tenant", "run"},
}
# No network at all: nothing but inline styles and same-origin links and forms.
_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;
background:#f5f6f8}
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:24px;align-items:center}
header a{color:#fff;text-decoration:none;font-weight:600}
header form{margin-left:auto}
main{padding:16px 20px;max-width:1400px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:12px 16px;
margin-bottom:16px;min-width:0}
h1{font-size:18px;margin:0}h2{font-size:15px;margin:0 0 8px}h3{font-size:13px;margin:10px 0 4px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceff3;vertical-align:top}
th{background:#f0f2f5;font-weight:600;white-space:nowrap}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.nowrap{white-space:nowrap}
td.id{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;
white-space:nowrap}
.scroll{overflow-x:auto}
svg.spark{display:block}
.ok{color:#17803d;font-weight:600}.cooling,.cooldown{color:#b26a00;font-weight:600}
.disabled,.unavailable,.failed,.unknown,.stopped{color:#c0262d;font-weight:600}
.succeeded{color:#17803d}.dispatching,.running{color:#2459c4}.muted{color:#6b7280}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:16px}
.tiles{display:grid;grid-template-columns:repeat(5,1fr);gap:12px;margin:0}
.tile small{font-size:13px;font-weight:400;color:#6b7280}
form.filters{display:flex;gap:10px;flex-wrap:wrap;align-items:end;margin:0 0 10px}
form.filters label{display:flex;flex-direction:column;font-size:12px;color:#6b7280}
.tile{border:1px solid #eceff3;border-radius:6px;padding:8px 12px}
.tile b{display:block;font-size:22px;font-variant-numeric:tabular-nums}
.glance{margin:8px 0 0;padding-left:18px}.glance li{margin:2px 0}
.legend{margin:4px 0 0;font-size:12px}.legend-item{margin-right:14px;white-space:nowrap}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
.stop{border-left:4px solid #c0262d;padding:6px 12px;margin:8px 0;background:#fdf3f3}
code{font-size:12px}
"""


def _e(v: Any) -> str:
    if v is None:
        return '<span class="muted">-</span>'
    return html.escape(str(v))


def _t(ts: float | None) -> str:
    """An instant, ISO-8601 UTC."""
    return _e(None) if ts is None else _e(iso(ts))


def _ago(ts: float | None, now: float) -> str:
    """A past instant as "12 s ago", the exact time on hover."""
    if ts is None:
        return _e(None)
    return f'<span title="{html.escape(iso(ts), quote=True)}">{_e(relative(ts, now))}</span>'


def _until(ts: float | None, now: float) -> str:
    if ts is None:
        return _e(None)
    if ts > now:
        return _e(relative(ts, now)) + f' <span class="muted">({_t(ts)})</span>'
    return _t(ts)


def _ahead(ts: float | None, now: float) -> str:
    """A time that holds only until it comes (a cooldown, a disable): ``-`` once passed."""
    return _e(None) if ts is None or ts <= now else _until(ts, now)


def _money(d: Decimal | None) -> str:
    return _e(None) if d is None else _e(f"{d:.6f}")


def _tag(cls: str) -> str:
    return f'<span class="{html.escape(cls)}">{html.escape(cls)}</span>'


def _link(run_id: str) -> str:
    return f'<a href="{html.escape(run_href(run_id), quote=True)}">{_e(run_id)}</a>'


def _document(title: str, body: str, refresh_s: int = 0, mode: str = "read-only"
              ) -> HTMLResponse:
    refresh = (f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s > 0
               else "")
    note = (f"auto-refresh every {int(refresh_s)} s" if refresh_s > 0 else "auto-refresh off")
    doc = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width, initial-scale=1">{refresh}'
           f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
           f'<header><h1><a href="/">failover-ledger</a></h1><span>provider health '
           f'(<span id="mode">{html.escape(mode)}</span>)</span><a href="/latency">latency</a>'
           f'<a href="/replay">replay</a><a href="/runs">runs</a>'
           f'<span class="muted" id="refresh-note">{note}</span>'
           f'<form action="/runs" method="get"><input name="id" placeholder="run id" size="32">'
           f' <button>show run</button></form></header><main>{body}</main></body></html>')
    return HTMLResponse(doc, headers={"Content-Security-Policy": _CSP,
                                      "Cache-Control": "no-store"})


def _table(headers: list[str], rows: list[list[str]], table_id: str, empty: str,
           classes: list[str] | None = None) -> str:
    """A table; ``classes`` gives each column's cell class (``num``, ``nowrap``, ``id``)."""
    if not rows:
        return f'<p class="muted" id="{table_id}-empty">{html.escape(empty)}</p>'
    cls = classes or [""] * len(headers)
    # A scrolling box, so a narrow window scrolls the table instead of crushing its columns.
    head = "".join(f'<th class="{c}">{html.escape(h)}</th>' if c == "num"
                   else f"<th>{html.escape(h)}</th>" for h, c in zip(headers, cls, strict=True))
    body = "".join("<tr>" + "".join(f'<td class="{c}">{v}</td>' if c else f"<td>{v}</td>"
                                    for v, c in zip(r, cls, strict=True)) + "</tr>"
                   for r in rows)
    return (f'<div class="scroll"><table id="{table_id}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def _glance_html(rep: HealthReport, attempts: int, bad: int, failovers: int, cost: Decimal,
                 held: Decimal, hours: float) -> str:
    """What an operator looks for first: what is cooling or held right now, and until when."""
    now = rep.now
    cooling = [k for k in rep.routes + rep.profiles if k.status != "ok"]
    floors = [g for g in rep.groups if g.mode != "open"]
    items = []
    for k in cooling:
        until = k.disabled_until if k.status == "disabled" else k.cooldown_until
        why = k.disabled_reason if k.status == "disabled" else None
        items.append(f"<li>{_tag(k.status)} {k.kind} <b>{_e(k.key)}</b> until "
                     f"{_until(until, now)}" + (f" ({_e(why)})" if why else "") + "</li>")
    for g in floors:
        items.append(f"<li>{_tag(g.mode)} group <b>{_e(g.group)}</b> waiting floor "
                     f"{_until(g.until, now) if g.until is not None else 'until released'}"
                     + (f" ({_e(g.reason)})" if g.reason else "") + "</li>")
    listing = (f'<ul class="glance" id="glance-list">{"".join(items)}</ul>' if items else
               '<p class="muted" id="glance-list">every route, profile and group is open</p>')
    rate = f"{100 * (attempts - bad) / attempts:.1f}%" if attempts else "-"
    # Each figure in its own tile, with its unit: runs, and money in the ledger's currency
    # unit (whatever the routes' prices are in).
    return (
        '<section id="glance"><h2>Now</h2><div class="tiles">'
        f'<div class="tile">cooling or disabled<b id="glance-cooling">{len(cooling)}</b></div>'
        f'<div class="tile">groups not open<b id="glance-groups">{len(floors)}</b></div>'
        f'<div class="tile">attempts, last {hours:g} h<b>{attempts}</b>'
        f'<span class="muted">{rate} without failure</span></div>'
        f'<div class="tile">runs failed over, last {hours:g} h<b><span id="glance-failovers">'
        f'{failovers}</span> <small>runs</small></b>'
        '<span class="muted">served elsewhere than selected</span></div>'
        f'<div class="tile">charged, last {hours:g} h<b><span id="glance-charged">'
        f'{_money(cost)}</span> <small>currency units</small></b>'
        f'<span class="muted">held <span id="glance-held">{_money(held)}</span></span></div>'
        f"</div>{listing}</section>")


def _health_html(rep: HealthReport) -> str:
    now = rep.now
    keys = [[_e(k.key), _e(k.kind), _e(k.provider), _tag(k.status),
             _ahead(k.cooldown_until, now),
             _ahead(k.disabled_until, now) + (f" ({_e(k.disabled_reason)})"
                                              if k.status == "disabled"
                                              and k.disabled_reason else ""),
             str(k.error_count), str(k.recent_failures), _ago(k.last_failure_at, now),
             _ago(k.last_probe_at, now), _ago(k.counted_at, now)]
            for k in rep.routes + rep.profiles]
    groups = [[_e(g.group), _tag(g.mode), _until(g.until, now) if g.mode != "open" else _e(None),
               _e(g.reason) if g.mode != "open" else _e(None), _e(g.in_flight), _e(g.limit),
               _e(g.waiting)]
              for g in rep.groups]
    return (
        '<section><h2>Routes and credential profiles</h2>'
        + _table(["key", "kind", "provider", "status", "cooldown until", "disabled until",
                  "errors", "recent failures", "last failure", "last probe", "counted since"],
                 keys, "health-table", "no health recorded yet",
                 ["id", "", "", "", "nowrap", "nowrap", "num", "num", "nowrap", "nowrap",
                  "nowrap"])
        + '</section><section><h2>Capacity groups</h2>'
        + _table(["group", "mode", "waiting floor", "reason", "in flight", "limit", "waiting"],
                 groups, "groups-table", "no capacity groups yet",
                 ["id", "", "nowrap", "", "num", "num", "num"])
        + "</section>")


def _secs(v: float | None) -> str:
    return _e(None) if v is None else _e(f"{v:.3f} s")


def _pcts(p: Percentiles | None) -> str:
    """``p50 / p95 / p99`` in seconds, with how many Attempts they are of on hover."""
    if p is None:
        return _e(None)
    return (f'<span title="{p.count} attempts">{p.p50:.3f} / {p.p95:.3f} / {p.p99:.3f}'
            "</span>")


def _span_text(seconds: float) -> str:
    """A bucket's width as the chart's caption says it: whole days in days, else minutes."""
    if seconds >= 86400 and not seconds % 86400:
        days = seconds / 86400
        return f"{days:g} day" + ("" if days == 1 else "s")
    return f"{seconds / 60:g} min"


def _charted(what: str, hours: float, since: float, until: float, now: float, n: int) -> str:
    """A chart's heading, saying its window as charted: "last N h" only when it is exactly
    the page's rolling window (the tiles' and the tables'); whole hours or days otherwise,
    from the first one's start, so the page never shows two different "last 24 h"."""
    if until == now:
        return f"{what}, last {hours:g} h"
    width = (until - since) / n
    unit, size = ("day", DAY) if width % DAY == 0 else ("hour", 3600.0)
    per = unit if width == size else f"{width / size:g} {unit}s"
    start = datetime.fromtimestamp(since, UTC)
    shown = f"{start:%Y-%m-%d}" if unit == "day" else f"{start:%Y-%m-%d %H:%M}"
    return f"{what} by {per}, from {shown} UTC to now (whole {unit}s)"


def _routes_html(series: list[RouteSeries], until: float, latency: LatencyReport | None,
                 heading: str) -> str:
    """Small multiples: per route, its success rate and latency over the window, side by side
    on shared axes (0-100 %, 0 to the busiest route's latency top) so rows compare; beside
    them the p50/p95/p99 latency of the route's answers over the whole window."""
    if not series:
        return (f'<section><h2>{_e(heading)}</h2><p class="muted" id="routes-table-empty">'
                "no attempts in this window</p></section>")
    top = latency_top(series)
    pcts = {x.key: x.succeeded_latency for x in latency.routes} if latency else {}
    rows = []
    for i, r in enumerate(series):
        ok = sum(p.succeeded for p in r.points)
        sent = sum(p.succeeded + p.failed + p.unknown for p in r.points)
        rows.append([
            _e(r.route), str(r.attempts), _e(f"{100 * ok / sent:.1f}%" if sent else None),
            sparkline_svg(r, metric="success_rate", top=1.0, css_id=f"success-{i}"),
            _pcts(pcts.get(r.route)),
            sparkline_svg(r, metric="latency_s", top=top, css_id=f"latency-{i}",
                          stroke="#e69f00"),
        ])
    # The window's end, not its last bucket's start.
    start = series[0].points[0].start
    return (f'<section id="routes-over-time"><h2>{_e(heading)} '
            f'<span class="muted" id="routes-window">({_t(start)} to {_t(until)}, '
            f"{len(series[0].points)} buckets; success = succeeded of sent; latency p50 / p95 "
            f"/ p99 of the succeeded, seconds; the chart their mean per bucket, axis "
            f"0-{axis_number(top)} s)</span></h2>"
            + _table(["route", "attempts", "success", "success rate over time",
                      "latency p50 / p95 / p99", "latency over time"], rows, "routes-table", "",
                     ["id", "num", "num", "", "num", ""])
            + "</section>")


def _latency_rows(stats: list[LatencyStats]) -> list[list[str]]:
    return [[_e(x.key), str(x.latency.count if x.latency else 0), _pcts(x.latency),
             str(x.first_token.count if x.first_token else 0), _pcts(x.first_token),
             _pcts(x.first_byte)] for x in stats]


def _latency_tables(rep: LatencyReport, ident: str) -> str:
    head = ["attempts", "latency p50 / p95 / p99", "streamed", "first token p50 / p95 / p99",
            "first byte p50 / p95 / p99"]
    cls = ["num", "num", "num", "num", "num"]
    # One above the other: side by side, ten columns each do not fit a laptop's width.
    return (
        "<h3>By route</h3>"
        + _table(["route", *head], _latency_rows(rep.routes), f"{ident}-routes-table",
                 "no attempt with a latency matches", ["id", *cls])
        + "<h3>By capacity group</h3>"
        + _table(["group", *head], _latency_rows(rep.groups), f"{ident}-groups-table",
                 "no attempt with a latency matches", ["id", *cls]))


def _latency_html(rep: LatencyReport | None, hours: float) -> str:
    if rep is None:
        return ""
    return (f'<section id="latency"><h2>Latency, last {hours:g} h <span class="muted">'
            "(seconds from an attempt's begin, by the ledger's clock: to its settle, to a "
            "stream's first token, to the response's first byte; every outcome; "
            '<a href="/latency">filter by route, group, category, tenant, outcome</a>)'
            "</span></h2>" + _latency_tables(rep, "latency") + "</section>")


def _runs_table(runs: list[RunSummary], now: float) -> str:
    rows = [[_link(r.run_id), _tag(r.status), _e(r.tenant), _e(r.selected_route),
             _e(r.current_route), f"{r.calls_used}", f"{r.retries_used}", _money(r.posted),
             _money(r.reserved) if r.reserved else _e(None),
             _ago(r.created_at, now) + f' <span class="muted">{_t(r.created_at)}</span>']
            for r in runs]
    return _table(["run", "status", "tenant", "selected", "served by (current)", "calls",
                   "retries", "posted", "held", "admitted"], rows, "runs-table", "no runs yet",
                  ["id", "", "", "id", "id", "num", "num", "num", "num", "nowrap"])


def _totals_rows(items: list[Totals]) -> list[list[str]]:
    return [[_e(t.key if t.key is not None else "(none)"), str(t.attempts), str(t.succeeded),
             str(t.failed), str(t.unknown), str(t.prompt_tokens + t.completion_tokens),
             _money(t.cost), _money(t.held)] for t in items]


_TOTALS_HEAD = ["attempts", "ok", "failed", "unknown", "tokens", "charged", "held"]
_TOTALS_CLS = ["num"] * 7


def _waits_html(tl: RunTimeline, now: float) -> str:
    if not tl.waits:
        return ""
    seqs = {a.attempt_id: a.seq for a in tl.attempts}
    rows = [[_e(f"{w.waited_s:.1f} s"), _e(w.text), _tag(w.outcome),
             _e(f"#{seqs[w.attempt_id]}" if w.attempt_id in seqs else None), _t(w.at)]
            for w in tl.waits]
    return ('<section id="waits"><h2>Waits</h2>'
            + _table(["waited", "for", "outcome", "attempt", "at"], rows, "waits-table",
                     "no waits", ["num", "", "", "num", "nowrap"]) + "</section>")


def _stops_html(tl: RunTimeline, now: float) -> str:
    if not tl.stops:
        return ""
    out = ['<section id="stops"><h2>Why the run stopped</h2>']
    for st in tl.stops:
        skipped = "".join(f"<li>skipped <b>{_e(s.route)}</b>: {_e(s.reason)}"
                          + (f' <span class="muted">({_e(s.detail)})</span>' if s.detail
                             else "") + "</li>" for s in st.skipped)
        errors = "".join(f"<li>error: {_e(err)}</li>" for err in st.errors)
        if st.candidates:
            # "route: failed: ..." / "route: skipped (reason): detail — fix: ..."
            skipped = "".join("<li><b>{}</b>: {}</li>".format(*map(_e, c.split(": ", 1)))
                              if ": " in c else f"<li>{_e(c)}</li>" for c in st.candidates)
            errors = ""
        out.append(f'<div class="stop"><b class="stop-reason">{_e(st.reason)}</b>'
                   + (f": {_e(st.detail)}" if st.detail else "")
                   + f' <span class="muted">{_ago(st.at, now)}</span>'
                   f"<ul>{skipped}{errors}</ul></div>")
    out.append("</section>")
    return "".join(out)


def _tokens(a: TimelineEntry) -> str:
    """Tokens in / out, with the parts reported as cached and reasoning under them."""
    if a.prompt_tokens is None and a.completion_tokens is None:
        return _e(None)
    text = (f"{a.prompt_tokens if a.prompt_tokens is not None else '-'} / "
            f"{a.completion_tokens if a.completion_tokens is not None else '-'}")
    parts = [f"{n} {what}" for n, what in ((a.cached_tokens, "cached"),
                                            (a.reasoning_tokens, "reasoning")) if n]
    return _e(text) + (f'<br><span class="muted">{_e(", ".join(parts))}</span>' if parts
                       else "")


def _timeline_html(tl: RunTimeline, now: float) -> str:
    r = tl.run
    rows = []
    for a in tl.attempts:
        why = _e(None)
        if a.selection is not None:
            why = _e(a.selection.reason or a.selection.decision)
            if a.selection.skipped:
                why += "<br><span class=\"muted\">skipped: " + ", ".join(
                    f"{_e(s.route)} ({_e(s.reason)})" for s in a.selection.skipped) + "</span>"
        fact = _e(None)
        if a.fact is not None:
            fact = _e(f"{a.fact.category.value} {a.fact.status or ''} phase={a.fact.phase.value}"
                      f" scope={a.fact.scope.value}")
        notes = "<br>".join(_e(f"{e.kind}: {data_text(e.data, now)}") for e in a.events)
        rows.append([str(a.seq), _e(a.kind), _e(a.route_id), _e(a.profile_id), _tag(a.state),
                     fact,
                     _e(a.debit_state) + " " + _money(a.posted if a.debit_state == "posted"
                                                      else a.reserved),
                     _money(a.cost), _secs(a.latency_s),
                     _secs(a.first_byte_s) + " / " + _secs(a.first_token_s), _tokens(a), why,
                     notes or _e(None), _t(a.created_at)])
    head = (f"<section><h2>Run <code>{_e(r.run_id)}</code></h2>"
            f'<p id="run-summary">status {_tag(r.status)} &middot; tenant {_e(r.tenant)} '
            f"&middot; selected <b>{_e(r.selected_route)}</b> &middot; served by "
            f'<b id="served-route">{_e(tl.served_route)}</b> &middot; failed over: '
            f"{'yes' if tl.failed_over else 'no'} &middot; charged "
            f'<span id="run-charged">{_money(tl.total_cost)}</span> &middot; held '
            f'<span id="run-held">{_money(tl.held)}</span> of '
            f"{_money(r.max_cost)} &middot; admitted {_t(r.created_at)} "
            f'({_e(relative(r.created_at, now))})'
            + (f" &middot; child of {_link(r.parent_run_id)}" if r.parent_run_id else "")
            + "</p>" + _budget_html(r) + _children_html(tl))
    return (head + _table(["#", "kind", "route", "profile", "outcome", "fact", "debit",
                           "reported cost", "latency", "first byte / token", "tokens in / out",
                           "why (selector)", "events", "at"], rows,
                          "timeline-table",
                          "no attempts yet",
                          ["num", "", "id", "id", "", "", "nowrap", "num", "num", "nowrap",
                           "nowrap", "", "", "nowrap"])
            + "</section>" + _waits_html(tl, now) + _stops_html(tl, now))


def _budget_html(r: Any) -> str:
    """A Run's budget per bound: admitted, used, held, carved for its Children, given back to
    its parent, and left (what it may still use)."""
    def row(name: str, budget: str, used: str, held: str, carved: str, back: str,
            left: str) -> list[str]:
        return [_e(name), budget, used, held, carved, back, f"<b>{left}</b>"]
    rows = [
        row("cost", _money(r.max_cost), _money(r.posted), _money(r.reserved), _money(r.carved),
            _money(r.returned), _money(r.cost_left)),
        row("calls", str(r.max_calls), str(r.calls_used), "-", str(r.carved_calls),
            str(r.returned_calls), str(r.calls_left)),
        row("retries", str(r.max_retries), str(r.retries_used), "-", str(r.carved_retries),
            str(r.returned_retries), str(r.retries_left)),
    ]
    if r.max_tokens is not None:
        rows.append(row("tokens", str(r.max_tokens), str(r.tokens_used), str(r.tokens_reserved),
                        str(r.carved_tokens), str(r.returned_tokens), str(r.tokens_left)))
    return _table(["budget", "admitted", "used / charged", "held", "carved for children",
                   "given back to parent", "left"], rows, "budget-table", "",
                  ["", "num", "num", "num", "num", "num", "num"])


def _children_html(tl: Any) -> str:
    """The Run's Child Runs: each one's carve, what it charged and holds, what it gave back."""
    if not tl.children:
        return ""
    rows = [[_link(c.run_id), _tag(c.status), _money(c.max_cost), _money(c.posted),
             _money(c.reserved), _money(c.returned),
             f"{c.calls_used} / {c.max_calls} (back {c.returned_calls})",
             f"{c.retries_used} / {c.max_retries} (back {c.returned_retries})"]
            for c in tl.children]
    return ("<h3>Children</h3>"
            + _table(["child", "status", "budget", "charged", "held", "gave back", "calls",
                      "retries"], rows, "children-table", "",
                     ["id", "", "num", "num", "num", "num", "nowrap", "nowrap"]))


def _host_name(header: str) -> str | None:
    """The name a Host header asks for, without its port, as :func:`_served_name` writes it;
    None when the header is malformed."""
    if header.startswith("["):
        name, sep, port = header[1:].partition("]")
        if not sep or (port and not port.startswith(":")):
            return None
        port = port[1:]
    else:
        name, _, port = header.partition(":")
    if port and not port.isdigit():
        return None
    return _served_name(name) if name else None


def _served_name(name: str) -> str:
    """A host name as the Host check compares it: lower case, an IP literal in its short form
    (``[0:0::1]`` is ``::1``)."""
    name = name.strip().strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name


class _ServedNamesOnly:
    """Refuses (400) a request whose Host header names another host than the dashboard is
    served as. A page of another site that points its own name at 127.0.0.1 (DNS rebinding)
    is same-origin to the browser, and could read every page and call every action; its
    requests still carry its own name in Host, which is how they are told apart."""

    def __init__(self, app: ASGIApp, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host", "")
            if _host_name(host) not in self.names:
                shown = ", ".join(sorted(self.names))
                await PlainTextResponse(
                    f"the Host header {host[:100]!r} is not a name this dashboard is served "
                    f"as ({shown}); open it by one of those, or start it with --allowed-host "
                    "NAME (create_app(allowed_hosts=...)) to answer to another",
                    status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(url: str | None = None, *, ledger: Ledger | None = None,
               clock: Clock | None = None, refresh_s: int = DEFAULT_REFRESH_S,
               metrics_ttl_s: float = DEFAULT_METRICS_TTL_S, actions: bool = False,
               token: str | None = None, read_url: str | None = None,
               allowed_hosts: Iterable[str] = ()) -> Starlette:
    """The dashboard over ``ledger`` (or a ledger opened on ``url`` without migrating it).

    ``read_url`` (with ``url``): a read replica the pages, the JSON and ``/metrics`` read from
    (:meth:`ledger.Ledger.open`); the actions write to ``url``. A ``ledger`` passed in reads
    where it was opened to read.

    Pages refresh themselves every ``refresh_s`` seconds (0: never; ``?refresh=N`` per page).
    ``/metrics`` reads the whole history (counters are totals), so one answer is reused for
    ``metrics_ttl_s`` seconds of this process's monotonic time: several scrapers (an HA pair of
    Prometheus servers) cost one read.

    Read-only unless ``actions`` is true and ``token`` given (both, deliberately): then the
    operator's actions (clear a cooldown, close a Run, settle an unknown Attempt) are served
    as POST routes that need the token (:mod:`ledger.dashboard.actions`); otherwise no route
    writes anything.

    A request is answered only when its Host header names loopback (:data:`LOOPBACK_HOSTS`,
    with any port) or one of ``allowed_hosts`` (the names it is reached by otherwise, e.g. the
    address it is bound to); any other is 400, so a page that rebinds its own name to this
    address cannot read it. Each of ``allowed_hosts`` is a host name or an IP address alone
    (:func:`check_allowed_hosts`).

    Nothing but the actions is authenticated: whoever reaches the app reads every page, the
    JSON and ``/metrics``. Put an authenticating proxy in front before serving it beyond
    loopback.

    Raises:
        InvalidArgument: not exactly one of ``url`` and ``ledger``; ``refresh_s`` not 0 to
            :data:`MAX_REFRESH_S`; actions without a usable token, or a token without
            actions; an ``allowed_hosts`` entry that is not a host name or IP address alone.
    """
    if (url is None) == (ledger is None):
        raise InvalidArgument("create_app needs exactly one of url or ledger", field="url")
    if read_url is not None and ledger is not None:
        raise InvalidArgument("read_url= goes with url=; a ledger passed in reads where it was "
                              "opened to (Ledger.open(url, read_url=...))", field="read_url")
    if not 0 <= refresh_s <= MAX_REFRESH_S:
        raise InvalidArgument(f"refresh_s must be from 0 to {MAX_REFRESH_S} seconds (0 turns "
                              "auto-refresh off)", field="refresh_s")
    if actions and token is None:
        raise InvalidArgument("actions=True needs token=: every action must carry it",
                              field="token")
    if token is not None and not actions:
        raise InvalidArgument("token= without actions=True enables nothing; pass actions=True "
                              "to serve the operator's actions, or no token", field="actions")
    if actions:
        check_token(token)
    allowed_hosts = check_allowed_hosts(allowed_hosts)
    names = frozenset(_served_name(h) for h in (*LOOPBACK_HOSTS, *allowed_hosts))
    mode = "operator actions enabled" if actions else "read-only"

    def _page(title: str, body: str, refresh_s: int = 0) -> HTMLResponse:
        return _document(title, body, refresh_s, mode)

    state: dict[str, Any] = {}
    metrics_cache: list[tuple[float, MetricsSnapshot]] = []  # (monotonic time read, it)
    metrics_lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        led = ledger if ledger is not None else Ledger.open(url or "", clock=clock,
                                                            migrate_schema=False,
                                                            read_url=read_url)
        state["audit"] = Audit(led)
        if actions:
            _warn_if_read_only(led)
        # The index's slowest read (health, with the window's exact latency percentiles) runs
        # here while the request's thread reads the rest: the page takes about as long as
        # that read instead of the sum of all. Two at once, whatever the number of requests.
        state["aside"] = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ledger-dashboard")
        try:
            yield
        finally:
            state["aside"].shutdown(wait=True, cancel_futures=True)
            if ledger is None:
                led.close()

    def audit() -> Audit:
        a: Audit = state["audit"]
        return a

    def handled(fn: Callable[[Request], Response],
                takes: frozenset[str] | None = None) -> Callable[[Request], Response]:
        """``fn`` with the ledger's errors as HTTP statuses; ``takes``: the query parameters
        a JSON route reads, any other refused (400) rather than ignored (a misspelt
        ``?tenat=`` answered for every tenant)."""
        def endpoint(request: Request) -> Response:
            try:
                if takes is not None:
                    _only(request, takes)
                return fn(request)
            except NotFound as e:
                return _refused(request, 404, "not found", e)
            except (InvalidArgument, ValueError) as e:
                return _refused(request, 400, "bad request", e)
            except DatabaseReadOnly as e:
                # 42501: the dashboard's role may not read these tables. A retry will not
                # grant it.
                return _refused(request, 403, "forbidden", e)
            except DatabaseUnavailable as e:
                return _refused(request, 503, "unavailable", e)
            except LedgerError as e:
                # A set-up error (a schema too old or too new, a role refused) or a defect:
                # not a state a client's retry waits out, as a 503 would tell it.
                return _refused(request, 500, "server error", e)
        return endpoint

    def _only(request: Request, takes: frozenset[str]) -> None:
        unknown = sorted(set(request.query_params) - takes)
        if unknown:
            accepted = ", ".join(sorted(takes)) or "none"
            raise InvalidArgument(
                f"unknown query parameter {unknown[0][:40]!r} for {request.url.path}; it takes: "
                f"{accepted}", field=unknown[0][:40])

    def _refused(request: Request, status: int, title: str, e: Exception) -> Response:
        """The error as the route speaks: JSON under /api and for /metrics, else a page."""
        field = getattr(e, "field", None)
        path = request.url.path
        if path.startswith("/api/") or path == "/metrics":
            doc = {"error": str(e)} | ({"field": field} if field else {})
            return JSONResponse(doc, status_code=status)
        return _with_status(_page(title, f'<section id="error"><h2>{html.escape(title)}</h2>'
                                  f"<p>{_e(str(e))}</p></section>"), status)

    def _hours(request: Request) -> float:
        """``?hours=``: the window, more than 0 and at most a leap year (the longest the
        health's latency reads), refused as itself before a time derived from it is."""
        hours = _num(request, "hours", 24)
        if not 0 < hours <= MAX_HOURS:
            raise InvalidArgument(f"hours must be more than 0 and at most {MAX_HOURS:g} (366 "
                                  f"days); got {request.query_params.get('hours')!r}",
                                  field="hours")
        return hours

    def _opt(request: Request, name: str) -> float | None:
        """``_num`` of a query parameter that may be absent (``None``)."""
        if request.query_params.get(name) is None:
            return None
        return _num(request, name, math.nan)

    def _num(request: Request, name: str, default: float) -> float:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):  # "inf" and 1e400 are floats too; int() of one raises
            raise InvalidArgument(f"query parameter {name} must be a finite number",
                                  field=name)
        return value

    def _int(request: Request, name: str, default: int, low: int | None = None,
             high: int | None = None) -> int:
        """A whole-number parameter: "2.5" or "1e3" is refused, not truncated to another
        number than was asked for; ``low``..``high`` when given (else the API checks it)."""
        raw = request.query_params.get(name)
        if raw is None:
            return default
        text = raw.strip()
        try:
            value = int(text) if text.lstrip("+-").isdigit() else None
        except ValueError:  # more digits than int() reads
            value = None
        span = f" from {low} to {high}" if low is not None and high is not None else ""
        if value is None or (low is not None and value < low) \
                or (high is not None and value > high):
            raise InvalidArgument(f"query parameter {name} must be a whole number{span}; got "
                                  f"{raw[:40]!r}", field=name)
        return value

    def _refresh(request: Request, default: int | None = None) -> int:
        return _int(request, "refresh", refresh_s if default is None else default, 0,
                    MAX_REFRESH_S)

    def index(request: Request) -> Response:
        au = audit()
        now = au.now()
        hours = _hours(request)
        days = _int(request, "days", 7, 1, 366)
        since = now - hours * 3600
        aside: ThreadPoolExecutor = state["aside"]
        health = aside.submit(au.health, now, latency_window_s=hours * 3600)
        chart_since, chart_until, n = chart_window(now, hours)
        buckets = au.activity(since=chart_since, until=chart_until, buckets=n)
        # The routes' small multiples share the chart's buckets: whole hours from a day on,
        # which the roll-ups count.
        series = au.route_series(since=chart_since, until=chart_until, buckets=n, routes=8)
        fos = au.failovers(since=since, until=now, limit=20)
        failed_over = au.count_failovers(since=since, until=now)  # the page shows 20 at most
        runs = au.runs(limit=15)
        by_tenant = au.costs(by="tenant", since=since, until=now, limit=1000)
        by_route = au.costs(by="route", since=since, until=now, limit=10)
        per_day = au.costs_by_day(days=days, now=now)
        spend_html = spend_section(au, now, days)
        recent_actions = au.actions(limit=10).items
        rep = health.result()
        today = now - now % DAY
        day_starts = [today - (days - 1 - i) * DAY for i in range(days)]
        fo_rows = [[_link(f.run_id), _e(f.tenant), _e(f.selected_route), _e(f.served_route),
                    _e(" > ".join(f.routes)),
                    _e(", ".join(f"{c.route}: " + (f"skipped ({c.category})"
                                                   if c.state == "skipped"
                                                   else c.category or c.state)
                                 + (f" {c.http_status}" if c.http_status else "")
                                 for c in f.causes)),
                    _tag(f.status), _ago(f.created_at, now)] for f in fos.items]
        # The tiles count the page's window, like the money beside them; the chart its hours.
        total = sum(t.attempts for t in by_tenant.items)
        bad = sum(t.failed + t.unknown for t in by_tenant.items)
        cost = sum((t.cost for t in by_tenant.items), Decimal(0))
        held = sum((t.held for t in by_tenant.items), Decimal(0))
        charted = sum(b.attempts for b in buckets)
        charted_bad = sum(b.failed + b.unknown for b in buckets)
        width = (chart_until - chart_since) / n
        body = (
            _glance_html(rep, total, bad, failed_over, cost, held, hours)
            + f'<section><h2 id="activity-heading">'
            f'{_e(_charted("Attempts and failures", hours, chart_since, chart_until, now, n))} '
            f'<span class="muted" id="activity-window">({_t(chart_since)} to {_t(now)}, '
            f"{n} buckets of {_span_text(width)}, UTC; {charted} attempts, {charted_bad} "
            f"failed or unknown)</span></h2>"
            + chart_svg(buckets) + "</section>"
            + _routes_html(series, now, rep.latency,
                           _charted("Routes over time", hours, chart_since, chart_until, now,
                                    n))
            + _health_html(rep)
            + _latency_html(rep.latency, hours)
            + f'<div class="grid"><section><h2>Cost by tenant, last {hours:g} h</h2>'
            + _table(["tenant", *_TOTALS_HEAD], _totals_rows(by_tenant.items[:10]),
                     "costs-tenant-table", "no attempts in the window", ["", *_TOTALS_CLS])
            + f"</section><section><h2>Cost by route, last {hours:g} h</h2>"
            + _table(["route", *_TOTALS_HEAD], _totals_rows(by_route.items),
                     "costs-route-table", "no attempts in the window", ["id", *_TOTALS_CLS])
            + f'</section></div><section><h2>Cost by day and tenant, last {days} days '
            '<span class="muted">(UTC)</span></h2>'
            + cost_days_svg(per_day, day_starts, width=1300, height=190)
            + "</section>"
            + '<section><h2>Recent failovers</h2>'
            + _table(["run", "tenant", "selected", "served by", "routes tried", "causes",
                      "status", "admitted"], fo_rows, "failovers-table",
                     f"no failovers in the last {hours:g} h",
                     ["id", "", "id", "id", "", "", "", "nowrap"])
            + '</section><section><h2>Recent runs <a class="muted" href="/runs">(all runs)</a>'
            "</h2>" + _runs_table(runs.items, now) + "</section>"
            + spend_html
            + (clear_forms_html(rep) if actions else "")
            + actions_html(recent_actions, now, title="Recent operator actions")
            + f'<p class="muted">as of {_t(now)} &middot; JSON: <a href="/api/health">'
            "health</a>, <a href=\"/api/failovers\">failovers</a>, <a href=\"/api/activity\">"
            "activity</a>, <a href=\"/api/routes\">routes</a>, <a href=\"/api/latency\">"
            "latency</a>, <a href=\"/api/costs\">costs</a>"
            ", <a href=\"/api/costs/days\">costs by day</a>, <a href=\"/api/budgets\">"
            "budgets</a>, <a href=\"/api/actions\">actions</a> &middot; "
            "<a href=\"/metrics\">Prometheus metrics</a></p>")
        return _page("failover-ledger dashboard", body, _refresh(request))

    def run_page(request: Request) -> Response:
        return run_page_for(request.path_params["run_id"], _refresh(request))

    def run_lookup(request: Request) -> Response:
        rid = (request.query_params.get("id") or "").strip()
        if not rid:
            return runs_page(request)
        return run_page_for(rid, _refresh(request))

    def runs_page(request: Request) -> Response:
        """Every run, newest first, a page of 50 at a time (``?status=``, ``?tenant=``)."""
        au = audit()
        now = au.now()
        p = request.query_params
        page = au.runs(status=p.get("status") or None, tenant=p.get("tenant") or None,
                       limit=_int(request, "limit", 50), cursor=p.get("cursor"))
        body = ('<section><h2>Runs <span class="muted">(newest first)</span></h2>'
                + _runs_table(page.items, now))
        if page.next_cursor:
            q = {k: v for k, v in p.items() if k in ("status", "tenant", "limit", "refresh")}
            q["cursor"] = page.next_cursor
            body += (f'<p><a id="runs-next" href="/runs?{html.escape(urlencode(q), quote=True)}">'
                     "older runs &rarr;</a></p>")
        return _page("runs", body + "</section>", _refresh(request))

    def run_page_for(rid: str, refresh: int) -> Response:
        au = audit()
        tl = au.timeline(rid)
        now = au.now()
        return _page(f"run {tl.run.run_id}", _timeline_html(tl, now)
                     + run_actions_html(tl, now, forms=actions), refresh)

    def _spend_by(request: Request) -> tuple[str, str | None]:
        """``?by=`` and ``?label=`` of ``/budgets`` and ``/api/budgets`` alike: a label without
        ``by=label`` is refused, as the command's ``--label`` without ``--by label`` (a label
        ignored would answer another question, by tenant, as if it were the one asked)."""
        p = request.query_params
        by = p.get("by", "tenant")
        label = p.get("label")
        if label is not None and by != "label":
            raise InvalidArgument(f"label {label[:40]!r} names the label to total by and goes "
                                  f"with by=label; add by=label (it has no effect with by="
                                  f"{by[:20]})", field="label")
        return by, label

    def budgets_page(request: Request) -> Response:
        """Spend against budgets by tenant or label (``?by=label&label=team``, ``?days=N``)."""
        au = audit()
        now = au.now()
        days = _int(request, "days", 30, 1, 366)
        by, label = _spend_by(request)
        if by == "label" and not label:
            label = "team"  # the label most ledgers carry; ?label= picks another
        # Two forms, one per grouping: one form with a label box sent the label with
        # by=tenant too, which is refused (the page has no script to leave it out).
        form = ('<form id="budgets-form" method="get" action="/budgets">'
                '<input type="hidden" name="by" value="tenant">by tenant, days <input '
                f'name="days" size="4" value="{days}"> <button>show</button></form>'
                '<form id="budgets-label-form" method="get" action="/budgets">'
                '<input type="hidden" name="by" value="label">by label <input name="label" '
                f'required size="12" value="{html.escape(label or "team", quote=True)}"> days '
                f'<input name="days" size="4" value="{days}"> <button>show</button></form>')
        body = (f"<section>{form}</section>"
                + spend_section(au, now, days, by=by, label=label, limit=200, link=False))
        return _page("spend against budgets", body, _refresh(request))

    def api_budgets(request: Request) -> Response:
        au = audit()
        now = au.now()
        p = request.query_params
        every = p.get("every")
        by, label = _spend_by(request)
        return JSONResponse(to_jsonable(au.spend(
            by=by, label=label,
            since=_num(request, "since", now - 7 * DAY), until=_num(request, "until", now),
            every=None if every is None else _num(request, "every", DAY),
            limit=_int(request, "limit", 100), cursor=p.get("cursor"))))

    def api_actions(request: Request) -> Response:
        au = audit()
        p = request.query_params
        since = p.get("since")
        until = p.get("until")
        # ?kind= is repeatable, as the command's --kind; unknown ones are refused, not
        # filtered down to nothing.
        kinds = p.getlist("kind") or list(ACTION_KINDS)
        unknown = [k for k in kinds if k not in ACTION_KINDS]
        if unknown:
            raise InvalidArgument(f"kind {unknown[0][:40]!r} is not an action kind; pass one of "
                                  f"{', '.join(ACTION_KINDS)} (repeatable)", field="kind")
        return JSONResponse(to_jsonable(au.actions(
            since=None if since is None else _num(request, "since", 0),
            until=None if until is None else _num(request, "until", 0), kinds=kinds,
            limit=_int(request, "limit", 50), cursor=p.get("cursor"))))

    def metrics(request: Request) -> Response:
        with metrics_lock:
            if not metrics_cache or time.monotonic() - metrics_cache[0][0] >= metrics_ttl_s:
                metrics_cache[:] = [(time.monotonic(), audit().metrics())]
            snapshot = metrics_cache[0][1]
        # The format the scraper asks for (OpenMetrics or the text format), from one read.
        body, content_type = encode(snapshot, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    def _latency_args(request: Request) -> dict[str, Any]:
        au = audit()
        now = au.now()
        p = request.query_params
        hours = _hours(request)
        return {"since": _num(request, "since", now - hours * 3600),
                "until": _num(request, "until", now),
                **{k: (p.get(k) or None) for k in ("route", "group", "category", "tenant",
                                                   "state")}}

    def latency_page(request: Request) -> Response:
        """p50/p95/p99 per route and group, filtered by the form's fields."""
        args = _latency_args(request)
        rep = audit().latency(**args)
        p = request.query_params

        def field(name: str, hint: str) -> str:
            return (f'<label>{name}<input name="{name}" size="18" placeholder="{hint}" '
                    f'value="{html.escape(p.get(name) or "", quote=True)}"></label>')

        states = "".join(
            f'<option value="{v}"{" selected" if (p.get("state") or "") == v else ""}>'
            f"{v or 'every outcome'}</option>"
            for v in ("", "succeeded", "failed", "unknown", "not_sent"))
        hours = p.get("hours") or "24"
        form = (
            '<form class="filters" id="latency-filters" action="/latency" method="get">'
            f'<label>hours<input name="hours" size="5" value="{html.escape(hours, quote=True)}">'
            "</label>" + field("route", "any route") + field("group", "any group")
            + field("category", "e.g. timeout") + field("tenant", "any tenant")
            + f'<label>outcome<select name="state">{states}</select></label>'
            "<button>show</button></form>")
        shown = ", ".join(f"{k} {v}" for k, v in (
            ("route", rep.route), ("group", rep.group), ("category", rep.category),
            ("tenant", rep.tenant), ("outcome", rep.state)) if v is not None) or "every attempt"
        body = (f'<section id="latency"><h2>Latency <span class="muted">({_t(rep.since)} to '
                f"{_t(rep.until)}; {_e(shown)}; seconds from an attempt's begin by the "
                "ledger's clock, to its settle, a stream's first token, the response's first "
                "byte)</span></h2>" + form + _latency_tables(rep, "latency") + "</section>")
        return _page("latency", body, _refresh(request))

    def api_latency(request: Request) -> Response:
        return JSONResponse(to_jsonable(audit().latency(**_latency_args(request))))

    def api_health(request: Request) -> Response:
        return JSONResponse(to_jsonable(audit().health()))

    def api_run(request: Request) -> Response:
        return JSONResponse(to_jsonable(audit().timeline(request.path_params["run_id"])))

    def api_runs(request: Request) -> Response:
        # The filters of the runs command (--since/--until as epoch seconds): unbounded
        # unless given, as Audit.runs is.
        p = request.query_params
        return JSONResponse(to_jsonable(audit().runs(
            status=p.get("status"), tenant=p.get("tenant"), since=_opt(request, "since"),
            until=_opt(request, "until"), limit=_int(request, "limit", 50),
            cursor=p.get("cursor"))))

    def api_failovers(request: Request) -> Response:
        au = audit()
        now = au.now()
        since = _num(request, "since", now - DAY)
        until = _num(request, "until", now)
        return JSONResponse(to_jsonable(au.failovers(
            since=since, until=until, limit=_int(request, "limit", 50),
            cursor=request.query_params.get("cursor"))))

    def api_costs(request: Request) -> Response:
        au = audit()
        now = au.now()
        p = request.query_params
        return JSONResponse(to_jsonable(au.costs(
            by=p.get("by", "route"), label=p.get("label"),
            since=_num(request, "since", now - DAY), until=_num(request, "until", now),
            limit=_int(request, "limit", 100), cursor=p.get("cursor"))))

    def api_costs_days(request: Request) -> Response:
        return JSONResponse(to_jsonable(audit().costs_by_day(days=_int(request, "days", 7))))

    def api_activity(request: Request) -> Response:
        au = audit()
        now = au.now()
        return JSONResponse(to_jsonable(au.activity(
            since=_num(request, "since", now - DAY), until=_num(request, "until", now),
            buckets=_int(request, "buckets", 48))))

    def _replay_args(request: Request) -> dict[str, Any]:
        """The replay a request asks for: a preset (never a file), a window, a tenant, a run."""
        au = audit()
        now = au.now()
        p = request.query_params
        policy = p.get("policy") or ""
        if policy not in PRESETS:
            raise InvalidArgument(f"policy must be one of {', '.join(PRESETS)} (the dashboard "
                                  "replays presets; the command line also takes a file)",
                                  field="policy")
        hours = _hours(request)
        run = p.get("run") or None
        if run is not None:
            # One run whenever it was admitted: ?hours= (the form always sends it) bounded it
            # by a day before this reader's clock, and a run outside read as "0 decisions".
            # Only an explicit ?since=/?until= bounds it; an unknown run is a 404.
            return {"policy": policy, "since": _opt(request, "since"),
                    "until": _opt(request, "until"), "tenant": p.get("tenant") or None,
                    "run": run}
        until = _num(request, "until", now)
        since = _num(request, "since", until - hours * 3600)
        # A replay reads its whole window at once (no pages): ?since= gets ?hours='s bound.
        if until - since > MAX_HOURS * 3600:
            raise InvalidArgument(f"since..until spans {(until - since) / DAY:.1f} days; a "
                                  f"replay reads at most {MAX_HOURS / 24:g} days at once: pass "
                                  "a later since (or hours=), or run= for one run",
                                  field="since")
        return {"policy": policy, "since": since, "until": until,
                "tenant": p.get("tenant") or None, "run": run}

    def replay_page(request: Request) -> Response:
        p = request.query_params
        hours = _hours(request)
        body = replay_form(p.get("policy"), hours, p.get("tenant"), p.get("run"))
        if p.get("policy"):
            body += replay_html(audit().replay(**_replay_args(request)))
        # A replay reads a whole window: on demand, unless the page asks to refresh.
        return _page("replay", body, _refresh(request, 0))

    def api_replay(request: Request) -> Response:
        return JSONResponse(to_jsonable(audit().replay(**_replay_args(request))))

    def api_routes(request: Request) -> Response:
        au = audit()
        now = au.now()
        return JSONResponse(to_jsonable(au.route_series(
            since=_num(request, "since", now - DAY), until=_num(request, "until", now),
            buckets=_int(request, "buckets", 24), routes=_int(request, "routes", 8))))

    routes = [
        Route("/", handled(index)),
        Route("/runs", handled(run_lookup)),
        Route("/runs/{run_id:path}", handled(run_page)),
        Route("/latency", handled(latency_page)),
        Route("/metrics", handled(metrics)),
        Route("/budgets", handled(budgets_page)),
        Route("/replay", handled(replay_page)),
    ]
    for path, api in (("/api/latency", api_latency), ("/api/health", api_health),
                      ("/api/runs", api_runs), ("/api/runs/{run_id:path}", api_run),
                      ("/api/failovers", api_failovers), ("/api/costs", api_costs),
                      ("/api/costs/days", api_costs_days), ("/api/activity", api_activity),
                      ("/api/routes", api_routes), ("/api/budgets", api_budgets),
                      ("/api/actions", api_actions), ("/api/replay", api_replay)):
        routes.append(Route(path, handled(api, API_PARAMETERS[path])))
    if actions:
        assert token is not None
        routes += action_routes(audit, token, _page)
    # Without actions only GET is routed: the dashboard has no way to change anything.
    return Starlette(routes=routes, lifespan=lifespan,
                     middleware=[Middleware(_ServedNamesOnly, names=names)])


def _warn_if_read_only(led: Ledger) -> None:
    """Started with actions on a role (or file) that may not write: said at once, as a warning
    (every action would be refused, 403). Not a refusal to start: the pages still serve the
    reading they are for, and the role may be granted what it lacks while the dashboard runs
    (each action asks the server anew). A database that cannot be asked now is left to the
    first action."""
    try:
        why = storage_of(led).context.write_refusal()
    except LedgerError:
        return
    if why is not None:
        log.warning("the dashboard serves operator actions (--allow-actions), but %s: every "
                    "action will be refused (403) and nothing recorded; start it with the URL "
                    "of the role that writes the ledger, or without --allow-actions", why)


def _with_status(resp: Response, status: int) -> Response:
    resp.status_code = status
    return resp


_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)\Z", re.IGNORECASE)
_ANY_ADDRESS = ("0.0.0.0", "::")


def _is_host(host: str) -> bool:
    """An IP address or a host name's syntax (by its form only; nothing is resolved)."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return True
    labels = host.removesuffix(".").split(".")
    # An all-digit last label is a mistyped IP address (127.0.0.999), never a name.
    return len(host) <= 253 and all(_LABEL.match(x) for x in labels) \
        and not labels[-1].isdigit()


def check_allowed_hosts(hosts: Iterable[Any], *, name: str = "allowed_hosts") -> list[str]:
    """The names the dashboard also answers to, each a host name or an IP address alone (an
    IPv6 one with or without brackets). A port, a scheme, a wildcard or a blank could never
    equal the name in a Host header: refused, naming the fix, instead of never matching."""
    if isinstance(hosts, str):
        raise InvalidArgument(f"{name} is a list of host names, e.g. ['dash.internal']",
                              field=name.lstrip("-").replace("-", "_"))
    out = []
    for h in hosts:
        bare = h[1:-1] if isinstance(h, str) and h.startswith("[") and h.endswith("]") else h
        if not isinstance(h, str) or not _is_host(bare) or (bare is not h and ":" not in bare):
            raise InvalidArgument(
                f"{name} {h!r} is not a host name or an IP address; pass the name alone, e.g. "
                "dash.internal: no scheme, no port (any port is answered), no wildcard",
                field=name.lstrip("-").replace("-", "_"))
        out.append(h)
    return out


def check_forwarded_allow_ips(value: Any, *, name: str = "forwarded_allow_ips"
                              ) -> list[str] | None:
    """The proxies whose ``X-Forwarded-Proto`` and ``X-Forwarded-For`` the server trusts:
    IP addresses or networks (``10.0.0.0/8``), or ``*`` for any (only where nothing but the
    proxy reaches the port). None (or empty): loopback alone (:data:`TRUSTED_PROXIES`). A
    string may list several, comma-separated, as uvicorn's ``--forwarded-allow-ips``."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        ok = text == "*"
        if not ok and isinstance(text, str) and text:
            # A network with host bits set (10.0.0.5/24) is strict's error: uvicorn would take
            # it for a literal name that no client address ever equals.
            with contextlib.suppress(ValueError):
                if "/" in text:
                    ipaddress.ip_network(text)
                else:
                    ipaddress.ip_address(text)
                ok = True
        if not ok:
            raise InvalidArgument(
                f"{name} {item!r} is not an IP address or network; pass the proxy's address "
                "(e.g. 10.0.0.5), its network (10.0.0.0/24, no host bits), several "
                "comma-separated, or '*' for any", field=name.lstrip("-").replace("-", "_"))
        out.append(text)
    return out or None


def check_bind(host: Any, port: Any, *, host_name: str = "host", port_name: str = "port"
               ) -> None:
    """Refuse an address the dashboard cannot listen on, before anything is resolved or bound:
    ``host`` an IP address or a host name's syntax, ``port`` 0 (any free port) to 65535.
    (A name is checked by its form only: it is resolved when the socket is bound.)"""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"{port_name} {port!r} is out of range; pass a port from 1 to "
                              "65535 (0: any free one)", field=port_name.lstrip("-"))
    if isinstance(host, str) and _is_host(host):
        return
    raise InvalidArgument(f"{host_name} {host!r} is neither an IP address nor a host name; pass "
                          "e.g. 127.0.0.1 (the default, loopback) or ::1",
                          field=host_name.lstrip("-"))


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port``, or the reason it cannot as one typed error."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(2048)
        except BaseException:
            sock.close()
            raise
    except socket.gaierror as e:
        raise LedgerError(f"cannot listen on {where}: the host name does not resolve "
                          f"({e.strerror}); pass --host an address of this machine",
                          host=host, port=port) from None
    except OSError as e:
        fix = ("another process listens there: stop it, or pass --port a free port"
               if e.errno == errno.EADDRINUSE else
               "pass --host an address of this machine and --port a port you may bind")
        raise LedgerError(f"cannot listen on {where}: {e.strerror or e}; {fix}", host=host,
                          port=port) from None
    return sock


def serve(url: str, *, host: str = "127.0.0.1", port: int = 8765,
          refresh_s: int = DEFAULT_REFRESH_S, actions: bool = False,
          token: str | None = None, read_url: str | None = None,
          allowed_hosts: Iterable[str] = (),
          forwarded_allow_ips: str | Iterable[str] | None = None) -> None:
    """Serve the dashboard until interrupted (``failover-ledger dashboard``).

    Read-only unless ``actions`` and ``token`` are both given (see :func:`create_app`);
    ``read_url``: a read replica to read from. It answers to loopback's names, ``host`` and
    ``allowed_hosts`` (:func:`create_app`).

    ``forwarded_allow_ips``: the addresses (or networks, or ``*``) of the proxies whose
    ``X-Forwarded-Proto`` is trusted (:func:`check_forwarded_allow_ips`); default loopback
    alone (:data:`TRUSTED_PROXIES`; ``$FORWARDED_ALLOW_IPS`` is not read). Behind a TLS proxy
    elsewhere, pass its address: otherwise the dashboard takes the request for plain http, and
    every browser action is refused as from another origin.

    Raises:
        InvalidArgument: ``host`` not an IP address or host name, ``port`` not 0 to 65535,
            an ``allowed_hosts`` or ``forwarded_allow_ips`` entry malformed.
        LedgerError: the address cannot be listened on (in use, not this machine's); nothing
            was served.
    """
    import uvicorn

    check_bind(host, port)
    proxies = check_forwarded_allow_ips(forwarded_allow_ips)
    served = [] if host in _ANY_ADDRESS else [host]
    app = create_app(url, refresh_s=refresh_s, actions=actions, token=token,
                     read_url=read_url, allowed_hosts=[*served, *allowed_hosts])
    sock = _listen(host, port)
    # Said once the socket listens, so the line never announces an address not served.
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    mode = ("OPERATOR ACTIONS ENABLED: POST with the token" if actions else "read-only")
    print(f"failover-ledger dashboard on http://{shown}:{bound}/ ({mode}; metrics at "
          "/metrics; Ctrl-C to stop)", flush=True)
    try:
        # Given explicitly (never None): uvicorn would otherwise read $FORWARDED_ALLOW_IPS,
        # a setting from the environment nobody passed to this command.
        uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                      forwarded_allow_ips=proxies or list(TRUSTED_PROXIES))
                       ).run(sockets=[sock])
    finally:
        sock.close()


__all__ = ["DEFAULT_REFRESH_S", "LOOPBACK_HOSTS", "MAX_REFRESH_S", "TRUSTED_PROXIES", "chart_svg",
           "check_allowed_hosts", "check_bind", "check_forwarded_allow_ips", "create_app",
           "serve"]
