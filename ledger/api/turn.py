"""The turn drivers: :func:`execute` (sync) and :func:`aexecute` (async).

A turn is :class:`~ledger.decide.turn.TurnLoop`, a generator of typed effects that holds every
decision. A driver checks the arguments, then performs each effect the loop yields: a snapshot,
begin or settle as the storage flow of the spec the loop decided (run by the ledger's runner,
blocking or for asyncio: no thread hop), the send through the caller's ``send``, a
wait through the injectable :class:`~ledger.clock.Sleeper`, a notice to ``on_notice``. The
drivers are the only code of the turn that sends, sleeps or shields a settle from
cancellation; they contain no decision.
"""
from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Annotated, Any, cast

from typing_extensions import TypedDict

from ledger import telemetry as _telemetry
from ledger.api.face import AsyncFace, Face, SyncFace
from ledger.clock import Sleeper, SystemSleeper
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
    RecordedTurn,
    ResolveBegin,
    Send,
    SendResult,
    Settle,
    Sleep,
    Snapshot,
    TurnRecord,
)
from ledger.decide.health import probe_key_kind
from ledger.decide.preflight import NO_DENIALS, CharEstimator, Denials, TokenCounter
from ledger.decide.profiles import Pin
from ledger.decide.turn import (
    NoticeFn,
    Reserve,
    RunResult,
    SendFn,
    Steps,
    TurnLoop,
    ledger_closed,
)
from ledger.domain.envelope import Envelope, PartHashes, require_parts
from ledger.domain.records import Lease, LeaseArg
from ledger.domain.validation import (
    As,
    Id,
    checked,
    function,
    instance,
    methods,
    money,
    one_of,
    rule,
    that,
)
from ledger.domain.values import Route
from ledger.storage.runner import Flow, blocking


@rule
def _reserve(value: Any) -> Decimal | Callable[[Route], Decimal]:
    # The same amounts begin_attempt accepts (a Decimal, an int, a float or a string), or a
    # function of the route.
    return value if callable(value) else money(value)


Hold = Annotated[Reserve, _reserve]
Pins = Annotated[Pin | str, one_of(Pin)]
DenialsArg = Annotated[Denials, instance(Denials, "a Denials",
                                         "pass a ledger.decide.preflight.Denials")]
Sleeps = Annotated[Sleeper, methods("sleep", "asleep", fix="pass e.g. ledger.SystemSleeper()")]
Notices = Annotated[NoticeFn, function("a function of a Notice")]
Rng = Annotated[random.Random, instance(random.Random, "a random.Random",
                                        "pass e.g. random.Random(7)")]
Counter = Annotated[TokenCounter, methods("count_tokens", fix="pass e.g. "
                                          "ledger.decide.preflight.CharEstimator()")]
Request = Annotated[Envelope | Mapping[str, Any], As(Envelope)]
Hashes = Annotated[PartHashes, instance(PartHashes, "a ledger.PartHashes",
                                        "keep one ledger.PartHashes() per conversation, or "
                                        "leave it out to have every part hashed")]
_SENDS = function("a function of a Dispatch returning a SendResult")


class TurnOptions(TypedDict, total=False):
    """The keyword arguments of :func:`execute` a Run session's ``turn`` passes on.

    Declared, so that the session checks them itself: a misspelt one is an
    :class:`~ledger.errors.ArgumentMismatch` naming ``turn``'s own arguments, and a bad value
    is refused before the turn starts (it then does not count as the block's last turn).
    ``part_hashes`` is refused: the session keeps its own.
    """

    pin: Pins | None
    denials: DenialsArg | None
    reserve: Hold | None
    sleeper: Sleeps | None
    on_notice: Notices | None
    rng: Rng | None
    token_counter: Counter | None
    part_hashes: Annotated[Any, that(
        lambda _v: False, "is computed by the session itself",
        "do not pass it to turn(); the session hashes each part of the conversation once")]


