"""The dashboard's replay page (``/replay``): what another policy would have done.

Server-rendered like the other pages (no script, inline CSS): a form to choose a preset and a
window, then the report of :meth:`ledger.ops.audit.Audit.replay` — the figures under both
policies side by side, the differences grouped with examples linking to each Run's timeline,
how much rests on estimates, and what could not be replayed. The dashboard replays presets
only: it never reads a file named in a request.
"""

from __future__ import annotations

import html
from decimal import Decimal
from typing import Any

from ledger.dashboard.links import run_href
from ledger.domain.timefmt import iso
from ledger.ops.replay import ReplayReport, Totals
from ledger.policy import PRESETS


def _e(v: Any) -> str:
    return html.escape(str(v))


def _num(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def _money(d: Decimal) -> str:
    return f"{d:.6f}"


def _delta(a: float, b: float, better: int = 0) -> str:
    """The change from ``a`` to ``b``, green where it goes the ``better`` way (+1 up, -1 down;
    0: neither)."""
    d = b - a
    if abs(d) < 0.05:
        return '<span class="muted">=</span>'
    cls = "" if not better else "succeeded" if d * better > 0 else "failed"
    return f'<span class="{cls}">{"+" if d > 0 else ""}{_num(round(d, 1))}</span>'


def replay_form(policy: str | None, hours: float, tenant: str | None, run: str | None) -> str:
    """The form that chooses what to replay (a GET to ``/replay``)."""
    options = "".join(f'<option value="{_e(p)}"{" selected" if p == policy else ""}>{_e(p)}'
                      "</option>" for p in PRESETS)
    return (
        '<section id="replay-form"><h2>Should we change policy?</h2>'
        '<p class="muted">Replays every decision recorded in the window under another policy, '
        "on the recorded facts: no provider is called and nothing is written. Where it would "
        "try a route that was not tried at that moment, the outcome is estimated from other "
        "runs' attempts on that route in the window.</p>"
        '<form action="/replay" method="get">'
        f'policy <select name="policy" id="replay-policy">{options}</select> '
        f'runs admitted in the last <input name="hours" value="{_num(hours)}" size="5"> h '
        f'tenant <input name="tenant" value="{_e(tenant or "")}" size="12"> '
        f'run <input name="run" value="{_e(run or "")}" size="24"> '
        "<button>replay</button></form></section>")


def _totals(rep: ReplayReport) -> str:
    b, o = rep.baseline, rep.replayed

    def lat(t: Totals) -> str:
        return "-" if t.latency_s is None else f"{t.latency_s:.2f} s"

    rows = [("turns", _num(b.turns), _num(o.turns), _delta(b.turns, o.turns)),
            ("served", _num(b.served), _num(o.served), _delta(b.served, o.served, +1)),
            ("stopped", _num(b.stopped), _num(o.stopped), _delta(b.stopped, o.stopped, -1)),
            ("open (in flight, no evidence)", _num(b.open), _num(o.open),
             _delta(b.open, o.open, -1)),
            ("attempts", _num(b.attempts), _num(o.attempts),
             _delta(b.attempts, o.attempts, -1)),
            ("cost", _money(b.cost), _money(o.cost), ""),
            ("latency, mean a turn", lat(b), lat(o), ""),
            ("runs stopped", _num(b.runs_stopped), _num(o.runs_stopped),
             _delta(b.runs_stopped, o.runs_stopped, -1))]
    body = "".join(f'<tr><td>{_e(k)}</td><td class="num">{x}</td><td class="num">{y}</td>'
                   f'<td class="num">{d}</td></tr>' for k, x, y, d in rows)
    return ('<section id="replay-totals"><h2>Under both policies</h2><div class="scroll">'
            '<table id="replay-totals-table"><thead><tr><th></th>'
            f'<th class="num">recorded ({_e(", ".join(rep.recorded) or "-")})</th>'
            f'<th class="num">{_e(rep.policy)}</th><th class="num">change</th></tr></thead>'
            f"<tbody>{body}</tbody></table></div>"
            '<p class="muted">Replayed figures are expected values where they rest on '
            "estimates; a run the replayed policy stops makes no further turns.</p></section>")


def _findings(rep: ReplayReport) -> str:
    nothing = rep.not_replayed()
    if nothing is not None:
        return ('<section id="replay-findings"><h2>Differences</h2><p class="muted" '
                f'id="replay-findings-empty">Nothing was replayed: {_e(nothing)}.</p>'
                "</section>")
    if not rep.findings:
        return ('<section id="replay-findings"><h2>Differences</h2><p class="muted" '
                f'id="replay-findings-empty">{_e(rep.policy)} decides every replayed decision '
                "as recorded.</p></section>")
    rows = []
    for f in rep.findings:
        examples = "<br>".join(
            f'<a href="{html.escape(run_href(e.run_id), quote=True)}">{_e(e.run_id)}</a> '
            f'<span class="muted">{_e(e.turn_id)}, {_e(iso(e.at))}: {_e(e.recorded)} &rarr; '
            f"{_e(e.replayed)}</span>" for e in f.examples)
        rows.append(f'<tr><td class="num">{f.count}</td><td>{_e(f.text)}</td>'
                    f"<td>{examples}</td></tr>")
    return ('<section id="replay-findings"><h2>Differences, largest first</h2>'
            '<div class="scroll"><table id="replay-findings-table"><thead><tr>'
            '<th class="num">count</th><th>what the other policy would have done</th>'
            f'<th>examples</th></tr></thead><tbody>{"".join(rows)}</tbody></table></div>'
            "</section>")


def replay_html(rep: ReplayReport) -> str:
    """The report of one replay as the page's sections."""
    est, cov, chk = rep.estimates, rep.coverage, rep.check
    cost_share = (100 * est.cost / rep.replayed.cost) if rep.replayed.cost else Decimal(0)
    tiles = (
        '<section id="replay-summary"><h2>Replay of '
        f'<span id="replay-policy-name">{_e(rep.policy)}</span> '
        f'<span class="muted">{_e(rep.policy_hash[:19])}, {rep.runs} runs admitted '
        f"{_e(iso(rep.since))} to {_e(iso(rep.until))}</span></h2>"
        '<div class="tiles">'
        f'<div class="tile">decisions replayed<b id="replay-decisions">{rep.decisions}</b>'
        f'<span class="muted">{chk.agree} of {chk.decisions} recomputed exactly as recorded'
        "</span></div>"
        f'<div class="tile">decided differently<b id="replay-differing">{rep.differing}</b>'
        f'<span class="muted">{len(rep.findings)} groups</span></div>'
        f'<div class="tile">resting on estimates<b id="replay-estimated">'
        f"{100 * est.share:.1f}%</b><span class=\"muted\">of the replayed attempts; "
        f"{cost_share:.1f}% of its cost; {est.decisions} decisions in {est.runs} runs</span>"
        "</div>"
        f'<div class="tile">not replayed<b>{cov.decisions_without_inputs}</b>'
        '<span class="muted">decisions recorded without their inputs</span></div>'
        "</div></section>")
    notes = "".join(f"<li>{_e(w)}</li>" for w in cov.world)
    if chk.disagree:
        notes += "".join(f'<li class="failed">recorded decision of {_e(e.run_id)} '
                         f"{_e(e.turn_id)} recomputed differently</li>" for e in chk.disagree)
    return (tiles + _totals(rep) + _findings(rep)
            + f'<section id="replay-notes"><h2>How it was replayed</h2><ul>{notes}</ul>'
            "</section>")


__all__ = ["replay_form", "replay_html"]
