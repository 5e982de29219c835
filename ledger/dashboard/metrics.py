"""The ``/metrics`` endpoint's body: the Prometheus text exposition format (version 0.0.4).

Written by hand rather than through ``prometheus_client``: the values are read from the ledger
at scrape time (nothing accumulates in this process), so a registry adds nothing but a
dependency; ``tests/audit/test_dashboard.py`` parses the output with ``prometheus_client``'s own
parser to hold it to the format.

Counters (``_total``) are totals over the ledger's whole history, so they keep rising across
dashboard restarts and hosts; gauges are "now".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal

from ledger.ops.audit import MetricsSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str | None]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v or "")}"' for k, v in labels.items()) + "}"


def _num(v: int | float | Decimal) -> str:
    if isinstance(v, Decimal):
        return format(v.normalize(), "f")
    return repr(float(v)) if isinstance(v, float) else str(v)


def _family(name: str, kind: str, help_text: str,
            samples: Iterable[tuple[Mapping[str, str | None], int | float | Decimal]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(lab)} {_num(v)}" for lab, v in samples]
    return "\n".join(lines) + "\n"


def exposition(m: MetricsSnapshot) -> str:
    """The whole scrape body."""
    parts = [
        _family("ledger_attempts_total", "counter",
                "Attempts recorded, by route and outcome (attempt state).",
                [({"route": r, "outcome": o}, n) for (r, o), n in sorted(m.attempts.items())]),
        _family("ledger_failovers_total", "counter",
                "Failovers: the selector moved a request to another route (move events).",
                [({}, m.failovers)]),
        _family("ledger_cooldowns_active", "gauge",
                "Routes and credential profiles cooling or disabled, and capacity groups "
                "not open, now.",
                [({"kind": k}, n) for k, n in sorted(m.cooldowns.items())]),
        _family("ledger_budget_posted_total", "counter",
                "Cost posted by settled attempts, per tenant, in the ledger's currency unit.",
                [({"tenant": t}, v) for t, v in sorted(m.posted.items(),
                                                        key=lambda x: x[0] or "")]),
        _family("ledger_budget_reserved", "gauge",
                "Cost held now by attempts not yet settled (or of unknown outcome), per tenant.",
                [({"tenant": t}, v) for t, v in sorted(m.reserved.items(),
                                                        key=lambda x: x[0] or "")]),
        _family("ledger_runs_total", "counter", "Runs admitted, per tenant.",
                [({"tenant": t}, n) for t, n in sorted(m.runs.items(),
                                                        key=lambda x: x[0] or "")]),
        _family("ledger_scrape_timestamp_seconds", "gauge",
                "The ledger clock's time of this scrape (epoch seconds).", [({}, m.now)]),
    ]
    return "".join(parts)


__all__ = ["CONTENT_TYPE", "exposition"]
