"""The typed effects of the turn loop: what the retry owner asks its driver to do.

The loop (:mod:`ledger.api.turn`) is a generator that yields these objects and is sent back each
one's result. Every effect names its result type (``Effect[T]``), and the loop receives it
through :func:`perform`, so a type checker follows the whole conversation::

    att = yield from perform(Begin(...))     # att: AttemptRecord

The drivers (``execute`` and ``aexecute``) match on the effect's type and are the only code that
reads the database, sends, sleeps or talks to the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Annotated, Any, Generic, TypeVar
from urllib.parse import quote

from ledger.decide.resolve import Resolution, UnresolvedBegin
from ledger.domain.facts import Observation, WireProtocol
from ledger.domain.records import (
    AttemptKind,
    AttemptRecord,
    Lease,
    Outcome,
    Queued,
    RunRecord,
    from_micros,
)
from ledger.domain.specs import BeginSpec, SettleSpec
from ledger.domain.validation import Id, checked, instance, one_of
from ledger.domain.values import GroupProjection, Health, Route
from ledger.errors import InvalidArgument
from ledger.policy.model import Policy

T = TypeVar("T")


class Effect(Generic[T]):
    """Something the loop needs done; ``T`` is what the driver sends back."""

    __slots__ = ()


def perform(effect: Effect[T]) -> Generator[Effect[T], T, T]:
    """Yield ``effect`` and return its (typed) result.

    A step of the retry owner reads ``x = yield from perform(eff)``.
    """
    return (yield effect)


@dataclass(frozen=True)
class TurnSnapshot:
    """Everything one decision reads, from one read transaction.

    ``run`` is the Run as it stands (counters, current route); ``policy`` its frozen policy,
    parsed once and shared by every Run frozen under it (never to be changed); ``groups`` the
    plan's capacity-group projections; ``health`` the plan's route and profile health;
    ``provenance`` the recorded content hashes of the references the envelope's parts carry
    (recorded anywhere in the Run's tree: its root and every descendant), never the Run's
    whole history.
    """

    run: RunRecord
    policy: Policy
    groups: Mapping[str, GroupProjection]
    health: Mapping[str, Health]
    provenance: Mapping[str, frozenset[str]]
    now: float
    # A turn's first read only: its Attempts sent before it and still without a receipt.
    unreceipted: tuple[str, ...] = ()


@dataclass
class SendProgress:
    """How far a send got.

    ``handed_over``: the driver called the send function (before that, nothing can have left).
    ``sent``: the sender's own report — ``False`` until the first byte of the request is written to
    the network, ``True`` from then on; ``None`` when the sender does not report it, and then a
    request handed over counts as possibly sent.
    ``delivered``: the sender handed streamed text or a tool-call proposal to the caller (its
    callback saw it): effective output, recorded as such even when the send is then cancelled.
    The adapters set it; a host's own send function sets it when it shows output.
    ``first_byte_at`` and ``first_token_at``: when the response's first byte (its status line
    and headers) and a stream's first content (text, a tool-call fragment or media, or the
    first event of a tool the provider runs itself; not reasoning) arrived, by the
    ledger's clock, which the driver hands over as ``clock``; the sender marks them with
    :meth:`first_byte` and :meth:`first_token` (the adapters do), and the Attempt's settle
    records them as seconds from its begin.
    ``failure``: the failure the sender observed, set as soon as it is known and before the
    sender tells the caller anything more (the adapters set it before the ``Reset`` that
    follows output already shown). When the send then raises (that callback raised, or the
    caller cancelled it there), the retry owner settles the Attempt with this failure as
    observed, its fact counted in route health as any failure's, and lets the exception go
    on: what the caller's callback did renames nothing the provider did. ``None``: no failure
    known, and an interrupted send is settled as the caller's cancellation.
    """

    handed_over: bool = False
    sent: bool | None = None
    delivered: bool = False
    # The host started a tool this Attempt proposed: a failure of the turn may no longer move
    # to another route (invariant 9).
    tool_started: bool = False
    first_byte_at: float | None = None
    first_token_at: float | None = None
    # The failure observed before the send was interrupted (see the docstring).
    failure: SendResult | None = None
    # The ledger's clock (set by the driver as it hands the send over; None: not timed).
    clock: Callable[[], float] | None = field(default=None, repr=False, compare=False)

    @property
    def provably_unsent(self) -> bool:
        """Whether the request certainly never left: not handed over, or reported unsent."""
        return not self.handed_over or self.sent is False

    def first_byte(self) -> None:
        """Mark the response's first byte now (the first mark stays; without a clock, none)."""
        if self.first_byte_at is None and self.clock is not None:
            self.first_byte_at = self.clock()

    def first_token(self) -> None:
        """Mark a stream's first content now (the first mark stays; without a clock, none).

        Content implies the response began: its first byte is marked too if it was not.
        """
        if self.first_token_at is None and self.clock is not None:
            self.first_byte()
            self.first_token_at = self.clock()

    def since(self, begun_at: float) -> tuple[float | None, float | None]:
        """``(first_byte_s, first_token_s)``: the marks as seconds after ``begun_at``."""
        def after(t: float | None) -> float | None:
            return None if t is None else max(0.0, t - begun_at)

        return after(self.first_byte_at), after(self.first_token_at)


