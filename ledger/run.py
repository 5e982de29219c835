"""The retry owner: one Run-level call that drives the whole attempt lifecycle.

The logic is written once, as a generator (:meth:`_Loop.steps`) that *yields* what it needs done
(a ledger call, a send, a sleep, a note to the caller) and receives the answer. Two thin drivers
execute those effects: :func:`execute` (sync) and :func:`aexecute` (async). Neither contains a
decision; every decision (classify, same-route retry, select, preflight) is a pure function.

The sequence per failure (seed 003 section 4): settle the failed attempt with its fact -> a
same-route retry if the policy allows one (each retry its own Attempt and debit, after taking a
retry permission) -> else reserve a retry permission, select the next eligible route from the
frozen plan (group facts, health, capability, role, disclosure) -> begin the next attempt. A
backup route brings no new budget: every attempt draws on the Run's allowances.
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from ledger import faults
from ledger.api import AsyncLedger, Ledger
from ledger.clock import Sleeper, SystemSleeper
from ledger.core.classify import classify
from ledger.core.envelope import Envelope
from ledger.core.facts import FailureFact, Observation, Phase
from ledger.core.preflight import NO_DENIALS, CharEstimator, Denials, TokenCounter
from ledger.core.profiles import Pin
from ledger.core.retry import retry_decision
from ledger.core.select import Decision, DecisionKind, RunPermissions, SelectionInput, select
from ledger.errors import (
    AllowanceExhausted,
    BudgetExceeded,
    CapacityUnavailable,
    FailoverExhausted,
    InvalidArgument,
    LedgerError,
    ProviderError,
)
from ledger.model import GroupMode, GroupProjection, Route
from ledger.policy.model import Policy
from ledger.records import AttemptKind, AttemptRecord, Lease, Outcome, RunRecord

log = logging.getLogger("ledger.run")


@dataclass(frozen=True)
class Dispatch:
    """What the send function is asked to do: send ``envelope`` on ``route``."""

    run_id: str
    attempt_id: str
    turn_id: str
    route: Route
    profile_id: str | None
    envelope: Envelope
    kind: AttemptKind


@dataclass(frozen=True)
class SendResult:
    """What the send function reports. ``observation`` is set exactly when the call failed."""

    ok: bool
    output: Any = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost: Decimal | None = None
    model_reported: str | None = None
    output_hash: str | None = None
    observation: Observation | None = None

    @classmethod
    def failed(cls, observation: Observation) -> SendResult:
        return cls(ok=False, observation=observation)


@dataclass(frozen=True)
class Notice:
    """Told to the caller: ``reset`` means discard text streamed by ``attempt_id``."""

    kind: str
    attempt_id: str
    route: str
    detail: str = ""


@dataclass(frozen=True)
class RunResult:
    """The answer, with the route that actually served it and every attempt made for it."""

    output: Any
    route: Route
    profile_id: str | None
    attempt: AttemptRecord
    attempts: list[AttemptRecord]
    resets: int = 0

    @property
    def switched(self) -> bool:
        return any(a.route_id != self.route.id for a in self.attempts)


SendFn = Callable[[Dispatch], SendResult | Awaitable[SendResult]]
NoticeFn = Callable[[Notice], Any]


# Effects the generator yields; the drivers execute them.
@dataclass(frozen=True)
class _Call:
    method: str
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class _Send:
    dispatch: Dispatch


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Notify:
    notice: Notice


_Effect = _Call | _Send | _Sleep | _Notify


@dataclass
class _Turn:
    tried: set[str] = field(default_factory=set)
    tried_profiles: set[str] = field(default_factory=set)
    errors: list[Exception] = field(default_factory=list)
    attempts: list[AttemptRecord] = field(default_factory=list)
    resets: int = 0
    # Groups whose admission refused this turn: Admission's own fresh fact for the selector.
    refused_groups: dict[str, float | None] = field(default_factory=dict)


def default_reserve(route: Route, envelope: Envelope, counter: TokenCounter) -> Decimal:
    """A hold that covers the request at the route's price: prompt estimate + max output."""
    prompt = counter.count_tokens(envelope, route)
    completion = envelope.max_output_tokens or 1024
    return route.cost(prompt, completion)


