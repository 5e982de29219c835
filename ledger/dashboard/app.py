"""The dashboard's Starlette app: HTML pages and JSON endpoints over the audit API.

Pages: ``/`` (route, profile and group health; attempts and failures over the last day; recent
failovers; recent runs) and ``/runs/{id}`` (a run's attempt timeline). JSON: ``/api/health``,
``/api/failovers``, ``/api/runs``, ``/api/runs/{id}``, ``/api/costs``, ``/api/activity``.

Every endpoint is a plain function: Starlette runs it in its thread pool, so the blocking
database reads never stall the event loop. Every value printed into HTML is escaped.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ledger.api import Ledger
from ledger.audit import ActivityBucket, Audit, HealthReport, RunTimeline, to_jsonable
from ledger.clock import Clock
from ledger.errors import InvalidArgument, LedgerError, NotFound

DAY = 86400.0
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
margin-bottom:16px}
h1{font-size:18px;margin:0}h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eceff3;vertical-align:top}
th{background:#f0f2f5;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#17803d;font-weight:600}.cooling,.cooldown{color:#b26a00;font-weight:600}
.disabled,.unavailable,.failed,.unknown{color:#c0262d;font-weight:600}
.succeeded{color:#17803d}.dispatching{color:#2459c4}.muted{color:#6b7280}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:16px}
code{font-size:12px}
"""


def _e(v: Any) -> str:
    if v is None:
        return '<span class="muted">-</span>'
    return html.escape(str(v))


def _t(ts: float | None) -> str:
    if ts is None:
        return _e(None)
    return _e(datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S"))


def _until(ts: float | None, now: float) -> str:
    if ts is None:
        return _e(None)
    if ts > now:
        return _e(f"in {ts - now:.0f}s") + f' <span class="muted">({_t(ts)})</span>'
    return _t(ts)


def _money(d: Decimal | None) -> str:
    return _e(None) if d is None else _e(f"{d:.6f}")


def _tag(cls: str) -> str:
    return f'<span class="{html.escape(cls)}">{html.escape(cls)}</span>'


def _page(title: str, body: str) -> HTMLResponse:
    doc = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width, initial-scale=1">'
           f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
           f'<header><h1><a href="/">ledger</a></h1><span>provider health (read-only)</span>'
           f'<form action="/runs" method="get"><input name="id" placeholder="run id" size="32">'
           f' <button>show run</button></form></header><main>{body}</main></body></html>')
    return HTMLResponse(doc, headers={"Content-Security-Policy": _CSP,
                                      "Cache-Control": "no-store"})