#: The request header that names the Attempt a request is, on every protocol: its value is the
#: Attempt's id, so a provider's or a proxy's request log joins the ledger's ``attempts`` rows.
ATTEMPT_HEADER = "X-Ledger-Attempt"

#: The client-request-id header each provider documents for the protocol, with the longest value
#: it accepts. Only OpenAI documents one (``X-Client-Request-Id``, ASCII, at most 512
#: characters; a longer one is answered with a 400: OpenAI API reference, "Debugging requests").
#: Anthropic documents only its response header ``request-id``, Google's APIs (Gemini) only the
#: system parameters, neither a client request id; no provider documents an idempotency key for
#: these endpoints. See docs/adapters.md, "The Attempt on the wire".
PROVIDER_REQUEST_ID_HEADERS: Mapping[WireProtocol, tuple[str, int]] = MappingProxyType({
    WireProtocol.OPENAI: ("X-Client-Request-Id", 512),
    WireProtocol.OPENAI_RESPONSES: ("X-Client-Request-Id", 512),
})

# Visible ASCII but "%": what an id may keep as it is in a header value. Everything else (a
# space, "%", any non-ASCII character) is percent-encoded as UTF-8, so every printable id has
# exactly one header value and no two ids share one.
_VERBATIM = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


Protocol = Annotated[WireProtocol | str, one_of(WireProtocol)]
Headers = Annotated[Mapping[str, str], instance(Mapping, "a mapping of header names to values",
                                                "pass a dict such as {'x-trace': 't1'}")]


@checked
def attempt_headers(attempt_id: Id, protocol: Protocol, *,
                    onto: Headers | None = None) -> dict[str, str]:
    """The request headers that name the Attempt ``attempt_id`` on a route of ``protocol``.

    :data:`ATTEMPT_HEADER` on every protocol and, where the provider documents a client request
    id (:data:`PROVIDER_REQUEST_ID_HEADERS`), that header too, both with the Attempt's id as
    their value (percent-encoded when the id holds anything but visible ASCII; the provider's
    header is left out when the value is longer than the provider accepts). The retry owner
    records exactly these with the Attempt (the ``headers`` of its ``select`` event) before the
    request is sent, the built-in adapters send them, and a host's own send function sends
    :attr:`Dispatch.headers`, which are these.

    Args:
        attempt_id: The Attempt's id.
        protocol: The route's :class:`~ledger.domain.facts.WireProtocol` (or its value).
        onto: The request's other headers, to add these to. Neither side silently overrides
            the other: a header of ``onto`` with one of these names, in any letter case, is
            refused.

    Returns:
        The headers (``onto``'s first, then these), as a new dict.

    Raises:
        InvalidArgument: ``attempt_id`` is not an id, ``protocol`` not a protocol, or ``onto``
            already carries one of these headers (``field`` is ``headers``).

    Example:
        >>> attempt_headers("att-1", "openai")
        {'X-Ledger-Attempt': 'att-1', 'X-Client-Request-Id': 'att-1'}
        >>> attempt_headers("att-1", "anthropic")
        {'X-Ledger-Attempt': 'att-1'}
    """
    value = quote(attempt_id, safe=_VERBATIM)
    ours = {ATTEMPT_HEADER: value}
    provider = PROVIDER_REQUEST_ID_HEADERS.get(WireProtocol(protocol))
    if provider is not None and len(value) <= provider[1]:
        ours[provider[0]] = value
    if onto is None:
        return ours
    taken = {name.lower(): name for name in onto}
    for name in ours:
        if name.lower() in taken:
            raise InvalidArgument(
                f"the request already carries a {taken[name.lower()]!r} header, which the ledger "
                f"sets to the Attempt's id ({name}); remove it from the request's own headers "
                "(the ledger's value is the one recorded with the Attempt)",
                field="headers", header=taken[name.lower()])
    return {**onto, **ours}