class _Loop:
    def __init__(
        self,
        lease: Lease,
        envelope: Envelope,
        *,
        turn_id: str,
        pin: Pin | None,
        denials: Denials,
        reserve: Decimal | Callable[[Route], Decimal] | None,
        rng: random.Random,
        token_counter: TokenCounter,
    ) -> None:
        self.lease = lease
        self.envelope = envelope
        self.turn_id = turn_id
        self.pin = pin
        self.denials = denials
        self.reserve = reserve
        self.rng = rng
        self.counter = token_counter

    def _hold(self, route: Route) -> Decimal:
        if self.reserve is None:
            return default_reserve(route, self.envelope, self.counter)
        if isinstance(self.reserve, Decimal):
            return self.reserve
        return self.reserve(route)

    def _selection(self, run: RunRecord, policy: Policy, turn: _Turn, now: float,
                   groups: Any, health: Any, provenance: Any, *, failure: FailureFact | None,
                   current: str | None, current_profile: str | None) -> SelectionInput:
        return SelectionInput(
            plan=run.plan,
            permissions=RunPermissions(
                retries_left=run.retries_left, calls_left=run.calls_left,
                tried=frozenset(turn.tried), tried_profiles=frozenset(turn.tried_profiles),
            ),
            policy=policy, now=now, request=self.envelope, role=run.role, grant=run.grant,
            groups=groups, health=health, current=current, current_profile=current_profile,
            pin=self.pin, failure=failure, denials=self.denials, provenance=provenance,
            token_counter=self.counter,
        )

    def _decide(self, policy: Policy, turn: _Turn, *, failure: FailureFact | None,
                current: str | None, current_profile: str | None, run_current: bool = False
                ) -> Generator[_Effect, Any, tuple[Decision, RunRecord]]:
        """Select with fresh facts. ``run_current``: a new turn continues from the route the
        Run actually used last, as read here."""
        run: RunRecord = yield _Call("get_run", {"run_id": self.lease.run_id})
        if run_current:
            current, current_profile = run.current_route, run.current_profile
        groups = yield _Call("group_projections", {"groups": sorted({r.group for r in run.plan})})
        now = yield _Call("now", {})
        if turn.refused_groups:
            groups = dict(groups)
            for g, until in turn.refused_groups.items():
                groups[g] = GroupProjection(group=g, mode=GroupMode.UNAVAILABLE, until=until,
                                            sampled_at=now)
        keys = [r.id for r in run.plan] + [p.id for r in run.plan for p in r.profiles]
        health = yield _Call("health", {"keys": keys})
        provenance = yield _Call("provenance", {"run_id": run.run_id})
        inp = self._selection(run, policy, turn, now, groups, health, provenance,
                              failure=failure, current=current, current_profile=current_profile)
        return select(inp), run

    def steps(self) -> Generator[_Effect, Any, RunResult]:
        policy: Policy = yield _Call("run_policy", {"run_id": self.lease.run_id})
        turn = _Turn()
        decision, run = yield from self._decide(
            policy, turn, failure=None, current=None, current_profile=None, run_current=True)
        kind = AttemptKind.FIRST
        same_route_retries = 0
        while True:
            if decision.kind is DecisionKind.STOP or decision.route is None:
                raise (yield from self._stopped(turn, decision, None))
            route, profile = decision.route, decision.profile
            if decision.kind is DecisionKind.PROBE:
                claimed = yield _Call("claim_probe", {"route": route,
                                                      "interval_s": policy.probe.interval_s})
                if not claimed:
                    # Another process probes it now: decide again with its probe recorded.
                    decision, run = yield from self._decide(
                        policy, turn, failure=None, current=None, current_profile=None)
                    continue
                kind = AttemptKind.PROBE
            yield from self._await_group(route, run, policy)
            try:
                att: AttemptRecord = yield _Call("begin_attempt", {
                    "lease": self.lease, "route": route, "envelope_hash": self.envelope.hash,
                    "reserve": self._hold(route), "turn_id": self.turn_id,
                    "profile_id": profile, "kind": kind,
                    "events": [("select", {**decision.to_json(),
                                           "attempt_kind": kind.value})],
                })
            except CapacityUnavailable as e:
                turn.errors.append(e)
                turn.tried.add(route.id)
                turn.refused_groups[route.group] = e.fields.get("until")
                attempt_id = e.fields.get("attempt_id")
                if attempt_id:
                    turn.attempts.append((yield _Call("get_attempt",
                                                      {"attempt_id": attempt_id})))
                log.info("[admission] %s/%s rejected before dispatch: %s", route.provider,
                         route.model, e.fields.get("reason"))
                decision, run = yield from self._decide(
                    policy, turn, failure=None, current=None, current_profile=None)
                kind = AttemptKind.FAILOVER
                continue
            except (BudgetExceeded, AllowanceExhausted) as e:
                turn.errors.append(e)
                raise (yield from self._stopped(turn, None, e)) from e
            dispatch = Dispatch(self.lease.run_id, att.attempt_id, self.turn_id, route, profile,
                                self.envelope, kind)
            faults.point("dispatch.before_send")
            try:
                result: SendResult = yield _Send(dispatch)
            except Exception:
                # The send function itself broke: we cannot know what left the process.
                yield _Call("settle_attempt", {"lease": self.lease,
                                               "attempt_id": att.attempt_id,
                                               "outcome": Outcome.UNKNOWN})
                raise
            faults.point("dispatch.after_send")
            if result.ok:
                done: AttemptRecord = yield _Call("settle_attempt", {
                    "lease": self.lease, "attempt_id": att.attempt_id,
                    "outcome": Outcome.SUCCEEDED, "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens, "cost": result.cost,
                    "model_reported": result.model_reported, "output_hash": result.output_hash,
                })
                turn.attempts.append(done)
                return RunResult(result.output, route, profile, done, turn.attempts, turn.resets)
            obs = result.observation or Observation(message="send reported failure without "
                                                            "an observation")
            now = yield _Call("now", {})
            fact = classify(obs, policy, now=now)
            # Sent with no answer (no status) after it left: execution unknown; the hold stays.
            unknown = fact.status is None and fact.phase in (Phase.AFTER_SEND, Phase.MID_STREAM)
            settled: AttemptRecord = yield _Call("settle_attempt", {
                "lease": self.lease, "attempt_id": att.attempt_id,
                "outcome": Outcome.UNKNOWN if unknown else Outcome.FAILED, "fact": fact,
            })
            turn.attempts.append(settled)
            turn.errors.append(ProviderError(
                f"{route.provider}/{route.model}: {fact.category.value}"
                + (f" (HTTP {fact.status})" if fact.status else ""),
                attempt_id=att.attempt_id, route=route.id, fact=fact.to_json(),
            ))
            if fact.effective_output and not fact.tool_started:
                turn.resets += 1
                yield _Notify(Notice("reset", att.attempt_id, route.id,
                                     "partial output of a failed attempt is discarded"))
            rd = retry_decision(fact, policy, same_route_retries, self.rng)
            if rd.retry and rd.delay_s is not None:
                try:
                    yield _Call("reserve_retry", {"lease": self.lease, "data": {
                        "route": route.id, "cause": fact.category.value, "same_route": True}})
                except AllowanceExhausted as e:
                    turn.errors.append(e)
                    raise (yield from self._stopped(turn, None, e)) from e
                same_route_retries += 1
                log.info("[LLM] %s:%s: %s; retry %d in %.1fs", route.provider, route.model,
                         fact.category.value, same_route_retries, rd.delay_s)
                yield _Call("append_event", {"lease": self.lease, "kind": "retry", "data": {
                    "route": route.id, "cause": _cause(fact), "delay_s": rd.delay_s,
                    "n": same_route_retries}, "attempt_id": att.attempt_id})
                yield _Sleep(rd.delay_s)
                kind = AttemptKind.RETRY
                decision = Decision(DecisionKind.ROUTE, route, profile)
                continue
            turn.tried.add(route.id)
            if profile and policy.profiles.rotate_before_model:
                # A failed credential is "tried" only where credentials rotate (fased); under a
                # route-level policy one 503 says nothing about the account shared by routes.
                turn.tried_profiles.add(profile)
            decision, run = yield from self._decide(
                policy, turn, failure=fact, current=route.id, current_profile=profile)
            if decision.kind is DecisionKind.STOP or decision.route is None:
                raise (yield from self._stopped(turn, decision, None))
            try:
                yield _Call("reserve_retry", {"lease": self.lease, "data": {
                    "route": decision.route.id, "cause": fact.category.value}})
            except AllowanceExhausted as e:
                turn.errors.append(e)
                raise (yield from self._stopped(turn, None, e)) from e
            nxt = decision.route
            log.info("[fallback] serving the request with %s/%s (%s/%s: %s)", nxt.provider,
                     nxt.model, route.provider, route.model, _describe(fact))
            yield _Call("append_event", {"lease": self.lease, "kind": "move", "data": {
                "from_route": route.id, "to_route": nxt.id, "profile": decision.profile,
                "cause": _cause(fact)}, "attempt_id": att.attempt_id})
            kind = AttemptKind.RETRY if nxt.id == route.id else AttemptKind.FAILOVER
            same_route_retries = 0

    def _await_group(self, route: Route, run: RunRecord, policy: Policy
                     ) -> Generator[_Effect, Any, None]:
        """Wait out the target group's waiting floor when it ends in time: before the Run's
        deadline and within the policy's ``admission.max_capacity_wait_s``.

        Crossing to another group never inherits the old group's Retry-After; only the target
        group's own floor applies (read again here: time has passed since the selection). A
        floor beyond either bound is left to admission, which records the rejection.
        """
        proj = yield _Call("group_projections", {"groups": [route.group]})
        g = proj.get(route.group)
        now = yield _Call("now", {})
        if g is None or g.until is None or g.until <= now or g.mode.value == "open":
            return
        if run.deadline is not None and g.until > run.deadline:
            return
        if g.until - now > policy.admission.max_capacity_wait_s:
            return
        yield _Sleep(g.until - now)

    def _stopped(self, turn: _Turn, decision: Decision | None, error: LedgerError | None
                 ) -> Generator[_Effect, Any, FailoverExhausted]:
        """Record the stop with its reasons (an audit event), then build the error to raise."""
        exc = self._stop(turn, decision, error)
        yield _Call("append_event", {"lease": self.lease, "kind": "stop", "data": {
            "reason": exc.reason, "detail": exc.fields.get("detail", ""),
            "skipped": exc.fields.get("skipped", []), "attempts": exc.attempts,
            "errors": [str(e) for e in turn.errors]}})
        return exc

    def _stop(self, turn: _Turn, decision: Decision | None,
              error: LedgerError | None) -> FailoverExhausted:
        if decision is not None:
            reason = decision.reason.value if decision.reason else "no_candidate"
            detail = decision.detail
        elif isinstance(error, BudgetExceeded):
            reason, detail = "budget", str(error)
        else:
            reason, detail = "retry_allowance", str(error) if error else ""
        names = "; ".join(str(e) for e in turn.errors) or "no attempt was made"
        return FailoverExhausted(
            f"every route failed ({reason}): {names}", list(turn.errors), reason=reason,
            attempts=[a.attempt_id for a in turn.attempts], detail=detail,
            skipped=[s.to_json() for s in decision.skipped] if decision else [],
        )


