"""The public ledger API: :class:`Ledger` (sync) and :class:`AsyncLedger` (async).

All logic lives in :class:`Ledger`; :class:`AsyncLedger` runs the same methods in a worker thread,
so there is one implementation of every check. Decisions that are pure (health effects, group
facts, hashes) are computed here from the Run's *frozen* policy and handed to the storage layer,
which applies them in the same transaction as the write.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from decimal import Decimal
from typing import Any, Concatenate, ParamSpec, TypeVar

from pydantic import ValidationError

from ledger.clock import Clock, SystemClock
from ledger.core.facts import FailureFact, Observation, Phase
from ledger.errors import InvalidArgument, NotFound, PolicyError
from ledger.model import Budget, Grant, GroupMode, GroupProjection, Health, Route, content_hash
from ledger.policy.model import Policy
from ledger.pricing import resolve_prices, same_route
from ledger.records import (
    AttemptKind,
    AttemptRecord,
    DebitRecord,
    EventRecord,
    Lease,
    Outcome,
    Page,
    RunRecord,
    RunStatus,
    to_micros,
)
from ledger.storage import engine as engine_mod
from ledger.storage import migrate
from ledger.storage.rows import new_id
from ledger.storage.specs import AdmitSpec, BeginSpec, GroupUpdate, SettleSpec
from ledger.storage.store import Store

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_LEASE_TTL_S = 30.0
# Classes a run may send to every recipient of its plan when the caller passes no grant.
DEFAULT_GRANT_CLASSES = ("user_input", "system", "tool_description")


def _resolve_policy(policy: Policy | str | Mapping[str, Any] | None) -> Policy:
    from ledger.policy.load import default_policy, load_policy

    if policy is None:
        return default_policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return load_policy(policy)
    try:
        return Policy.model_validate(dict(policy))
    except ValidationError as e:
        raise PolicyError(f"invalid policy object: {e.errors()[0]['msg']}") from e


def _policy_hash(policy: Policy) -> str:
    from ledger.policy.load import policy_hash

    return policy_hash(policy)


def validate_plan(plan: Sequence[Route]) -> None:
    if not plan:
        raise InvalidArgument("the candidate plan is empty; pass at least one Route", field="plan")
    seen: set[str] = set()
    for r in plan:
        if r.id in seen:
            raise InvalidArgument(f"route id {r.id!r} appears twice in the plan; ids must be "
                                  "unique", field="plan")
        seen.add(r.id)


def check_child_within_parent(parent: RunRecord, plan: Sequence[Route], grant: Grant) -> None:
    """A child inherits the parent's approved candidates and grant, never broader."""
    parent_routes = {r.id: r for r in parent.plan}
    for r in plan:
        if parent_routes.get(r.id) != r:
            raise InvalidArgument(
                f"child route {r.id!r} is not one of the parent's approved candidates (or differs "
                "from the parent's frozen snapshot); a child may only narrow the parent's plan",
                field="plan",
            )
    for recipient, classes in grant.recipients.items():
        allowed = set(parent.grant.recipients.get(recipient, []))
        extra = sorted(set(classes) - allowed)
        if extra:
            raise InvalidArgument(
                f"child grant approves {extra} for {recipient!r}, which the parent's grant does "
                "not; a child grant may only narrow the parent's",
                field="grant",
            )
    if grant.roles is not None and parent.grant.roles is not None:
        extra = sorted(set(grant.roles) - set(parent.grant.roles))
        if extra:
            raise InvalidArgument(f"child grant adds roles {extra} the parent lacks",
                                  field="grant.roles")