@dataclass(frozen=True)
class Dispatch:
    """What the send function is asked to do: send ``envelope`` on ``route``.

    The Attempt is already recorded (begun) when the send function sees it.

    A request it sends carries :attr:`headers` (the Attempt's id, as the built-in adapters
    send it), so the provider's request log joins the ledger's rows.

    Attributes:
        run_id: The Run.
        attempt_id: The Attempt this physical call is (its hold is taken); the value of the
            request's ``X-Ledger-Attempt`` header.
        turn_id: The logical turn it serves.
        route: The frozen route to send on.
        profile_id: The credential profile to use (``None``: the route has none).
        envelope: The request (an :class:`~ledger.domain.envelope.Envelope`).
        kind: Why it is made (first, retry, failover, probe).
        progress: Tell it how far the send got (``progress.sent``), so an interruption is
            settled truthfully; the adapters do this themselves.
    """

    run_id: str
    attempt_id: str
    turn_id: str
    route: Route
    profile_id: str | None
    envelope: Any  # ledger.domain.envelope.Envelope (Any keeps this module import-light)
    kind: AttemptKind
    progress: SendProgress = field(default_factory=SendProgress, compare=False)

    @property
    def headers(self) -> dict[str, str]:
        """The headers that name this Attempt on the wire (:func:`attempt_headers`).

        The ones the retry owner recorded with the Attempt before handing it over; send them
        as they are (merge your own with ``attempt_headers(d.attempt_id, d.route.protocol,
        onto=yours)``, which refuses a header of yours that would take their place).
        """
        return attempt_headers(self.attempt_id, self.route.protocol)


@dataclass(frozen=True)
class SendResult:
    """What the send function reports about one physical call.

    Attributes:
        ok: Whether an answer came back.
        output: The answer, for the caller (the adapters put their ``AdapterResult``).
        prompt_tokens: Usage the provider reported (``None``: not reported, and then the
            whole hold is posted). A failure may report usage too (a billed partial answer):
            a ``failed`` Attempt is then posted at ``cost``, at most the hold.
        completion_tokens: Likewise.
        cached_tokens: The part of ``prompt_tokens`` served from the provider's cache, where
            it reports it.
        reasoning_tokens: The part of ``completion_tokens`` spent reasoning, where the
            provider reports it.
        cost: The cost the provider reported, if any.
        model_reported: The model the provider says served it; on a failure, the model it
            named before failing (an error answer's ``model``, a stream's ``message_start``),
            recorded with a ``failed`` or ``unknown`` Attempt.
        output_hash: The answer's content hash, recorded with the Attempt.
        observation: The evidence of a failure; set exactly when ``ok`` is False.
        sent: ``False`` only when the request provably never left the process (nothing was
            written to the network): such an Attempt is settled *not sent*, its hold voided.
        parts: The answer as conversation parts (text, images and documents, tool calls),
            each recorded as provenance of the Attempt at settle so the next turn can carry
            them.
        partial_text: On a failure, text the caller was shown before it (effective output).
        renamed_calls: ``(provider id, call id)`` of each tool call of the answer whose id
            the provider gave could not be a part's ``tool_call_id`` (over 200 characters, a
            line break or a NUL, blank), so the adapter made one up
            (:attr:`ledger.adapters.ToolCall.provider_id`): the settle records each in a
            ``tool_call_id`` event of the Attempt.
    """

    ok: bool
    output: Any = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost: Decimal | None = None
    model_reported: str | None = None
    output_hash: str | None = None
    observation: Observation | None = None
    sent: bool = True
    # The answer as conversation parts (text, images and documents, tool calls), each recorded
    # as provenance of the Attempt at settle so the next turn can carry them.
    parts: tuple[Any, ...] = ()
    # On a failure: text the caller was shown before the failure (effective output).
    partial_text: str = ""
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    renamed_calls: tuple[tuple[str, str], ...] = ()

    @property
    def provenance(self) -> tuple[str, ...]:
        """The content hashes the Attempt's settle records as its outputs."""
        return tuple(p.content_hash for p in self.parts)

    @classmethod
    def failed(cls, observation: Observation, *, sent: bool = True) -> SendResult:
        """A failed send, with its evidence; ``sent=False`` when no byte left."""
        return cls(ok=False, observation=observation, sent=sent)


