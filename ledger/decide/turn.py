"""The retry owner's turn, as data: a generator that yields typed effects and decides.

:meth:`TurnLoop.steps` is the whole attempt lifecycle of one turn, written once. It yields
effects (:mod:`ledger.decide.effects`: a snapshot read, a begin, a send, a settle, a sleep, a
note to the caller) and is sent back each one's result; it never reads a clock, sleeps, sends
or writes itself. The drivers in :mod:`ledger.api.turn` (``execute``/``aexecute``) perform
the effects; every decision here is one of the pure functions of :mod:`ledger.decide`.

The sequence per failure (seed 003 section 4): settle the failed attempt with its fact -> a
same-route retry if the policy allows one -> else select the next eligible route from the
frozen plan with fresh facts (group facts, health, capability, role, disclosure) -> begin the
next attempt, which takes one retry permission in its own transaction. A backup route brings no
new budget: every attempt draws on the Run's allowances.

Interruptions (``CancelledError``, ``KeyboardInterrupt``, ``GeneratorExit``, a timeout) are
recorded truthfully before they propagate unchanged: a begin or settle already under way is
completed first; an attempt whose request provably never left is settled *not sent* (hold
voided); one that may have left is settled *unknown* with a ``cancelled`` fact (hold kept),
unless the send observed its failure first (``SendProgress.failure``: a callback that raised on
the ``Reset`` after it): that failure is settled, as observed, in its place.
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from ledger import faults
from ledger.decide.begin import begin_spec
from ledger.decide.classify import classify
from ledger.decide.effects import (
    AwaitSlot,
    Begin,
    ClaimProbe,
    Dispatch,
    Effect,
    HeldLease,
    LeaveQueue,
    Notice,
    Notify,
    Now,
    Record,
    ResolveBegin,
    Send,
    SendProgress,
    SendResult,
    Settle,
    Sleep,
    Snapshot,
    TurnRecord,
    TurnSnapshot,
    attempt_headers,
    perform,
)
from ledger.decide.health import route_key
from ledger.decide.inputs import record_inputs
from ledger.decide.preflight import (
    Denials,
    TokenCounter,
    check_envelope_limits,
    needs_cover,
    require_carried,
)
from ledger.decide.profiles import Pin, keeps_pinned_profile, marks_profile_tried
from ledger.decide.resolve import Resolution, stays, unresolved_begin
from ledger.decide.retry import retry_decision
from ledger.decide.select import (
    Decision,
    DecisionKind,
    Reason,
    RunPermissions,
    SelectionInput,
    Skip,
    first_reopening,
    preflight_verdicts,
    recheck,
    reopening_wait,
    select,
)
from ledger.decide.settle import failure_outcome, settle_spec
from ledger.decide.stops import (
    attempt_error,
    candidate_lines,
    cause_of,
    describe,
    failover_details,
    failures_by_route,
    provider_text,
    queue_timeout,
    recorded_candidate_lines,
    rejected_record,
    reopening_note,
    skipped_error,
)
from ledger.domain.bounds import MAX_TOKENS
from ledger.domain.carried import Uncarried
from ledger.domain.envelope import (
    DEFAULT_OUTPUT_TOKENS,
    DERIVED_ROLE_CLASS,
    Envelope,
    Part,
    tool_link_problem,
)
from ledger.domain.facts import Category, FailureFact, Observation, Phase, Source
from ledger.domain.records import (
    AttemptKind,
    AttemptRecord,
    AttemptState,
    Lease,
    Outcome,
    Queued,
    to_micros,
)
from ledger.domain.timefmt import iso
from ledger.domain.validation import amount_in_range, tokens_in_range
from ledger.domain.values import GroupMode, GroupProjection, Route, new_id
from ledger.errors import (
    AllowanceExhausted,
    BudgetExceeded,
    CapacityUnavailable,
    DatabaseUnavailable,
    FailoverExhausted,
    FencedOut,
    InvalidArgument,
    InvalidState,
    LeaseLost,
    LedgerError,
    NotFound,
    PartialOutput,
    ProviderError,
    SettleConflict,
)
from ledger.policy.model import Policy

# The retry owner's log lines (the seeds' "[fallback] ..." lines) keep the logger name
# operators filter on.
log = logging.getLogger("ledger.run")


@dataclass(frozen=True)
class RunResult:
    """The answer, with the route that actually served it and every attempt made for it.

    Attributes:
        output: What the send function returned as the answer (the adapters':
            ``AdapterResult``).
        route: The frozen route that served it.
        profile_id: The credential profile it was served with.
        attempt: The successful Attempt, as settled.
        attempts: Every Attempt of the turn, in order (rejected ones included).
        resets: How often streamed text of a failed Attempt had to be discarded.
        parts: The answer as conversation parts, ready to append to the next envelope.
    """

    output: Any
    route: Route
    profile_id: str | None
    attempt: AttemptRecord
    attempts: list[AttemptRecord]
    resets: int = 0
    parts: list[Part] = field(default_factory=list)

    @property
    def switched(self) -> bool:
        """Whether an Attempt of the turn was on another route than the one that served it."""
        return any(a.route_id != self.route.id for a in self.attempts)

    @property
    def text(self) -> str:
        """The answer's text (its text parts, joined)."""
        return "".join(p.content for p in self.parts if p.role == "assistant"
                       and p.tool_call_id is None)

    @property
    def tool_calls(self) -> list[Part]:
        """The tool calls the model proposed, as parts.

        Each has ``tool_call_id``, ``name``, and the arguments as JSON in ``content``.
        """
        return [p for p in self.parts if p.tool_call_id is not None]


SendFn = Callable[[Dispatch], SendResult | Awaitable[SendResult]]
# A cost hold: an amount (as begin_attempt takes it) or a function of the route.
Reserve = Decimal | int | float | str | Callable[[Route], Decimal]
NoticeFn = Callable[[Notice], Any]
Steps = Generator[Effect[Any], Any, RunResult]

# The stop reason of a turn whose continuation admission refused (failover.after_rejection).
REJECTED = "rejected_before_dispatch"
EXECUTION_UNKNOWN = Reason.EXECUTION_UNKNOWN.value

# What the caller did not ask for but the loop must survive: the caller's own cancellation.
CANCELLED_FACT = FailureFact(category=Category.CANCELLED, phase=Phase.AFTER_SEND,
                             source=Source.LOCAL, message="the caller cancelled the call")


@dataclass
class _Turn:
    tried: set[str] = field(default_factory=set)
    tried_profiles: set[str] = field(default_factory=set)
    errors: list[Exception] = field(default_factory=list)
    attempts: list[AttemptRecord] = field(default_factory=list)
    resets: int = 0
    # Groups whose admission refused this turn: Admission's own fresh fact for the selector.
    refused_groups: dict[str, float | None] = field(default_factory=dict)
    # (route, profile) pairs that failed, and routes whose probe another process claimed.
    tried_pairs: set[tuple[str, str]] = field(default_factory=set)
    refused_probes: set[str] = field(default_factory=set)
    # Output the caller was shown before its attempt failed: handed back if the turn stops.
    partial: PartialOutput | None = None
    # Seconds waited so far (group floors, reopenings, a full group's queue): together at most
    # the policy's one bound on waiting, admission.max_capacity_wait_s.
    waited: float = 0.0
    # Audit events that led to the next attempt; written in its begin transaction.
    pending: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # The latest reason each candidate was passed over, by route id (for the stop).
    skips: dict[str, Skip] = field(default_factory=dict)
    # A route chosen after waiting for its cooldown to end: its Attempt is a probe.
    reopened: str | None = None
    # What the current decision was made from (a refused probe claim decides again from it):
    # the selector's arguments, what it decides (``on``: new_turn, failure, rejection) and the
    # Attempt whose failure it follows.
    basis: dict[str, Any] = field(default_factory=dict)
    on: str = "new_turn"
    failed: str | None = None
    # The recorded inputs of the current decision (written with the Attempt it leads to, or
    # with the stop), and the snapshot it was made on.
    inputs: dict[str, Any] | None = None
    snap: TurnSnapshot | None = None
    # When the first candidate would reopen, for a decision that found none, and the time and
    # wait bound that decision was made with.
    reopens_at: float | None = None
    now: float | None = None
    bound: float | None = None
    plan: Sequence[Route] = ()


