"""The values the storage layer takes for its writes (built by ``ledger.api.facade``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.domain.facts import FailureFact
from ledger.domain.records import (
    AttemptKind,
    Lease,
    Outcome,
)
from ledger.domain.values import Budget, GroupMode, Health, Route, canonical_json
from ledger.domain.values import Grant as GrantModel

HealthUpdate = Callable[[Health], Health]

# Fields compared on a duplicate admission, in the order reported.
ADMISSION_FIELDS = (
    "parent_run_id", "role", "tenant", "labels", "plan", "run_grant", "budget", "policy_hash",
    "selected_route", "deadline",
)


def normal_admission_field(name: str, value: Any) -> Any:
    """A frozen field as compared on a repeated admission.

    JSON snapshots are re-read through their models, so ``1`` and ``"1.00"``, or lists that are
    sets, compare equal.
    """
    if value is None or name not in ("plan", "run_grant", "budget", "labels"):
        return value
    doc = json.loads(value)
    if name == "plan":
        return canonical_json([Route.model_validate(r) for r in doc])
    if name == "run_grant":
        return canonical_json(GrantModel.model_validate(doc))
    if name == "budget":
        return canonical_json(Budget.model_validate(doc))
    return canonical_json(doc)


@dataclass(frozen=True)
class AdmitSpec:
    """One admission, checked and hashed by the facade: the frozen Run as the store writes it."""

    run_id: str
    parent_run_id: str | None
    parent_lease: Lease | None
    role: str
    tenant: str | None
    labels: str  # JSON
    plan: str  # JSON
    run_grant: str  # JSON
    budget: str  # JSON
    policy: str  # JSON
    policy_hash: str
    selected_route: str
    content_hash: str
    deadline: float | None
    max_calls: int
    max_retries: int
    max_cost_micros: int
    max_tokens: int | None


@dataclass(frozen=True)
class BeginSpec:
    """One begin: the Attempt to record under the lease ``fence`` held by ``executor``.

    ``take_retry``: the Attempt is a further one of its turn and takes one retry permission in
    the same transaction. ``reserve_tokens``: the token hold (prompt estimate + max output).
    """

    run_id: str
    fence: int
    attempt_id: str
    turn_id: str
    kind: AttemptKind
    route: Route
    profile_id: str | None
    envelope_hash: str
    reserve_micros: int
    executor: str | None
    begin_hash: str
    events: Sequence[tuple[str, dict[str, Any]]] = ()
    tenant: str | None = None
    take_retry: bool = False
    reserve_tokens: int = 0
    # When the group is full: wait in its queue until then (epoch seconds); ``None`` refuses
    # (a ``rejected`` Attempt), as a host's own begin does.
    queue_until: float | None = None


@dataclass(frozen=True)
class GroupUpdate:
    """A capacity-group fact written by settle: a cooldown with a waiting floor."""

    mode: GroupMode
    until: float | None
    reason: str


@dataclass(frozen=True)
class SettleSpec:
    """One settle under the lease ``fence``.

    ``cost_micros`` and the token counts are what the provider reported (``None``: not reported);
    what that does to the holds is :func:`ledger.decide.settle.settle_holds`, applied to the Attempt
    as locked.
    """

    attempt_id: str
    fence: int
    outcome: Outcome
    fact: FailureFact | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_micros: int | None
    effective_output: bool
    tool_started: bool
    model_reported: str | None
    output_hash: str | None
    settle_hash: str
    health: Mapping[str, tuple[str, str | None, HealthUpdate]]  # key -> (kind, provider, update)
    group_update: GroupUpdate | None
    events: Sequence[tuple[str, dict[str, Any]]] = ()
    # Content hashes of every output part (text, tool calls) recorded as the Attempt's
    # provenance, beside ``output_hash``.
    provenance: tuple[str, ...] = ()
    # The parts of the prompt tokens served from the provider's cache and of the completion
    # tokens spent reasoning, where the provider reported them.
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    # Seconds from the begin to the response's first byte and to a stream's first content,
    # by the ledger's clock (a measurement: not part of the settle hash).
    first_byte_s: float | None = None
    first_token_s: float | None = None
    # A success leaves the Run's current profile as it is (only its current route moves):
    # the session's user-pinned profile outlives a failover to another one (seed 002, "stay
    # locked to that profile ... until a new session starts"). Not part of the settle hash:
    # it is the session's state, not the receipt.
    keep_profile: bool = False


@dataclass(frozen=True)
class ReceiptSpec:
    """An operator's evidence for an ``unknown`` Attempt (``Ledger.settle_unknown``).

    ``outcome`` is ``succeeded``, ``failed`` or ``not_sent``; the counts and ``cost_micros``
    are what the evidence says (``None``: not known; then the whole hold is posted for a
    succeeded or failed outcome, as a settle without usage posts it). ``by`` and ``note`` say
    who recorded it and why.
    """

    attempt_id: str
    outcome: Outcome
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_micros: int | None
    by: str
    note: str | None
    # Only an Attempt begun under this fence is settled (``None``: any): the retry owner's own
    # late resolution of a begin it never sent (:mod:`ledger.decide.resolve`) names its fence.
    fence: int | None = None
    # Audit events written in the same transaction, beside the ``late_receipt`` event.
    events: Sequence[tuple[str, dict[str, Any]]] = ()