@dataclass(frozen=True)
class Notice:
    """Told to the caller.

    ``reset``: discard the text streamed by ``attempt_id``; ``queued``: the turn waits in a full
    capacity group's queue before ``attempt_id`` is begun (``detail`` says which and how long).
    """

    kind: str
    attempt_id: str
    route: str
    detail: str = ""


Events = Sequence[tuple[str, Mapping[str, Any]]]


@dataclass(frozen=True)
class Snapshot(Effect[TurnSnapshot]):
    """One read: the Run, its groups, health and the provenance of ``refs``.

    With ``turn_id`` (a turn's first read), also that turn's Attempts without a receipt.
    ``carried``: the (ref, content hash) of each part the turn carries; a ref the Run's own
    line recorded with every hash carried under it needs no read of the rest of its tree
    (``None``: every ref is read in the whole tree).
    """

    run_id: str
    refs: tuple[str, ...] = ()
    turn_id: str | None = None
    carried: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True)
class Begin(Effect[AttemptRecord | Queued]):
    """Record an Attempt before its send (one commit).

    ``spec`` is the :class:`~ledger.domain.specs.BeginSpec` the loop decided with the pure
    rules (:func:`ledger.decide.begin.begin_spec`).

    ``spec.take_retry``: it is a further Attempt of its turn and takes a retry permission in
    the same transaction; ``spec.events`` (the selector's decision, the move or retry that led
    here) are written with it; ``spec.queue_until``: a full capacity group queues the begin
    until then (the result is a :class:`~ledger.domain.records.Queued` place, nothing
    recorded), ``None`` refuses.
    """

    spec: BeginSpec

    @property
    def attempt_id(self) -> str:
        """The Attempt's id."""
        return self.spec.attempt_id

    @property
    def route(self) -> Route:
        """The frozen route it is sent on."""
        return self.spec.route

    @property
    def profile_id(self) -> str | None:
        """The credential profile it uses."""
        return self.spec.profile_id

    @property
    def kind(self) -> AttemptKind:
        """Why it is made (first, retry, failover, probe)."""
        return self.spec.kind

    @property
    def turn_id(self) -> str:
        """The logical turn it serves."""
        return self.spec.turn_id

    @property
    def reserve(self) -> Decimal:
        """Its cost hold."""
        return from_micros(self.spec.reserve_micros)

    @property
    def events(self) -> Events:
        """The audit events written with it."""
        return self.spec.events

    @property
    def queue_until(self) -> float | None:
        """Until when it may wait in a full group's queue."""
        return self.spec.queue_until


@dataclass(frozen=True)
class Settle(Effect[AttemptRecord]):
    """Record an Attempt's outcome (one commit); never abandoned halfway by a cancellation.

    ``spec`` is what :func:`ledger.decide.settle.settle_spec` decided: the outcome, the fact,
    the usage, and what the settle does to holds, health and the capacity group. When the
    database does not take it, the driver remembers it and its ``DatabaseUnavailable`` comes
    back (``deferred=True``): the store writes it as it is before the Run's next write, from the
    lease keeper, or when the ledger closes (:class:`ledger.decide.resolve.UnresolvedSettle`).
    """

    run_id: str
    spec: SettleSpec

    @property
    def attempt_id(self) -> str:
        """The Attempt settled."""
        return self.spec.attempt_id

    @property
    def outcome(self) -> Outcome:
        """What it is settled as."""
        return self.spec.outcome

    @property
    def events(self) -> Events:
        """The audit events written with it."""
        return self.spec.events


