"""A realistic history written by the ledger itself (``failover-ledger generate``).

Runs over many routes, providers, capacity groups, tenants and labels, of one to three turns
each, are *really run*: each is admitted (:meth:`~ledger.Ledger.admit_run`, under a copy of the
``goclaw`` preset), leased, and each of its turns is served by the retry owner
(:func:`ledger.execute`) with a scripted send function in place of the network. The script
answers as providers and the transport do, decided by a seeded random generator: answers with
usage, rate limits with Retry-After, overloads, server errors, read timeouts after the request
left, refused connections, auth failures, context overflows. Time is a
:class:`~ledger.clock.ManualClock` moved through the ``days`` window: Runs start spread over it
and overlap as the Runs of a busy service do (one after another in this process, each from its
own start time, so later Runs see the cooldowns earlier ones left), each call takes as long as
such a call takes (an answer seconds, a read timeout a minute or two), and the retry owner's
waits (backoffs, Retry-After) pass on the same clock. Later turns carry the
earlier answers with their provenance, as an agent's conversation does.

So every record is exactly what the ledger writes: the begin and settle transactions, the holds
(a timeout after the request left is ``unknown`` and keeps its hold; a refused connection is
``not_sent``, its hold voided), the retry permissions, the health and cooldowns the failures
leave for later Runs, the selector's decisions and the retry owner's events; ``failover-ledger
reconcile`` finds nothing to report. At the recent end a few Runs are still in flight: an
Attempt begun (:meth:`~ledger.Ledger.begin_attempt`) and not answered, under a lease its
executor keeps renewed until the end of the history.

Deterministic for a given seed (the Runs, their ids and turns, what each call answers, the retry
owner's jitter), except the ids the ledger draws itself (attempt ids). Run again on a ledger that
holds a history of the same seed, it names its Runs anew (ids derived from the seed's and the
histories already there), so a second history adds Runs of its own and never writes into the
first's. It writes through the ledger's
transactions, a few per Attempt, so it is far slower than bulk loading (``docs/audit.md`` gives
the rate); the benchmarks' bulk generator (``python -m benchmarks generate``) makes the
millions of Attempts the audit benchmarks need.
"""

from __future__ import annotations

import hashlib
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

from ledger.api.facade import Ledger
from ledger.api.face import storage_of
from ledger.api.turn import execute
from ledger.clock import ManualClock
from ledger.decide.effects import Dispatch, SendResult
from ledger.decide.ending import turn_end
from ledger.decide.preflight import CharEstimator
from ledger.domain.bounds import MAX_TIME
from ledger.domain.envelope import MODEL_DERIVED, USER_INPUT, Envelope, Part
from ledger.domain.facts import Observation, Transport, WireProtocol
from ledger.domain.records import AttemptState, Lease, RunStatus
from ledger.domain.timefmt import iso
from ledger.domain.values import Budget, Grant, Price, Profile, Route
from ledger.errors import FailoverExhausted, InvalidArgument, NotFound
from ledger.policy.load import policy_hash, preset
from ledger.policy.model import Policy
from ledger.storage.partitions import ensure_partitions

Progress = Callable[[int, int], None]

