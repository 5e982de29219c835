"""Prices of routes that name none, from a maintained table, resolved once at admission.

A :class:`~ledger.domain.values.Route` whose ``price`` is ``None`` gets the price that the
`genai-prices <https://pypi.org/project/genai-prices/>`_ table gives for its provider and model
(the provider by id, e.g. ``openai``, ``anthropic``, ``gemini``; else by the route's endpoint
URL, e.g. ``https://api.openai.com/v1``), so cost budgets work without typing prices in. An
explicit ``Price`` always wins, ``Price()`` included (a route declared free).

Resolution happens at admission (:meth:`ledger.api.facade.Ledger.admit_run`), so the Run's frozen
plan carries the resolved price: its Attempts are costed and held under it for the Run's whole life,
and a later table update changes new Runs only. A child Run's unpriced routes take the price of
the parent's frozen snapshot, so a child always matches its parent's candidates.

When the table does not know a route and the Run has a cost budget (``max_cost > 0``),
admission fails with :class:`~ledger.errors.InvalidArgument` naming ``plan[i].price``: a silent
zero would let every call through a budget meant to bound it. With ``max_cost == 0`` (the Run
may spend nothing) such a route is frozen at ``Price()``.

The table gives USD per million tokens; the flat input/output price of a route is the table's
base tier (prompts below the first tier threshold, e.g. 200k tokens for some models). Cached
input, audio and per-request fees are not part of a route's price. The table's bundled data is
used as shipped: no network fetch happens here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from decimal import Decimal

from ledger.domain.values import Budget, Price, Route
from ledger.errors import InvalidArgument

# Tokens priced per lookup: small enough to stay in every table's base tier, large enough that
# the per-Mtok figure (x 1000) is exact in Decimal.
_PROBE_TOKENS = 1000


def _plain(d: Decimal) -> Decimal:
    """``2.5000`` -> ``2.5``, ``10.00`` -> ``10`` (no exponent form), for stable snapshots."""
    d = d.normalize()
    return d.quantize(Decimal(1)) if d == d.to_integral_value() else d


def lookup_price(provider: str, model: str, *, endpoint: str | None = None,
                 at: float | None = None) -> Price | None:
    """The table's price for ``provider``/``model`` at time ``at`` (epoch seconds; default now).

    ``None`` when the table knows neither the provider (by id or endpoint) nor the model.
    """
    from genai_prices import Usage, calc_price

    usage = Usage(input_tokens=_PROBE_TOKENS, output_tokens=_PROBE_TOKENS)
    when = datetime.fromtimestamp(at, UTC) if at is not None else None
    calc = None
    try:
        calc = calc_price(usage, model, provider_id=provider, genai_request_timestamp=when)
    except LookupError:
        if endpoint and endpoint.startswith(("http://", "https://")):
            with contextlib.suppress(LookupError):
                calc = calc_price(usage, model, provider_api_url=endpoint,
                                  genai_request_timestamp=when)
    if calc is None:
        return None
    scale = Decimal(1_000_000) / _PROBE_TOKENS
    return Price(input_per_mtok=_plain(calc.input_price * scale),
                 output_per_mtok=_plain(calc.output_price * scale))


def resolve_prices(plan: Sequence[Route], budget: Budget, *, at: float,
                   inherited: Iterable[Route] = ()) -> list[Route]:
    """The plan with every route priced.

    Explicit prices are kept, ``None`` is looked up (or taken from ``inherited``, a parent Run's
    frozen plan, by route id). See the module docstring.
    """
    parent = {r.id: r.price for r in inherited if r.price is not None}
    out: list[Route] = []
    for i, route in enumerate(plan):
        if route.price is not None:
            out.append(route)
            continue
        price = parent.get(route.id)
        if price is None:
            price = lookup_price(route.provider, route.model, endpoint=route.endpoint, at=at)
        if price is None:
            if budget.max_cost > 0:
                raise InvalidArgument(
                    f"plan[{i}] (route {route.id!r}) has no price and the price table does not "
                    f"know provider {route.provider!r} model {route.model!r}; with a cost budget "
                    f"(max_cost {budget.max_cost}) its calls cannot be costed. Give the route "
                    "price=Price(input_per_mtok=..., output_per_mtok=...) (Price() for a free "
                    "route), or use the provider and model names the table knows "
                    "(e.g. provider 'openai', model 'gpt-4o')",
                    field=f"plan[{i}].price", route=route.id, provider=route.provider,
                    model=route.model)
            price = Price()
        out.append(route.model_copy(update={"price": price}))
    return out


def same_route(given: Route, frozen: Route) -> bool:
    """Whether a caller's ``given`` route is the ``frozen`` snapshot.

    Equal, or equal but for a price left to the table (``None``) that admission resolved.
    """
    if given == frozen:
        return True
    return given.price is None and given.model_copy(update={"price": frozen.price}) == frozen


__all__ = ["lookup_price", "resolve_prices", "same_route"]
