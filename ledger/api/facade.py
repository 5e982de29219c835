"""The public ledger API: :class:`Ledger` (sync) and :class:`AsyncLedger` (async).

A method checks its arguments (:mod:`ledger.api.arguments`), asks the pure core what the write
means (:mod:`ledger.decide`: what an admission freezes, what a begin may use, what a settle
records and does to holds, health and groups, all under the Run's *frozen* policy), and hands
the resulting spec to the storage port (:mod:`ledger.storage.port`), which applies it in one
transaction. The port is private to the ledger; ops and tools reach it with :func:`storage_of`.

The operations of the turn (snapshot, begin, settle, leases, ...) are built once as a
:class:`~ledger.api.calls.Call` and run natively on either driver, so :class:`AsyncLedger`
awaits the same checks and the same transaction without a thread hop; its cold methods (admin
and reads) run the blocking method in a worker thread.
"""
from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ledger.api.arguments import (
    MAX_EVENT_KIND,
    as_model,
    attempt_filters,
    audit_data,
    check_opening,
    event_kind,
    events_arg,
    hash_arg,
    lease_arg,
    optional_tokens,
)
from ledger.api.calls import Call, Lru
from ledger.clock import Clock, SystemClock
from ledger.decide.admission import admission_spec, admission_terms, validate_plan
from ledger.decide.begin import begin_spec
from ledger.decide.effects import TurnSnapshot
from ledger.decide.health import PROVIDER_KEY_PREFIX, as_read, route_key
from ledger.decide.pricing import resolve_prices
from ledger.decide.settle import settle_spec
from ledger.domain.bounds import (
    MAX_LEASE_TTL_S,
    check_amount,
    check_bool,
    check_choice,
    check_count,
    check_id,
    check_ids,
    check_optional_id,
    check_optional_time,
    check_seconds,
    check_text,
    check_tokens,
)
from ledger.domain.facts import FailureFact, Observation
from ledger.domain.records import (
    AttemptKind,
    AttemptRecord,
    DebitRecord,
    EventRecord,
    FrozenRun,
    Lease,
    Outcome,
    Page,
    RunRecord,
    RunStatus,
    to_micros,
)
from ledger.domain.specs import GroupUpdate
from ledger.domain.validation import checked_call, checked_calls
from ledger.domain.values import (
    Budget,
    Grant,
    GroupMode,
    GroupProjection,
    Health,
    Route,
    new_id,
)
from ledger.errors import InvalidArgument, NotFound
from ledger.policy.model import Policy
from ledger.storage import DEFAULT_LEASE_MARGIN_S, open_store
from ledger.storage.port import Snapshot, StoragePort
from ledger.storage.rows import run_live

if TYPE_CHECKING:
    from ledger.api.session import AsyncRunSession, RunSession

P = ParamSpec("P")
R = TypeVar("R")
K = TypeVar("K")
V = TypeVar("V")

DEFAULT_LEASE_TTL_S = 30.0


def _resolve_policy(policy: Policy | str | Mapping[str, Any] | None) -> Policy:
    from ledger.policy.load import default_policy, load_policy, validate_policy

    if policy is None:
        return default_policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str | os.PathLike):
        return load_policy(policy)
    # A mapping, or anything else: the loader's validation names the field path and the fix.
    return validate_policy(policy)


def _policy_hash(policy: Policy) -> str:
    from ledger.policy.load import policy_hash

    return policy_hash(policy)


