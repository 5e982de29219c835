"""Server-rendered inline SVG charts: no JavaScript, no fonts or scripts fetched, nothing but
markup the page's Content-Security-Policy allows. Every text is escaped; every point carries a
``<title>`` so a hover shows the exact figure."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal

from ledger.ops.audit import ActivityBucket, DayCost, RouteSeries

# Distinguishable on white and for the common colour-vision deficiencies (Okabe-Ito + greys).
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#7f7f7f",
           "#1d2330")
_AXIS = "#6b7280"


def color(i: int) -> str:
    """The colour of the i-th series."""
    return PALETTE[i % len(PALETTE)]


def _hm(ts: float) -> str:
    return f"{datetime.fromtimestamp(ts, UTC):%m-%d %H:%M}"


def _nice_max(v: float) -> float:
    """The smallest 1/2/5 x 10^n at or above ``v`` (an axis top a reader can read)."""
    if v <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(v))
    for step in (1, 2, 5, 10):
        if step * mag >= v:
            return float(step * mag)
    return float(10 * mag)  # pragma: no cover


def axis_number(v: float) -> str:
    """An axis label as people write it: ``0.00005``, ``20``, ``1.5`` (never ``5e-05``)."""
    return format(Decimal(repr(float(v))).normalize(), "f")


def chart_window(now: float, hours: float) -> tuple[float, float, int]:
    """The activity chart's (since, until, buckets) for the last ``hours`` hours at ``now``.

    A whole number of hours, a day to a week, is charted in buckets of whole hours (24 to 48)
    that start on the hour and end with the hour ``now`` is in: their counts come from the
    hourly roll-ups (:meth:`ledger.ops.audit.Audit.activity`), and the chart covers ``hours``
    hours at least, less than one bucket more. A shorter or fractional span, whose attempts
    are few enough to count one by one, keeps 48 equal slices of exactly
    ``[now - hours h, now)``. A span of more than a week is charted in whole UTC days that
    end with the day ``now`` is in, so that the days the roll-up folded
    (:data:`~ledger.domain.bounds.DEFAULT_FOLD_AFTER_S`: 8 days) are counted whole."""
    if hours < 24 or hours != int(hours):
        return now - hours * 3600, now, 48
    width = math.ceil(hours / 48)
    if hours > 7 * 24:
        until = (math.floor(now / 86400) + 1) * 86400.0
        span = hours + (until - now) / 3600  # to cover [now - hours h, now]
        width = 24 * math.ceil(span / 48 / 24)
        n = math.ceil(span / width)
        return until - n * width * 3600.0, until, n
    n = math.ceil(hours / width)
    until = (math.floor(now / 3600) + 1) * 3600.0
    return until - n * width * 3600.0, until, n


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
             f'<text x="0" y="{pad_t + 8}" font-size="11" fill="{_AXIS}">{top}</text>',
             f'<text x="0" y="{height - pad_b}" font-size="11" fill="{_AXIS}">0</text>',
             f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width}" y2="{height - pad_b}" '
             f'stroke="#c7ccd4"/>']
    for i, b in enumerate(buckets):
        x = pad_l + i * bw
        h_all = plot_h * b.attempts / top
        h_bad = plot_h * (b.failed + b.unknown) / top
        label = (f"{_hm(b.start)} UTC: {b.attempts} attempts, {b.failed} failed, "
                 f"{b.unknown} unknown")
        parts.append(f'<g><title>{html.escape(label)}</title>'
                     f'<rect x="{x:.1f}" y="{height - pad_b - h_all:.1f}" width="{bw * 0.85:.1f}"'
                     f' height="{h_all:.1f}" fill="#9aa5b8"/>'
                     f'<rect class="fail" x="{x:.1f}" y="{height - pad_b - h_bad:.1f}" '
                     f'width="{bw * 0.85:.1f}" height="{h_bad:.1f}" fill="#d64545"/></g>')
    parts.append(_time_axis([b.start for b in buckets], pad_l, bw, width, height))
    parts.append("</svg>")
    return "".join(parts)


def _time_axis(starts: Sequence[float], pad_l: float, bw: float, width: float,
               height: float) -> str:
    if not starts:
        return ""
    last = len(starts) - 1
    out = []
    for i, anchor in ((0, "start"), (last // 2, "middle"), (last, "end")):
        x = pad_l + (i + (1 if anchor == "end" else 0)) * bw  # keep the last label inside
        out.append(f'<text x="{min(x, width):.1f}" y="{height - 6}" font-size="11" '
                   f'text-anchor="{anchor}" fill="{_AXIS}">{_hm(starts[i])}</text>')
    return "".join(out)


def latency_top(series: list[RouteSeries]) -> float:
    """A shared latency axis top for every route's chart (so their heights compare)."""
    values = [p.latency_s for s in series for p in s.points if p.latency_s is not None]
    return _nice_max(max(values, default=0.0))