@dataclass(frozen=True)
class _Try:
    """The next attempt of a turn.

    What was decided, why it is made, and how many same-route retries of this request came
    before it.
    """

    decision: Decision
    kind: AttemptKind
    retries: int


@dataclass(frozen=True)
class _Failed:
    """An attempt that was sent and failed (settled with ``fact``)."""

    route: Route
    profile: str | None
    attempt_id: str
    fact: FailureFact


@dataclass(frozen=True)
class _Refused:
    """An attempt the capacity group did not admit (refused, or full past the wait bound)."""

    route: Route
    error: CapacityUnavailable


@dataclass(frozen=True)
class _Unclaimed:
    """A probe whose cluster-wide slot another process took."""

    route: Route


@dataclass(frozen=True)
class _Outdated:
    """A chosen route that stopped serving while the turn waited to begin on it.

    The wait was in its group's queue or for its group's waiting floor. ``skip`` says why (read
    from ``snap``, the fresh snapshot the turn decides again on); ``events`` are the ones that
    led to the begin it waited for (its ``move`` and ``select`` left out): they go with the
    next Attempt.
    """

    route: Route
    snap: TurnSnapshot
    skip: Skip
    events: tuple[tuple[str, dict[str, Any]], ...] = ()


_Ended = _Failed | _Refused | _Unclaimed | _Outdated


def _token_estimate(route: Route, envelope: Envelope, counter: TokenCounter) -> tuple[int, int]:
    """(prompt, completion) tokens to hold, their sum within the documented token range.

    Clamped rather than refused: a hold of the most tokens a Run may hold still meets the
    Run's token and cost budgets, which refuse it as an overdraw with nothing sent, where an
    unbounded estimate (a counter's, or a document's) would overflow the ledger's columns.
    """
    out = envelope.max_output_tokens or DEFAULT_OUTPUT_TOKENS
    return min(counter.count_tokens(envelope, route), MAX_TOKENS - out), out


def group_wait(group: GroupProjection | None, now: float, deadline: float | None,
               max_wait_s: float) -> float:
    """How long to wait for the target group's waiting floor before beginning.

    Its end, when it ends before the Run's deadline and within ``max_wait_s``; else 0 (admission
    decides).
    """
    if group is None or group.until is None or group.until <= now:
        return 0.0
    if group.mode is GroupMode.OPEN:
        return 0.0
    if deadline is not None and group.until > deadline:
        return 0.0
    wait = group.until - now
    return wait if wait <= max_wait_s else 0.0