@dataclass(frozen=True)
class ResolveBegin(Effect[Resolution]):
    """Settle a begin that will never be sent ``not_sent`` (its ``COMMIT``'s outcome is unknown).

    The driver remembers ``item`` first: when the database does not answer, its error comes
    back and the store resolves the begin before the Run's next write, from the lease keeper,
    or when the ledger closes (:mod:`ledger.decide.resolve`).
    """

    item: UnresolvedBegin


@dataclass(frozen=True)
class AwaitSlot(Effect[None]):
    """Wait for a slot of ``group`` to come free, at most ``seconds``, for queued ``waiter``.

    The first wait of a waiter only registers it for wake-ups and returns at once (the loop
    then begins again, so a slot freed meanwhile is not missed); later ones wait for a wake-up
    or the store's polling interval, through the sleeper. ``ticket`` is the waiter's place in
    the queue: a freed slot wakes this process's earliest waiter only, and only the earliest of
    the group here polls (the others wait for a signal, see :mod:`ledger.storage.wake`).
    """

    group: str
    waiter: str
    seconds: float
    ticket: int


@dataclass(frozen=True)
class LeaveQueue(Effect[None]):
    """Stop waiting in ``group``'s queue; ``drop``: give up the place (cancelled, timed out).

    Without ``drop`` the place is already gone (the begin that was served took it).
    """

    group: str
    waiter: str
    drop: bool


@dataclass(frozen=True)
class Send(Effect[SendResult]):
    """Perform one physical call (the caller's send function); its result comes back."""

    dispatch: Dispatch


@dataclass(frozen=True)
class Sleep(Effect[None]):
    """Wait ``seconds`` (a backoff, a capacity group's waiting floor) through the sleeper."""

    seconds: float


@dataclass(frozen=True)
class Notify(Effect[None]):
    """Tell the caller something (``on_notice``): a :class:`Notice`."""

    notice: Notice


@dataclass(frozen=True)
class ClaimProbe(Effect[bool]):
    """Take the cluster-wide probe slot of a cooling route, under its health ``key``.

    A claim taken also bounds the probe state (``ttl_s``, ``max_keys``); the result says whether
    this caller got the slot.
    """

    route: Route
    interval_s: float
    key: str
    ttl_s: float | None = None
    max_keys: int | None = None


@dataclass(frozen=True)
class Record(Effect[None]):
    """Append an audit event under the lease (the stop of a turn)."""

    lease: Lease
    kind: str
    data: Mapping[str, Any]
    attempt_id: str | None = None


@dataclass(frozen=True)
class RecordedTurn:
    """A turn as recorded, read back for a stop that names its candidates.

    ``attempts``: its Attempts in order; ``skipped``: each ``skipped`` list of its decisions in
    order (the ``select`` events of its Attempts, then its ``stop`` events), as
    :meth:`ledger.decide.select.Skip.to_json` wrote them.
    """

    attempts: tuple[AttemptRecord, ...]
    skipped: tuple[tuple[Mapping[str, Any], ...], ...]


@dataclass(frozen=True)
class TurnRecord(Effect[RecordedTurn]):
    """Read what a turn recorded: its Attempts and the candidates its decisions passed over.

    Asked only by a turn that stops before deciding (asked again while an Attempt of it has no
    receipt), so that its stop names the candidates as the first call's did.
    """

    run_id: str
    turn_id: str


@dataclass(frozen=True)
class Now(Effect[float]):
    """The injectable clock's time."""


@dataclass(frozen=True)
class HeldLease(Effect[Lease]):
    """The Run's lease as the driver holds it now.

    A Run session's keeper renews the lease while a turn runs, so its ``expires_at`` may be
    later than that of the lease the turn started with; a driver given a lease only answers
    with that lease.
    """


__all__ = [
    "ATTEMPT_HEADER",
    "PROVIDER_REQUEST_ID_HEADERS",
    "AwaitSlot",
    "Begin",
    "ClaimProbe",
    "Dispatch",
    "Effect",
    "HeldLease",
    "LeaveQueue",
    "Notice",
    "Notify",
    "Now",
    "Record",
    "RecordedTurn",
    "ResolveBegin",
    "Send",
    "SendProgress",
    "SendResult",
    "Settle",
    "Sleep",
    "Snapshot",
    "TurnRecord",
    "TurnSnapshot",
    "attempt_headers",
    "perform",
]
