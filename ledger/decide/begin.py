"""What beginning an Attempt records (pure): the frozen route it uses, and its hash.

The hash makes a repeated begin the same write.

A Run only ever uses its admitted candidates, under the snapshots frozen at admission, with one
of the route's own credential profiles; :func:`begin_spec` refuses anything else before the
storage layer sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ledger.decide.pricing import same_route
from ledger.domain.records import AttemptKind, FrozenRun, Lease
from ledger.domain.specs import BeginSpec
from ledger.domain.values import Route, content_hash
from ledger.errors import InvalidArgument


def frozen_route(run: FrozenRun, route: str | Route) -> Route:
    """The Run's frozen snapshot of ``route`` (an id, or a Route that must equal the snapshot).

    Raises :class:`~ledger.errors.InvalidArgument` (field ``route``) for a route outside the
    frozen plan or one that differs from its snapshot.
    """
    route_id = route if isinstance(route, str) else route.id
    try:
        snap = run.route(route_id)
    except KeyError:
        raise InvalidArgument(
            f"route {route_id!r} is not in the frozen plan of run {run.run_id!r} "
            f"({[r.id for r in run.plan]}); a run can only use its admitted candidates",
            field="route",
        ) from None
    if isinstance(route, Route) and not same_route(route, snap):
        raise InvalidArgument(
            f"route {route_id!r} differs from the snapshot frozen at admission; historical "
            "and new attempts use the frozen route", field="route",
        )
    return snap


def begin_spec(run: FrozenRun, lease: Lease, *, route: str | Route, profile_id: str | None,
               envelope_hash: str, reserve_micros: int, reserve_tokens: int, turn_id: str,
               kind: AttemptKind, attempt_id: str,
               events: Sequence[tuple[str, dict[str, Any]]], take_retry: bool,
               queue_until: float | None = None) -> BeginSpec:
    """The begin of one Attempt of ``run`` under ``lease``.

    ``queue_until`` is how long it may wait in its full capacity group's queue
    (:attr:`~ledger.domain.specs.BeginSpec.queue_until`).

    ``profile_id`` must be one of the route's credential profiles (or ``None``), else
    :class:`~ledger.errors.InvalidArgument` (field ``profile_id``). The begin hash leaves the
    lease's fence out: the same begin retried under a lease acquired again (after a lost
    acknowledgement) is the same write.
    """
    snap = frozen_route(run, route)
    if profile_id is not None and profile_id not in {p.id for p in snap.profiles}:
        known = ", ".join(repr(p.id) for p in snap.profiles)
        raise InvalidArgument(
            f"profile_id {profile_id!r} is not a credential profile of route {snap.id!r}; "
            + (f"pass one of {known}" if known else "the route has none: pass None"),
            field="profile_id")
    begin_hash = content_hash({
        "run": lease.run_id, "turn": turn_id, "route": snap.id, "profile": profile_id,
        "envelope": envelope_hash, "reserve": reserve_micros, "kind": kind.value,
        "tokens": reserve_tokens,
    })
    return BeginSpec(
        run_id=lease.run_id, fence=lease.fence, attempt_id=attempt_id, turn_id=turn_id,
        kind=kind, route=snap, profile_id=profile_id, envelope_hash=envelope_hash,
        reserve_micros=reserve_micros, executor=lease.executor, begin_hash=begin_hash,
        events=events, tenant=run.tenant, take_retry=take_retry, reserve_tokens=reserve_tokens,
        queue_until=queue_until,
    )


__all__ = ["begin_spec", "frozen_route"]