def _cause(fact: FailureFact) -> dict[str, Any]:
    return {"category": fact.category.value, "status": fact.status, "scope": fact.scope.value,
            "phase": fact.phase.value}


def _describe(fact: FailureFact) -> str:
    return f"{fact.status} {fact.category.value}" if fact.status else fact.category.value


def _loop(lease: Lease, envelope: Envelope, turn_id: str | None, pin: Pin | str | None,
          denials: Denials | None, reserve: Decimal | Callable[[Route], Decimal] | None,
          rng: random.Random | None, token_counter: TokenCounter | None) -> _Loop:
    if not isinstance(envelope, Envelope):
        raise InvalidArgument("envelope must be a ledger.Envelope", field="envelope")
    return _Loop(
        lease, envelope, turn_id=turn_id or f"turn-{envelope.hash[7:19]}",
        pin=Pin(pin) if pin else None, denials=denials or NO_DENIALS, reserve=reserve,
        rng=rng or random.Random(), token_counter=token_counter or CharEstimator(),
    )


def execute(
    ledger: Ledger,
    lease: Lease,
    envelope: Envelope,
    send: Callable[[Dispatch], SendResult],
    *,
    turn_id: str | None = None,
    pin: Pin | str | None = None,
    denials: Denials | None = None,
    reserve: Decimal | Callable[[Route], Decimal] | None = None,
    sleeper: Sleeper | None = None,
    on_notice: NoticeFn | None = None,
    rng: random.Random | None = None,
    token_counter: TokenCounter | None = None,
) -> RunResult:
    """Serve one logical turn of the Run (sync). Raises :class:`FailoverExhausted` on a stop."""
    gen = _loop(lease, envelope, turn_id, pin, denials, reserve, rng, token_counter).steps()
    sleeper = sleeper or _sleeper_of(ledger)
    done, item = _advance(gen, None, None)
    while not done:
        value: Any = None
        error: Exception | None = None
        try:
            if isinstance(item, _Call):
                value = _sync_call(ledger, item)
            elif isinstance(item, _Send):
                value = send(item.dispatch)
            elif isinstance(item, _Sleep):
                sleeper.sleep(item.seconds)
            elif on_notice is not None:
                on_notice(item.notice)
        except Exception as e:
            error = e
        done, item = _advance(gen, value, error)
    return item  # type: ignore[no-any-return]