def sparkline_svg(s: RouteSeries, *, metric: str, top: float, css_id: str,
                  width: int = 320, height: int = 44, stroke: str = PALETTE[0]) -> str:
    """One route's ``metric`` over its buckets: ``success_rate`` (0-100 %) or ``latency_s``
    (0 to ``top`` seconds). A bucket with no value breaks the line, so a gap reads as "nothing
    sent", never as zero; each point's ``<title>`` gives the bucket's exact figures."""
    pad = 3
    n = max(1, len(s.points))
    step = (width - 2 * pad) / n
    plot_h = height - 2 * pad
    segments: list[list[str]] = [[]]
    dots = []
    for j, p in enumerate(s.points):
        v = p.success_rate if metric == "success_rate" else p.latency_s
        if v is None:
            segments.append([])
            continue
        x = pad + (j + 0.5) * step
        y = pad + plot_h * (1 - min(v, top) / top)
        segments[-1].append(f"{x:.1f},{y:.1f}")
        shown = f"{v * 100:.0f}%" if metric == "success_rate" else f"{v:.2f} s"
        tip = (f"{_hm(p.start)} UTC: {shown} ({p.succeeded} of "
               f"{p.succeeded + p.failed + p.unknown} succeeded, {p.attempts} attempts)")
        dots.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{stroke}">'
                    f"<title>{html.escape(tip)}</title></circle>")
    lines = "".join(f'<polyline fill="none" stroke="{stroke}" stroke-width="1.6" '
                    f'points="{" ".join(seg)}"/>' for seg in segments if seg)
    mid = pad + plot_h / 2
    return (f'<svg id="{html.escape(css_id, quote=True)}" class="spark" '
            f'xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="'
            f'{html.escape(s.route, quote=True)} {metric.replace("_", " ")} over time">'
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#f7f8fa"/>'
            f'<line x1="0" y1="{mid:.1f}" x2="{width}" y2="{mid:.1f}" stroke="#e3e6eb"/>'
            f'{lines}{"".join(dots)}</svg>')


def cost_days_svg(days: list[DayCost], day_starts: list[float], *, width: int = 660,
                  height: int = 200) -> str:
    """Stacked bars of cost per UTC day, one colour per tenant (the costliest first)."""
    pad_l, pad_b, pad_t = 60, 22, 12
    tenants: dict[str | None, Decimal] = {}
    for d in days:
        tenants[d.tenant] = tenants.get(d.tenant, Decimal(0)) + d.cost
    order = sorted(tenants, key=lambda t: (-tenants[t], t or ""))
    per_day: dict[float, dict[str | None, Decimal]] = {}
    for d in days:
        per_day.setdefault(d.day, {})[d.tenant] = d.cost
    top = _nice_max(float(max((sum(v.values(), Decimal(0)) for v in per_day.values()),
                              default=Decimal(0))))
    n = max(1, len(day_starts))
    bw = (width - pad_l - 4) / n
    plot_h = height - pad_b - pad_t
    parts = [f'<svg id="cost-days-chart" xmlns="http://www.w3.org/2000/svg" width="100%" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="cost per day by tenant">',
             f'<text x="{pad_l - 4}" y="{pad_t + 8}" font-size="11" text-anchor="end" '
             f'fill="{_AXIS}" id="cost-axis-top">{axis_number(top)}</text>',
             f'<text x="{pad_l - 4}" y="{height - pad_b}" font-size="11" text-anchor="end" '
             f'fill="{_AXIS}">0</text>',
             f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width}" y2="{height - pad_b}" '
             f'stroke="#c7ccd4"/>']
    for i, day in enumerate(day_starts):
        x = pad_l + i * bw
        y = float(height - pad_b)
        for k, tenant in enumerate(order):
            cost = per_day.get(day, {}).get(tenant)
            if not cost:
                continue
            h = plot_h * float(cost) / top
            y -= h
            tip = f"{datetime.fromtimestamp(day, UTC):%Y-%m-%d} {tenant or '(no tenant)'}: {cost}"
            parts.append(f'<rect x="{x + bw * 0.1:.1f}" y="{y:.1f}" width="{bw * 0.8:.1f}" '
                         f'height="{h:.1f}" fill="{color(k)}"><title>{html.escape(tip)}'
                         "</title></rect>")
        parts.append(f'<text x="{x + bw / 2:.1f}" y="{height - 6}" font-size="11" '
                     f'text-anchor="middle" fill="{_AXIS}">'
                     f"{datetime.fromtimestamp(day, UTC):%m-%d}</text>")
    parts.append("</svg>")
    legend = "".join(
        f'<span class="legend-item"><span class="swatch" style="background:{color(k)}">'
        f"</span>{html.escape(t or '(no tenant)')}</span>" for k, t in enumerate(order))
    return "".join(parts) + f'<p class="legend">{legend}</p>'


__all__ = ["PALETTE", "axis_number", "chart_svg", "chart_window", "color", "cost_days_svg",
           "latency_top", "sparkline_svg"]
