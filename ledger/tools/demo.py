"""``failover-ledger demo``: a small research task against local fake providers, no network.

Two fake endpoints on loopback stand in for a shared gateway ("go": two models behind one
account, one capacity group) and an independent official endpoint. Three runs show the seed's
scenarios:

1. a 503 while the gateway's group is healthy -> the next model behind the same gateway;
2. a trusted 429 with Retry-After -> the gateway group cools; its other model is skipped, the
   independent endpoint serves;
3. the same 429, but the run's grant does not approve the official endpoint for the request's
   model-derived context -> the switch is refused and the run stops with its reasons.

Everything goes to a real ledger (the embedded SQLite file by default), so
``failover-ledger runs`` and ``failover-ledger run show`` can read it afterwards.

A demo writes into a new or empty database, or a ledger holding only earlier demo runs (on
either backend alike, :func:`demo_ledger`); anything else is refused, never written to. The
earlier runs stay, and the new ones get ids of their own. Cooldowns and group floors are durable,
so a demo that started where the last one did would find the gateway still cooling (and its
health "sampled in the future") and tell another story than its headings: its simulated time
starts after the latest instant the ledger holds instead (:func:`demo_start`), and each scenario
first lets :data:`SCENARIO_GAP_S` of simulated time pass, longer than any cooldown or group
floor the demo leaves. Nothing it records (nor any cooldown it leaves) lies past the real "now":
a demo that would not fit before it, after the earlier ones, is refused until it does.
"""

from __future__ import annotations

import math
import time
import uuid
from decimal import Decimal
from typing import TextIO

from ledger.adapters.runner import sync_sender
from ledger.adapters.secrets import StaticSecretProvider
from ledger.adapters.sync import SyncAdapter
from ledger.api.facade import Ledger
from ledger.api.turn import execute
from ledger.clock import Clock, SystemClock
from ledger.domain.envelope import MODEL_DERIVED, Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.records import AttemptRecord
from ledger.domain.timefmt import iso
from ledger.domain.values import Budget, Capabilities, Grant, Price, Profile, Route
from ledger.errors import DatabaseSetupError, FailoverExhausted, InvalidArgument, NotFound
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault


def _routes(go: FakeProvider, official: FakeProvider) -> list[Route]:
    price = Price(input_per_mtok=Decimal("0.30"), output_per_mtok=Decimal("1.20"))
    caps = Capabilities(tools=True, context_window=128_000, streaming=True)
    return [
        Route(id="go-deepseek", provider="go", model="deepseek-v4", group="go",
              recipient="go-gateway", protocol=WireProtocol.OPENAI, endpoint=go.endpoint("openai"),
              capabilities=caps, price=price, profiles=[Profile(id="go:demo")]),
        Route(id="go-glm", provider="go", model="glm-5", group="go", recipient="go-gateway",
              protocol=WireProtocol.OPENAI, endpoint=go.endpoint("openai"), capabilities=caps,
              price=price, profiles=[Profile(id="go:demo")]),
        Route(id="official-deepseek", provider="deepseek", model="deepseek-v4",
              group="deepseek-official", recipient="deepseek", protocol=WireProtocol.OPENAI,
              endpoint=official.endpoint("openai"), capabilities=caps, price=price,
              profiles=[Profile(id="deepseek:demo")]),
    ]


def _envelope(derived: str | None, derived_ref: str | None) -> Envelope:
    parts = [Part(content="Compare the Q3 filings of the two companies.")]
    if derived is not None:
        parts.append(Part(role="assistant", content=derived, data_class=MODEL_DERIVED,
                          provenance=derived_ref))
        parts.append(Part(content="Now summarise the risks you found."))
    return Envelope(parts=parts, max_output_tokens=300)


def _short_id(id_: str) -> str:
    """``d-att-0193...5e1f9a2c`` as ``d-att-..5e1f9a2c``: ids are time-ordered, so the head of
    their digits is when they were made, the same for every id of one demo; the tail tells
    them apart."""
    head, _, digits = id_.rpartition("-")
    return f"{head}-..{digits[-8:]}"


def _preview(text: str, most: int = 80) -> str:
    """An answer as the demo shows it: whole up to ``most`` characters, else cut with an
    ellipsis (cut bare, "streaming in piece" read as an answer lost mid-stream)."""
    return text if len(text) <= most else text[:most - 1] + "\u2026"


def print_timeline(led: Ledger, run_id: str, out: TextIO) -> None:
    run = led.get_run(run_id)
    selects = {e.attempt_id: e.data for e in led.events(run_id, ["select"])}
    print(f"\nrun {run_id} ({run.status.value})  selected={run.selected_route}  "
          f"served-by={run.current_route}  "
          f"calls={run.calls_used}/{run.budget.max_calls}  retries={run.retries_used}/"
          f"{run.budget.max_retries}  posted={run.posted}  held={run.reserved}", file=out)
    rows: list[AttemptRecord] = led.timeline(run_id)
    for a in rows:
        cause = f"{a.category} HTTP {a.http_status}" if a.category else ""
        print(f"  #{a.seq} {a.kind.value:<8} {a.route_id:<18} {a.state.value:<9} "
              f"debit={_short_id(a.debit_id)} "
              f"({a.debit_state.value if a.debit_state else '?'}) "
              f"{cause}", file=out)
        sel = selects.get(a.attempt_id) or {}
        for s in sel.get("skipped", []):
            if s["reason"] != "already_tried":
                print(f"       skipped {s['route']}: {s['reason']} ({s['detail']})", file=out)