async def aexecute(
    ledger: AsyncLedger,
    lease: Lease,
    envelope: Envelope,
    send: SendFn,
    *,
    turn_id: str | None = None,
    pin: Pin | str | None = None,
    denials: Denials | None = None,
    reserve: Decimal | Callable[[Route], Decimal] | None = None,
    sleeper: Sleeper | None = None,
    on_notice: NoticeFn | None = None,
    rng: random.Random | None = None,
    token_counter: TokenCounter | None = None,
) -> RunResult:
    """Serve one logical turn of the Run (async). Same logic as :func:`execute`."""
    gen = _loop(lease, envelope, turn_id, pin, denials, reserve, rng, token_counter).steps()
    sleeper = sleeper or _sleeper_of(ledger.sync)
    done, item = _advance(gen, None, None)
    while not done:
        value: Any = None
        error: Exception | None = None
        try:
            if isinstance(item, _Call):
                value = await _async_call(ledger, item)
            elif isinstance(item, _Send):
                out = send(item.dispatch)
                value = await out if inspect.isawaitable(out) else out
            elif isinstance(item, _Sleep):
                await sleeper.asleep(item.seconds)
            elif on_notice is not None:
                res = on_notice(item.notice)
                if inspect.isawaitable(res):
                    await res
        except Exception as e:
            error = e
        done, item = _advance(gen, value, error)
    return item  # type: ignore[no-any-return]


def _advance(gen: Generator[_Effect, Any, RunResult], value: Any,
             error: Exception | None) -> tuple[bool, Any]:
    """Resume the loop with an effect's result (or its error): (finished, effect or result)."""
    try:
        return False, (gen.throw(error) if error is not None else gen.send(value))
    except StopIteration as stop:
        return True, stop.value


def _sleeper_of(ledger: Ledger) -> Sleeper:
    # A ManualClock is also a sleeper that advances it: tests never really wait.
    clock: Any = ledger.clock
    if callable(getattr(clock, "sleep", None)) and callable(getattr(clock, "asleep", None)):
        return clock  # type: ignore[no-any-return]
    return SystemSleeper()


def _sync_call(ledger: Ledger, eff: _Call) -> Any:
    if eff.method == "now":
        return ledger.now()
    return getattr(ledger, eff.method)(**eff.kwargs)


async def _async_call(ledger: AsyncLedger, eff: _Call) -> Any:
    if eff.method == "now":
        return ledger.sync.now()
    return await getattr(ledger, eff.method)(**eff.kwargs)


__all__ = [
    "Dispatch",
    "Notice",
    "RunResult",
    "SendResult",
    "aexecute",
    "default_reserve",
    "execute",
]