def _loop(lease: Lease, envelope: Request, turn_id: str | None, pin: Pin | str | None,
          denials: Denials | None, reserve: Reserve | None, rng: random.Random | None,
          token_counter: TokenCounter | None, part_hashes: PartHashes | None,
          lease_margin_s: float) -> TurnLoop:
    """The turn loop of :func:`execute`'s / :func:`aexecute`'s validated arguments.

    Nothing is read or written before they pass.
    """
    envelope = cast(Envelope, envelope)
    require_parts(envelope)
    return TurnLoop(
        lease, envelope, turn_id=turn_id,
        pin=None if pin is None else Pin(pin), denials=denials or NO_DENIALS,
        reserve=cast(Decimal | Callable[[Route], Decimal] | None, reserve),
        rng=rng, token_counter=token_counter or CharEstimator(),
        # Computed here, never taken from the caller: coverage is judged by these hashes.
        part_hashes=None if part_hashes is None else part_hashes.of(envelope),
        lease_margin_s=lease_margin_s,
    )


# -- the drivers ----------------------------------------------------------------------------------


@checked
def execute(
    ledger: Annotated[SyncFace[Any, Any], instance(SyncFace, "a ledger.Ledger",
                                       "use aexecute with an AsyncLedger")],
    lease: LeaseArg,
    envelope: Request,
    send: Annotated[Callable[[Dispatch], SendResult], _SENDS],
    *,
    turn_id: Id | None = None,
    pin: Pins | None = None,
    denials: DenialsArg | None = None,
    reserve: Hold | None = None,
    sleeper: Sleeps | None = None,
    on_notice: Notices | None = None,
    rng: Rng | None = None,
    token_counter: Counter | None = None,
    part_hashes: Hashes | None = None,
) -> RunResult:
    """Serve one logical turn of the Run (sync): the retry owner.

    Every physical call is an Attempt, recorded (begun, with its holds) before ``send`` is
    called and settled after; failures are classified, retried on the same route or moved to
    the next eligible route of the frozen plan as the Run's frozen policy says, within the
    Run's budget and retry allowance. See the module docstring and ``docs/retry-owner.md``.

    Args:
        ledger: The :class:`~ledger.Ledger` (an :class:`~ledger.AsyncLedger` goes with
            :func:`aexecute`).
        lease: The Run's live lease (:meth:`~ledger.Ledger.acquire_lease`).
        envelope: The whole request (an :class:`~ledger.Envelope`, or a mapping of its
            fields). One with no parts is refused even when it was built without validation
            (``model_construct``, ``model_copy(update=...)``), before any Attempt is begun.
        send: Performs one physical call: a function of a :class:`~ledger.Dispatch`
            returning a :class:`~ledger.SendResult` (e.g.
            :func:`ledger.adapters.sync_sender`).
        turn_id: Names the logical turn (default: from the envelope's hash, so a repeated
            turn is recognised: while an earlier Attempt of it has no receipt, the turn stops
            with ``execution_unknown`` and sends nothing; pass another id to ask again on
            purpose).
        pin: Keeps a credential profile: ``"user"`` (kept even while it cools, until a new
            session; a failover's answer on another profile does not replace it) or
            ``"auto"`` (kept while usable); see
            :class:`~ledger.decide.profiles.Pin`.
        denials: Routes and recipients switched off in the current configuration
            (:class:`~ledger.decide.preflight.Denials`): a current denial always wins over
            the frozen grant.
        reserve: Overrides the cost hold of each Attempt: an amount (a Decimal, int, float
            or string) or a function of the route (default: the prompt estimate plus the
            maximum output, at the route's price).
        sleeper: Waits the backoffs (default: the ledger's clock when it can sleep, as a
            :class:`~ledger.ManualClock` can, else real waits).
        on_notice: Hears each :class:`~ledger.Notice`: ``reset`` means discard the text the
            named Attempt streamed.
        rng: Makes the retry jitter reproducible (a :class:`random.Random`).
        token_counter: Estimates prompt tokens for the holds and the context check
            (default: :class:`~ledger.decide.preflight.CharEstimator`).
        part_hashes: A :class:`~ledger.PartHashes` kept across the conversation's turns, so
            that a part sent again as the same object is not hashed again (a Run session keeps
            its own); else each part is hashed here. The hashes are always computed, never
            taken from the caller.

    Returns:
        The :class:`RunResult`: the answer, the route that served it, every Attempt.

    Raises:
        FailoverExhausted: the turn stopped without an answer; ``reason`` says why (a
            selector reason such as ``no_candidate`` or ``execution_unknown``,
            ``retry_allowance``, ``budget``, ``rejected_before_dispatch``), ``exceptions``
            holds every Attempt's error and ``partial`` the text already shown, if any.
        InvalidArgument: an argument is wrong (nothing is read or written then); an unknown
            keyword is :class:`~ledger.errors.ArgumentMismatch`.
        FencedOut: the Run was taken over by another executor; :class:`~ledger.errors.LeaseLost`
            when the lease lapsed (acquire it again).
        DatabaseUnavailable: the database could not be reached. A begin whose ``COMMIT``'s
            outcome is unknown was never sent: it is settled ``not_sent`` at once, or, when the
            database stays away (``fields["deferred"]``), by this process as soon as it answers
            again (its next write for the Run, the lease keeper, ``close()``); recovery settles
            what the process leaves behind.

    An interruption (``KeyboardInterrupt``, a timeout) propagates unchanged after the Attempt
    in flight is recorded truthfully (not sent, or unknown with its hold kept).

    Example:
        >>> lease = led.acquire_lease("task-1")  # doctest: +SKIP
        >>> with SyncAdapter() as adapter:  # doctest: +SKIP
        ...     result = execute(led, lease, Envelope(parts=[Part(content="Hello")]),
        ...                      sync_sender(adapter))
        >>> result.text, result.route.id, len(result.attempts)  # doctest: +SKIP
    """
    return _turn_sync(ledger, lease, envelope, send, turn_id=turn_id, pin=pin, denials=denials,
                      reserve=reserve, sleeper=sleeper, on_notice=on_notice, rng=rng,
                      token_counter=token_counter, part_hashes=part_hashes)