class Ledger:
    """A ledger over one database. Open with :meth:`open`."""

    def __init__(self, store: Store, clock: Clock | None = None,
                 executor_id: str | None = None) -> None:
        self.store = store
        self.clock: Clock = clock or SystemClock()
        self.executor_id = executor_id or new_id("exec")
        self._frozen: dict[str, RunRecord] = {}
        # Attempts this process began and has not settled: settle needs their route, profile
        # and hold, and reading them back would cost a transaction on the hot path.
        self._in_flight: dict[str, AttemptRecord] = {}
        self._policies: dict[str, Policy] = {}
        self._lock = threading.Lock()

    # -- opening --------------------------------------------------------------------------

    @classmethod
    def open(cls, url: str, *, clock: Clock | None = None, executor_id: str | None = None,
             migrate_schema: bool = True) -> Ledger:
        """Open (creating or upgrading the schema) a ledger at a SQLite path or a URL."""
        norm = engine_mod.normalize_url(url)
        eng = engine_mod.create(norm)
        if migrate_schema:
            try:
                migrate.upgrade(eng, norm)
            except BaseException:
                eng.dispose()
                raise
        return cls(Store(eng, norm), clock=clock, executor_id=executor_id)

    def close(self) -> None:
        self.store.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def backend(self) -> str:
        return self.store.dialect

    def now(self) -> float:
        return self.clock.now()

    # -- runs -----------------------------------------------------------------------------

    def admit_run(
        self,
        run_id: str,
        *,
        plan: Sequence[Route],
        budget: Budget | Mapping[str, Any],
        grant: Grant | None = None,
        policy: Policy | str | Mapping[str, Any] | None = None,
        role: str = "research",
        parent_run_id: str | None = None,
        parent_fence: int | None = None,
        tenant: str | None = None,
        labels: Mapping[str, str] | None = None,
        deadline: float | None = None,
        selected_route: str | None = None,
    ) -> RunRecord:
        """Admit a Run, freezing plan, grant, budget and policy. Idempotent per content."""
        if not run_id or not isinstance(run_id, str):
            raise InvalidArgument("run_id must be a non-empty string", field="run_id")
        if not isinstance(budget, Budget):
            try:
                budget = Budget.model_validate(dict(budget))
            except ValidationError as e:
                err = e.errors()[0]
                path = "budget." + ".".join(str(p) for p in err["loc"]) if err["loc"] else "budget"
                raise InvalidArgument(
                    f"invalid {path}: {err['msg']}; give max_calls, max_retries and max_cost as "
                    "non-negative numbers",
                    field=path,
                ) from e
        plan = list(plan)
        validate_plan(plan)
        parent = self.get_run(parent_run_id) if parent_run_id is not None else None
        # Unpriced routes get the price table's price, frozen with the plan (ledger.pricing).
        plan = resolve_prices(plan, budget, at=self.now(),
                              inherited=parent.plan if parent is not None else ())
        if grant is None:
            grant = Grant(recipients={r.recipient: list(DEFAULT_GRANT_CLASSES) for r in plan})
        pol = _resolve_policy(policy)
        selected = selected_route or plan[0].id
        if selected not in {r.id for r in plan}:
            raise InvalidArgument(f"selected_route {selected!r} is not in the plan",
                                  field="selected_route")
        if parent is not None:
            check_child_within_parent(parent, plan, grant)
        frozen = {
            "plan": [r.model_dump(mode="json") for r in plan],
            "grant": grant.model_dump(mode="json"),
            "budget": budget.model_dump(mode="json"),
            "policy_hash": _policy_hash(pol),
            "role": role,
            "parent": parent_run_id,
            "tenant": tenant,
            "labels": dict(labels or {}),
            "selected_route": selected,
            "deadline": deadline,
        }
        spec = AdmitSpec(
            run_id=run_id,
            parent_run_id=parent_run_id,
            parent_fence=parent_fence,
            role=role,
            tenant=tenant,
            labels=json.dumps(dict(labels or {}), sort_keys=True),
            plan=json.dumps(frozen["plan"], sort_keys=True),
            run_grant=json.dumps(frozen["grant"], sort_keys=True),
            budget=json.dumps(frozen["budget"], sort_keys=True),
            policy=json.dumps(pol.model_dump(mode="json"), sort_keys=True),
            policy_hash=str(frozen["policy_hash"]),
            selected_route=selected,
            content_hash=content_hash(frozen),
            deadline=deadline,
            max_calls=budget.max_calls,
            max_retries=budget.max_retries,
            max_cost_micros=to_micros(budget.max_cost),
            max_tokens=budget.max_tokens,
        )
        rec, _created = self.store.admit(spec, self.now())
        return rec

    def get_run(self, run_id: str) -> RunRecord:
        return self.store.get_run(run_id)

    def children(self, run_id: str) -> list[RunRecord]:
        return self.store.children(run_id)

    def frozen_run(self, run_id: str) -> RunRecord:
        """The run as admitted (its frozen parts never change, so this is cached)."""
        with self._lock:
            rec = self._frozen.get(run_id)
        if rec is None:
            rec = self.store.get_run(run_id)
            with self._lock:
                self._frozen[run_id] = rec
        return rec

    def run_policy(self, run_id: str) -> Policy:
        """The policy snapshot the run froze at admission."""
        with self._lock:
            pol = self._policies.get(run_id)
        if pol is None:
            pol = Policy.model_validate(self.frozen_run(run_id).policy)
            with self._lock:
                self._policies[run_id] = pol
        return pol

    def finish_run(self, run_id: str, fence: int, status: RunStatus | str) -> None:
        self.store.finish_run(run_id, fence, RunStatus(status), self.now())

    # -- leases ---------------------------------------------------------------------------

    def acquire_lease(self, run_id: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S,
                      executor_id: str | None = None) -> Lease:
        if ttl_s <= 0:
            raise InvalidArgument("ttl_s must be > 0", field="ttl_s")
        return self.store.acquire_lease(run_id, executor_id or self.executor_id, ttl_s,
                                        self.now())

    def renew_lease(self, lease: Lease, *, ttl_s: float = DEFAULT_LEASE_TTL_S) -> Lease:
        return self.store.renew_lease(lease.run_id, lease.fence, ttl_s, self.now())

    def release_lease(self, lease: Lease) -> None:
        self.store.release_lease(lease.run_id, lease.fence, self.now())

    def reserve_retry(self, lease: Lease, data: Mapping[str, Any] | None = None) -> int:
        """Take one bounded retry permission from the run; returns how many are left.

        ``data`` (e.g. the route and cause) is recorded with the permission as an audit event.
        """
        return self.store.reserve_retry(lease.run_id, lease.fence, self.now(), data)

    # -- attempts -------------------------------------------------------------------------

    def begin_attempt(
        self,
        lease: Lease,
        *,
        route: str | Route,
        envelope_hash: str,
        reserve: Decimal | int | str,
        turn_id: str = "turn-1",
        profile_id: str | None = None,
        kind: AttemptKind | str = AttemptKind.FIRST,
        attempt_id: str | None = None,
        events: Sequence[tuple[str, Mapping[str, Any]]] = (),
    ) -> AttemptRecord:
        """Record an Attempt (debit held, capacity slot taken) before its request is sent."""
        run = self.frozen_run(lease.run_id)
        route_id = route if isinstance(route, str) else route.id
        try:
            snap = run.route(route_id)
        except KeyError:
            raise InvalidArgument(
                f"route {route_id!r} is not in run {run.run_id!r}'s frozen plan "
                f"({[r.id for r in run.plan]}); a run can only use its admitted candidates",
                field="route",
            ) from None
        if isinstance(route, Route) and not same_route(route, snap):
            raise InvalidArgument(
                f"route {route_id!r} differs from the snapshot frozen at admission; historical "
                "and new attempts use the frozen route", field="route",
            )
        if profile_id is not None and snap.profiles and profile_id not in {
            p.id for p in snap.profiles
        }:
            raise InvalidArgument(f"profile {profile_id!r} is not a profile of route {route_id!r}",
                                  field="profile_id")
        reserve_micros = to_micros(reserve)
        if reserve_micros < 0:
            raise InvalidArgument("reserve must be >= 0", field="reserve")
        kind = AttemptKind(kind)
        attempt_id = attempt_id or new_id("att")
        begin_hash = content_hash({
            "run": lease.run_id, "turn": turn_id, "route": route_id, "profile": profile_id,
            "envelope": envelope_hash, "reserve": reserve_micros, "kind": kind.value,
            "fence": lease.fence,
        })
        spec = BeginSpec(
            run_id=lease.run_id, fence=lease.fence, attempt_id=attempt_id, turn_id=turn_id,
            kind=kind, route=snap, profile_id=profile_id, envelope_hash=envelope_hash,
            reserve_micros=reserve_micros, executor=lease.executor, begin_hash=begin_hash,
            events=[(k, dict(d)) for k, d in events], tenant=run.tenant,
        )
        rec = self.store.begin_attempt(spec, self.now())
        with self._lock:
            if len(self._in_flight) >= 10_000:
                self._in_flight.clear()  # a bound, not a correctness matter: settle re-reads
            self._in_flight[rec.attempt_id] = rec
        return rec

    def settle_attempt(
        self,
        lease: Lease,
        attempt_id: str,
        *,
        outcome: Outcome | str,
        fact: FailureFact | None = None,
        observation: Observation | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cost: Decimal | int | str | None = None,
        effective_output: bool | None = None,
        tool_started: bool | None = None,
        model_reported: str | None = None,
        output_hash: str | None = None,
        events: Sequence[tuple[str, Mapping[str, Any]]] = (),
    ) -> AttemptRecord:
        """Record an Attempt's outcome; health and group facts update in the same transaction."""
        from ledger.core.classify import classify
        from ledger.effects import group_update, health_updates

        outcome = Outcome(outcome)
        pol = self.run_policy(lease.run_id)
        now = self.now()
        if outcome is Outcome.FAILED and fact is None:
            if observation is None:
                raise InvalidArgument(
                    "a failed outcome needs a fact or an observation to classify",
                    field="fact",
                )
            fact = classify(observation, pol, now=now)
        if outcome is Outcome.SUCCEEDED and (fact is not None or observation is not None):
            raise InvalidArgument("a succeeded outcome carries no failure fact", field="fact")
        eff = bool(effective_output if effective_output is not None
                   else (fact.effective_output if fact else False))
        tool = bool(tool_started if tool_started is not None
                    else (fact.tool_started if fact else False))
        for name, v in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens)):
            if v is not None and v < 0:
                raise InvalidArgument(f"{name} must be >= 0", field=name)
        cost_micros = to_micros(cost) if cost is not None else None
        if cost_micros is not None and cost_micros < 0:
            raise InvalidArgument("cost must be >= 0", field="cost")
        with self._lock:
            known = self._in_flight.get(attempt_id)
        att = known if known is not None else self.store.get_attempt(attempt_id)
        if att.run_id != lease.run_id:
            raise NotFound(f"attempt {attempt_id!r} does not belong to run {lease.run_id!r}",
                           attempt_id=attempt_id, run_id=lease.run_id)
        if (cost_micros is None and outcome is Outcome.FAILED and fact is not None
                and fact.phase in (Phase.AFTER_SEND, Phase.MID_STREAM)):
            # It ran (or may have) and reported no usage: post the whole hold, never zero.
            cost_micros = to_micros(att.reserved)
        run = self.frozen_run(lease.run_id)
        route = run.route(att.route_id)
        # Provably never sent: the hold is voided. Anything later keeps or posts it.
        void = outcome is Outcome.FAILED and fact is not None and fact.phase is Phase.BEFORE_SEND
        settle_hash = content_hash({
            "outcome": outcome.value,
            "fact": fact.to_json() if fact else None,
            "tokens": [prompt_tokens, completion_tokens],
            "cost": cost_micros, "eff": eff, "tool": tool, "model": model_reported,
            "output": output_hash,
        })
        spec = SettleSpec(
            attempt_id=attempt_id, fence=lease.fence, outcome=outcome, fact=fact,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cost_micros=cost_micros, effective_output=eff, tool_started=tool,
            model_reported=model_reported, output_hash=output_hash, settle_hash=settle_hash,
            void_hold=void,
            health=health_updates(pol, route, att.profile_id, outcome, fact, now),
            group_update=group_update(pol, fact, now) if outcome is Outcome.FAILED else None,
            events=[(k, dict(d)) for k, d in events],
        )
        done = self.store.settle_attempt(lease.run_id, spec, now)
        with self._lock:
            self._in_flight.pop(attempt_id, None)
        return done

    def mark_unknown(self, lease: Lease, attempt_id: str, reason: str) -> AttemptRecord:
        return self.store.mark_unknown(lease.run_id, attempt_id, lease.fence, self.now(), reason)

    # -- groups, health, provenance, events -------------------------------------------------

    def configure_group(self, group: str, *, max_in_flight: int | None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise InvalidArgument("max_in_flight must be >= 1 (or None for no limit)",
                                  field="max_in_flight")
        self.store.configure_group(group, max_in_flight, self.now())

    def set_group_state(self, group: str, mode: GroupMode | str, *, until: float | None,
                        reason: str = "operator") -> None:
        self.store.set_group_mode(group, GroupUpdate(GroupMode(mode), until, reason), self.now())

    def group_projections(self, groups: Sequence[str] | None = None
                          ) -> dict[str, GroupProjection]:
        return self.store.group_projections(groups, self.now())

    def health(self, keys: Sequence[str] | None = None) -> dict[str, Health]:
        return self.store.health(keys)

    def claim_probe(self, route: Route, interval_s: float) -> bool:
        return self.store.claim_probe(route.id, route.provider, self.now(), interval_s)

    def record_provenance(self, lease: Lease, ref: str, content_hash: str,
                          kind: str = "tool_result") -> None:
        self.store.record_provenance(lease.run_id, lease.fence, ref, content_hash, kind,
                                     self.now())

    def provenance(self, run_id: str) -> dict[str, set[str]]:
        """Recorded outputs of this run and its ancestors: ref -> content hashes."""
        ids = [run_id]
        run = self.frozen_run(run_id)
        while run.parent_run_id is not None:
            ids.append(run.parent_run_id)
            run = self.frozen_run(run.parent_run_id)
        return self.store.provenance(ids)

    def append_event(self, lease: Lease, kind: str, data: Mapping[str, Any],
                     attempt_id: str | None = None) -> None:
        self.store.append_event(lease.run_id, attempt_id, kind, data, self.now(), lease.fence)

    def events(self, run_id: str, kinds: Sequence[str] | None = None) -> list[EventRecord]:
        return self.store.events(run_id, kinds)

    # -- reads ----------------------------------------------------------------------------

    def get_attempt(self, attempt_id: str) -> AttemptRecord:
        return self.store.get_attempt(attempt_id)

    def timeline(self, run_id: str) -> list[AttemptRecord]:
        """The run's Attempts in order, each under its original route."""
        return self.store.timeline(run_id)

    def attempts(self, /, **filters: Any) -> Page[AttemptRecord]:
        """Attempts newest first; filters: route, group, state, category, since, until, limit,
        cursor."""
        return self.store.attempts(**filters)

    def debit(self, debit_id: str) -> DebitRecord:
        return self.store.debit(debit_id)


def _in_thread(
    fn: Callable[Concatenate[Ledger, P], R],
) -> Callable[Concatenate[AsyncLedger, P], Coroutine[Any, Any, R]]:
    """The async twin of a :class:`Ledger` method: the same method, run in a worker thread
    (the database call blocks), with the same typed signature."""

    async def method(self: AsyncLedger, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(fn, self.sync, *args, **kwargs)

    method.__name__ = fn.__name__
    method.__qualname__ = f"AsyncLedger.{fn.__name__}"
    method.__doc__ = fn.__doc__
    return method


class AsyncLedger:
    """The async twin of :class:`Ledger`: the same methods, awaited; one implementation."""

    def __init__(self, ledger: Ledger) -> None:
        self.sync = ledger

    @classmethod
    async def open(cls, url: str, *, clock: Clock | None = None,
                   executor_id: str | None = None) -> AsyncLedger:
        led = await asyncio.to_thread(Ledger.open, url, clock=clock, executor_id=executor_id)
        return cls(led)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncLedger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def clock(self) -> Clock:
        return self.sync.clock

    @property
    def backend(self) -> str:
        return self.sync.backend

    @property
    def executor_id(self) -> str:
        return self.sync.executor_id

    def now(self) -> float:
        return self.sync.now()

    admit_run = _in_thread(Ledger.admit_run)
    get_run = _in_thread(Ledger.get_run)
    children = _in_thread(Ledger.children)
    frozen_run = _in_thread(Ledger.frozen_run)
    run_policy = _in_thread(Ledger.run_policy)
    finish_run = _in_thread(Ledger.finish_run)
    acquire_lease = _in_thread(Ledger.acquire_lease)
    renew_lease = _in_thread(Ledger.renew_lease)
    release_lease = _in_thread(Ledger.release_lease)
    reserve_retry = _in_thread(Ledger.reserve_retry)
    begin_attempt = _in_thread(Ledger.begin_attempt)
    settle_attempt = _in_thread(Ledger.settle_attempt)
    mark_unknown = _in_thread(Ledger.mark_unknown)
    configure_group = _in_thread(Ledger.configure_group)
    set_group_state = _in_thread(Ledger.set_group_state)
    group_projections = _in_thread(Ledger.group_projections)
    health = _in_thread(Ledger.health)
    claim_probe = _in_thread(Ledger.claim_probe)
    record_provenance = _in_thread(Ledger.record_provenance)
    provenance = _in_thread(Ledger.provenance)
    append_event = _in_thread(Ledger.append_event)
    events = _in_thread(Ledger.events)
    get_attempt = _in_thread(Ledger.get_attempt)
    timeline = _in_thread(Ledger.timeline)
    attempts = _in_thread(Ledger.attempts)
    debit = _in_thread(Ledger.debit)


__all__ = ["AsyncLedger", "Ledger"]