class SimulatedClock:
    """Wall time plus an offset that waits advance instead of blocking (a demo never stalls).

    It starts where :func:`demo_start` says: hours in the past on a new ledger, so everything
    the demo records lies before the real "now" that the operator commands read with afterwards.
    ``wall`` is that real clock (:class:`~ledger.clock.SystemClock` unless a test injects one).
    """

    def __init__(self, start_offset: float = 0.0, wall: Clock | None = None) -> None:
        self.offset = start_offset
        self.wall = wall or SystemClock()

    def now(self) -> float:
        return self.wall.now() + self.offset

    def sleep(self, seconds: float) -> None:
        self.offset += max(0.0, seconds)

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


DEMO_TENANT = "demo"


def demo_ledger(db_url: str, now: float) -> float | None:
    """Check that the demo may write into ``db_url`` at ``now`` (the real clock's); returns the
    latest instant it holds.

    A database that does not exist, or holds no tables or no run, is made a ledger by the demo;
    one that holds only earlier demo runs (tenant ``demo``) is written into as it is, keeping
    them (the latest instant it holds is returned, for :func:`demo_start`; ``None`` when it holds
    none). A file holding anything else (other runs, another application's tables, or not a
    SQLite database at all: :func:`ledger.storage.engine.file_holds`, read without writing), or
    a PostgreSQL database holding other runs, is refused with :class:`InvalidArgument` naming
    ``--db``: the demo never writes next to other history. So is a ledger whose earlier demo
    runs leave no room for another before ``now`` (:func:`demo_start`): the demo never records
    past the real now.
    """
    from ledger.api.face import storage_of
    from ledger.storage.audit import AuditQueries
    from ledger.storage.engine import file_holds, normalize_url, not_a_ledger, parse, redact_url

    norm = normalize_url(db_url)
    # The file as SQLAlchemy reads the URL (percent-decoded, without its options).
    path = (parse(norm)[1].database or None) if norm.startswith("sqlite:///") else None
    where = path or redact_url(norm)
    fix = ("pass --db a new file, e.g. --db demo.db" if path is not None
           else "pass --db an empty database, or a new SQLite file (e.g. --db demo.db)")
    if path is not None:
        holds = file_holds(path)
        if holds == "empty":
            return None
        if holds != "ledger":
            raise InvalidArgument(f"the demo will not write into {where}: "
                                  f"{not_a_ledger(holds)}; {fix}", field="db")
    # A database that cannot be opened or read says so itself, with its own fix.
    try:
        with Ledger.open(db_url, migrate_schema=False) as led:
            store = AuditQueries(storage_of(led).context)
            if path is None and not store.schema_present():
                return None  # an empty PostgreSQL database: the demo migrates it
            other = store.first_run_other_than(tenant=DEMO_TENANT)
            latest = store.latest_instant() if other is None else None
    except DatabaseSetupError as e:
        if e.fields.get("problem") != "schema_outdated":
            raise
        raise InvalidArgument(f"the demo will not write into {where}: it is a ledger of "
                              f"an older schema, which the demo leaves alone; {fix}",
                              field="db") from e
    if other is not None:
        raise InvalidArgument(f"the demo will not write into {where}: it holds runs other "
                              f"than the demo's (e.g. {other!r}); {fix}", field="db",
                              run_id=other)
    if latest is not None and demo_start(now, latest) is None:
        raise InvalidArgument(
            f"the demo will not write into {where} yet: its earlier demo runs reach "
            f"{iso(latest)}, and another ({DEMO_SPAN_S // 3600:.0f} h "
            f"{DEMO_SPAN_S % 3600 // 60:.0f} min of simulated time after them) would record "
            f"past the real now; run it again after "
            f"{iso(latest + DEMO_SPAN_S)}, or {fix}", field="db")
    return latest


#: Where a demo's simulated time starts on a ledger holding nothing later: hours back, so that
#: what it records lies before the real "now" the operator commands read with afterwards, and
#: inside their default window (the last 24 hours) for demos run again one after another (each
#: takes about 3.25 hours of simulated time: five fit, with :data:`DEMO_SPAN_S` for the last).
_HOURS_BACK = 20 * 3600.0
#: The simulated time let pass before each scenario: longer than any cooldown or group floor
#: the failure-domain policy leaves (each capped at an hour: ``health.cooldown.cap_s``,
#: ``classification.retry_after_limit_s``), so each scenario starts on healthy routes; short
#: enough that demos run again soon after another (each starts where the last one ended) still
#: record before the real "now".
SCENARIO_GAP_S = 65 * 60.0
#: The simulated time a demo may take, from its start to the end of the last cooldown it
#: leaves: a gap before each of its three scenarios, and a fourth for the scenarios' own waits
#: (seconds) and what the last one leaves cooling (at most an hour, as above).
DEMO_SPAN_S = 4 * SCENARIO_GAP_S


