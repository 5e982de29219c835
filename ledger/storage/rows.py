"""Rows read back as the ledger's records."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Row

from ledger.domain.facts import FailureFact
from ledger.domain.records import (
    AttemptKind,
    AttemptRecord,
    AttemptState,
    DebitState,
    RunRecord,
    RunStatus,
    from_micros,
)
from ledger.domain.values import Budget, Grant, GroupProjection, Health, Route
from ledger.storage import schema as s


@dataclass(frozen=True)
class SnapshotRows:
    """What one routing decision reads, in one read transaction
    (:meth:`ledger.storage.store.Store.turn_snapshot`).

    ``run`` holds the Run's live columns by name (counters, current route and profile, lease,
    compactions), not its frozen snapshots; ``now`` is the clock as read after the rows.
    """

    run: SimpleNamespace
    groups: dict[str, GroupProjection]
    health: dict[str, Health]
    provenance: dict[str, frozenset[str]]
    now: float
    unreceipted: tuple[str, ...] = ()  # the turn's Attempts sent before, without a receipt


# Every attempts column, for building a record from the values a transaction just wrote.
ATTEMPT_NULLS: dict[str, Any] = {c.name: None for c in s.attempts.c}



def run_record(row: Row[Any]) -> RunRecord:
    return RunRecord(
        run_id=row.run_id,
        parent_run_id=row.parent_run_id,
        role=row.role,
        tenant=row.tenant,
        labels=json.loads(row.labels),
        status=RunStatus(row.status),
        plan=[Route.model_validate(x) for x in json.loads(row.plan)],
        grant=Grant.model_validate(json.loads(row.run_grant)),
        budget=Budget.model_validate(json.loads(row.budget)),
        policy=json.loads(row.policy),
        policy_hash=row.policy_hash,
        selected_route=row.selected_route,
        content_hash=row.content_hash,
        deadline=row.deadline,
        calls_used=row.calls_used,
        retries_used=row.retries_used,
        reserved=from_micros(row.reserved_micros),
        posted=from_micros(row.posted_micros),
        tokens_used=row.tokens_used,
        tokens_reserved=row.tokens_reserved,
        carved_calls=row.carved_calls,
        carved_retries=row.carved_retries,
        carved=from_micros(row.carved_micros),
        carved_tokens=row.carved_tokens,
        returned_calls=row.returned_calls,
        returned_retries=row.returned_retries,
        returned=from_micros(row.returned_micros),
        returned_tokens=row.returned_tokens,
        current_route=row.current_route,
        current_profile=row.current_profile,
        lease_holder=row.lease_holder,
        fence=row.fence,
        lease_expires_at=row.lease_expires_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
        compactions=row.compactions,
        profile_compactions=row.profile_compactions,
    )


def attempt_record(row: Any, debit_state: str | None) -> AttemptRecord:
    return AttemptRecord(
        attempt_id=row.attempt_id,
        run_id=row.run_id,
        turn_id=row.turn_id,
        seq=row.seq,
        kind=AttemptKind(row.kind),
        route_id=row.route_id,
        provider=row.provider,
        model=row.model,
        group_id=row.group_id,
        profile_id=row.profile_id,
        debit_id=row.debit_id,
        envelope_hash=row.envelope_hash,
        state=AttemptState(row.state),
        reject_reason=row.reject_reason,
        fact=FailureFact.model_validate_json(row.fact) if row.fact else None,
        category=row.category,
        http_status=row.http_status,
        effective_output=bool(row.effective_output),
        tool_started=bool(row.tool_started),
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        cost=from_micros(row.cost_micros) if row.cost_micros is not None else None,
        reserved=from_micros(row.reserved_micros),
        reserved_tokens=row.reserved_tokens or 0,
        model_reported=row.model_reported,
        output_hash=row.output_hash,
        fence=row.fence,
        executor=row.executor,
        created_at=row.created_at,
        settled_at=row.settled_at,
        debit_state=DebitState(debit_state) if debit_state else None,
        latency_s=_float(getattr(row, "latency_s", None)),
        first_byte_s=_float(getattr(row, "first_byte_s", None)),
        first_token_s=_float(getattr(row, "first_token_s", None)),
        cached_tokens=getattr(row, "cached_tokens", None),
        reasoning_tokens=getattr(row, "reasoning_tokens", None),
    )


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def written_attempt(values: Mapping[str, Any], debit_state: str | None) -> AttemptRecord:
    """An AttemptRecord from column values this transaction wrote, converted exactly as a row
    read back would be (times are stored as double precision)."""
    cols = {**ATTEMPT_NULLS, **values}
    for name in ("created_at", "settled_at", "latency_s", "first_byte_s", "first_token_s"):
        if cols[name] is not None:
            cols[name] = float(cols[name])
    return attempt_record(SimpleNamespace(**cols), debit_state)


def health_record(row: Any) -> Health:
    return Health(
        key=row.key,
        cooldown_until=row.cooldown_until,
        disabled_until=row.disabled_until,
        disabled_reason=row.disabled_reason,
        error_count=row.error_count,
        failure_counts=json.loads(row.failure_counts or "{}"),
        last_failure_at=row.last_failure_at,
        counted_at=row.counted_at,
        last_used=row.last_used,
        last_probe_at=row.last_probe_at,
        reset_at=row.reset_at,
        recent_failures=tuple(float(t) for t in json.loads(row.recent_failures))
        if row.recent_failures else (),
    )