@checked
async def aexecute(
    ledger: Annotated[AsyncFace[Any, Any], instance(AsyncFace, "a ledger.AsyncLedger",
                                            "use execute with a Ledger")],
    lease: LeaseArg,
    envelope: Request,
    send: Annotated[SendFn, _SENDS],
    *,
    turn_id: Id | None = None,
    pin: Pins | None = None,
    denials: DenialsArg | None = None,
    reserve: Hold | None = None,
    sleeper: Sleeps | None = None,
    on_notice: Notices | None = None,
    rng: Rng | None = None,
    token_counter: Counter | None = None,
    part_hashes: Hashes | None = None,
) -> RunResult:
    """Serve one logical turn of the Run (async): the retry owner on the asyncio driver.

    The same logic, arguments, result and errors as :func:`execute`, with an
    :class:`~ledger.AsyncLedger`; ``send`` (e.g. :func:`ledger.adapters.async_sender`) and
    ``on_notice`` may be coroutine functions, and ``sleeper`` waits with ``asleep``. A begin or
    settle under way when the caller cancels is completed (shielded) before the
    ``CancelledError`` is delivered.

    Args:
        ledger: The :class:`~ledger.AsyncLedger`.
        lease: The Run's live lease.
        envelope: The whole request.
        send: Performs one physical call (a coroutine function is awaited).
        turn_id: As :func:`execute`.
        pin: As :func:`execute`.
        denials: As :func:`execute`.
        reserve: As :func:`execute`.
        sleeper: As :func:`execute` (its ``asleep`` is awaited).
        on_notice: As :func:`execute` (a coroutine function is awaited).
        rng: As :func:`execute`.
        token_counter: As :func:`execute`.
        part_hashes: As :func:`execute`.

    Returns:
        The :class:`RunResult`.

    Raises:
        FailoverExhausted: the turn stopped without an answer.
        InvalidArgument: an argument is wrong (a sync :class:`~ledger.Ledger` included).
        FencedOut: the Run was taken over (``LeaseLost``: its lease lapsed).
        DatabaseUnavailable: the database could not be reached.
    """
    return await _turn_async(ledger, lease, envelope, send, turn_id=turn_id, pin=pin,
                             denials=denials, reserve=reserve, sleeper=sleeper,
                             on_notice=on_notice, rng=rng, token_counter=token_counter,
                             part_hashes=part_hashes)