def demo_start(now: float, latest: float | None) -> float | None:
    """The instant a demo's simulated time starts at: :data:`_HOURS_BACK` before ``now``, or the
    ``latest`` instant the ledger holds (an earlier demo's) when that is later, so the new demo
    never reads state from its own future. ``None`` when a demo starting there would not end
    (:data:`DEMO_SPAN_S`) by ``now``: demos run again in quick succession each start where the
    last one ended, and the seventh recorded past the real "now" (``health`` then told of a
    failure "in 28 s")."""
    start = max(now - _HOURS_BACK, latest if latest is not None else -math.inf)
    return start if start + DEMO_SPAN_S <= now else None


def _free_suffix(led: Ledger) -> str:
    """A suffix for the demo's run ids that names no run yet (as ``generate`` takes a fresh
    tag): the time with a random tail, drawn again in the unlikely case another demo took it."""
    while True:
        suffix = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
        try:
            led.get_run(f"demo-{suffix}-1")
        except NotFound:
            return suffix


def run_demo(db_url: str, out: TextIO, wall: Clock | None = None) -> list[str]:
    """Run the three scenarios into ``db_url`` (see :func:`demo_ledger`), after anything
    recorded there and before ``wall``'s now (the real clock by default); returns the run ids
    written.

    Raises :class:`InvalidArgument` (``field="db"``), writing nothing, when the earlier demo
    runs there reach too close to now for another to fit before it (see :func:`demo_start`).
    """
    wall = wall or SystemClock()
    now = wall.now()
    latest = demo_ledger(db_url, now)
    start = demo_start(now, latest)
    assert start is not None  # demo_ledger refused a ledger that leaves no room
    if latest is not None:
        print("(the ledger holds earlier demo runs: they stay, and this demo's runs are new "
              "ones after them)", file=out)
    secrets = StaticSecretProvider({"go:demo": "demo-key-go", "deepseek:demo": "demo-key-ds"})
    run_ids: list[str] = []
    clock = SimulatedClock(start_offset=start - now, wall=wall)
    print("(simulated time: the demo's waits and cooldowns pass instantly, from "
          f"{iso(start)} on)", file=out)
    with FakeProvider().in_thread() as go, FakeProvider().in_thread() as official, \
            Ledger.open(db_url, clock=clock) as led:
        adapter = SyncAdapter(secrets=secrets)
        try:
            suffix = _free_suffix(led)
            send = sync_sender(adapter)
            plan = _routes(go, official)
            budget = Budget(max_calls=6, max_retries=3, max_cost=Decimal("0.05"))
            wide = Grant(recipients={"go-gateway": ["user_input", MODEL_DERIVED],
                                     "deepseek": ["user_input", MODEL_DERIVED]})
            narrow = Grant(recipients={"go-gateway": ["user_input", MODEL_DERIVED],
                                       "deepseek": ["user_input"]})
            scenarios: list[tuple[str, Grant, Fault | Behavior]] = [
                ("503 while the gateway group is healthy", wide, Fault.UNAVAILABLE),
                ("429 with Retry-After cools the shared gateway", wide,
                 Behavior(fault=Fault.RATE_LIMIT_RETRY_AFTER, retry_after="30")),
                ("the backup's recipient is not approved for derived context", narrow,
                 Behavior(fault=Fault.RATE_LIMIT_RETRY_AFTER, retry_after="30")),
            ]
            for i, (title, grant, fault) in enumerate(scenarios, 1):
                run_id = f"demo-{suffix}-{i}"
                run_ids.append(run_id)
                print(f"\n== scenario {i}: {title}", file=out)
                # Cooldowns are durable and shared: let simulated time pass so that each
                # scenario starts with healthy routes and an open gateway group.
                clock.sleep(SCENARIO_GAP_S)
                led.admit_run(run_id, plan=plan, budget=budget, grant=grant,
                              policy="failure-domain", tenant=DEMO_TENANT,
                              labels={"task": "filings"})
                lease = led.acquire_lease(run_id)
                # Turn 1 succeeds on the primary; its answer becomes provenance-backed context.
                first = execute(led, lease, _envelope(None, None), send, turn_id="t1")
                answer = first.output.text
                go.enqueue(fault, model="deepseek-v4")
                try:
                    res = execute(led, lease, _envelope(answer, first.attempt.attempt_id), send,
                                  turn_id="t2")
                    print(f"   -> answered by {res.route.id}: {_preview(res.output.text)!r}",
                          file=out)
                    status = "succeeded"
                except FailoverExhausted as e:
                    print(f"   -> stopped: {e.reason}; the turn-1 result is kept", file=out)
                    status = "stopped"
                    for s in e.fields.get("skipped", []):
                        if s["reason"] != "already_tried":
                            print(f"       skipped {s['route']}: {s['reason']} ({s['detail']})",
                                  file=out)
                led.finish_run(lease, status)
                led.release_lease(lease)
                print_timeline(led, run_id, out)
        finally:
            adapter.close()
    return run_ids