def _table(headers: list[str], rows: list[list[str]], table_id: str, empty: str) -> str:
    if not rows:
        return f'<p class="muted" id="{table_id}-empty">{html.escape(empty)}</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def chart_svg(buckets: list[ActivityBucket], width: int = 900, height: int = 170) -> str:
    """Bars of attempts per bucket (grey) with their failures and unknowns (red) in front."""
    pad_l, pad_b, pad_t = 44, 22, 10
    n = max(1, len(buckets))
    top = max([b.attempts for b in buckets] + [1])
    bw = (width - pad_l - 4) / n
    plot_h = height - pad_b - pad_t
    parts = [f'<svg id="activity-chart" xmlns="http://www.w3.org/2000/svg" width="100%" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="attempts and failures '
             f'over time">',
             f'<text x="0" y="{pad_t + 8}" font-size="11" fill="#6b7280">{top}</text>',
             f'<text x="0" y="{height - pad_b}" font-size="11" fill="#6b7280">0</text>',
             f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width}" y2="{height - pad_b}" '
             f'stroke="#c7ccd4"/>']
    for i, b in enumerate(buckets):
        x = pad_l + i * bw
        h_all = plot_h * b.attempts / top
        h_bad = plot_h * (b.failed + b.unknown) / top
        label = (f"{datetime.fromtimestamp(b.start, UTC):%m-%d %H:%M} UTC: {b.attempts} "
                 f"attempts, {b.failed} failed, {b.unknown} unknown")
        parts.append(f'<g><title>{html.escape(label)}</title>'
                     f'<rect x="{x:.1f}" y="{height - pad_b - h_all:.1f}" width="{bw * 0.85:.1f}"'
                     f' height="{h_all:.1f}" fill="#9aa5b8"/>'
                     f'<rect class="fail" x="{x:.1f}" y="{height - pad_b - h_bad:.1f}" '
                     f'width="{bw * 0.85:.1f}" height="{h_bad:.1f}" fill="#d64545"/></g>')
    if buckets:
        last = len(buckets) - 1
        for i, anchor in ((0, "start"), (last // 2, "middle"), (last, "end")):
            ts = datetime.fromtimestamp(buckets[i].start, UTC)
            x = pad_l + (i + (1 if anchor == "end" else 0)) * bw  # keep the last label inside
            parts.append(f'<text x="{x:.1f}" y="{height - 6}" font-size="11" '
                         f'text-anchor="{anchor}" fill="#6b7280">{ts:%m-%d %H:%M}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _health_html(rep: HealthReport) -> str:
    now = rep.now
    keys = [[_e(k.key), _e(k.kind), _e(k.provider), _tag(k.status),
             _until(k.cooldown_until, now),
             _until(k.disabled_until, now) + (f" ({_e(k.disabled_reason)})"
                                              if k.disabled_reason else ""),
             f'<span class="num">{k.error_count}</span>', _t(k.last_failure_at),
             _t(k.last_probe_at)] for k in rep.routes + rep.profiles]
    groups = [[_e(g.group), _tag(g.mode), _until(g.until, now) if g.mode != "open" else _e(None),
               _e(g.reason) if g.mode != "open" else _e(None), _e(g.in_flight), _e(g.limit)]
              for g in rep.groups]
    return (
        '<section><h2>Routes and credential profiles</h2>'
        + _table(["key", "kind", "provider", "status", "cooldown until", "disabled until",
                  "errors", "last failure (UTC)", "last probe (UTC)"], keys, "health-table",
                 "no health recorded yet")
        + '</section><section><h2>Capacity groups</h2>'
        + _table(["group", "mode", "waiting floor", "reason", "in flight", "limit"], groups,
                 "groups-table", "no capacity groups yet")
        + "</section>")


def _timeline_html(tl: RunTimeline) -> str:
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
        notes = "<br>".join(_e(f"{e.kind}: " + ", ".join(f"{k}={v}" for k, v in
                                                          sorted(e.data.items())))
                            for e in a.events)
        rows.append([f'<span class="num">{a.seq}</span>', _e(a.kind), _e(a.route_id),
                     _e(a.profile_id), _tag(a.state), fact,
                     _e(a.debit_state) + " " + _money(a.posted if a.debit_state == "posted"
                                                      else a.reserved),
                     _money(a.cost), why, notes or _e(None), _t(a.created_at)])
    head = (f"<section><h2>Run <code>{_e(r.run_id)}</code></h2>"
            f'<p id="run-summary">status {_tag(r.status)} &middot; tenant {_e(r.tenant)} '
            f"&middot; selected <b>{_e(r.selected_route)}</b> &middot; served by "
            f'<b id="served-route">{_e(tl.served_route)}</b> &middot; failed over: '
            f"{'yes' if tl.failed_over else 'no'} &middot; cost {_money(tl.total_cost)} of "
            f"{_money(r.max_cost)} &middot; admitted {_t(r.created_at)} UTC</p>")
    return (head + _table(["#", "kind", "route", "profile", "outcome", "fact", "debit", "cost",
                           "why (selector)", "events", "at (UTC)"], rows, "timeline-table",
                          "no attempts yet") + "</section>")


def create_app(url: str | None = None, *, ledger: Ledger | None = None,
               clock: Clock | None = None) -> Starlette:
    """The dashboard over ``ledger`` (or a ledger opened on ``url`` without migrating it)."""
    if (url is None) == (ledger is None):
        raise InvalidArgument("create_app needs exactly one of url or ledger", field="url")
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        led = ledger if ledger is not None else Ledger.open(url or "", clock=clock,
                                                            migrate_schema=False)
        state["audit"] = Audit(led)
        try:
            yield
        finally:
            if ledger is None:
                led.close()

    def audit() -> Audit:
        a: Audit = state["audit"]
        return a

    def handled(fn: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            try:
                return fn(request)
            except NotFound as e:
                if request.url.path.startswith("/api/"):
                    return JSONResponse({"error": str(e)}, status_code=404)
                return _with_status(_page("not found", f"<section><p>{_e(str(e))}</p>"
                                          "</section>"), 404)
            except (InvalidArgument, ValueError) as e:
                return JSONResponse({"error": str(e)}, status_code=400)
            except LedgerError as e:
                return JSONResponse({"error": str(e)}, status_code=503)
        return endpoint

    def _num(request: Request, name: str, default: float) -> float:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        try:
            return float(raw)
        except ValueError:
            raise InvalidArgument(f"query parameter {name} must be a number",
                                  field=name) from None

    def index(request: Request) -> Response:
        au = audit()
        now = au.now()
        hours = _num(request, "hours", 24)
        rep = au.health(now)
        buckets = au.activity(since=now - hours * 3600, until=now, buckets=48)
        fos = au.failovers(since=now - hours * 3600, until=now, limit=20)
        runs = au.runs(limit=15)
        fo_rows = [[f'<a href="/runs/{html.escape(f.run_id, quote=True)}">{_e(f.run_id)}</a>',
                    _e(f.tenant), _e(f.selected_route), _e(f.served_route),
                    _e(" > ".join(f.routes)),
                    _e(", ".join(f"{c.route}: {c.category or c.state}"
                                 + (f" {c.http_status}" if c.http_status else "")
                                 for c in f.causes)),
                    _tag(f.status), _t(f.created_at)] for f in fos.items]
        run_rows = [[f'<a href="/runs/{html.escape(r.run_id, quote=True)}">{_e(r.run_id)}</a>',
                     _tag(r.status), _e(r.tenant), _e(r.selected_route), _e(r.current_route),
                     _money(r.posted), _t(r.created_at)] for r in runs.items]
        total = sum(b.attempts for b in buckets)
        bad = sum(b.failed + b.unknown for b in buckets)
        body = (
            _health_html(rep)
            + f'<section><h2>Attempts and failures, last {hours:g}h '
            f'<span class="muted">({total} attempts, {bad} failed or unknown; UTC)</span></h2>'
            + chart_svg(buckets) + "</section>"
            + '<div class="grid"><section><h2>Recent failovers</h2>'
            + _table(["run", "tenant", "selected", "served by", "routes", "causes", "status",
                      "admitted (UTC)"], fo_rows, "failovers-table",
                     f"no failovers in the last {hours:g}h")
            + "</section><section><h2>Recent runs</h2>"
            + _table(["run", "status", "tenant", "selected", "current", "posted",
                      "admitted (UTC)"], run_rows, "runs-table", "no runs yet")
            + "</section></div>"
            + f'<p class="muted">as of {_t(now)} UTC &middot; JSON: <a href="/api/health">'
            "health</a>, <a href=\"/api/failovers\">failovers</a>, <a href=\"/api/activity\">"
            "activity</a>, <a href=\"/api/costs\">costs</a></p>")
        return _page("ledger dashboard", body)

    def run_page(request: Request) -> Response:
        tl = audit().timeline(request.path_params["run_id"])
        return _page(f"run {tl.run.run_id}", _timeline_html(tl))

    def run_lookup(request: Request) -> Response:
        rid = (request.query_params.get("id") or "").strip()
        if not rid:
            raise InvalidArgument("give a run id", field="id")
        return run_page_for(rid)

    def run_page_for(rid: str) -> Response:
        tl = audit().timeline(rid)
        return _page(f"run {tl.run.run_id}", _timeline_html(tl))

    def api_health(request: Request) -> Response:
        return JSONResponse(to_jsonable(audit().health()))

    def api_run(request: Request) -> Response:
        return JSONResponse(to_jsonable(audit().timeline(request.path_params["run_id"])))

    def api_runs(request: Request) -> Response:
        p = request.query_params
        return JSONResponse(to_jsonable(audit().runs(
            status=p.get("status"), tenant=p.get("tenant"),
            limit=int(_num(request, "limit", 50)), cursor=p.get("cursor"))))

    def api_failovers(request: Request) -> Response:
        au = audit()
        now = au.now()
        since = _num(request, "since", now - DAY)
        until = _num(request, "until", now)
        return JSONResponse(to_jsonable(au.failovers(
            since=since, until=until, limit=int(_num(request, "limit", 50)),
            cursor=request.query_params.get("cursor"))))

    def api_costs(request: Request) -> Response:
        au = audit()
        now = au.now()
        p = request.query_params
        return JSONResponse(to_jsonable(au.costs(
            by=p.get("by", "route"), label=p.get("label"),
            since=_num(request, "since", now - DAY), until=_num(request, "until", now),
            limit=int(_num(request, "limit", 100)), cursor=p.get("cursor"))))

    def api_activity(request: Request) -> Response:
        au = audit()
        now = au.now()
        return JSONResponse(to_jsonable(au.activity(
            since=_num(request, "since", now - DAY), until=_num(request, "until", now),
            buckets=int(_num(request, "buckets", 48)))))

    routes = [
        Route("/", handled(index)),
        Route("/runs", handled(run_lookup)),
        Route("/runs/{run_id:path}", handled(run_page)),
        Route("/api/health", handled(api_health)),
        Route("/api/runs", handled(api_runs)),
        Route("/api/runs/{run_id:path}", handled(api_run)),
        Route("/api/failovers", handled(api_failovers)),
        Route("/api/costs", handled(api_costs)),
        Route("/api/activity", handled(api_activity)),
    ]
    # Only GET is routed: the dashboard has no way to change anything.
    return Starlette(routes=routes, lifespan=lifespan)


def _with_status(resp: Response, status: int) -> Response:
    resp.status_code = status
    return resp


def serve(url: str, *, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve the dashboard until interrupted (``ledger dashboard``)."""
    import uvicorn

    print(f"ledger dashboard on http://{host}:{port}/ (read-only; Ctrl-C to stop)", flush=True)
    uvicorn.run(create_app(url), host=host, port=port, log_level="warning")


__all__ = ["chart_svg", "create_app", "serve"]