def _turn_sync(ledger: SyncFace[Any, Any], lease: Lease, envelope: Request,
               send: Callable[[Dispatch], SendResult], *, held: Callable[[], Lease] | None = None,
               turn_id: str | None = None, pin: Pin | str | None = None,
               denials: Denials | None = None, reserve: Reserve | None = None,
               sleeper: Sleeper | None = None, on_notice: NoticeFn | None = None,
               rng: random.Random | None = None, token_counter: TokenCounter | None = None,
               part_hashes: PartHashes | None = None) -> RunResult:
    """:func:`execute` on validated arguments.

    ``held`` gives the lease as its holder holds it now (a Run session's keeper renews it
    while the turn runs); without it the turn knows only ``lease``.
    """
    loop = _loop(lease, envelope, turn_id, pin, denials, reserve, rng, token_counter, part_hashes,
                 ledger.lease_margin_s)
    gen = _telemetry.observed(loop.steps(), lease.run_id, loop.turn_id, loop.envelope)
    slept = sleeper or _sleeper_of(ledger)
    current = held or (lambda: lease)
    return _drive_sync(gen, lambda eff: _perform_sync(ledger, eff, send, slept, on_notice,
                                                      current))


async def _turn_async(ledger: AsyncFace[Any, Any], lease: Lease, envelope: Request,
                      send: SendFn, *, held: Callable[[], Lease] | None = None,
                      turn_id: str | None = None, pin: Pin | str | None = None,
                      denials: Denials | None = None, reserve: Reserve | None = None,
                      sleeper: Sleeper | None = None, on_notice: NoticeFn | None = None,
                      rng: random.Random | None = None,
                      token_counter: TokenCounter | None = None,
                      part_hashes: PartHashes | None = None) -> RunResult:
    """:func:`aexecute` on validated arguments (``held``: see :func:`_turn_sync`)."""
    loop = _loop(lease, envelope, turn_id, pin, denials, reserve, rng, token_counter, part_hashes,
                 ledger.lease_margin_s)
    gen = _telemetry.observed(loop.steps(), lease.run_id, loop.turn_id, loop.envelope)
    return await _drive_async(gen, ledger, send, sleeper or _sleeper_of(ledger), on_notice,
                              held or (lambda: lease))


def _advance(gen: Steps, value: Any, error: BaseException | None,
             pending: BaseException | None = None) -> tuple[bool, Any]:
    """Resume the loop with an effect's result (or its error): (finished, effect or result).

    ``pending``: an interruption the driver holds for the loop's next effect. A loop that
    raises before it reaches one (a begin whose refusal it learned by doing the interrupted
    write again) would lose it: the interruption is raised instead, the loop's error its
    context, so a Ctrl-C or a cancellation is never swallowed.
    """
    try:
        return False, (gen.throw(error) if error is not None else gen.send(value))
    except StopIteration as stop:
        return True, stop.value
    except Exception:
        if pending is None:
            raise
        raise pending  # noqa: B904 - the interruption stands; the loop's error is its context


def _writes(eff: Effect[Any]) -> bool:
    return isinstance(eff, Begin | Settle | LeaveQueue | ResolveBegin)


def _drive_sync(gen: Steps, perform_one: Callable[[Effect[Any]], Any]) -> RunResult:
    done, item = _advance(gen, None, None)
    pending: BaseException | None = None  # an interruption to deliver at the next effect
    while not done:
        value: Any = None
        error: BaseException | None = None
        if pending is not None:
            error, pending = pending, None
        else:
            try:
                value = perform_one(item)
            except Exception as e:
                error = e
            except BaseException as e:
                if not _writes(item):
                    error = e
                else:
                    # Interrupted inside a begin or settle (KeyboardInterrupt): it committed or
                    # rolled back. The same write again is recognised, so it is done once more
                    # to learn its outcome; the interruption is delivered right after.
                    pending = e
                    try:
                        value = perform_one(item)
                    except Exception as again:
                        error = again
                        if ledger_closed(again):
                            # Refused unread: the interrupted try's outcome stays unknown, and
                            # the loop hears the interruption there (it settles what it can).
                            error, pending = e, None
        done, item = _advance(gen, value, error, pending)
    if pending is not None:
        raise pending  # the turn's last write completed; the interruption still stands
    return item  # type: ignore[no-any-return]