_PROVIDERS = {
    # provider: (models, groups, base failure rate, price in/out per Mtok)
    "openai": (["gpt-4o", "gpt-4o-mini", "o3"], ["openai-east", "openai-west"], 0.08, (2.5, 10)),
    "anthropic": (["claude-sonnet", "claude-haiku"], ["anthropic-main"], 0.10, (3, 15)),
    "gemini": (["gemini-pro", "gemini-flash"], ["gemini-main"], 0.12, (1.25, 5)),
    "mistral": (["mistral-large"], ["mistral-eu"], 0.15, (2, 6)),
    "together": (["llama-70b", "qwen-72b"], ["together-shared"], 0.22, (0.9, 0.9)),
}
_PROTOCOL = {"anthropic": WireProtocol.ANTHROPIC, "gemini": WireProtocol.GEMINI}
# The providers whose usage reports the prompt's cached part.
_CACHING = frozenset({"openai", "anthropic", "gemini"})
_TENANTS = ["acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "wonka"]
_TEAMS = ["search", "research", "support", "eval"]
_ENVS = ["prod", "prod", "prod", "staging"]
# What a failed call looks like to the adapter: (weight, observation of it on a route).
_FAILURES: list[tuple[int, Callable[[Route, random.Random], Observation]]] = [
    (34, lambda r, rng: Observation(status=429, provider=r.provider, protocol=r.protocol,
                                    headers={"retry-after": str(rng.choice([1, 2, 5, 30]))})),
    (18, lambda r, rng: Observation(status=529 if r.provider == "anthropic" else 503,
                                    provider=r.provider, protocol=r.protocol)),
    (16, lambda r, rng: Observation(status=500, provider=r.provider, protocol=r.protocol,
                                    body='{"error": {"type": "api_error", "message": '
                                         '"Internal server error"}}')),
    (14, lambda r, rng: Observation(transport=Transport.READ_TIMEOUT, provider=r.provider,
                                    protocol=r.protocol)),
    (8, lambda r, rng: Observation(transport=Transport.CONNECT_REFUSED, provider=r.provider,
                                   protocol=r.protocol)),
    (5, lambda r, rng: Observation(status=401, provider=r.provider, protocol=r.protocol)),
    (5, lambda r, rng: Observation(status=400, provider=r.provider, protocol=r.protocol,
                                   body="This model's maximum context length is 128000 tokens")),
]
# How long each kind of answer takes (seconds): a refused connection at once, an error status
# quickly, a read timeout after the stream's read timeout.
_LATENCY = {"ok": (0.4, 12.0), "status": (0.1, 2.0), "timeout": (30.0, 120.0),
            "refused": (0.001, 0.05)}
_BUDGET = Budget(max_calls=12, max_retries=4, max_cost=Decimal(1))
_MAX_COMPLETION = 1500  # the completion tokens a turn asks for (and holds)
# A Run's lease outlasts any of its turns (a dozen calls of two minutes); it is renewed
# between turns, as a lease keeper would.
_RUN_LEASE_S = 3600.0
_KEPT_LEASE_S = 30.0  # what the executor of a Run still in flight renewed last, at the end
_TAIL_S = 900.0  # no Run starts in the last quarter hour (at most a tenth of the span)
_IN_FLIGHT_S = 600.0  # Runs started in the last ten minutes (at most a tenth of the span) ...
_IN_FLIGHT_SHARE = 0.15  # ... are still in flight at the end with this chance
_CHARS_PER_TOKEN = 4  # the default token counter's (CharEstimator) ratio
_FILLER = ("The filings show revenue growth in the segment, offset by higher costs of capital "
           "and a one-off charge; the risks named are supply, currency and litigation. ") * 8


@dataclass
class GenStats:
    """What :func:`generate` wrote.

    ``failed``, ``unknown``, ``not_sent`` and ``dispatching`` count Attempts in that state;
    ``failovers`` the Runs with an Attempt on another route than their selected one; ``events``
    the Runs' events. ``until`` is the end of the history: ``end``, or the end of a Run that ran
    past it (none starts in the last quarter hour, so that is rare).
    """

    runs: int = 0
    attempts: int = 0
    failed: int = 0
    unknown: int = 0
    not_sent: int = 0
    dispatching: int = 0
    failovers: int = 0
    events: int = 0
    since: float = 0.0
    until: float = 0.0
    routes: list[str] = field(default_factory=list)


def catalog() -> list[Route]:
    """The generated routes: every model of every provider in each of its groups."""
    out = []
    for prov, (models, groups, _rate, (pin, pout)) in _PROVIDERS.items():
        for model in models:
            for group in groups:
                out.append(Route(
                    id=f"{prov}/{model}@{group.split('-')[-1]}", provider=prov, model=model,
                    group=group, recipient=prov,
                    protocol=_PROTOCOL.get(prov, WireProtocol.OPENAI),
                    profiles=[Profile(id=f"{prov}-key-{i}") for i in (1, 2)],
                    price=Price(input_per_mtok=Decimal(str(pin)),
                                output_per_mtok=Decimal(str(pout)))))
    return out


def generated_policy() -> Policy:
    """The policy generated Runs are admitted under: the ``goclaw`` preset under its own name.

    It decides exactly as ``goclaw`` does; its name gives it its own hash, which is how
    ``generate`` tells its history from real Runs (see :func:`generated_policy_hash`).
    """
    base = preset("goclaw")
    return base.model_copy(update={
        "name": "goclaw-generated",
        "description": "The goclaw preset, for the synthetic history of failover-ledger "
                       "generate (the same rules under another name)."})


def generated_policy_hash() -> str:
    """The ``policy_hash`` every Run ``generate`` writes carries, and no other Run."""
    return policy_hash(generated_policy())


def _text(prefix: str, tokens: int) -> str:
    """``tokens`` tokens of text (by the default counter's measure), starting with ``prefix``."""
    chars = max(tokens * _CHARS_PER_TOKEN - len(prefix), 0)
    reps = _FILLER * (chars // len(_FILLER) + 1)
    return prefix + reps[:chars]


class _Provider:
    """The scripted send function: what each call answers, decided by the seeded generator.

    The last Attempt the caller asked for succeeds, so the history ends on a served turn.
    """

    def __init__(self, rng: random.Random, clock: ManualClock, routes: list[Route],
                 stats: GenStats, target: int) -> None:
        self.rng = rng
        self.clock = clock
        self.stats = stats
        self.target = target
        self.fail_rate = {r.id: _PROVIDERS[r.provider][2] * rng.uniform(0.6, 1.4)
                          for r in routes}
        self.weights = [w for w, _ in _FAILURES]
        self.counter = CharEstimator()

    def __call__(self, d: Dispatch) -> SendResult:
        rng, route = self.rng, d.route
        self.stats.attempts += 1
        last = self.stats.attempts >= self.target
        if last or rng.random() >= self.fail_rate[route.id]:
            # The answer streams: its headers after a tenth of the call, its first token after
            # a quarter (marked on the ledger's clock, as the adapters mark them), the rest after.
            took = rng.uniform(*_LATENCY["ok"])
            self.clock.advance(took * 0.1)
            d.progress.first_byte()
            self.clock.advance(took * 0.15)
            d.progress.first_token()
            self.clock.advance(took * 0.75)
            # Usage as a provider reports it: the prompt within the counter's estimate (which
            # the hold was taken for), the completion within the asked maximum; its cost at the
            # route's price, as the adapters compute it. The providers that say so report the
            # prompt's cached part (a prefix, in blocks of 128), the o-series its reasoning.
            estimate = self.counter.count_tokens(d.envelope, route)
            prompt = max(1, int(estimate * rng.uniform(0.7, 1.0)))
            completion = rng.randint(50, d.envelope.max_output_tokens or _MAX_COMPLETION)
            answer = Part(role="assistant", content=_text(f"[{d.attempt_id}] ", completion),
                          data_class=MODEL_DERIVED, provenance=d.attempt_id)
            cached = (prompt // 2) // 128 * 128 if route.provider in _CACHING else None
            reasoning = completion // 3 if route.model.startswith("o") else None
            return SendResult(ok=True, output=answer.content, prompt_tokens=prompt,
                              completion_tokens=completion,
                              cost=route.cost(prompt, completion), model_reported=route.model,
                              output_hash=answer.content_hash, parts=(answer,),
                              cached_tokens=cached, reasoning_tokens=reasoning)
        obs = rng.choices(_FAILURES, self.weights)[0][1](route, rng)
        if obs.transport is Transport.CONNECT_REFUSED:
            self.clock.advance(rng.uniform(*_LATENCY["refused"]))
            d.progress.sent = False
            return SendResult.failed(obs, sent=False)  # no byte left: never sent
        kind = "timeout" if obs.transport is Transport.READ_TIMEOUT else "status"
        took = rng.uniform(*_LATENCY[kind])
        if kind == "status":  # an error answer: its first byte is most of the call
            self.clock.advance(took * 0.9)
            d.progress.first_byte()
            took *= 0.1
        self.clock.advance(took)
        return SendResult.failed(obs)


def free_tag(led: Ledger, tag: str, run_id: Callable[[str, int], str]) -> str:
    """``tag``, or the first tag derived from it (its seed's history loaded again) whose Run
    number 1, ``run_id(tag, 1)``, the ledger does not hold.

    Every history admits (or loads) its Run number 1 first, so that one tells whether a tag is
    used. The derivation depends on ``tag`` alone: the same ledger gives the same tags.
    """
    n, free = 0, tag
    while _holds(led, run_id(free, 1)):
        n += 1
        free = hashlib.sha256(f"{tag}/{n}".encode()).hexdigest()[:8]
    return free


def _holds(led: Ledger, run_id: str) -> bool:
    try:
        led.get_run(run_id)
    except NotFound:
        return False
    return True


def _run_id(tag: str, i: int) -> str:
    return f"gen-{tag}-{i:08d}"


class _Generator:
    """Runs the Runs, one after another on the ledger's manual clock."""

    def __init__(self, led: Ledger, clock: ManualClock, rng: random.Random, *, attempts: int,
                 in_flight_from: float, stats: GenStats) -> None:
        self.led = led
        self.clock = clock
        self.rng = rng
        self.in_flight_from = in_flight_from  # Runs started from then on may be in flight
        self.attempts = attempts
        self.stats = stats
        # Admitting the seed's Runs again under their old ids (generate ran here with this seed
        # before) met the first history's Runs: a tag of its own (free_tag).
        self.tag = free_tag(led, uuid.UUID(int=rng.getrandbits(128)).hex[:8], _run_id)
        self.policy = generated_policy()
        self.routes = catalog()
        self.send = _Provider(rng, clock, self.routes, stats, attempts)
        # A plan is 3 routes from 3 different providers, primary first.
        self.plans: list[list[Route]] = []
        for _ in range(24):
            chosen = rng.sample(list(_PROVIDERS), 3)
            self.plans.append([rng.choice([r for r in self.routes if r.provider == p])
                               for p in chosen])
        # Every provider may receive the user's input and the earlier answers.
        self.grant = Grant(recipients={p: [USER_INPUT, MODEL_DERIVED] for p in _PROVIDERS})
        self.in_flight: list[Lease] = []

    def run(self, i: int) -> None:
        """Run number ``i``, admitted now; it makes at most the Attempts still asked for."""
        rng, led, stats = self.rng, self.led, self.stats
        plan = self.plans[rng.randrange(len(self.plans))]
        run_id = _run_id(self.tag, i)
        led.admit_run(run_id, plan=plan, budget=_BUDGET, grant=self.grant, policy=self.policy,
                      tenant=rng.choice(_TENANTS),
                      labels={"team": rng.choice(_TEAMS), "env": rng.choice(_ENVS)})
        lease = led.acquire_lease(run_id, ttl_s=_RUN_LEASE_S)
        in_flight = (self.clock.now() >= self.in_flight_from
                     and rng.random() < _IN_FLIGHT_SHARE)
        turns = rng.choices([1, 2, 3], [6, 3, 1])[0]
        conversation: list[Part] = []
        status = RunStatus.SUCCEEDED
        for n in range(1, turns + 1):
            if n > 1:
                self.clock.advance(rng.uniform(0.5, 30.0))  # the agent reads, runs its tools
                lease = led.renew_lease(lease, ttl_s=_RUN_LEASE_S)
            question = Part(content=_text(f"[{run_id} turn {n}] ", rng.randint(200, 4000)))
            envelope = Envelope(parts=[*conversation, question],
                                max_output_tokens=_MAX_COMPLETION)
            # The last Attempt asked for must be a served one, so an unanswered one never is.
            if in_flight and n == turns and self.attempts - stats.attempts >= 2:
                self._leave_in_flight(run_id, lease, envelope, f"turn-{n}")
                self._count(run_id, plan[0].id)
                return
            try:
                result = execute(led, lease, envelope, self.send, turn_id=f"turn-{n}", rng=rng)
            except FailoverExhausted as e:
                status = turn_end(e)
                break
            conversation += [question, *result.parts]
            if stats.attempts >= self.attempts:
                break  # the requested number of Attempts is written
        led.finish_run(lease, status)
        led.release_lease(lease)
        self._count(run_id, plan[0].id)

    def _leave_in_flight(self, run_id: str, lease: Lease, envelope: Envelope,
                         turn_id: str) -> None:
        """Begin the turn's first Attempt and leave it unanswered: the Run is still going."""
        run = self.led.get_run(run_id)
        route = next(r for r in run.plan if r.id == (run.current_route or run.selected_route))
        prompt = CharEstimator().count_tokens(envelope, route)
        self.led.begin_attempt(lease, route=route.id, envelope_hash=envelope.hash,
                               reserve=route.cost(prompt, _MAX_COMPLETION),
                               reserve_tokens=prompt + _MAX_COMPLETION, turn_id=turn_id)
        self.stats.attempts += 1
        self.in_flight.append(lease)

    def _count(self, run_id: str, selected: str) -> None:
        """Add the Run's records, as the ledger holds them, to the statistics."""
        attempts = self.led.timeline(run_id)
        st = self.stats
        st.runs += 1
        for a in attempts:
            if a.state is AttemptState.FAILED:
                st.failed += 1
            elif a.state is AttemptState.UNKNOWN:
                st.unknown += 1
            elif a.state is AttemptState.NOT_SENT:
                st.not_sent += 1
            elif a.state is AttemptState.DISPATCHING:
                st.dispatching += 1
        if any(a.route_id != selected for a in attempts):
            st.failovers += 1
        st.events += len(self.led.events(run_id))


#: The most Attempts one ``generate`` writes: a million, about two hours of a core and 7.5 GB
#: through the ledger (``docs/audit.md``). A count past it is a slip of extra zeros that would
#: fill the disk over days; a larger history is the benchmarks' bulk generator's, or several
#: runs of this one (each adds a history of its own).
MAX_ATTEMPTS = 1_000_000


def check_window(*, attempts: int, days: float, end: float, flag: str = "") -> None:
    """Refuse what :func:`generate` cannot write as a history every command can read.

    ``end`` is a time as every other command takes one (epoch seconds in ``[0, MAX_TIME)``), and
    the history's start, ``days`` before it, no earlier than 1970: past those bounds SQLite took
    a history no command could reach (``--end`` in milliseconds wrote year 58901) and
    PostgreSQL failed on the months' partitions after the ledger was opened. ``flag`` prefixes
    the names in the messages (``"--"`` for the command line's options).

    Raises:
        InvalidArgument: naming ``attempts`` (at least 1, at most :data:`MAX_ATTEMPTS`),
            ``days`` or ``end`` and the fix.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise InvalidArgument(f"{flag}attempts must be an integer >= 1", field="attempts")
    if attempts > MAX_ATTEMPTS:
        raise InvalidArgument(
            f"{flag}attempts {attempts} is more than {MAX_ATTEMPTS:,}, the most one generate "
            f"writes (about two hours and 7.5 GB through the ledger): pass at most "
            f"{MAX_ATTEMPTS}, run generate again to add more, or use the benchmarks' bulk "
            "generator (python -m benchmarks generate) for larger histories", field="attempts")
    if isinstance(end, bool) or not isinstance(end, int | float) or not 0 <= end < MAX_TIME:
        raise InvalidArgument(
            f"{flag}end {end!r} is not a time the ledger holds: pass seconds since 1970, not "
            f"milliseconds, from 0 to below {MAX_TIME:g} (e.g. {flag}end 1796000000)",
            field="end")
    if isinstance(days, bool) or not isinstance(days, int | float) or not 0 < days < math.inf:
        raise InvalidArgument(f"{flag}days must be a number of days > 0", field="days")
    if days * 86400.0 > end:
        raise InvalidArgument(
            f"{flag}days {days:g} reaches back before 1970 from {flag}end ({iso(end)}): pass "
            f"at most {math.floor(end / 864.0) / 100} days, or a later {flag}end",
            field="days")


def generate(led: Ledger, *, attempts: int, days: float = 7.0, end: float, seed: int = 1,
             progress: Progress | None = None) -> GenStats:
    """Write exactly ``attempts`` Attempts of history, in Runs admitted over the ``days`` days
    before ``end``, by running them through ``led`` (see the module docstring).

    Args:
        led: A ledger opened with a :class:`~ledger.clock.ManualClock`
            (``Ledger.open(url, clock=ManualClock())``); generating moves that clock.
        attempts: How many Attempts to write (at least 1, at most :data:`MAX_ATTEMPTS`).
        days: The span of the history (above 0; it starts in 1970 or later).
        end: The end of the history, in epoch seconds (below
            :data:`~ledger.domain.bounds.MAX_TIME`, as every time the ledger reads).
        seed: Makes the history reproducible.
        progress: Called with (Attempts written, ``attempts``) after each Run.

    Returns:
        What was written (:class:`GenStats`).

    Raises:
        InvalidArgument: the ledger's clock is not a ManualClock, or ``attempts``, ``days`` or
            ``end`` are out of range; nothing is written then.
    """
    clock = led.clock
    if not isinstance(clock, ManualClock):
        raise InvalidArgument("generate moves the ledger's clock through the history: open "
                              "the ledger with clock=ManualClock()", field="ledger")
    check_window(attempts=attempts, days=days, end=end)
    rng = random.Random(seed)
    span = days * 86400.0
    stats = GenStats(since=end - span, until=end)
    # On PostgreSQL, the history's months get their partitions first, as a ledger that lived
    # through them has (an open makes only the coming months').
    ensure_partitions(storage_of(led).context, end, since=stats.since)
    # Runs start over the span but the last minutes, so that the last ones end by ``end``.
    starts = span - min(_TAIL_S, span / 10)
    gen = _Generator(led, clock, rng, attempts=attempts, stats=stats,
                     in_flight_from=stats.since + starts - min(_IN_FLIGHT_S, span / 10))
    stats.routes = [r.id for r in gen.routes]
    latest = stats.since
    i = 0
    while stats.attempts < attempts:
        # Runs arrive in time order, spread evenly by the Attempts written so far (so the
        # requested count lands on the span, whatever the retry mix). They overlap as the
        # Runs of a busy service do: a Run starts at its time even when the one before is still
        # going, so the clock goes back to it (each Run's own time only moves forward).
        clock.set(stats.since + starts * min(stats.attempts + rng.random(), attempts - 0.5)
                  / attempts)
        i += 1
        gen.run(i)
        latest = max(latest, clock.now())
        clock.slept.clear()  # the waits are in the ledger's records; the list need not grow
        if progress:
            progress(min(stats.attempts, attempts), attempts)
    # The executors of the Runs still in flight keep their leases renewed up to the end.
    clock.set(max(end, latest))
    for lease in gen.in_flight:
        led.renew_lease(lease, ttl_s=_KEPT_LEASE_S)
    stats.until = clock.now()
    return stats


__all__ = ["MAX_ATTEMPTS", "GenStats", "catalog", "check_window", "free_tag", "generate",
           "generated_policy", "generated_policy_hash"]