def _sync(fn: Callable[Concatenate[Ledger, P], Call[R]]) -> Callable[Concatenate[Ledger, P], R]:
    """The blocking method of an operation built by ``fn``."""

    @functools.wraps(fn)
    def method(self: Ledger, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return fn(self, *args, **kwargs).run()

    method.__name__ = fn.__name__.lstrip("_")
    method.__qualname__ = f"Ledger.{method.__name__}"
    return method


def _native(fn: Callable[Concatenate[Ledger, P], Call[R]]
            ) -> Callable[Concatenate[AsyncLedger, P], Coroutine[Any, Any, R]]:
    """The coroutine method of the same operation, on the asyncio driver (no thread hop)."""

    @functools.wraps(fn)
    async def method(self: AsyncLedger, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await fn(self.sync, *args, **kwargs).arun()

    method.__name__ = fn.__name__.lstrip("_")
    method.__qualname__ = f"AsyncLedger.{method.__name__}"
    return method


@checked_calls
class Ledger:
    """A ledger over one database. Open with :meth:`open`.

    ``Ledger(store)`` builds one over a storage port that is already open (see
    :func:`ledger.storage.open_store`); the ledger owns it from then on and closes it.
    """

    def __init__(self, store: StoragePort, clock: Clock | None = None,
                 executor_id: str | None = None) -> None:
        # Private: applications use the ledger's methods; ops and tools reach the port
        # deliberately, through storage_of().
        self._store = store
        self.clock: Clock = clock or SystemClock()
        self.executor_id = executor_id or new_id("exec")
        self._frozen: Lru[str, FrozenRun] = Lru(1024)
        self._policies: Lru[str, Policy] = Lru(1024)
        # Attempts this process began and has not settled: settle needs their route, profile
        # and hold, and reading them back would cost a transaction on the hot path.
        self._in_flight: Lru[str, AttemptRecord] = Lru(10_000)

    # -- opening --------------------------------------------------------------------------

    @classmethod
    def open(cls, url: str, *, clock: Clock | None = None, executor_id: str | None = None,
             migrate_schema: bool = True,
             lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> Ledger:
        """Open (creating or upgrading the schema) a ledger at a SQLite path or a URL.

        ``lease_margin_s``: how long before its end a lease stops starting work; it is the
        clock skew between hosts the ledger tolerates (``docs/operations.md``).
        """
        check_seconds(lease_margin_s, "lease_margin_s", maximum=60.0)
        check_bool(migrate_schema, "migrate_schema")
        check_opening(url, clock, executor_id)
        store = open_store(url, lease_margin_s=lease_margin_s, migrate_schema=migrate_schema)
        return cls(store, clock=clock, executor_id=executor_id)

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def backend(self) -> str:
        return self._store.backend

    @property
    def lease_margin_s(self) -> float:
        """How long before its end a lease stops starting work (seconds; set at :meth:`open`):
        a lease's ``ttl_s`` must be longer, and a keeper renews before it."""
        return self._store.lease_margin_s

    def now(self) -> float:
        return self.clock.now()

    # -- runs -----------------------------------------------------------------------------

    def admit_run(
        self,
        run_id: str,
        *,
        plan: Sequence[Route],
        budget: Budget | Mapping[str, Any],
        grant: Grant | Mapping[str, Any] | None = None,
        policy: Policy | str | Mapping[str, Any] | None = None,
        role: str = "research",
        parent: Lease | None = None,
        tenant: str | None = None,
        labels: Mapping[str, str] | None = None,
        deadline: float | None = None,
        selected_route: str | None = None,
    ) -> RunRecord:
        """Admit a Run, freezing plan, grant, budget and policy. Idempotent per content.

        ``parent``: the parent's lease, to admit a Child Run (its budget is carved from the
        parent's under that lease; its plan, grant, role and policy may only narrow the
        parent's; with ``policy=None`` and ``grant=None`` it inherits them).
        """
        check_id(run_id, "run_id")
        check_id(role, "role")
        if len(role) > 64:
            raise InvalidArgument("role is at most 64 characters; pass a shorter role name",
                                  field="role")
        check_optional_id(tenant, "tenant")
        deadline = check_optional_time(deadline, "deadline")
        check_optional_id(selected_route, "selected_route")
        if parent is not None:
            parent = lease_arg(parent, "parent")
        budget = as_model(Budget, budget, "budget")
        if grant is not None:
            grant = as_model(Grant, grant, "grant")
        if isinstance(plan, str | bytes | Mapping) or not isinstance(plan, Sequence):
            raise InvalidArgument("plan must be a list of ledger.Route (or of mappings of "
                                  "their fields)", field="plan")
        plan = [as_model(Route, r, f"plan[{i}]") for i, r in enumerate(plan)]
        validate_plan(plan)
        # Unpriced routes get the price table's price, frozen with the plan (ledger.decide.pricing);
        # a child's take its parent's frozen price.
        plan = resolve_prices(plan, budget, at=self.now(),
                              inherited=self.frozen_run(parent.run_id).plan if parent else ())
        if labels is not None and not isinstance(labels, Mapping):
            raise InvalidArgument("labels must be a mapping of strings to strings; pass e.g. "
                                  "{'team': 'search'}", field="labels")
        label_map = dict(labels or {})
        for k, v in label_map.items():
            # Printable: audit totals group by a label through the database's JSON functions.
            check_id(k, "labels")
            check_text(v, f"labels[{k!r}]")
        prec = self.frozen_run(parent.run_id) if parent is not None else None
        if policy is None and prec is None:
            pol: Policy | None = _resolve_policy(None)
        else:
            pol = None if policy is None else _resolve_policy(policy)
        pol, grant = admission_terms(
            plan, grant, role, pol, policy_hash=_policy_hash, parent=prec,
            parent_policy=self.run_policy(prec.run_id) if prec is not None else None)
        spec = admission_spec(
            run_id, plan=plan, budget=budget, grant=grant, policy=pol,
            policy_hash=_policy_hash(pol), role=role, parent=parent, tenant=tenant,
            labels=label_map, selected_route=selected_route, deadline=deadline)
        rec, _created = self._store.admit(spec, self.clock.now)
        return rec

    def run(
        self,
        run_id: str,
        *,
        plan: Sequence[Route],
        budget: Budget | Mapping[str, Any],
        grant: Grant | Mapping[str, Any] | None = None,
        policy: Policy | str | Mapping[str, Any] | None = None,
        role: str = "research",
        parent: Lease | None = None,
        tenant: str | None = None,
        labels: Mapping[str, str] | None = None,
        deadline: float | None = None,
        selected_route: str | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        adapter: Any = None,
        secrets: Any = None,
    ) -> RunSession:
        """A Run held in a ``with`` block: admitted (or resumed, for the same id and content)
        and leased on entering, finished and released on leaving. See :mod:`ledger.api.session`.

        The admission arguments are those of :meth:`admit_run`. ``lease_ttl_s`` is the lease
        the session keeps renewed; ``adapter`` a :class:`~ledger.adapters.SyncAdapter` to send
        with (default: one of the session's own, closed with it) and ``secrets`` the secret
        provider of that default adapter.

        >>> with led.run("task-1", plan=routes, budget=budget) as run:   # doctest: +SKIP
        ...     answer = run.turn(Envelope(parts=[Part(content="Hello")]))
        """
        from ledger.api.session import RunSession

        return RunSession(self, run_id, dict(
            plan=plan, budget=budget, grant=grant, policy=policy, role=role, parent=parent,
            tenant=tenant, labels=labels, deadline=deadline, selected_route=selected_route),
            lease_ttl_s=lease_ttl_s, adapter=adapter, secrets=secrets)

    def get_run(self, run_id: str) -> RunRecord:
        """The Run as it stands now (frozen parts and live counters)."""
        return self._store.get_run(check_id(run_id, "run_id"))

    def children(self, run_id: str) -> list[RunRecord]:
        """The Child Runs admitted under ``run_id``."""
        return self._store.children(check_id(run_id, "run_id"))

    def frozen_run(self, run_id: str) -> FrozenRun:
        """What the Run froze at admission (plan, grant, budget, policy, role, parent,
        deadline), read once and cached: it never changes. Its live counters are
        :meth:`get_run`'s.

        Raises :class:`~ledger.errors.NotFound` for an unknown ``run_id``.
        """
        frozen = self._frozen.get(run_id)
        if frozen is None:
            frozen = self._store.get_run(check_id(run_id, "run_id")).frozen
            self._frozen.put(run_id, frozen)
        return frozen

    def run_policy(self, run_id: str) -> Policy:
        """The policy snapshot the run froze at admission (parsed once per Run)."""
        pol = self._policies.get(run_id)
        if pol is None:
            pol = Policy.model_validate(self.frozen_run(run_id).policy)
            self._policies.put(run_id, pol)
        return pol

    def _finish_run(self, lease: Lease, status: RunStatus | str) -> Call[None]:
        """Record the Run's end (``succeeded``, ``failed``, ``stopped`` or ``cancelled``)."""
        ends = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CANCELLED)
        st = check_choice(status, RunStatus, "status", ends)
        lease, clock = lease_arg(lease), self.clock.now
        return Call(lambda: self._store.finish_run(lease, st, clock),
                     lambda: self._store.afinish_run(lease, st, clock))

    # -- leases ---------------------------------------------------------------------------

    def _acquire_lease(self, run_id: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S,
                       executor_id: str | None = None) -> Call[Lease]:
        """Take the Run's lease for ``ttl_s`` seconds (renew it with :meth:`renew_lease` or a
        :class:`~ledger.api.lease.LeaseKeeper`). Another holder's unexpired lease is
        :class:`LeaseHeld`; one's own unexpired lease is renewed under the same fence."""
        check_id(run_id, "run_id")
        ttl = check_seconds(ttl_s, "ttl_s", maximum=MAX_LEASE_TTL_S, positive=True)
        if ttl <= self._store.lease_margin_s:
            raise InvalidArgument(
                f"ttl_s={ttl:g} is not above the lease margin ({self._store.lease_margin_s:g}s): "
                "such a lease could start nothing; use a longer ttl_s", field="ttl_s")
        executor = self.executor_id if executor_id is None else executor_id
        check_id(executor, "executor_id")
        clock = self.clock.now
        return Call(lambda: self._store.acquire_lease(run_id, executor, ttl, clock),
                     lambda: self._store.aacquire_lease(run_id, executor, ttl, clock))

    def _renew_lease(self, lease: Lease, *, ttl_s: float = DEFAULT_LEASE_TTL_S) -> Call[Lease]:
        """Extend a live lease; a lapsed one (expired or released) is :class:`LeaseLost`."""
        ttl = check_seconds(ttl_s, "ttl_s", maximum=MAX_LEASE_TTL_S, positive=True)
        lease, clock = lease_arg(lease), self.clock.now
        return Call(lambda: self._store.renew_lease(lease, ttl, clock),
                     lambda: self._store.arenew_lease(lease, ttl, clock))

    def _release_lease(self, lease: Lease) -> Call[None]:
        """Give the lease up (the Run's attempts must be settled first)."""
        lease, clock = lease_arg(lease), self.clock.now
        return Call(lambda: self._store.release_lease(lease, clock),
                     lambda: self._store.arelease_lease(lease, clock))

    def _reserve_retry(self, lease: Lease, data: Mapping[str, Any] | None = None
                       ) -> Call[int]:
        """Take one bounded retry permission from the run; returns how many are left.

        ``data`` (e.g. the route and cause) is recorded with the permission as an audit event.
        """
        lease, clock = lease_arg(lease), self.clock.now
        if data is not None:
            data = audit_data(data, "data")
        return Call(lambda: self._store.reserve_retry(lease, clock, data),
                     lambda: self._store.areserve_retry(lease, clock, data))

    # -- attempts -------------------------------------------------------------------------

    def _begin_attempt(
        self,
        lease: Lease,
        *,
        route: str | Route,
        envelope_hash: str,
        reserve: Decimal | int | str,
        reserve_tokens: int = 0,
        turn_id: str = "turn-1",
        profile_id: str | None = None,
        kind: AttemptKind | str = AttemptKind.FIRST,
        attempt_id: str | None = None,
        events: Sequence[tuple[str, Mapping[str, Any]]] = (),
        take_retry: bool = False,
    ) -> Call[AttemptRecord]:
        """Record an Attempt (debit held, capacity slot taken) before its request is sent.

        ``reserve`` is the cost hold, ``reserve_tokens`` the token hold (checked against the
        Run's ``max_tokens``); ``take_retry`` takes one retry permission in the same transaction
        (the retry owner does for every further Attempt of a turn). Retrying with the same
        ``attempt_id`` and arguments, also after acquiring the lease again, is the same write.
        """
        lease = lease_arg(lease)
        run = self.frozen_run(lease.run_id)
        if not isinstance(route, str | Route):
            raise InvalidArgument("route must be a route id or a ledger.Route of the Run's plan",
                                  field="route")
        if isinstance(route, str):
            check_id(route, "route")
        check_optional_id(profile_id, "profile_id")
        hash_arg(envelope_hash, "envelope_hash")
        check_id(turn_id, "turn_id")
        reserve_micros = to_micros(check_amount(reserve, "reserve"))
        reserve_tokens = check_tokens(reserve_tokens, "reserve_tokens")
        kind = check_choice(kind, AttemptKind, "kind")
        attempt_id = new_id("att") if attempt_id is None else check_id(attempt_id, "attempt_id")
        check_bool(take_retry, "take_retry")
        spec = begin_spec(
            run, lease, route=route, profile_id=profile_id, envelope_hash=envelope_hash,
            reserve_micros=reserve_micros, reserve_tokens=reserve_tokens, turn_id=turn_id,
            kind=kind, attempt_id=attempt_id, events=events_arg(events), take_retry=take_retry)
        clock = self.clock.now

        def done(rec: AttemptRecord) -> AttemptRecord:
            self._in_flight.put(rec.attempt_id, rec)
            return rec

        return Call(lambda: self._store.begin_attempt(spec, clock),
                     lambda: self._store.abegin_attempt(spec, clock), done)

    def _settle_attempt(
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
        provenance_hashes: Sequence[str] = (),
        repeat: bool = False,
    ) -> Call[AttemptRecord]:
        """Record an Attempt's outcome; health and group facts update in the same transaction.

        ``outcome``: ``succeeded``, ``failed`` (with a ``fact`` or an ``observation`` to
        classify), ``unknown`` (sent, no receipt: the hold stays) or ``not_sent`` (provably never
        left: the hold is voided and the call given back; a failure whose phase is
        ``before_send`` is recorded as not sent). Usage and ``cost`` are what the provider
        reported; when none was reported, the whole hold is posted. ``repeat``: the Attempt
        was a same-route retry of a failure this request already counted in health, so its
        failure restarts the key's window without counting again (unless the policy's
        ``health.count_same_route_retries`` says every try counts).
        """
        lease = lease_arg(lease)
        outcome = check_choice(outcome, Outcome, "outcome")
        check_id(attempt_id, "attempt_id")
        if fact is not None:
            fact = as_model(FailureFact, fact, "fact")
        if observation is not None:
            observation = as_model(Observation, observation, "observation")
        for name, flag in (("effective_output", effective_output),
                           ("tool_started", tool_started)):
            if flag is not None:
                check_bool(flag, name)
        prompt_tokens = optional_tokens(prompt_tokens, "prompt_tokens")
        completion_tokens = optional_tokens(completion_tokens, "completion_tokens")
        cost_micros = to_micros(check_amount(cost, "cost")) if cost is not None else None
        if model_reported is not None:
            check_text(model_reported, "model_reported")
        hash_arg(output_hash, "output_hash", optional=True)
        if (isinstance(provenance_hashes, str | bytes | Mapping)
                or not isinstance(provenance_hashes, Sequence)):
            raise InvalidArgument("provenance_hashes must be a list of content hashes; pass "
                                  "e.g. [part.content_hash for part in parts]",
                                  field="provenance_hashes")
        hashes = tuple(str(hash_arg(h, f"provenance_hashes[{i}]"))
                       for i, h in enumerate(provenance_hashes))
        if not isinstance(repeat, bool):
            raise InvalidArgument("repeat must be True or False", field="repeat")
        known = self._in_flight.get(attempt_id)
        att = known if known is not None else self._store.get_attempt(attempt_id)
        if att.run_id != lease.run_id:
            raise NotFound(f"attempt {attempt_id!r} does not belong to run {lease.run_id!r}",
                           attempt_id=attempt_id, run_id=lease.run_id)
        spec = settle_spec(
            self.run_policy(lease.run_id), self.frozen_run(lease.run_id).route(att.route_id),
            att.profile_id, lease, attempt_id, outcome=outcome, fact=fact,
            observation=observation, now=self.now(), effective_output=effective_output,
            tool_started=tool_started, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, cost_micros=cost_micros,
            model_reported=model_reported, output_hash=output_hash, events=events_arg(events),
            provenance=hashes, repeat=repeat)
        clock = self.clock.now

        def done(rec: AttemptRecord) -> AttemptRecord:
            self._in_flight.pop(attempt_id)
            return rec

        return Call(lambda: self._store.settle_attempt(lease.run_id, spec, clock),
                     lambda: self._store.asettle_attempt(lease.run_id, spec, clock), done)

    def _mark_unknown(self, lease: Lease, attempt_id: str, reason: str) -> Call[AttemptRecord]:
        """Settle a dispatched Attempt as unknown (no receipt): its hold stays."""
        if not isinstance(reason, str):
            raise InvalidArgument("reason must be a string; pass why no receipt came",
                                  field="reason")
        lease, clock, why = lease_arg(lease), self.clock.now, reason[:200]
        check_id(attempt_id, "attempt_id")
        return Call(lambda: self._store.mark_unknown(lease, attempt_id, clock, why),
                     lambda: self._store.amark_unknown(lease, attempt_id, clock, why))

    def _turn_snapshot(self, run_id: str, refs: Sequence[str] = ()) -> Call[TurnSnapshot]:
        """Everything one routing decision reads, in one read transaction: the Run as it
        stands, its frozen policy, its groups' projections, its routes' and profiles' health,
        and the provenance of ``refs`` recorded by the Run or its ancestors."""
        frozen = self.frozen_run(run_id)
        policy = self.run_policy(run_id)
        refs = check_ids(refs, "refs")
        chain = [run_id]
        anc = frozen
        while anc.parent_run_id is not None:
            chain.append(anc.parent_run_id)
            anc = self.frozen_run(anc.parent_run_id)
        groups = sorted({r.group for r in frozen.plan})
        keys = sorted({route_key(r, policy) for r in frozen.plan}
                      | {p.id for r in frozen.plan for p in r.profiles})
        clock, wanted = self.clock.now, list(refs)

        def done(snap: Snapshot) -> TurnSnapshot:
            health = {k: as_read(h, snap.now) for k, h in snap.health.items()}
            return TurnSnapshot(run=run_live(frozen, snap.run), policy=policy,
                                groups=snap.groups, health=health,
                                provenance=snap.provenance, now=snap.now)

        return Call(
            lambda: self._store.turn_snapshot(run_id, groups, keys, chain, wanted, clock),
            lambda: self._store.aturn_snapshot(run_id, groups, keys, chain, wanted, clock), done)

    # -- groups, health, provenance, events -------------------------------------------------

    def configure_group(self, group: str, *, max_in_flight: int | None) -> None:
        """Set a capacity group's concurrency limit (``None``: unlimited)."""
        check_id(group, "group")
        if max_in_flight is not None:
            check_count(max_in_flight, "max_in_flight")
            if max_in_flight < 1:
                raise InvalidArgument("max_in_flight must be >= 1 (or None for no limit)",
                                      field="max_in_flight")
        self._store.configure_group(group, max_in_flight, self.now())

    def set_group_state(self, group: str, mode: GroupMode | str, *, until: float | None,
                        reason: str = "operator") -> None:
        """Set a group's mode by hand (an operator's cooldown or outage notice)."""
        check_id(group, "group")
        mode = check_choice(mode, GroupMode, "mode")
        until = check_optional_time(until, "until")
        why = check_text(reason, "reason")
        self._store.set_group_mode(group, GroupUpdate(mode, until, why), self.now())

    def group_projections(self, groups: Sequence[str] | None = None
                          ) -> dict[str, GroupProjection]:
        """Admission's view of the named capacity groups (``None``: every known group)."""
        wanted = None if groups is None else check_ids(groups, "groups")
        return self._store.group_projections(wanted, self.now())

    def health(self, keys: Sequence[str] | None = None) -> dict[str, Health]:
        """Health rows (all, or of ``keys``: route ids, profile ids, ``provider:<name>``) as
        they stand now: counters past their reset time read as reset."""
        wanted = None if keys is None else check_ids(keys, "keys")
        now = self.now()
        return {k: as_read(h, now) for k, h in self._store.health(wanted).items()}

    def _claim_probe(self, route: Route, interval_s: float, *, key: str | None = None,
                     ttl_s: float | None = None, max_keys: int | None = None) -> Call[bool]:
        """Take the cluster-wide probe slot of ``route``: True for one caller per interval.

        ``key`` is the health key the probe state lives under (default: the route id; the
        retry owner passes the policy's key, e.g. ``provider:<name>``). A claim taken also
        bounds the probe state: times ``ttl_s`` old are forgotten and at most ``max_keys``
        keys keep one (GoClaw's probe state TTL and key limit).
        """
        if not isinstance(route, Route):
            raise InvalidArgument("route must be a ledger.Route", field="route")
        interval = check_seconds(interval_s, "interval_s")
        ttl = check_seconds(ttl_s, "ttl_s", positive=True) if ttl_s is not None else None
        if max_keys is not None:
            check_count(max_keys, "max_keys")
            if max_keys < 1:
                raise InvalidArgument("max_keys must be >= 1 (or None for no limit)",
                                      field="max_keys")
        k = check_id(key, "key") if key is not None else route.id
        kind = "route" if k == route.id else (
            "provider" if k.startswith(PROVIDER_KEY_PREFIX) else "profile")
        now = self.now()
        return Call(
            lambda: self._store.claim_probe(k, route.provider, now, interval, kind=kind,
                                           ttl_s=ttl, max_keys=max_keys),
            lambda: self._store.aclaim_probe(k, route.provider, now, interval, kind=kind,
                                            ttl_s=ttl, max_keys=max_keys))

    def _record_compaction(self, lease: Lease) -> Call[int]:
        """Record that the host compacted the Run's session (its context was summarised);
        returns the Run's compaction count. Under a policy with ``profiles.sticky`` the
        auto-pinned credential profile is dropped: the next turn chooses again (Fased: the
        pinned profile is reused until "a compaction completes (compaction count
        increments)"). A user pin is kept. Needs a live lease."""
        lease, clock = lease_arg(lease), self.clock.now
        return Call(lambda: self._store.record_compaction(lease, clock),
                     lambda: self._store.arecord_compaction(lease, clock))

    def _record_provenance(self, lease: Lease, ref: str, content_hash: str,
                           kind: str = "tool_result") -> Call[None]:
        """Record that ``ref`` (a tool-call id, ...) produced content with ``content_hash``."""
        check_id(ref, "ref")
        hash_arg(content_hash, "content_hash")
        event_kind(kind, "kind", 16)
        lease, clock = lease_arg(lease), self.clock.now
        return Call(
            lambda: self._store.record_provenance(lease, ref, content_hash, kind, clock),
            lambda: self._store.arecord_provenance(lease, ref, content_hash, kind, clock))

    def provenance(self, run_id: str) -> dict[str, set[str]]:
        """Recorded outputs of this run and its ancestors: ref -> content hashes."""
        ids = [check_id(run_id, "run_id")]
        run = self.frozen_run(run_id)
        while run.parent_run_id is not None:
            ids.append(run.parent_run_id)
            run = self.frozen_run(run.parent_run_id)
        return self._store.provenance(ids)

    def _append_event(self, lease: Lease, kind: str, data: Mapping[str, Any],
                      attempt_id: str | None = None) -> Call[None]:
        """Append an audit event to the Run (needs a live lease)."""
        name, payload = event_kind(kind, "kind", MAX_EVENT_KIND), audit_data(data, "data")
        check_optional_id(attempt_id, "attempt_id")
        lease, clock = lease_arg(lease), self.clock.now
        return Call(lambda: self._store.append_event(lease, attempt_id, name, payload, clock),
                     lambda: self._store.aappend_event(lease, attempt_id, name, payload, clock))

    finish_run = _sync(_finish_run)
    acquire_lease = _sync(_acquire_lease)
    renew_lease = _sync(_renew_lease)
    release_lease = _sync(_release_lease)
    reserve_retry = _sync(_reserve_retry)
    begin_attempt = _sync(_begin_attempt)
    settle_attempt = _sync(_settle_attempt)
    mark_unknown = _sync(_mark_unknown)
    turn_snapshot = _sync(_turn_snapshot)
    claim_probe = _sync(_claim_probe)
    record_compaction = _sync(_record_compaction)
    record_provenance = _sync(_record_provenance)
    append_event = _sync(_append_event)

    def events(self, run_id: str, kinds: Sequence[str] | None = None) -> list[EventRecord]:
        """The Run's audit events in order, optionally only those of the given kinds."""
        check_id(run_id, "run_id")
        if kinds is not None:
            if isinstance(kinds, str | bytes) or not isinstance(kinds, Sequence | set | frozenset):
                raise InvalidArgument("kinds must be a list of event kinds; pass e.g. ['stop']",
                                      field="kinds")
            kinds = [event_kind(k, f"kinds[{i}]", MAX_EVENT_KIND) for i, k in enumerate(kinds)]
        return self._store.events(run_id, kinds)

    # -- reads ----------------------------------------------------------------------------

    def get_attempt(self, attempt_id: str) -> AttemptRecord:
        """One Attempt, under its original route."""
        return self._store.get_attempt(check_id(attempt_id, "attempt_id"))

    def timeline(self, run_id: str) -> list[AttemptRecord]:
        """The run's Attempts in order, each under its original route."""
        return self._store.timeline(check_id(run_id, "run_id"))

    def attempts(self, /, **filters: Any) -> Page[AttemptRecord]:
        """Attempts newest first. Filters: ``route``, ``group`` (ids), ``state`` (an
        :class:`AttemptState`), ``category`` (a :class:`Category`), ``since``/``until`` (epoch
        seconds), ``limit`` (1 to 10 000, default 100), ``cursor`` (a page's ``next_cursor``)."""
        return self._store.attempts(**attempt_filters(filters))

    def debit(self, debit_id: str) -> DebitRecord:
        """One debit (an Attempt's budget hold)."""
        return self._store.debit(check_id(debit_id, "debit_id"))


@checked_call
def storage_of(ledger: Ledger | AsyncLedger) -> StoragePort:
    """The storage port under ``ledger``: the one deliberate way for the ledger's own
    operations and tools (recovery, reconciliation, the audit, ``generate``, the benchmarks,
    the command line) to reach the database. Applications use the ledger's methods: the port
    takes its arguments as already checked and writes without the facade's rules.

    Raises :class:`InvalidArgument` when ``ledger`` is neither a :class:`Ledger` nor an
    :class:`AsyncLedger`.
    """
    if isinstance(ledger, AsyncLedger):
        ledger = ledger.sync
    if not isinstance(ledger, Ledger):
        raise InvalidArgument("ledger must be a ledger.Ledger or a ledger.AsyncLedger",
                              field="ledger")
    return ledger._store


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
    method.__wrapped__ = fn  # type: ignore[attr-defined]  # its signature, for misuse checks
    return method


class _Opening:
    """An AsyncLedger being opened: awaitable, or used as ``async with``."""

    def __init__(self, make: Callable[[], AsyncLedger]) -> None:
        self._make = make
        self._led: AsyncLedger | None = None

    def __await__(self) -> Generator[Any, None, AsyncLedger]:
        return asyncio.to_thread(self._make).__await__()

    async def __aenter__(self) -> AsyncLedger:
        self._led = await asyncio.to_thread(self._make)
        return self._led

    async def __aexit__(self, *exc: object) -> None:
        if self._led is not None:
            await self._led.close()


@checked_calls
class AsyncLedger:
    """The async twin of :class:`Ledger`: the same methods, awaited; one implementation."""

    def __init__(self, ledger: Ledger) -> None:
        self.sync = ledger

    @classmethod
    def open(cls, url: str, *, clock: Clock | None = None, executor_id: str | None = None,
             migrate_schema: bool = True,
             lease_margin_s: float = DEFAULT_LEASE_MARGIN_S) -> _Opening:
        """Open a ledger (see :meth:`Ledger.open`): ``led = await AsyncLedger.open(url)``, or
        ``async with AsyncLedger.open(url) as led:`` (closed when the block ends)."""
        return _Opening(lambda: cls(Ledger.open(
            url, clock=clock, executor_id=executor_id, migrate_schema=migrate_schema,
            lease_margin_s=lease_margin_s)))

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

    @property
    def lease_margin_s(self) -> float:
        """See :attr:`Ledger.lease_margin_s`."""
        return self.sync.lease_margin_s

    def now(self) -> float:
        return self.sync.now()

    def run(self, run_id: str, *, plan: Sequence[Route], budget: Budget | Mapping[str, Any],
            grant: Grant | Mapping[str, Any] | None = None,
            policy: Policy | str | Mapping[str, Any] | None = None, role: str = "research",
            parent: Lease | None = None, tenant: str | None = None,
            labels: Mapping[str, str] | None = None, deadline: float | None = None,
            selected_route: str | None = None, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
            adapter: Any = None, secrets: Any = None) -> AsyncRunSession:
        """The asyncio twin of :meth:`Ledger.run`: ``async with led.run(...) as run:``;
        ``adapter`` is an :class:`~ledger.adapters.HttpAdapter`."""
        from ledger.api.session import AsyncRunSession

        return AsyncRunSession(self, run_id, dict(
            plan=plan, budget=budget, grant=grant, policy=policy, role=role, parent=parent,
            tenant=tenant, labels=labels, deadline=deadline, selected_route=selected_route),
            lease_ttl_s=lease_ttl_s, adapter=adapter, secrets=secrets)

    async def warm(self, run_id: str) -> None:
        """Read the Run's (and its ancestors') frozen parts into the cache off the event loop,
        so the turn's own calls never block it on a first read."""
        led = self.sync
        rid: str | None = run_id
        while rid is not None:
            rec = led._frozen.get(rid)
            if rec is None:
                rec = await asyncio.to_thread(led.frozen_run, rid)
                await asyncio.to_thread(led.run_policy, rid)
            rid = rec.parent_run_id

    admit_run = _in_thread(Ledger.admit_run)
    get_run = _in_thread(Ledger.get_run)
    children = _in_thread(Ledger.children)
    frozen_run = _in_thread(Ledger.frozen_run)
    run_policy = _in_thread(Ledger.run_policy)
    finish_run = _native(Ledger._finish_run)
    acquire_lease = _native(Ledger._acquire_lease)
    renew_lease = _native(Ledger._renew_lease)
    release_lease = _native(Ledger._release_lease)
    reserve_retry = _native(Ledger._reserve_retry)
    begin_attempt = _native(Ledger._begin_attempt)
    settle_attempt = _native(Ledger._settle_attempt)
    mark_unknown = _native(Ledger._mark_unknown)
    turn_snapshot = _native(Ledger._turn_snapshot)
    configure_group = _in_thread(Ledger.configure_group)
    set_group_state = _in_thread(Ledger.set_group_state)
    group_projections = _in_thread(Ledger.group_projections)
    health = _in_thread(Ledger.health)
    claim_probe = _native(Ledger._claim_probe)
    record_compaction = _native(Ledger._record_compaction)
    record_provenance = _native(Ledger._record_provenance)
    provenance = _in_thread(Ledger.provenance)
    append_event = _native(Ledger._append_event)
    events = _in_thread(Ledger.events)
    get_attempt = _in_thread(Ledger.get_attempt)
    timeline = _in_thread(Ledger.timeline)
    attempts = _in_thread(Ledger.attempts)
    debit = _in_thread(Ledger.debit)


__all__ = ["AsyncLedger", "Ledger", "storage_of"]