async def _drive_async(gen: Steps, ledger: AsyncFace[Any, Any], send: SendFn, sleeper: Sleeper,
                       on_notice: NoticeFn | None, held: Callable[[], Lease]) -> RunResult:
    done, item = _advance(gen, None, None)
    pending: BaseException | None = None
    while not done:
        value: Any = None
        error: BaseException | None = None
        if pending is not None:
            error, pending = pending, None
        elif _writes(item):
            # A begin or settle runs to completion even when the caller cancels meanwhile; the
            # cancellation is delivered at the next effect, once the loop knows the outcome.
            task = asyncio.ensure_future(
                _perform_async(ledger, item, send, sleeper, on_notice, held))
            again = True
            while True:
                cancelled = await outlast(task)
                if task.cancelled():
                    # The write's own task was cancelled (a teardown cancels every task). As
                    # after an interrupt in the sync driver, the same write is done once more
                    # (it is recognised) to learn its outcome; cancelled again, the loop hears
                    # the cancellation at this write and settles what it can.
                    if not again:
                        error, pending = cancelled, None
                        break
                    again, pending = False, cancelled
                    task = asyncio.ensure_future(
                        _perform_async(ledger, item, send, sleeper, on_notice, held))
                    continue
                pending = cancelled or pending
                try:
                    value = task.result()
                except Exception as inner:
                    error = inner
                    if not again and pending is not None and ledger_closed(inner):
                        # The write done again was refused unread: as in the sync driver.
                        error, pending = pending, None
                break
        else:
            try:
                value = await _perform_async(ledger, item, send, sleeper, on_notice, held)
            except BaseException as e:
                error = e
        done, item = _advance(gen, value, error, pending)
    if pending is not None:
        raise pending  # the turn's last write completed; the cancellation still stands
    return item  # type: ignore[no-any-return]


