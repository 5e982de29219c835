"""Spend against budgets on the dashboard: per tenant or label, the budgets of the Runs admitted
in a window, what they were charged and what they still hold, and the same split by the day
the Runs were admitted (:meth:`ledger.ops.audit.Audit.spend`).

The index shows the tenants over the last days; ``/budgets`` (``?by=label&label=team``,
``?days=N``) any grouping, and ``/api/budgets`` the JSON. Each row's chart is the share of that
day's admitted budgets charged (blue) and held (amber), on a 0-100 % axis shared by every row,
so rows compare; a day with no Run admitted shows no bar. Every figure is exact on hover.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from decimal import Decimal

from ledger.ops.audit import Audit, Spend, SpendPoint

DAY = 86400.0
_AXIS = "#6b7280"
_POSTED = "#0072b2"
_HELD = "#e69f00"


def _e(v: object) -> str:
    if v is None:
        return '<span class="muted">-</span>'
    return html.escape(str(v))


def _money(d: Decimal) -> str:
    return html.escape(f"{d:.6f}")


def used_share(posted: Decimal, held: Decimal, budget: Decimal) -> str:
    """``(posted + held) / budget`` as a percentage for people (``-`` with no budget)."""
    if not budget:
        return "-"
    return f"{100 * (posted + held) / budget:.1f}%"


def _tip(p: SpendPoint, key: str) -> str:
    day = f"{datetime.fromtimestamp(p.start, UTC):%Y-%m-%d}"
    return (f"{day} {key}: {p.runs} runs admitted, budget {p.budget}, charged {p.posted}, "
            f"held {p.held} ({used_share(p.posted, p.held, p.budget)} used)")


def used_bars_svg(s: Spend, css_id: str, *, width: int = 320, height: int = 44) -> str:
    """One key's share of each bucket's budgets charged and held (0-100 %), as bars."""
    pad = 3
    n = max(1, len(s.points))
    step = (width - 2 * pad) / n
    plot_h = height - 2 * pad
    base = height - pad
    key = s.key if s.key is not None else "(none)"
    bars = []
    for j, p in enumerate(s.points):
        if not p.runs or not p.budget:
            continue
        x = pad + j * step + step * 0.1
        w = step * 0.8
        # posted + held never exceed the budget (a Run never overdraws); the bounds only
        # keep a drawing inside its box.
        posted = min(p.posted / p.budget, Decimal(1))
        held = min(p.held / p.budget, 1 - posted)
        h_posted, h_held = plot_h * float(posted), plot_h * float(held)
        # A thin outline marks a day that had Runs, even when they spent nothing yet.
        bars.append(f'<g><title>{html.escape(_tip(p, key))}</title>'
                    f'<rect x="{x:.1f}" y="{pad}" width="{w:.1f}" height="{plot_h}" '
                    f'fill="#eef0f4"/>'
                    f'<rect class="posted" x="{x:.1f}" y="{base - h_posted:.1f}" '
                    f'width="{w:.1f}" height="{h_posted:.1f}" fill="{_POSTED}"/>'
                    f'<rect class="held" x="{x:.1f}" y="{base - h_posted - h_held:.1f}" '
                    f'width="{w:.1f}" height="{h_held:.1f}" fill="{_HELD}"/></g>')
    return (f'<svg id="{html.escape(css_id, quote=True)}" class="spark" '
            f'xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="'
            f'{html.escape(key, quote=True)}: share of budgets charged and held, by day">'
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#f7f8fa"/>'
            f'<line x1="0" y1="{base}" x2="{width}" y2="{base}" stroke="#c7ccd4"/>'
            f'{"".join(bars)}</svg>')


def spend_table(items: list[Spend], label: str, table_id: str) -> str:
    """The keys' budgets, charged, held, left and share used, each with its chart by day."""
    if not items:
        return (f'<p class="muted" id="{table_id}-empty">no runs admitted in the window</p>')
    head = ("<tr><th>" + html.escape(label) + "</th><th class=\"num\">runs</th>"
            "<th class=\"num\">budget</th><th class=\"num\">charged</th>"
            "<th class=\"num\">held</th><th class=\"num\">left</th><th class=\"num\">used</th>"
            "<th>share of each day's budgets charged / held</th></tr>")
    rows = []
    for i, s in enumerate(items):
        rows.append(
            f"<tr><td>{_e(s.key if s.key is not None else '(none)')}</td>"
            f'<td class="num">{s.runs}</td><td class="num">{_money(s.budget)}</td>'
            f'<td class="num">{_money(s.posted)}</td><td class="num">{_money(s.held)}</td>'
            f'<td class="num">{_money(s.left)}</td>'
            f'<td class="num">{_e(used_share(s.posted, s.held, s.budget))}</td>'
            f"<td>{used_bars_svg(s, f'{table_id}-bars-{i}')}</td></tr>")
    return (f'<div class="scroll"><table id="{table_id}"><thead>{head}</thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def window(now: float, days: int) -> tuple[float, float]:
    """The last ``days`` UTC days up to ``now``: (midnight ``days - 1`` days ago, now)."""
    today = now - now % DAY
    return today - (days - 1) * DAY, now


def spend_section(audit: Audit, now: float, days: int, *, by: str = "tenant",
                  label: str | None = None, limit: int = 10, table_id: str = "spend-table",
                  link: bool = True) -> str:
    """A section: spend against budgets by ``by`` over the last ``days`` days, by day."""
    since, until = window(now, days)
    page = audit.spend(by=by, label=label, since=since, until=until, every=DAY, limit=limit)
    name = label if by == "label" and label else by
    first = datetime.fromtimestamp(since, UTC)
    more = (' <a class="muted" href="/budgets">(by label, more days)</a>' if link else "")
    legend = (f'<p class="legend"><span class="legend-item"><span class="swatch" '
              f'style="background:{_POSTED}"></span>charged</span><span class="legend-item">'
              f'<span class="swatch" style="background:{_HELD}"></span>held</span>'
              f'<span class="muted">Runs count on the day they were admitted (UTC), with what '
              f"they were charged and hold now; a budget is what a Run was admitted with, less "
              f"what it carved for its children and what it gave back to its parent.</span>"
              f"</p>")
    return (f'<section id="spend"><h2>Spend against budgets by {_e(name)}, last {days} days '
            f'<span class="muted">(runs admitted since {first:%Y-%m-%d} UTC)</span>{more}'
            f"</h2>" + spend_table(page.items, name, table_id) + legend + "</section>")


__all__ = ["spend_section", "spend_table", "used_bars_svg", "used_share", "window"]