@dataclass(frozen=True)
class _Usage:
    """The usage a send reported, as the settle records it."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost: Decimal | None = None
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    events: tuple[tuple[str, dict[str, Any]], ...] = ()

    @classmethod
    def of(cls, result: SendResult) -> _Usage:
        pt, ct, cost = result.prompt_tokens, result.completion_tokens, result.cost
        cached, reasoning = result.cached_tokens, result.reasoning_tokens
        if not _usage_ok(result):
            # A hostile or buggy provider must not turn a finished call into a crash: the
            # Attempt is recorded, the usage is marked invalid (kept as evidence), and the
            # settle posts as if none was reported.
            return cls(events=(("usage_invalid", {
                "prompt_tokens": _as_reported(pt), "completion_tokens": _as_reported(ct),
                "cost": _as_reported(cost), "cached_tokens": _as_reported(cached),
                "reasoning_tokens": _as_reported(reasoning)}),))
        if not _details_ok(result):
            # The totals stand; parts that do not fit in them are kept as evidence only.
            return cls(pt, ct, cost, events=(("usage_invalid", {
                "cached_tokens": _as_reported(cached),
                "reasoning_tokens": _as_reported(reasoning)}),))
        return cls(pt, ct, cost, cached, reasoning)


#: The most characters of one reported value a ``usage_invalid`` event keeps.
MAX_REPORTED_CHARS = 200


def _as_reported(value: Any) -> str:
    """A reported figure as a ``usage_invalid`` event keeps it: its text, bounded.

    The value is whatever the provider (or a host's send) put there: a 16 MiB string, a
    whole list where a usage object belongs, an integer too long for ``str()``. The event
    is evidence, not a copy of the body, and writing it must never fail the settle.
    """
    try:
        text = str(value)
    except (ValueError, RecursionError):  # past sys.get_int_max_str_digits(); deep nesting
        text = (f"an integer of {value.bit_length()} bits" if isinstance(value, int)
                else f"a {type(value).__name__} too deep to write")
    if len(text) <= MAX_REPORTED_CHARS:
        return text
    return text[:MAX_REPORTED_CHARS] + f"...[{len(text)} characters]"


def _renamed_calls(result: SendResult) -> list[tuple[str, dict[str, Any]]]:
    """A ``tool_call_id`` event for each call whose provider id the adapter replaced.

    The integrations write an event of this kind when they give a call a stable id
    (``provider_id``, ``call_id``). Here the provider's id is what no part could keep (a
    16 MiB text, a NUL, a terminal escape): the event keeps it as a provider's text is stored
    (printable, redacted, its first 200 characters), with its length and why it was replaced.
    """
    out: list[tuple[str, dict[str, Any]]] = []
    for provider_id, call_id in result.renamed_calls:
        out.append(("tool_call_id", {
            "provider_id": provider_text(provider_id), "provider_id_chars": len(provider_id),
            "call_id": provider_text(call_id),
            "problem": tool_link_problem("tool_call_id", provider_id)}))
    return out


def ledger_closed(error: BaseException) -> bool:
    """Whether ``error`` is a closed (or closing) ledger's refusal.

    The store raises it when a write asks for a connection, or a begin comes once the close
    has begun (:func:`ledger.storage.failure.closed_error`): before any transaction, so that
    try wrote nothing. (A write done again after an interruption to learn its outcome learns
    nothing from it: the drivers of :mod:`ledger.api.turn` deliver the interruption instead.)
    """
    return isinstance(error, InvalidState) and error.fields.get("problem") == "ledger_closed"


def _usage_ok(result: SendResult) -> bool:
    return (all(v is None or tokens_in_range(v)
                for v in (result.prompt_tokens, result.completion_tokens))
            and (result.cost is None or amount_in_range(result.cost)))


def _details_ok(result: SendResult) -> bool:
    """Whether the cached and reasoning counts are counts within their totals."""
    return all(part is None or (tokens_in_range(part) and (total is None or part <= total))
               for part, total in ((result.cached_tokens, result.prompt_tokens),
                                   (result.reasoning_tokens, result.completion_tokens)))


class TurnLoop:
    """One turn of a Run under ``lease``, as a generator of typed effects.

    Iterate :meth:`steps` and send back each effect's result (the drivers in
    :mod:`ledger.api.turn` do). ``reserve`` is the cost hold (an amount, a function of the
    route, or ``None`` for the route's price of the token estimate); the other arguments are
    :func:`ledger.execute`'s, checked.
    """

    def __init__(
        self,
        lease: Lease,
        envelope: Envelope,
        *,
        turn_id: str | None,
        pin: Pin | None,
        denials: Denials,
        reserve: Decimal | Callable[[Route], Decimal] | None,
        rng: random.Random | None,
        token_counter: TokenCounter,
        part_hashes: Sequence[str] | None = None,
        lease_margin_s: float = 0.0,
    ) -> None:
        self.lease = lease
        self.lease_margin_s = lease_margin_s
        self.envelope = envelope
        self.pin = pin
        self.denials = denials
        self.reserve = reserve
        self._rng = rng
        self.counter = token_counter
        # Every part hashed once per turn: the envelope's hash and each decision's coverage
        # check use these (a long conversation's parts dominate a turn's CPU otherwise).
        self.part_hashes = (tuple(p.content_hash for p in envelope.parts)
                            if part_hashes is None else tuple(part_hashes))
        self.envelope_hash = envelope.hash_with(self.part_hashes)
        # What of the request some protocols cannot build (read once, by require_carried).
        self.uncarried: tuple[Uncarried, ...] | None = None
        self.turn_id = turn_id or f"turn-{self.envelope_hash[7:19]}"
        # Only the references the disclosure check reads: the user's own input needs none,
        # and a reference it carries (recorded by nobody) cost a read of the whole tree.
        # Each with the content carried under it: a ref the Run's own line recorded with other
        # content is looked up in the rest of its tree too.
        pairs = zip(envelope.parts, self.part_hashes, strict=True)
        self.carried = tuple(sorted({
            (p.provenance, h) for p, h in pairs if p.provenance
            and needs_cover(p.data_class, p.role in DERIVED_ROLE_CLASS)}))
        self.refs = tuple(sorted({ref for ref, _ in self.carried}))

    def _read(self, turn_id: str | None = None) -> Snapshot:
        """The turn's snapshot read.

        With ``turn_id`` (the turn's first) it also finds the turn's Attempts without a receipt.
        """
        return Snapshot(self.lease.run_id, self.refs, turn_id, self.carried)

    def _holds(self, route: Route) -> tuple[Decimal, int]:
        prompt, completion = _token_estimate(route, self.envelope, self.counter)
        if self.reserve is None:
            cost = route.cost(prompt, completion)
        elif isinstance(self.reserve, Decimal):
            cost = self.reserve
        else:
            cost = self.reserve(route)
        return cost, prompt + completion

    def _input(self, snap: TurnSnapshot, turn: _Turn, *, failure: FailureFact | None,
               current: str | None, current_profile: str | None) -> SelectionInput:
        run = snap.run
        groups = snap.groups
        if turn.refused_groups:
            groups = dict(groups)
            for g, until in turn.refused_groups.items():
                groups[g] = GroupProjection(group=g, mode=GroupMode.UNAVAILABLE, until=until,
                                            sampled_at=snap.now)
        given: dict[str, Any] = dict(
            plan=run.plan,
            permissions=RunPermissions(
                retries_left=run.retries_left, calls_left=run.calls_left,
                tried=frozenset(turn.tried), tried_profiles=frozenset(turn.tried_profiles),
                tried_pairs=frozenset(turn.tried_pairs),
            ),
            policy=snap.policy, now=snap.now, request=self.envelope, role=run.role,
            grant=run.grant, groups=groups, health=snap.health, current=current,
            current_profile=current_profile, pin=self.pin, failure=failure,
            denials=self.denials, provenance=snap.provenance, token_counter=self.counter,
            part_hashes=self.part_hashes, uncarried=self.uncarried,
            no_probe=frozenset(turn.refused_probes),
        )
        # Every plan route's preflight verdict, decided once: the selector uses them and the
        # decision's record keeps them, so it can be recomputed under any policy.
        return SelectionInput(**given,
                              verdicts=preflight_verdicts(SelectionInput(**given)))

    def _record(self, inp: SelectionInput, turn: _Turn, by: str) -> dict[str, Any]:
        """The recorded inputs of a decision made (``by``) from ``inp`` in ``turn``."""
        return record_inputs(inp, by=by, on=turn.on, turn=self.turn_id, failed=turn.failed,
                             refused=sorted(turn.refused_groups))

    @property
    def rng(self) -> random.Random:
        """The jitter of this turn's retry waits.

        The one given, else one seeded from the system on first use: a healthy turn never
        waits, so it never pays for the seeding.
        """
        if self._rng is None:
            self._rng = random.Random()
        return self._rng

    def steps(self) -> Steps:
        """The turn: yields each effect, receives its result, returns the :class:`RunResult`.

        It reads top to bottom: decide, then attempt (begin, send, settle) until an answer,
        each failure deciding whether to retry the route or move on. When it stops it raises
        :class:`~ledger.errors.FailoverExhausted`, holding every attempt's error (a budget or
        allowance refusal at begin included, as its cause) and a
        :class:`~ledger.errors.CandidateSkipped` for every candidate passed over.
        """
        turn = _Turn()
        snap = yield from perform(self._read(self.turn_id))
        self._policy = snap.policy
        # Images and documents beyond the Run's frozen bounds: refused before anything is
        # recorded (the snapshot is a read).
        check_envelope_limits(self.envelope, snap.policy.envelope)
        if snap.unreceipted:
            raise (yield from self._sent_before(turn, snap.run.plan, snap.unreceipted))
        run = snap.run
        # Parameters, parts or values no route of the plan can carry are the request's fault,
        # refused as the bounds above are; a route that alone cannot is skipped by preflight.
        self.uncarried = require_carried(self.envelope, run.plan)
        turn.plan = run.plan
        # A new turn keeps the session's profile (a user pin survives a compaction).
        turn.basis = {"failure": None, "current": run.current_route,
                      "current_profile": run.current_profile if self.pin is Pin.USER
                      else run.pinned_profile}
        decision, snap = yield from self._decide(snap, turn, turn.basis)
        attempt = _Try(decision, AttemptKind.FIRST, 0)
        while True:
            ended = yield from self._attempt(turn, snap, attempt)
            if isinstance(ended, RunResult):
                return ended
            attempt, snap = yield from self._next(turn, attempt, ended)

    # -- one attempt: begin, send, settle ----------------------------------------------------

    def _attempt(self, turn: _Turn, snap: TurnSnapshot, attempt: _Try
                 ) -> Generator[Effect[Any], Any, RunResult | _Ended]:
        """Make the decided attempt: its answer, or how it ended without one."""
        decision, policy = attempt.decision, self._policy
        if decision.kind is DecisionKind.STOP or decision.route is None:
            raise (yield from self._stopped(turn, decision, None))
        route, profile = decision.route, decision.profile
        attempt_kind = attempt.kind
        if decision.kind is DecisionKind.PROBE:
            pp = policy.probe
            claimed = yield from perform(ClaimProbe(
                route, pp.interval_s, key=route_key(route, policy), ttl_s=pp.ttl_s,
                max_keys=pp.max_keys))
            if not claimed:
                return _Unclaimed(route)  # another process probes it now
            attempt_kind = AttemptKind.PROBE
        elif turn.reopened == route.id:
            attempt_kind = AttemptKind.PROBE  # the first call since it reopened
        wait = group_wait(snap.groups.get(route.group), snap.now, snap.run.deadline,
                          self._wait_left(policy, turn))
        if wait > 0:
            yield from perform(Sleep(wait))
            turn.waited += wait
            floor = {"for": "group_floor", "group": route.group, "waited_s": round(wait, 6)}
            # As after a wait in a full group's queue: the route may have stopped serving
            # while the turn slept (another worker's failures cooled it).
            outdated = yield from self._rechecked(turn, attempt)
            if outdated is not None:
                yield from self._record_redecided("wait", floor, outdated)
                # What led here goes with the Attempt decided instead, but the move to this
                # route, which is not made.
                led_here = tuple((k, d) for k, d in turn.pending if k != "move")
                turn.pending = []
                return replace(outdated, events=led_here)
            turn.pending.append(("wait", floor))
        reserve, reserve_tokens = self._holds(route)
        attempt_id = new_id("att")
        # The headers that will name this Attempt on the wire, recorded before it is sent.
        events = [*turn.pending, ("select", {
            **decision.to_json(), "attempt_kind": attempt_kind.value,
            "headers": attempt_headers(attempt_id, route.protocol),
            **({"inputs": turn.inputs} if turn.inputs is not None else {})})]
        turn.pending = []
        begin = Begin(begin_spec(
            snap.run, self.lease, route=route, profile_id=profile,
            envelope_hash=self.envelope_hash, reserve_micros=to_micros(reserve),
            reserve_tokens=reserve_tokens, turn_id=self.turn_id, kind=attempt_kind,
            attempt_id=attempt_id, events=events,
            take_retry=attempt.kind is not AttemptKind.FIRST,
            queue_until=self._queue_until(snap, turn, waited=wait)))
        try:
            att = yield from self._admitted(begin, turn, policy, attempt)
        except CapacityUnavailable as e:
            turn.errors.append(e)
            if not e.fields.get("queued"):  # a queue's wait wrote no Attempt
                turn.attempts.append(rejected_record(begin, e, snap.now))
            return _Refused(route, e)
        except (BudgetExceeded, AllowanceExhausted) as e:
            turn.errors.append(e)
            raise (yield from self._stopped(turn, None, e, begun=(decision, attempt_kind))
                   ) from e
        except DatabaseUnavailable as e:
            yield from self._resolve_begin(route, profile, attempt_id, e)
            raise
        except (GeneratorExit, FencedOut):
            # Closed with no driver left, or refused for a stale fence or a lapsed lease (the
            # begin rolled back): there is nothing to settle, and a settle would only be kept
            # as the late receipt of an attempt that never existed.
            raise
        except BaseException as e:
            # A closed (or closing) ledger refuses a begin before it opens a transaction: no
            # Attempt to settle, and a settle's refusal would read as one left to recovery.
            if not ledger_closed(e):
                # Interrupted: the begin may have committed; if it did, it was never sent.
                yield from self._settle_quietly(route, profile, attempt_id, Outcome.NOT_SENT)
            raise
        if isinstance(att, _Outdated):
            # Nothing was begun: what led here goes with the Attempt decided instead, but the
            # move to this route, which is not made.
            return replace(att, events=tuple((k, d) for k, d in events[:-1] if k != "move"))
        if att.state is not AttemptState.DISPATCHING:
            raise LedgerError(
                f"attempt {attempt_id!r} is already {att.state.value}; it is not sent again",
                attempt_id=attempt_id, state=att.state.value)
        dispatch = Dispatch(self.lease.run_id, att.attempt_id, self.turn_id, route, profile,
                            self.envelope, attempt_kind, SendProgress())
        try:
            faults.point("dispatch.before_send")
            now = yield from perform(Now())
            lapsed = self._lapsed_since_begin(att, now, self.lease)
            if lapsed is not None:
                # The lease the turn started with is stale once the turn outlived it (a queue
                # wait, backoffs): its holder's keeper may have renewed it since.
                lapsed = self._lapsed_since_begin(att, now, (yield from perform(HeldLease())))
            if lapsed is not None:
                raise lapsed
            result = yield from perform(Send(dispatch))
            if not isinstance(result, SendResult):
                # The host's send may have sent the request: settled as interrupted (unknown
                # unless provably unsent) on the way out, like a send that raised.
                fix = ("return SendResult(ok=True, ...) for an answer, "
                       "SendResult.failed(Observation(...)) for a failure, or raise")
                if inspect.iscoroutine(result):
                    result.close()  # never to be awaited here
                    fix = "a coroutine function sends with aexecute and an AsyncLedger"
                raise InvalidArgument(
                    f"send returned {type(result).__name__}, not a SendResult: {fix}",
                    field="send", attempt_id=att.attempt_id)
        except GeneratorExit:
            raise  # closed with no driver left: recovery settles it
        except BaseException:
            yield from self._settle_interrupted(route, profile, att, dispatch,
                                                repeat=attempt.retries > 0)
            raise
        repeat = attempt.retries > 0
        # The answer is in hand from here: an interruption before its settle is written (a
        # KeyboardInterrupt, a fault, a cancellation raised by the host's clock) settles it as
        # answered, not unknown, then propagates.
        try:
            faults.point("dispatch.after_send")
            # A failover's success under a user pin leaves the session on its pinned profile.
            keep = keeps_pinned_profile(self.pin, snap.run.current_profile, profile)
            if result.ok:
                settled = yield from self._settle_success(route, profile, att, result,
                                                          dispatch.progress, keep_profile=keep)
            else:
                fact, now = yield from self._fact_of(result, dispatch)
                # A same-route retry's failure was counted with the request's first: not again.
                settled = yield from self._settle_failure(
                    route, profile, att, fact, result, now, repeat=repeat,
                    times=dispatch.progress.since(att.created_at))
        except (GeneratorExit, LedgerError):
            # Closed with no driver left (recovery settles it), or the settle's own refusal
            # (a database away, a lost lease), which says what becomes of it.
            raise
        except BaseException:
            yield from self._settle_answered(route, profile, att, result, dispatch,
                                             repeat=repeat, current=snap.run.current_profile)
            raise
        if result.ok:
            turn.attempts.append(settled)
            return RunResult(result.output, route, profile, settled, turn.attempts, turn.resets,
                             list(result.parts))
        return (yield from self._failed(turn, route, profile, att, result, fact, settled))

    def _lapsed_since_begin(self, att: AttemptRecord, now: float, lease: Lease
                            ) -> LeaseLost | None:
        """Why the request may no longer leave, or ``None``.

        The begin proved the lease live until ``lease_margin_s`` past its own time, and
        ``lease`` (as last renewed) until its ``expires_at``; past both (the process paused
        between begin and send, or its loop was held that long) another executor may already
        hold the Run, so the request is not sent: the attempt is settled ``not_sent`` on the
        way out.
        """
        until = max(att.created_at + self.lease_margin_s, lease.expires_at)
        if now < until:
            return None
        return LeaseLost(
            f"the lease on run {self.lease.run_id!r} may have lapsed between the begin of "
            f"attempt {att.attempt_id} and its send ({now - att.created_at:.3f} s later; it was "
            f"known live until {until - att.created_at:.3f} s after the begin): nothing was sent; "
            "acquire the lease again before more work", run_id=self.lease.run_id,
            attempt_id=att.attempt_id)

    def _fact_of(self, result: SendResult, dispatch: Dispatch
                 ) -> Generator[Effect[Any], Any, tuple[FailureFact, float]]:
        """The fact of a failed send, classified from what was observed, and when."""
        obs = result.observation or Observation(message="send reported failure without "
                                                        "an observation")
        if dispatch.progress.tool_started:
            # The host started a tool this attempt proposed: the turn may not move on.
            obs = obs.model_copy(update={"tool_started": True, "effective_output": True})
        if result.sent and obs.phase is None and obs.transport is None and obs.status is None:
            # Evidence that says nothing of how far the request got defaults to "never left";
            # the send said it left, so nothing is known after sending: it may have run.
            obs = obs.model_copy(update={"phase": Phase.AFTER_SEND})
        now = yield from perform(Now())
        return classify(obs, self._policy, now=now), now

    def _failed(self, turn: _Turn, route: Route, profile: str | None, att: AttemptRecord,
                result: SendResult, fact: FailureFact, settled: AttemptRecord
                ) -> Generator[Effect[Any], Any, _Failed]:
        """A failed send, classified and settled: tell the caller what it must discard."""
        if fact.effective_output and result.partial_text:
            turn.partial = PartialOutput(result.partial_text, att.attempt_id, route.id)
        turn.attempts.append(settled)
        turn.errors.append(attempt_error(att.attempt_id, route.id, route.provider, route.model,
                                         fact))
        if fact.effective_output and not fact.tool_started:
            turn.resets += 1
            yield from perform(Notify(Notice("reset", att.attempt_id, route.id,
                                             "partial output of a failed attempt is "
                                             "discarded")))
        if fact.category is Category.UNUSABLE:
            log.warning("[fallback] %s/%s cannot be used: %s", route.provider, route.model,
                        fact.message or fact.category.value)
            turn.pending.append(("unusable", {"route": route.id, "profile": profile,
                                              "why": fact.message or ""}))
        return _Failed(route, profile, att.attempt_id, fact)

    # -- after an attempt: retry the route, or move on -----------------------------------------

    def _next(self, turn: _Turn, attempt: _Try, ended: _Ended
              ) -> Generator[Effect[Any], Any, tuple[_Try, TurnSnapshot]]:
        """The next attempt after one that gave no answer, and the snapshot it decides on."""
        policy = self._policy
        if isinstance(ended, _Unclaimed):
            # Decide again, without the probe another process took.
            turn.refused_probes.add(ended.route.id)
            snap = yield from perform(self._read())
            decision, snap = yield from self._decide(snap, turn, turn.basis)
            return _Try(decision, attempt.kind, attempt.retries), snap
        if isinstance(ended, _Outdated):
            return (yield from self._decide_again(turn, attempt, ended))
        if isinstance(ended, _Refused):
            route, e = ended.route, ended.error
            turn.tried.add(route.id)
            turn.refused_groups[route.group] = e.fields.get("until")
            log.info("[admission] %s/%s rejected before dispatch: %s", route.provider,
                     route.model, e.fields.get("reason"))
            cause = next((x for x in reversed(turn.errors) if isinstance(x, ProviderError)),
                         None)
            turn.basis = {"failure": None, "current": None, "current_profile": None}
            turn.on, turn.failed = "rejection", None
            if cause is not None and policy.failover.after_rejection == "stop":
                # Seed 003: "Rejected before dispatch -> Return to original recovery". What the
                # selector would have read instead is recorded with the stop.
                if turn.snap is not None:
                    turn.inputs = self._record(self._input(turn.snap, turn, **turn.basis),
                                               turn, "after_rejection")
                raise (yield from self._stopped(turn, None, e, reason=REJECTED,
                                                cause=cause)) from cause
            snap = yield from perform(self._read())
            decision, snap = yield from self._decide(snap, turn, turn.basis)
            return _Try(decision, AttemptKind.FAILOVER, 0), snap
        route, profile, fact = ended.route, ended.profile, ended.fact
        rd = retry_decision(fact, policy, attempt.retries, self.rng)
        if rd.retry and rd.delay_s is not None and fact.category is not Category.UNUSABLE:
            n = attempt.retries + 1
            log.info("[LLM] %s:%s: %s; retry %d in %.1fs", route.provider, route.model,
                     fact.category.value, n, rd.delay_s)
            turn.pending.append(("retry", {"route": route.id, "cause": cause_of(fact),
                                           "delay_s": rd.delay_s, "n": n,
                                           "from_attempt": ended.attempt_id}))
            yield from perform(Sleep(rd.delay_s))
            snap = yield from perform(self._read())
            # The policy's retry rule decided, not the selector: what the selector would have
            # read, had the route not been retried, is recorded with the retry.
            turn.on, turn.failed = "failure", ended.attempt_id
            inp = self._input(snap, turn, failure=fact, current=route.id,
                              current_profile=profile)
            perm = inp.permissions
            pairs, ruled_out = set(perm.tried_pairs), set(perm.tried_profiles)
            if profile:
                pairs.add((route.id, profile))
                if marks_profile_tried(fact, route.provider, policy):
                    ruled_out.add(profile)
            inp = replace(inp, permissions=replace(
                perm, tried=perm.tried | {route.id}, tried_pairs=frozenset(pairs),
                tried_profiles=frozenset(ruled_out)))
            turn.inputs, turn.snap = self._record(inp, turn, "retry"), snap
            return _Try(Decision(DecisionKind.ROUTE, route, profile), AttemptKind.RETRY, n), snap
        turn.tried.add(route.id)
        if profile:
            turn.tried_pairs.add((route.id, profile))
            if marks_profile_tried(fact, route.provider, policy):
                turn.tried_profiles.add(profile)
        snap = yield from perform(self._read())
        turn.basis = {"failure": fact, "current": route.id, "current_profile": profile}
        turn.on, turn.failed = "failure", ended.attempt_id
        waited = turn.waited
        decision, snap = yield from self._decide(snap, turn, turn.basis)
        # The backoff is what the decision waited for a candidate to reopen (none is usual).
        backoff = turn.waited - waited
        if decision.kind is DecisionKind.STOP or decision.route is None:
            over_budget = fact.category is Category.BUDGET_EXCEEDED
            reason = "budget" if over_budget else (
                decision.reason.value if decision.reason else "no_candidate")
            log.info("[fallback] no route to move to (%s/%s: %s): %s", route.provider,
                     route.model, describe(fact), failover_details(
                         self.lease.run_id, ended.attempt_id, route.id, fact, stop=reason,
                         backoff_s=backoff))
            raise (yield from self._stopped(turn, decision, None,
                                            reason="budget" if over_budget else None))
        nxt = decision.route
        log.info("[fallback] serving the request with %s/%s (%s/%s: %s): %s", nxt.provider,
                 nxt.model, route.provider, route.model, describe(fact), failover_details(
                     self.lease.run_id, ended.attempt_id, route.id, fact, to=nxt.id,
                     backoff_s=backoff))
        turn.pending.append(("move", {"from_route": route.id, "to_route": nxt.id,
                                      "profile": decision.profile, "cause": cause_of(fact),
                                      "from_attempt": ended.attempt_id}))
        kind = AttemptKind.RETRY if nxt.id == route.id else AttemptKind.FAILOVER
        return _Try(decision, kind, 0), snap

    # -- deciding and waiting ----------------------------------------------------------------

    def _wait_left(self, policy: Policy, turn: _Turn) -> float:
        """What is left of the turn's one bound on waiting (``max_capacity_wait_s``)."""
        return max(0.0, policy.admission.max_capacity_wait_s - turn.waited)

    def _queue_until(self, snap: TurnSnapshot, turn: _Turn, *, waited: float
                     ) -> float | None:
        """Until when a begin may wait in a full group's queue (``None``: it may not).

        ``waited``: what the turn slept since ``snap`` was read (a group's floor).
        """
        now = snap.now + waited
        until = now + self._wait_left(snap.policy, turn)
        if snap.run.deadline is not None:
            until = min(until, snap.run.deadline)
        return until if until > now else None

    def _decide(self, snap: TurnSnapshot, turn: _Turn, basis: dict[str, Any]
                ) -> Generator[Effect[Any], Any, tuple[Decision, TurnSnapshot]]:
        """Select; when every candidate is cooling and one reopens soon enough, wait for it.

        Returns the decision and the snapshot it was made on.
        """
        inp = self._input(snap, turn, **basis)
        decision = select(inp)
        wait = reopening_wait(inp, decision, max_wait_s=self._wait_left(snap.policy, turn),
                              deadline=snap.run.deadline)
        if wait > 0:
            cooling = {s.route for s in decision.skipped
                       if s.reason in (Reason.ROUTE_COOLDOWN, Reason.PROBE_THROTTLED)}
            yield from perform(Sleep(wait))
            turn.waited += wait
            snap = yield from perform(self._read())
            inp = self._input(snap, turn, **basis)
            decision = select(inp)
            if decision.route_id is not None:
                turn.pending.append(("wait", {"for": "reopening", "route": decision.route_id,
                                              "waited_s": round(wait, 6)}))
                if decision.route_id in cooling:
                    turn.reopened = decision.route_id
        for skip in decision.skipped:
            turn.skips[skip.route] = skip
        turn.inputs, turn.snap = self._record(inp, turn, "select"), snap
        turn.reopens_at = first_reopening(inp, decision)
        turn.now, turn.bound = snap.now, self._wait_left(snap.policy, turn)
        return decision, snap

    def _admitted(self, begin: Begin, turn: _Turn, policy: Policy, attempt: _Try
                  ) -> Generator[Effect[Any], Any, AttemptRecord | _Outdated]:
        """Begin; while the group is full, wait in its queue (first come, first served).

        The wait is bounded by ``begin.queue_until``; past it the place is given up and
        :class:`~ledger.errors.CapacityUnavailable` raised (``queued=True``: no Attempt was
        recorded). An interruption gives the place up too, then propagates. Each time the wait
        ends the selector's choice is looked at again on a fresh snapshot before the begin:
        a route that stopped serving meanwhile (it started cooling: other workers' failures
        tripped it) gives the place up and comes back as :class:`_Outdated`, with nothing
        recorded but the wait (``capacity_wait``, outcome ``redecided``).
        """
        result = yield from perform(begin)
        if not isinstance(result, Queued):
            return result
        first = result
        group, waiter = begin.route.group, begin.attempt_id
        waits = 0
        outdated: _Outdated | None = None
        try:
            yield from perform(Notify(Notice(
                "queued", waiter, begin.route.id,
                f"capacity group {group!r} is full (limit {first.limit}: {first.in_flight} in "
                f"flight, {first.ahead} waiting ahead); waiting for a slot until "
                f"{iso(begin.queue_until or first.now)}")))
            while isinstance(result, Queued):
                left = (begin.queue_until or result.now) - result.now
                if left <= 0:
                    raise queue_timeout(begin, first, result, policy)
                yield from perform(AwaitSlot(group, waiter, left, result.ticket))
                waits += 1
                # The first wait only registered the waiter (nothing changed since the
                # decision); after a real one, a begin on the old snapshot's choice would send
                # to a route that may have started cooling meanwhile, and its failure, begun
                # after the route's last one, would step the cooldown as a new outage.
                if waits > 1:
                    outdated = yield from self._rechecked(turn, attempt)
                    if outdated is not None:
                        break
                result = yield from perform(begin)
        except GeneratorExit:
            raise  # closed with no driver left: the place lapses with the lease
        except BaseException as e:
            yield from perform(LeaveQueue(group, waiter, drop=True))
            if isinstance(e, CapacityUnavailable):
                waited = float(e.fields.get("waited_s") or 0.0)
                turn.waited += waited
                yield from self._record_quietly("capacity_wait", {
                    "group": group, "limit": first.limit, "outcome": "timed_out",
                    "waited_s": waited})
            raise
        if outdated is not None:
            yield from perform(LeaveQueue(group, waiter, drop=True))
            waited = max(0.0, outdated.snap.now - first.since)
            turn.waited += waited
            yield from self._record_redecided("capacity_wait", {
                "group": group, "limit": first.limit, "waited_s": round(waited, 6)}, outdated)
            return outdated
        assert isinstance(result, AttemptRecord)
        yield from perform(LeaveQueue(group, waiter, drop=False))
        turn.waited += max(0.0, result.created_at - first.since)
        return result

    def _rechecked(self, turn: _Turn, attempt: _Try
                   ) -> Generator[Effect[Any], Any, _Outdated | None]:
        """The attempt's decision, after a wait, as it stands on a fresh snapshot.

        ``None`` while its route serves. The policy's same-route retry was not the selector's
        choice, and a probe was chosen because the route cools: neither is looked at again.
        """
        decision = attempt.decision
        if attempt.retries > 0 or decision.kind is not DecisionKind.ROUTE:
            return None
        snap = yield from perform(self._read())
        skip = recheck(self._input(snap, turn, **turn.basis), decision)
        if skip is None:
            return None
        assert decision.route is not None
        return _Outdated(decision.route, snap, skip)

    def _record_redecided(self, kind: str, wait: dict[str, Any], outdated: _Outdated
                          ) -> Generator[Effect[Any], Any, None]:
        """Record a wait that ended with its route no longer serving (outcome ``redecided``).

        ``kind``: ``capacity_wait`` (a full group's queue) or ``wait`` (a group's floor). It is
        recorded on the Run at once, with the route and why: no Attempt came of it.
        """
        yield from self._record_quietly(kind, {
            **wait, "outcome": "redecided", "route": outdated.route.id,
            "why": outdated.skip.to_json()})

    def _decide_again(self, turn: _Turn, attempt: _Try, ended: _Outdated
                      ) -> Generator[Effect[Any], Any, tuple[_Try, TurnSnapshot]]:
        """Decide again on the same basis after the chosen route stopped serving during a wait.

        The wait was in a full group's queue or for a group's waiting floor. Nothing was
        begun: no retry permission or model call was taken, so the next Attempt is what the
        waiting one would have been (the turn's first, or a further one taking its one
        permission), now on the route the fresh facts choose.
        """
        route = ended.route
        log.info("[admission] %s/%s stopped serving while the turn waited to begin on it: %s; "
                 "deciding again", route.provider, route.model, ended.skip.detail)
        turn.pending.extend(ended.events)
        decision, snap = yield from self._decide(ended.snap, turn, turn.basis)
        fact: FailureFact | None = turn.basis.get("failure")
        failed: str | None = turn.basis.get("current") if fact is not None else None
        if attempt.kind is AttemptKind.FIRST:
            kind = AttemptKind.FIRST
        elif decision.route_id is not None and decision.route_id == failed:
            kind = AttemptKind.RETRY
        else:
            kind = AttemptKind.FAILOVER
        nxt = decision.route
        if fact is not None and failed is not None and nxt is not None:
            turn.pending.append(("move", {"from_route": failed, "to_route": nxt.id,
                                          "profile": decision.profile, "cause": cause_of(fact),
                                          "from_attempt": turn.failed}))
        return _Try(decision, kind, 0), snap

    def _record_quietly(self, kind: str, data: dict[str, Any]
                        ) -> Generator[Effect[Any], Any, None]:
        try:
            yield from perform(Record(self.lease, kind, data))
        except LedgerError as e:  # the news is the error the turn raises anyway
            log.info("%s of run %s not recorded: %s", kind, self.lease.run_id, e)

    # -- settling ----------------------------------------------------------------------------

    def _settle(self, route: Route, profile: str | None, attempt_id: str, outcome: Outcome,
                *, now: float | None = None, fact: FailureFact | None = None,
                prompt_tokens: int | None = None, completion_tokens: int | None = None,
                cost: Decimal | None = None, model_reported: str | None = None,
                output_hash: str | None = None, tool_started: bool | None = None,
                provenance: tuple[str, ...] = (), events: Sequence[tuple[str, Any]] = (),
                repeat: bool = False, cached_tokens: int | None = None,
                reasoning_tokens: int | None = None,
                times: tuple[float | None, float | None] = (None, None),
                began_at: float | None = None, keep_profile: bool = False,
                ) -> Generator[Effect[Any], Any, AttemptRecord]:
        """Settle ``attempt_id`` (on ``route`` with ``profile``) as the pure rules say.

        ``times``: the send's first byte and first token, in seconds from the begin;
        ``began_at``: when the Attempt began (its health update reads it: an outcome of a
        request in flight when the key's outage was counted is of that outage);
        ``keep_profile``: a success leaves the Run's (user-pinned) profile as it is.

        A settle the database does not take raises its ``DatabaseUnavailable`` unchanged
        (``operation="settle"``, ``resolved``, ``landed``), and ``deferred=True``: the driver
        remembers it and writes it, as decided here, once the database answers
        (:class:`ledger.decide.resolve.UnresolvedSettle`).
        """
        if now is None:
            now = yield from perform(Now())
        spec = settle_spec(
            self._policy, route, profile, self.lease, attempt_id, outcome=outcome, fact=fact,
            observation=None, now=now, effective_output=None, tool_started=tool_started,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cost_micros=None if cost is None else to_micros(cost),
            model_reported=model_reported, output_hash=output_hash,
            events=[(k, dict(d)) for k, d in events], provenance=provenance, repeat=repeat,
            cached_tokens=cached_tokens, reasoning_tokens=reasoning_tokens,
            first_byte_s=times[0], first_token_s=times[1], began_at=began_at,
            keep_profile=keep_profile)
        return (yield from perform(Settle(self.lease.run_id, spec)))

    def _settle_success(self, route: Route, profile: str | None, att: AttemptRecord,
                        result: SendResult, progress: SendProgress, *, keep_profile: bool
                        ) -> Generator[Effect[Any], Any, AttemptRecord]:
        u = _Usage.of(result)
        return (yield from self._settle(
            route, profile, att.attempt_id, Outcome.SUCCEEDED, prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens, cost=u.cost,
            model_reported=provider_text(result.model_reported), output_hash=result.output_hash,
            tool_started=progress.tool_started or None, provenance=result.provenance,
            events=[*u.events, *_renamed_calls(result)], cached_tokens=u.cached_tokens,
            reasoning_tokens=u.reasoning_tokens,
            times=progress.since(att.created_at), began_at=att.created_at,
            keep_profile=keep_profile))

    def _settle_failure(self, route: Route, profile: str | None, att: AttemptRecord,
                        fact: FailureFact, result: SendResult, now: float, *,
                        repeat: bool = False,
                        times: tuple[float | None, float | None] = (None, None),
                        ) -> Generator[Effect[Any], Any, AttemptRecord]:
        outcome = failure_outcome(fact, result.sent)
        discarded = bool(result.partial_text) and not fact.effective_output
        # Streamed text nobody was shown (the caller buffered) is no effective output: it is
        # discarded, and that is recorded; the policy may then move on.
        events = [("discarded", {"reason": "partial output of a failed attempt that was "
                                 "never delivered"})] if discarded else []
        # A failure the provider answered may have been billed (an incomplete answer, a stream
        # its error event ended): the usage it reported is posted as an answer's is, and with
        # none the fact decides (settle_holds: the whole hold after a 2xx). An unknown
        # outcome keeps its hold for the receipt; the tokens it saw before the cut (Anthropic's
        # message_start) are kept for audit only, and no cost, which the hold stands in for
        # until a receipt says it. A request never sent cost nothing.
        if outcome is Outcome.FAILED:
            u = _Usage.of(result)
        elif outcome is Outcome.UNKNOWN:
            u = replace(_Usage.of(result), cost=None)
        else:
            u = _Usage()
        # The model the provider named before it failed (an error answer's ``model``, the
        # ``message_start`` of a stream it then ended) is which model answered, for the audit
        # trail, kept as an answer's is; a request that never left was answered by none.
        model = None if outcome is Outcome.NOT_SENT else provider_text(result.model_reported)
        return (yield from self._settle(
            route, profile, att.attempt_id, outcome, now=now, fact=fact,
            events=[*events, *u.events], repeat=repeat, times=times,
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cost=u.cost,
            cached_tokens=u.cached_tokens, reasoning_tokens=u.reasoning_tokens,
            model_reported=model, began_at=att.created_at))

    def _settle_interrupted(self, route: Route, profile: str | None, att: AttemptRecord,
                            dispatch: Dispatch, *, repeat: bool = False,
                            ) -> Generator[Effect[Any], Any, None]:
        """The send was interrupted (or the send function broke): settle truthfully.

        A failure the sender observed before the interruption (``progress.failure``: the
        caller's callback raised on, or was cancelled in, the ``Reset`` that followed it) is
        settled as observed, as :meth:`_failed` would (``repeat``: a same-route retry's), but
        with no ``reset`` notice: the caller is leaving with its own exception.
        """
        progress = dispatch.progress
        observed = progress.failure
        if observed is not None and not observed.ok:
            # Classification depends only on observed facts (DESIGN section 2): the caller's
            # exception is not the provider's failure, which route health must count.
            fact, now = yield from self._fact_of(observed, dispatch)
            yield from self._quietly(att.attempt_id, self._settle_failure(
                route, profile, att, fact, observed, now, repeat=repeat,
                times=progress.since(att.created_at)))
            return
        if progress.provably_unsent:
            yield from self._settle_quietly(
                route, profile, att.attempt_id, Outcome.NOT_SENT,
                CANCELLED_FACT.model_copy(update={"phase": Phase.BEFORE_SEND}))
            return
        # What the caller was already shown is effective output, cancelled or not.
        fact = CANCELLED_FACT
        if progress.delivered or progress.tool_started:
            fact = fact.model_copy(update={"phase": Phase.MID_STREAM,
                                           "effective_output": True,
                                           "tool_started": progress.tool_started})
        yield from self._settle_quietly(route, profile, att.attempt_id, Outcome.UNKNOWN, fact,
                                        times=progress.since(att.created_at))

    def _settle_answered(self, route: Route, profile: str | None, att: AttemptRecord,
                         result: SendResult, dispatch: Dispatch, *, repeat: bool,
                         current: str | None) -> Generator[Effect[Any], Any, None]:
        """The send returned ``result``, and an interruption cut its settle short: settle it.

        The answer is known, so the Attempt is settled as it says (an answer with its usage, a
        failure with its facts), as :meth:`_attempt` would have (``repeat``: a same-route
        retry's; ``current``: the Run's profile when the turn began), not ``unknown``: what
        the interruption cut short (classification, the settle's content) is computed again,
        pure as it is. No ``reset`` notice: the caller is leaving with its own exception. A
        settle that cannot be written is left as :meth:`_quietly` says; a second interruption
        here propagates, and the Attempt is left to the session's exit or to recovery.
        """
        try:
            if result.ok:
                keep = keeps_pinned_profile(self.pin, current, profile)
                settle = self._settle_success(route, profile, att, result, dispatch.progress,
                                              keep_profile=keep)
            else:
                fact, now = yield from self._fact_of(result, dispatch)
                settle = self._settle_failure(route, profile, att, fact, result, now,
                                              repeat=repeat,
                                              times=dispatch.progress.since(att.created_at))
            yield from self._quietly(att.attempt_id, settle)
        except Exception as e:
            # Not the interruption: the answer itself broke the rules that settle it (a
            # defect). Settled as an interrupted send would be, so nothing is left dispatching.
            log.warning("settle of %s on interruption could not be made from its answer (%s); "
                        "settled as interrupted", att.attempt_id, e)
            yield from self._settle_interrupted(route, profile, att, dispatch, repeat=repeat)

    def _settle_quietly(self, route: Route, profile: str | None, attempt_id: str,
                        outcome: Outcome, fact: FailureFact | None = None, *,
                        times: tuple[float | None, float | None] = (None, None),
                        ) -> Generator[Effect[Any], Any, None]:
        """A settle on the way out of an interruption.

        What cannot be written is left to recovery (an attempt whose run was taken over, or a
        database that went away); an attempt that was never recorded has nothing to settle.
        """
        yield from self._quietly(attempt_id, self._settle(route, profile, attempt_id, outcome,
                                                          fact=fact, times=times))

    @staticmethod
    def _quietly(attempt_id: str, settle: Generator[Effect[Any], Any, AttemptRecord]
                 ) -> Generator[Effect[Any], Any, None]:
        """``settle`` on the way out of an interruption (see :meth:`_settle_quietly`)."""
        try:
            yield from settle
        except NotFound:
            log.info("attempt %s was never recorded (its begin did not commit): nothing to "
                     "settle on interruption", attempt_id)
        except SettleConflict as e:
            # Settled already (the session's exit marked an abandoned send unknown): the
            # record stands, and there is nothing left for recovery.
            log.info("attempt %s was settled before its interruption was: %s", attempt_id, e)
        except LedgerError as e:
            if e.fields.get("state") == AttemptState.REJECTED.value:
                # Its begin was refused (capacity): it holds nothing and was never sent, so
                # there is nothing to settle and nothing for recovery to do.
                log.debug("attempt %s was rejected before dispatch: nothing to settle on "
                          "interruption, nor for recovery", attempt_id)
                return
            later = ("this process writes it once the database answers again, or recovery "
                     "settles it" if e.fields.get("deferred") else "recovery settles it")
            log.warning("settle of %s on interruption not written (%s): %s", attempt_id, later,
                        e)

    def _resolve_begin(self, route: Route, profile: str | None, attempt_id: str,
                       error: DatabaseUnavailable) -> Generator[Effect[Any], Any, None]:
        """A begin the database failed: make its outcome certain, then let ``error`` go.

        Nothing was sent: sending waits for the begin's acknowledgement. When its ``COMMIT``'s
        outcome is unknown (``commit="unknown"``: the connection lost or the session ended
        after the ``COMMIT`` was sent, :mod:`ledger.storage.driver`), the begin may have
        landed, so it is settled
        ``not_sent`` (hold voided, slot freed, the call given back, a ``commit_unknown`` event
        saying why). A settle locks the Run's row before it reads the Attempt, so it waits for
        the server to finish the old transaction and then sees its outcome: the Attempt, or
        nothing (the begin did not land). When the database does not answer that either, the
        begin stays remembered by the process (:mod:`ledger.decide.resolve`), which settles it
        the same way before anything else is written for the Run: at its next write (the next
        turn, the session's exit), from the lease keeper, or when the ledger closes.
        ``error``'s fields say what happened (``operation``, ``attempt_id``, ``resolved``,
        ``landed``, and ``deferred`` when the process will resolve it later); nothing is
        hidden.
        """
        error.fields.update(operation="begin", attempt_id=attempt_id)
        if error.fields.get("commit") != "unknown":
            error.fields.update(resolved=True, landed=False)  # rolled back: nothing to undo
            return
        item = unresolved_begin(self._policy, route, profile, self.lease, attempt_id,
                                by="the retry owner")
        try:
            verdict = yield from perform(ResolveBegin(item))
        except LedgerError as e:
            deferred = stays(e)
            error.fields.update(resolved=False, landed=None, deferred=deferred)
            later = ("it was never sent, and this process settles it not_sent as soon as the "
                     "database answers again (before the Run's next write, from the lease "
                     "keeper, or when the ledger is closed); if the process ends first, "
                     "recovery settles it once the lease lapses" if deferred else
                     "if it was recorded, recovery settles it once the lease lapses")
            error.add_note(f"the begin of attempt {attempt_id} could not be resolved ({e}); "
                           + later)
            log.warning("begin of %s: its COMMIT's outcome is unknown and could not be "
                        "resolved (%s): %s", attempt_id, e,
                        "kept for later" if deferred else "left to recovery")
            return
        landed = verdict is not Resolution.ABSENT
        error.fields.update(resolved=verdict is not Resolution.LEFT, landed=landed)
        what = ("it had been recorded and is now settled not_sent (hold voided)"
                if landed else "it had not been recorded")
        error.add_note(f"the begin of attempt {attempt_id} lost its acknowledgement; nothing "
                       f"was sent: {what}")
        log.warning("begin of %s: the connection was lost after its COMMIT; nothing was sent, "
                    "%s", attempt_id, what)

    # -- stopping ----------------------------------------------------------------------------

    def _sent_before(self, turn: _Turn, plan: list[Route], attempts: tuple[str, ...]
                     ) -> Generator[Effect[Any], Any, FailoverExhausted]:
        """The stop of a turn asked again while an earlier Attempt of it has no receipt.

        That request may have run (a crash, a cut, a cancellation after it left): sending it
        again could run it twice (invariant 6), under any policy. The host settles the Attempt
        with evidence (``settle_unknown``) or asks under another turn id. The stop names the
        candidates as the first call's did, from what that call recorded.
        """
        run_id = self.lease.run_id
        turn.errors.extend(InvalidState(
            f"attempt {a} of turn {self.turn_id} of run {run_id!r} was sent and has no "
            "receipt", run_id=run_id, attempt_id=a, turn_id=self.turn_id) for a in attempts)
        recorded = yield from perform(TurnRecord(run_id, self.turn_id))
        return (yield from self._stopped(turn, None, None, reason=EXECUTION_UNKNOWN,
                                         candidates=recorded_candidate_lines(plan, recorded),
                                         detail=(
            f"this turn ({self.turn_id}) was sent before (attempt {', '.join(attempts)}) and "
            "no receipt came; the ledger never sends a request whose execution is unknown "
            "again: settle the attempt with evidence (Ledger.settle_unknown, failover-ledger "
            "attempt settle), or ask with another turn_id"), sent_before=attempts))

    def _stopped(self, turn: _Turn, decision: Decision | None, error: LedgerError | None, *,
                 reason: str | None = None, cause: Exception | None = None,
                 begun: tuple[Decision, AttemptKind] | None = None, detail: str | None = None,
                 sent_before: tuple[str, ...] = (), candidates: list[str] | None = None
                 ) -> Generator[Effect[Any], Any, FailoverExhausted]:
        """Record the stop with its reasons (an audit event), then build the error to raise.

        ``reason`` overrides the stop reason (the token budget, a rejection before dispatch);
        ``cause`` is the original failure a stop returns to, kept in the event and the error.
        ``begun``: the decision (and the kind of its Attempt) whose begin was refused (a budget
        or an allowance). The event keeps the decision the turn stopped on (the selector's
        stop, or ``begun``) with the inputs it was made from. ``detail`` overrides the stop's
        detail; ``sent_before`` are Attempts of earlier calls the stop is about, and
        ``candidates`` the candidates' lines when they are not this call's (theirs).
        """
        exc = self._stop(turn, decision, error, reason=reason, cause=cause, detail=detail,
                         sent_before=sent_before, begun=begun[0] if begun else None,
                         candidates=candidates)
        made: dict[str, Any] = {}
        if decision is not None:
            made = {"kind": decision.kind.value,
                    "reason": decision.reason.value if decision.reason else None,
                    "detail": decision.detail}
        elif begun is not None:
            made = {**begun[0].to_json(), "attempt_kind": begun[1].value}
        try:
            yield from perform(Record(self.lease, "stop", {
                "reason": exc.reason, "detail": exc.fields.get("detail", ""),
                "skipped": exc.fields.get("skipped", []), "attempts": exc.attempts,
                "errors": [str(e) for e in turn.errors],
                "candidates": exc.fields.get("candidates", []),
                **({"cause": str(cause)} if cause is not None else {}),
                **({"decision": made} if made else {}),
                **({"inputs": turn.inputs} if turn.inputs is not None and (
                    made or reason == REJECTED) else {})}))
        except FencedOut as e:  # the lease is gone: the stop itself is the news
            log.info("stop of run %s not recorded: %s", self.lease.run_id, e)
        return exc

    def _stop(self, turn: _Turn, decision: Decision | None, error: LedgerError | None, *,
              reason: str | None = None, cause: Exception | None = None,
              detail: str | None = None, sent_before: tuple[str, ...] = (),
              begun: Decision | None = None, candidates: list[str] | None = None
              ) -> FailoverExhausted:
        if decision is not None:
            why = decision.reason.value if decision.reason else "no_candidate"
            said = decision.detail
            if decision.reason is Reason.NO_CANDIDATE:
                said += reopening_note(turn.reopens_at, turn.bound, turn.now)
        elif isinstance(error, BudgetExceeded):
            why, said = "budget", str(error)
        elif isinstance(error, CapacityUnavailable):
            why, said = "no_candidate", str(error)
        else:
            why, said = "retry_allowance", str(error) if error else ""
        why, detail = reason or why, detail or said
        errors = list(turn.errors)
        if decision is not None and decision.reason is Reason.CALL_ALLOWANCE and not errors:
            route = turn.plan[0].id if turn.plan else None
            errors.append(AllowanceExhausted(
                f"run {self.lease.run_id!r} has no model call left: {decision.detail}; raise "
                "Budget.max_calls for new Runs", run_id=self.lease.run_id, route=route,
                field="calls"))
        failed = {getattr(e, "route", None) for e in errors}
        for skip in turn.skips.values():
            if skip.route not in failed:
                errors.append(skipped_error(skip))
        states = {a.attempt_id: a.state for a in turn.attempts}
        lines = candidates if candidates is not None else candidate_lines(
            turn.plan, failures_by_route(errors, states), turn.skips)
        # A refused begin's decision skipped candidates too: they are why it was the one.
        chosen = decision if decision is not None else begun
        exc = FailoverExhausted(
            f"the turn stopped ({why}): {detail}" + "".join(f"\n  {ln}" for ln in lines),
            errors, reason=why, attempts=[*sent_before, *(a.attempt_id for a in turn.attempts)],
            detail=detail,
            skipped=[s.to_json() for s in chosen.skipped] if chosen else [],
            partial=turn.partial, candidates=lines,
            **({"cause": str(cause)} if cause is not None else {}),
        )
        if cause is not None:
            exc.__cause__ = cause
        return exc


__all__ = [
    "CANCELLED_FACT",
    "REJECTED",
    "NoticeFn",
    "Reserve",
    "RunResult",
    "SendFn",
    "Steps",
    "TurnLoop",
    "group_wait",
    "ledger_closed",
]