async def outlast(task: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait until ``task`` is done, however often the waiting task is cancelled meanwhile.

    A write under way (a begin, a settle, a Run's finish, a lease taken) must end before its
    caller may go: its outcome decides what the caller still owes. Returns the last
    cancellation the waiting task received, for the caller to raise once it has used that
    outcome (``task.result()``), else ``None``. A ``task`` that was itself cancelled returns
    its ``CancelledError``.
    """
    pending: asyncio.CancelledError | None = None
    while True:
        try:
            await asyncio.shield(task)
            return pending
        except asyncio.CancelledError as e:
            pending = e
            if task.done():
                return pending
        except Exception:
            return pending  # the task's own error: its caller reads it from the task


def _turn_record(ledger: Face[Any, Any], run_id: str, turn_id: str) -> Flow[RecordedTurn]:
    attempts, skipped = yield from blocking(lambda: ledger._runs.turn_record(run_id, turn_id))
    return RecordedTurn(tuple(attempts), tuple(tuple(d) for d in skipped))


def _flow_of(ledger: Face[Any, Any], eff: Effect[Any]) -> Flow[Any]:
    """The storage flow a database effect asks for: one mapping for both drivers.

    The loop decided every write with the pure rules (its specs), so nothing is checked again.
    """
    store, clock = ledger._store, ledger.clock.now
    match eff:
        case Snapshot(run_id=run_id, refs=refs, turn_id=turn_id, carried=carried):
            return ledger._snapshot(run_id, refs, turn_id, carried)
        case Begin(spec=spec):
            return store.begin_attempt(spec, clock)
        case Settle(run_id=run_id, spec=spec):
            # The retry owner holds the receipt: one the database does not take now is written
            # once it answers, so the Attempt's slot and hold are not held for the session.
            return store.settle_attempt(run_id, spec, clock, remember=True)
        case ResolveBegin(item=item):
            return store.resolve_begin(item, clock)
        case LeaveQueue(group=group, waiter=waiter):
            return store.leave_queue(waiter, group)
        case ClaimProbe(route=route, interval_s=interval, key=key):
            return store.claim_probe(key, route.provider, clock(), interval,
                                     kind=probe_key_kind(route, key), ttl_s=eff.ttl_s,
                                     max_keys=eff.max_keys)
        case Record(lease=lease, kind=kind, data=data, attempt_id=attempt_id):
            return store.append_event(lease, attempt_id, kind, data, clock)
        case TurnRecord(run_id=run_id, turn_id=turn_id):
            return _turn_record(ledger, run_id, turn_id)
    raise TypeError(f"not a database effect: {eff!r}")  # pragma: no cover


def _perform_sync(ledger: SyncFace[Any, Any], eff: Effect[Any],
                  send: Callable[[Dispatch], SendResult], sleeper: Sleeper,
                  on_notice: NoticeFn | None, held: Callable[[], Lease]) -> Any:
    match eff:
        case Send(dispatch=dispatch):
            dispatch.progress.clock = ledger.clock.now  # the send's marks, on the ledger's time
            dispatch.progress.handed_over = True
            return send(dispatch)
        case Sleep(seconds=seconds):
            sleeper.sleep(seconds)
            return None
        case Notify(notice=notice):
            if on_notice is not None:
                on_notice(notice)
            return None
        case Now():
            return ledger.now()
        case HeldLease():
            return held()
        case AwaitSlot(group=group, waiter=waiter, seconds=seconds, ticket=ticket):
            waker = ledger._store.waker
            if waker.join(group, waiter, ticket):
                return None  # registered: begin once more before waiting (no wake is missed)
            waker.wait(waiter, seconds, sleeper)
            return None
        case LeaveQueue(waiter=waiter, drop=drop):
            try:
                if drop:
                    ledger._runner.run(_flow_of(ledger, eff))
            finally:
                ledger._store.waker.leave(waiter)
            return None
    return ledger._runner.run(_flow_of(ledger, eff))


async def _perform_async(ledger: AsyncFace[Any, Any], eff: Effect[Any], send: SendFn,
                         sleeper: Sleeper, on_notice: NoticeFn | None,
                         held: Callable[[], Lease]) -> Any:
    match eff:
        case Send(dispatch=dispatch):
            dispatch.progress.clock = ledger.clock.now  # the send's marks, on the ledger's time
            dispatch.progress.handed_over = True
            out = send(dispatch)
            return await out if inspect.isawaitable(out) else out
        case Sleep(seconds=seconds):
            await sleeper.asleep(seconds)
            return None
        case Notify(notice=notice):
            if on_notice is not None:
                res = on_notice(notice)
                if inspect.isawaitable(res):
                    await res
            return None
        case Now():
            return ledger.now()
        case HeldLease():
            return held()
        case AwaitSlot(group=group, waiter=waiter, seconds=seconds, ticket=ticket):
            waker = ledger._store.waker
            if await waker.ajoin(group, waiter, ticket):
                return None  # registered: begin once more before waiting (no wake is missed)
            await waker.await_(waiter, seconds, sleeper)
            return None
        case LeaveQueue(waiter=waiter, drop=drop):
            try:
                if drop:
                    await ledger._runner.arun(_flow_of(ledger, eff))
            finally:
                ledger._store.waker.leave(waiter)
            return None
    # The database effects run on the asyncio driver: no worker-thread hop.
    return await ledger._runner.arun(_flow_of(ledger, eff))


def _sleeper_of(ledger: Face[Any, Any]) -> Sleeper:
    # A ManualClock is also a sleeper that advances it: tests never really wait.
    clock: Any = ledger.clock
    if callable(getattr(clock, "sleep", None)) and callable(getattr(clock, "asleep", None)):
        return clock  # type: ignore[no-any-return]
    return SystemSleeper()


__all__ = [
    "Dispatch",
    "Notice",
    "RunResult",
    "SendResult",
    "aexecute",
    "execute",
]
