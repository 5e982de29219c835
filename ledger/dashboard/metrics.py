"""The ``/metrics`` endpoint's body, built with ``prometheus_client``.

The values are read from the ledger at scrape time (:meth:`ledger.ops.audit.Audit.metrics`):
nothing accumulates in this process, so counters (``_total``) are totals over the ledger's whole
history and keep rising across dashboard restarts and hosts, and gauges are "now". An attempt's
counters and histograms count it once it is settled for good, under the state it keeps; while
it is dispatching or unknown it is in a gauge (``ledger_attempts_in_flight``,
``ledger_attempts_unknown``), so no counter goes down when its state changes. That is a
*custom collector* in ``prometheus_client``'s terms: :class:`LedgerCollector` turns one
:class:`~ledger.ops.audit.MetricsSnapshot` into metric families, registered in a registry of its
own (never the process's global one), and the client library writes the exposition, in the
format the scraper asks for (:func:`encode`: the text format 0.0.4, or OpenMetrics).

Names follow OpenTelemetry's, as ``ledger.telemetry`` reports the same measurements and as
OpenTelemetry's Prometheus exporter would write them (dots become underscores, the unit
``s`` becomes ``_seconds``, a counter gains ``_total``): the GenAI semantic conventions' where
they define one (``gen_ai.client.operation.time_to_first_chunk``, ``gen_ai.token.type``), the
ledger's own (``ledger.*``) elsewhere; labels are the attribute names the same way
(the attribute ledger.route is the label ``ledger_route``). The list is in ``docs/operations.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from decimal import Decimal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from ledger.ops.audit import Histogram, MetricsSnapshot


def _tenant(t: str | None) -> str:
    return t or ""


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out = [(repr(float(b)), float(c)) for b, c in zip(h.bounds, h.counts, strict=True)]
    out.append(("+Inf", float(h.count)))
    return out


def _gauge(name: str, doc: str, label: str, values: Mapping[str, int]) -> GaugeMetricFamily:
    """A gauge of one label, a sample per key of ``values`` (sorted, so scrapes read alike)."""
    gauge = GaugeMetricFamily(name, doc, labels=[label])
    for key, n in sorted(values.items()):
        gauge.add_metric([key], n)
    return gauge


def _histogram(name: str, doc: str, labels: list[str],
               samples: Mapping[tuple[str, str], Histogram]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=labels, unit="seconds")
    for key, h in sorted(samples.items()):
        fam.add_metric(list(key), _buckets(h), h.sum)
    return fam


def _by_tenant(fam: CounterMetricFamily | GaugeMetricFamily,
               values: Mapping[str | None, int | Decimal]) -> Metric:
    for tenant, v in sorted(values.items(), key=lambda x: _tenant(x[0])):
        fam.add_metric([_tenant(tenant)], float(v))
    return fam


def families(m: MetricsSnapshot) -> Iterator[Metric]:
    """The snapshot as metric families, in a stable order."""
    route_outcome = ["ledger_route", "ledger_outcome"]
    attempts = CounterMetricFamily(
        "ledger_attempts", "Attempts settled for good, by route and outcome (attempt state: "
        "every one but dispatching and unknown, which are the gauges ledger_attempts_in_flight "
        "and ledger_attempts_unknown until they settle).", labels=route_outcome)
    for (route, outcome), n in sorted(m.attempts.items()):
        attempts.add_metric([route, outcome], n)
    yield attempts
    yield _gauge("ledger_attempts_in_flight",
                 "Attempts dispatching now (begun, not settled), by route.", "ledger_route",
                 m.in_flight)
    yield _gauge("ledger_attempts_unknown", "Attempts of unknown outcome now (sent, no receipt; "
                 "until settled with evidence), by route.", "ledger_route", m.unknown)
    yield _histogram(
        "ledger_attempt_duration",
        "Attempt latency: from its begin to its settle by its executor, by the ledger's clock.",
        route_outcome, m.latency)
    yield _histogram(
        "gen_ai_client_operation_time_to_first_chunk",
        "Time to a streamed answer's first content (text or a tool-call fragment), from the "
        "Attempt's begin, by the ledger's clock; streamed attempts only.",
        route_outcome, m.first_token)
    yield _histogram(
        "ledger_attempt_time_to_first_byte",
        "Time to the response's first byte (its status line and headers), from the Attempt's "
        "begin, by the ledger's clock.",
        route_outcome, m.first_byte)
    tokens = CounterMetricFamily(
        "ledger_tokens", "Tokens the providers reported, by route and gen_ai.token.type: "
        "input and output, and the parts of those read from the provider's cache (cache_read) "
        "and spent reasoning (reasoning).", labels=["ledger_route", "gen_ai_token_type"])
    for (route, kind), n in sorted(m.tokens.items()):
        tokens.add_metric([route, kind], n)
    yield tokens
    cost = CounterMetricFamily(
        "ledger_cost", "Cost charged to budgets (posted debits) by attempts on each route, "
        "in the ledger's currency unit.", labels=["ledger_route"])
    for route, v in sorted(m.cost.items()):
        cost.add_metric([route], float(v))
    yield cost
    failovers = CounterMetricFamily(
        "ledger_failovers", "Failovers: the selector moved a request to another route (move "
        "events), by the routes and the failure category that caused it.",
        labels=["ledger_route_from", "ledger_route_to", "ledger_failure_category"])
    for (src, dst, cat), n in sorted(m.failovers_by.items()):
        failovers.add_metric([src, dst, cat], n)
    yield failovers
    yield _histogram(
        "ledger_capacity_wait_duration",
        "Waits of a turn in a full capacity group's queue, by group and how the wait ended "
        "(admitted, rejected, timed_out, redecided).",
        ["ledger_capacity_group", "ledger_outcome"], m.queue_waits)
    yield _gauge("ledger_capacity_waiting", "Turns waiting in a full capacity group's queue "
                 "now; every limited group has its series (0 while nobody waits).",
                 "ledger_capacity_group", m.waiting)
    yield _gauge("ledger_cooldowns_active", "Routes and credential profiles cooling or "
                 "disabled, and capacity groups not open, now.", "ledger_kind", m.cooldowns)
    yield _by_tenant(CounterMetricFamily(
        "ledger_budget_posted", "Cost posted by settled attempts, per tenant, in the ledger's "
        "currency unit.", labels=["ledger_tenant"]), m.posted)
    yield _by_tenant(GaugeMetricFamily(
        "ledger_budget_held", "Cost held now by attempts not yet settled (or of unknown "
        "outcome), per tenant.", labels=["ledger_tenant"]), m.reserved)
    yield _by_tenant(CounterMetricFamily(
        "ledger_runs", "Runs admitted, per tenant.", labels=["ledger_tenant"]), m.runs)
    yield GaugeMetricFamily("ledger_scrape_timestamp_seconds",
                            "The ledger clock's time of this scrape (epoch seconds).",
                            value=m.now)


class LedgerCollector(Collector):
    """A collector of the snapshot ``snapshot()`` returns (read at each collection)."""

    def __init__(self, snapshot: Callable[[], MetricsSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return list(families(self.snapshot()))


def encode(m: MetricsSnapshot, accept: str | None) -> tuple[bytes, str]:
    """The scrape body for ``m`` and its content type, in the format ``accept`` asks for
    (``prometheus_client``'s negotiation: OpenMetrics, else the text format 0.0.4)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(lambda: m))
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


__all__ = ["LedgerCollector", "encode", "families"]
