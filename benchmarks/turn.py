"""``python -m benchmarks turn``: the whole ``aexecute``/``execute`` path against a local fake
provider.

What a user runs: a Run admitted and leased, then turns served by ``aexecute`` (async tasks) or
``execute`` (threads) through the shipped httpx adapter (:func:`ledger.adapters.async_sender`,
:func:`ledger.adapters.sync_sender`) against :class:`ledger.testing.fakeprovider.FakeProvider`
on loopback, in a process of its own. Two scenarios:

* **healthy**: one route answers 200 (default ``failure-domain`` policy);
* **failover**: the primary answers 503 and the fallback route, in another capacity group,
  serves. The policy is ``failure-domain`` with two edits so that *every* turn fails over
  instead of only the first: a 503 does not cool the route (``health.cooldown_categories: []``)
  and a new turn starts at the first plan entry (``failover.new_turn: first_entry``).

Each is measured at each concurrency (concurrent turns of as many Runs: async tasks for
``aexecute``, OS threads for ``execute``) beside a **raw httpx reference** in the same run: the
same request body, headers and URL (built by the route's codec), sent with a bare
``httpx.AsyncClient``/``httpx.Client`` and its JSON read; for failover the reference is the 503
call followed by the 200 call. Ledger and reference run in alternating blocks so both see the
same machine load. Reported per row:

* p50/p95 latency and the **overhead** over the reference (ledger p50 - reference p50, same for
  p95); calls per second of each and their ratio;
* client CPU per call (``time.process_time`` of this process: the ledger, the adapter and the
  HTTP client; the fake provider runs elsewhere) and the reference's CPU per call, whose
  difference is the ledger's own CPU;
* **database transactions per call**, counted in a separate pass after the timed one (see
  :mod:`benchmarks.txcount`).

When ``litellm`` is installed, LiteLLM Router's calls per second at the highest concurrency
(:mod:`benchmarks.litellm_ref`) are measured in the same run, and each healthy async row at
that concurrency is read against them (the issue's target: at least twice).

The floor's two-commit time (raw driver, prepared statements, autocommit, c=1) is measured on
the same database at the start, so the overhead can be read against the issue's targets: floor
two-commit time + 0.9 ms for a healthy call and four commits + 1.4 ms for a failover (p50, c=1).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import httpx

from benchmarks import defaults
from benchmarks.common import (
    BenchError,
    Column,
    MachineProbe,
    Progress,
    Report,
    cpu_now,
    fmt,
    percentile,
    quiet,
)
from benchmarks.fake import FakeServer
from benchmarks.txcount import TxCount, TxCounter, counting
from ledger.api.facade import AsyncLedger, Ledger
from ledger.domain.envelope import Envelope, Part
from ledger.domain.facts import WireProtocol
from ledger.domain.records import Lease
from ledger.domain.values import Budget, Price, Route
from ledger.policy.load import preset
from ledger.policy.model import Policy

DRIVERS = ("async", "sync")
SCENARIOS = ("healthy", "failover")
DEFAULT_CONCURRENCY = (1, 16)
DEFAULT_CALLS = defaults.TURN_CALLS
DEFAULT_COUNT_CALLS = defaults.TURN_COUNT_CALLS
DEFAULT_WARMUP = 5
BLOCK = 10  # calls per worker per block; ledger and reference blocks alternate

HEALTHY_TARGET_EXTRA_MS = 0.9  # healthy overhead <= floor two-commit time + 0.9 ms
FAILOVER_TARGET_EXTRA_MS = 1.4  # failover overhead <= four commits + 1.4 ms
CPU_TARGET_MS = 1.0  # ledger CPU per healthy call, the HTTP client excluded
TX_TARGET = {"healthy": 3, "failover": 6}  # 1 read + 2 writes; 2 reads + 4 writes

# The fake's sticky behaviours, by model: the failover primary always answers 503.
OK_MODEL = "bench-ok"
FAILING_MODEL = "bench-503"
FAKE_DEFAULTS = {FAILING_MODEL: "unavailable"}
LEASE_TTL_S = 3600.0
QUESTION = "Summarise the three main risks in the attached quarterly filing, one line each."


@dataclass(frozen=True)
class Plan:
    """A scenario's frozen plan, policy and what its turns must show."""

    scenario: str
    routes: list[Route]
    policy: Policy | None
    serving: str  # the route that must answer
    raw: list[tuple[Route, int]]  # the reference's calls and the status each must get


def failover_policy() -> Policy:
    """``failure-domain`` where every turn fails over: no cooldown, new turns start first."""
    data = preset("failure-domain").model_dump(mode="json")
    data["name"] = "bench-failover"
    data["description"] = "failure-domain; a 503 does not cool the route; turns start first"
    data["health"]["cooldown_categories"] = []
    data["failover"]["new_turn"] = "first_entry"
    return Policy.model_validate(data)


def plans(fake: FakeServer) -> dict[str, Plan]:
    """The healthy and failover plans against ``fake``."""
    def route(rid: str, model: str, group: str) -> Route:
        return Route(id=rid, provider="fake", model=model, group=group, recipient="fake",
                     protocol=WireProtocol.OPENAI, endpoint=fake.endpoint("openai"),
                     price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2)))

    healthy = route("bench-healthy", OK_MODEL, "bench-group-a")
    primary = route("bench-primary", FAILING_MODEL, "bench-group-a")
    fallback = route("bench-fallback", OK_MODEL, "bench-group-b")
    return {
        "healthy": Plan("healthy", [healthy], None, healthy.id, [(healthy, 200)]),
        "failover": Plan("failover", [primary, fallback], failover_policy(), fallback.id,
                         [(primary, 503), (fallback, 200)]),
    }


def envelope() -> Envelope:
    """The request every turn of this bench sends."""
    return Envelope(parts=[Part(content=QUESTION)], max_output_tokens=256)


def wire_requests(plan: Plan, env: Envelope) -> list[tuple[str, dict[str, str], Any, int]]:
    """The reference's requests: (url, headers, JSON body, expected status), built by the
    route's own codec so they are byte for byte what the adapter sends."""
    from ledger.adapters import codec_for

    out = []
    for r, status in plan.raw:
        w = codec_for(r.protocol).build_request(r, env)
        out.append((w.url, dict(w.headers), w.body, status))
    return out


BUDGET = Budget(max_calls=10_000_000, max_retries=10_000_000, max_cost=Decimal(1_000_000))


@dataclass
class Samples:
    """Latencies (ms), wall and CPU seconds, calls, accumulated over blocks."""

    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def calls(self) -> int:
        """Calls measured."""
        return len(self.latencies)

    def add(self, latencies: Sequence[float], wall: float, cpu: float) -> None:
        """Add one block."""
        self.latencies.extend(latencies)
        self.wall_s += wall
        self.cpu_s += cpu

    @property
    def per_s(self) -> float:
        """Calls per second of wall time."""
        return self.calls / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def cpu_ms(self) -> float:
        """CPU per call, ms."""
        return self.cpu_s / self.calls * 1000 if self.calls else math.nan


@dataclass(frozen=True)
class TurnRow:
    """One (driver, scenario, concurrency) on one backend."""

    backend: str
    driver: str
    scenario: str
    concurrency: int
    calls: int
    p50_ms: float
    p95_ms: float
    raw_p50_ms: float
    raw_p95_ms: float
    overhead_p50_ms: float
    overhead_p95_ms: float
    calls_per_s: float
    raw_calls_per_s: float
    throughput_ratio: float
    cpu_ms: float
    raw_cpu_ms: float
    ledger_cpu_ms: float
    tx_per_call: float | None
    tx_reads_per_call: float | None
    tx_writes_per_call: float | None
    tx_count_calls: int
    tx_connections: int | None
    floor_two_commit_ms: float
    target_overhead_ms: float | None
    checks: dict[str, bool] = field(default_factory=dict)


def _checks_cell(r: TurnRow) -> str:
    return " ".join(f"{k}:{'ok' if v else 'miss'}" for k, v in r.checks.items())


def _tx_cell(r: TurnRow) -> str:
    if r.tx_per_call is None:
        return "-"
    if r.tx_writes_per_call is not None and r.tx_reads_per_call is not None:
        return (f"{r.tx_per_call:.1f} ({r.tx_reads_per_call:.1f}r"
                f"+{r.tx_writes_per_call:.1f}w)")
    return f"{r.tx_per_call:.1f}"


COLUMNS = (
    Column("backend", lambda r: r.backend, left=True),
    Column("driver", lambda r: "aexecute" if r.driver == "async" else "execute", left=True),
    Column("scenario", lambda r: r.scenario, left=True),
    Column("c", lambda r: str(r.concurrency)),
    Column("calls", lambda r: str(r.calls)),
    Column("p50 ms", lambda r: fmt(r.p50_ms, 2)),
    Column("p95 ms", lambda r: fmt(r.p95_ms, 2)),
    Column("raw p50", lambda r: fmt(r.raw_p50_ms, 2)),
    Column("ovh p50", lambda r: fmt(r.overhead_p50_ms, 2)),
    Column("ovh p95", lambda r: fmt(r.overhead_p95_ms, 2)),
    Column("target", lambda r: fmt(r.target_overhead_ms, 2)),
    Column("calls/s", lambda r: fmt(r.calls_per_s)),
    Column("raw/s", lambda r: fmt(r.raw_calls_per_s)),
    Column("x raw", lambda r: fmt(r.throughput_ratio, 2)),
    Column("CPU ms", lambda r: fmt(r.cpu_ms, 2)),
    Column("raw CPU", lambda r: fmt(r.raw_cpu_ms, 2)),
    Column("ledger CPU", lambda r: fmt(r.ledger_cpu_ms, 2)),
    Column("tx/call", _tx_cell),
    Column("conns", lambda r: "-" if r.tx_connections is None else str(r.tx_connections)),
    Column("targets", _checks_cell, left=True),
)


# -- the two drivers --------------------------------------------------------------------------

class _Driver:
    """Runs blocks of calls on ``c`` workers; each call returns its latency in ms."""

    concurrency: int

    def block(self, call: Callable[[int], Any], per_worker: int) -> tuple[list[float], float,
                                                                          float]:
        """(latencies, wall s, CPU s) of ``per_worker`` calls on each worker."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the driver's resources."""


class _ThreadDriver(_Driver):
    """``execute`` on OS threads (c=1: the calling thread)."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.pool = ThreadPoolExecutor(concurrency) if concurrency > 1 else None

    def block(self, call: Callable[[int], Any], per_worker: int) -> tuple[list[float], float,
                                                                          float]:
        def worker(w: int) -> list[float]:
            return [call(w) for _ in range(per_worker)]

        c0, t0 = cpu_now(), time.perf_counter()
        if self.pool is None:
            lat = worker(0)
        else:
            futs = [self.pool.submit(worker, w) for w in range(self.concurrency)]
            lat = [x for f in futs for x in f.result()]
        return lat, time.perf_counter() - t0, cpu_now() - c0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


class _AsyncDriver(_Driver):
    """``aexecute`` as tasks on one event loop (run in a thread of its own)."""

    def __init__(self, concurrency: int, loop: asyncio.AbstractEventLoop) -> None:
        self.concurrency = concurrency
        self.loop = loop

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run a coroutine on the driver's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def block(self, call: Callable[[int], Any], per_worker: int) -> tuple[list[float], float,
                                                                          float]:
        async def worker(w: int) -> list[float]:
            return [await call(w) for _ in range(per_worker)]

        async def all_workers() -> tuple[list[float], float, float]:
            c0, t0 = cpu_now(), time.perf_counter()
            got = await asyncio.gather(*(worker(w) for w in range(self.concurrency)))
            return [x for g in got for x in g], time.perf_counter() - t0, cpu_now() - c0

        result: tuple[list[float], float, float] = self.run(all_workers())
        return result


# -- one scenario -----------------------------------------------------------------------------

@dataclass
class _Setup:
    url: str
    plan: Plan
    concurrency: int
    calls: int
    count_calls: int
    warmup: int


def _check(res: Any, plan: Plan) -> None:
    switched = plan.scenario == "failover"
    if res.route.id != plan.serving or res.switched != switched:
        raise BenchError(f"{plan.scenario} turn served by {res.route.id!r} "
                         f"(switched={res.switched}); the scenario expects {plan.serving!r}")


def _admit(led: Ledger, plan: Plan, n: int) -> list[Lease]:
    tag = uuid.uuid4().hex[:8]
    leases = []
    for w in range(n):
        run_id = f"bench-turn-{plan.scenario}-{tag}-{w}"
        led.admit_run(run_id, plan=plan.routes, budget=BUDGET, policy=plan.policy)
        leases.append(led.acquire_lease(run_id, ttl_s=LEASE_TTL_S))
    return leases


async def _aadmit(aled: AsyncLedger, plan: Plan, n: int) -> list[Lease]:
    tag = uuid.uuid4().hex[:8]
    leases = []
    for w in range(n):
        run_id = f"bench-turn-{plan.scenario}-{tag}-{w}"
        await aled.admit_run(run_id, plan=plan.routes, budget=BUDGET, policy=plan.policy)
        leases.append(await aled.acquire_lease(run_id, ttl_s=LEASE_TTL_S))
    return leases


def _measure(driver: _Driver, ledger_call: Callable[[int], Any], raw_call: Callable[[int], Any],
             s: _Setup) -> tuple[Samples, Samples]:
    """Warm up both, then alternate blocks of reference and ledger calls."""
    c = s.concurrency
    driver.block(raw_call, s.warmup)
    driver.block(ledger_call, s.warmup)
    led, raw = Samples(), Samples()
    per_worker_total = max(1, math.ceil(s.calls / c))
    done = 0
    while done < per_worker_total:
        k = min(BLOCK, per_worker_total - done)
        raw.add(*driver.block(raw_call, k))
        led.add(*driver.block(ledger_call, k))
        done += k
    return led, raw


def _row(backend: str, driver: str, s: _Setup, led: Samples, raw: Samples,
         count: TxCount | None, count_calls: int, floor_ms: float) -> TurnRow:
    p50, p95 = percentile(led.latencies, 0.5), percentile(led.latencies, 0.95)
    r50, r95 = percentile(raw.latencies, 0.5), percentile(raw.latencies, 0.95)
    target = None
    if s.concurrency == 1:
        target = (floor_ms + HEALTHY_TARGET_EXTRA_MS if s.plan.scenario == "healthy"
                  else 2 * floor_ms + FAILOVER_TARGET_EXTRA_MS)
    ledger_cpu = led.cpu_ms - raw.cpu_ms
    tx = count.per(count_calls) if count else None
    checks: dict[str, bool] = {}
    if target is not None:
        checks["overhead"] = p50 - r50 <= target
    if s.plan.scenario == "healthy" and s.concurrency == 1:
        checks["cpu"] = ledger_cpu <= CPU_TARGET_MS
    if tx is not None:
        checks["tx"] = tx <= TX_TARGET[s.plan.scenario]
    return TurnRow(
        backend=backend, driver=driver, scenario=s.plan.scenario, concurrency=s.concurrency,
        calls=led.calls, p50_ms=round(p50, 3), p95_ms=round(p95, 3), raw_p50_ms=round(r50, 3),
        raw_p95_ms=round(r95, 3), overhead_p50_ms=round(p50 - r50, 3),
        overhead_p95_ms=round(p95 - r95, 3), calls_per_s=round(led.per_s, 1),
        raw_calls_per_s=round(raw.per_s, 1),
        throughput_ratio=round(led.per_s / raw.per_s, 3) if raw.per_s else math.nan,
        cpu_ms=round(led.cpu_ms, 3), raw_cpu_ms=round(raw.cpu_ms, 3),
        ledger_cpu_ms=round(ledger_cpu, 3), tx_per_call=None if tx is None else round(tx, 2),
        tx_reads_per_call=(round(count.reads / count_calls, 2)
                           if count and count.reads is not None and tx is not None else None),
        tx_writes_per_call=(round(count.writes / count_calls, 2)
                            if count and count.writes is not None and tx is not None else None),
        tx_count_calls=count_calls if count else 0,
        tx_connections=count.connections if count else None,
        floor_two_commit_ms=round(floor_ms, 4), target_overhead_ms=None if target is None
        else round(target, 3), checks=checks,
    )


def _sync_scenario(backend: str, s: _Setup, counter: TxCounter | None, floor_ms: float
                   ) -> TurnRow:
    from ledger.adapters import StaticSecretProvider, SyncAdapter, sync_sender
    from ledger.api.turn import execute

    env = envelope()
    wires = wire_requests(s.plan, env)
    led = Ledger.open(s.url)
    adapter = SyncAdapter(secrets=StaticSecretProvider({}))
    raw_client = httpx.Client(transport=httpx.HTTPTransport(retries=0), timeout=30.0)
    driver = _ThreadDriver(s.concurrency)
    closed = False
    try:
        leases = _admit(led, s.plan, s.concurrency)
        send = sync_sender(adapter)
        turns = itertools.count()
        lock = threading.Lock()

        def ledger_call(w: int) -> float:
            with lock:
                turn = next(turns)
            t0 = time.perf_counter()
            res = execute(led, leases[w], env, send, turn_id=f"turn-{turn}")
            dt = (time.perf_counter() - t0) * 1000
            _check(res, s.plan)
            return dt

        def raw_call(_w: int) -> float:
            t0 = time.perf_counter()
            for url, headers, body, status in wires:
                resp = raw_client.post(url, json=body, headers=headers)
                resp.json()
                if resp.status_code != status:
                    raise BenchError(f"raw reference got HTTP {resp.status_code}, "
                                     f"expected {status}")
            return (time.perf_counter() - t0) * 1000

        ledger_s, raw_s = _measure(driver, ledger_call, raw_call, s)
        count = None
        n = max(1, math.ceil(s.count_calls / s.concurrency))
        if counter is not None:
            counter.start()
            driver.block(ledger_call, n)
            led.close()
            closed = True
            count = counter.finish()
        return _row(backend, "sync", s, ledger_s, raw_s, count, n * s.concurrency, floor_ms)
    finally:
        driver.close()
        raw_client.close()
        adapter.close()
        if not closed:
            led.close()


def _async_scenario(backend: str, s: _Setup, counter: TxCounter | None, floor_ms: float,
                    loop: asyncio.AbstractEventLoop) -> TurnRow:
    from ledger.adapters import HttpAdapter, StaticSecretProvider, async_sender
    from ledger.api.turn import aexecute

    env = envelope()
    wires = wire_requests(s.plan, env)
    driver = _AsyncDriver(s.concurrency, loop)

    async def open_all() -> tuple[AsyncLedger, HttpAdapter, httpx.AsyncClient]:
        return (await AsyncLedger.open(s.url), HttpAdapter(secrets=StaticSecretProvider({})),
                httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0), timeout=30.0))

    aled, adapter, raw_client = driver.run(open_all())
    closed = False
    try:
        leases: list[Lease] = driver.run(_aadmit(aled, s.plan, s.concurrency))
        send = async_sender(adapter)
        turns = itertools.count()

        async def ledger_call(w: int) -> float:
            t0 = time.perf_counter()
            res = await aexecute(aled, leases[w], env, send, turn_id=f"turn-{next(turns)}")
            dt = (time.perf_counter() - t0) * 1000
            _check(res, s.plan)
            return dt

        async def raw_call(_w: int) -> float:
            t0 = time.perf_counter()
            for url, headers, body, status in wires:
                resp = await raw_client.post(url, json=body, headers=headers)
                resp.json()
                if resp.status_code != status:
                    raise BenchError(f"raw reference got HTTP {resp.status_code}, "
                                     f"expected {status}")
            return (time.perf_counter() - t0) * 1000

        ledger_s, raw_s = _measure(driver, ledger_call, raw_call, s)
        count = None
        n = max(1, math.ceil(s.count_calls / s.concurrency))
        if counter is not None:
            counter.start()
            driver.block(ledger_call, n)
            driver.run(aled.close())
            closed = True
            count = counter.finish()
        return _row(backend, "async", s, ledger_s, raw_s, count, n * s.concurrency, floor_ms)
    finally:
        async def close_all() -> None:
            await raw_client.aclose()
            await adapter.aclose()
            if not closed:
                await aled.close()

        driver.run(close_all())


class EventLoopThread:
    """An event loop running in a thread of its own, for the async driver."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-loop",
                                       daemon=True)

    def __enter__(self) -> asyncio.AbstractEventLoop:
        self.thread.start()
        return self.loop

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def bench_database(url: str, backend: str, fake: FakeServer, *,
                   drivers: Sequence[str] = DRIVERS, scenarios: Sequence[str] = SCENARIOS,
                   concurrency: Sequence[int] = DEFAULT_CONCURRENCY, calls: int = DEFAULT_CALLS,
                   count_calls: int = DEFAULT_COUNT_CALLS, warmup: int = DEFAULT_WARMUP,
                   count_tx: bool = True, floor_attempts: int = 300,
                   progress: Progress = quiet) -> tuple[list[TurnRow], float]:
    """Every (driver, scenario, concurrency) on one database; returns the rows and the floor's
    two-commit time (ms, median, c=1)."""
    from benchmarks.write import floor_two_commit_ms

    Ledger.open(url).close()  # migrate before the counter sees anything
    progress(f"bench turn: {backend}: the floor's two-commit time")
    floor_ms = floor_two_commit_ms(url, attempts=floor_attempts)
    all_plans = plans(fake)
    rows: list[TurnRow] = []
    with counting(backend, url, enabled=count_tx) as counter, EventLoopThread() as loop:
        for driver in drivers:
            for scenario in scenarios:
                for c in concurrency:
                    progress(f"bench turn: {backend}: {driver} {scenario} c={c}")
                    s = _Setup(url, all_plans[scenario], c, calls, count_calls, warmup)
                    if driver == "async":
                        rows.append(_async_scenario(backend, s, counter, floor_ms, loop))
                    else:
                        rows.append(_sync_scenario(backend, s, counter, floor_ms))
    return rows, floor_ms


def new_report() -> Report:
    """An empty ``turn`` report with its columns, targets and notes."""
    return Report(
        bench="turn", columns=COLUMNS,
        targets={
            "overhead": f"p50, c=1: healthy <= floor two-commit + {HEALTHY_TARGET_EXTRA_MS} ms; "
                        f"failover <= four commits + {FAILOVER_TARGET_EXTRA_MS} ms",
            "cpu": f"ledger CPU (CPU ms - raw CPU) <= {CPU_TARGET_MS} ms per healthy call",
            "tx": "transactions per call <= 3 healthy (1 read + 2 writes), <= 6 failover",
            "throughput": "c=16 healthy calls/s at least twice LiteLLM Router's, measured in "
                          "the same run against the same fake endpoint (when litellm is "
                          "installed; see the notes)",
        },
        notes=["ovh = ledger latency - raw httpx latency (same body, same fake endpoint, same "
               "run, alternating blocks); raw for failover = the 503 call + the 200 call",
               "CPU ms = this process's CPU per call (ledger + adapter + httpx; the fake provider "
               "runs in another process); ledger CPU = CPU ms - raw CPU",
               "aexecute: c async tasks on one event loop; execute: c OS threads; each worker "
               "drives its own Run",
               "tx/call counted in a separate pass after the timed one (SQLite: reads+writes); "
               "conns = database connections opened during that pass; aexecute on SQLite at "
               "c>1: the transactions queued together on the database's thread commit as one "
               "(group commit) and count once"],
    )


def _against_litellm(report: Report, fake: FakeServer, c: int, calls: int, warmup: int,
                     progress: Progress) -> None:
    """LiteLLM Router's calls/s at ``c`` in this run, and each healthy async row's ratio."""
    from benchmarks import litellm_ref

    if not litellm_ref.available():
        report.notes.append("LiteLLM Router not measured: litellm is not installed "
                            "(pip install litellm)")
        return
    progress(f"bench turn: LiteLLM Router, c={c}")
    with EventLoopThread() as loop:
        ref = litellm_ref.measure(fake.endpoint("openai"), OK_MODEL, QUESTION,
                                  concurrency=c, calls=calls, warmup=warmup, loop=loop)
    assert ref is not None
    report.extra["litellm"] = ref
    for row in report.rows:
        if (isinstance(row, TurnRow) and row.driver == "async" and row.scenario == "healthy"
                and row.concurrency == c):
            ratio = row.calls_per_s / ref.calls_per_s
            row.checks["throughput"] = ratio >= 2
            report.notes.append(
                f"{row.backend}: aexecute healthy c={c} {row.calls_per_s:.1f} calls/s = "
                f"{ratio:.2f}x LiteLLM Router's {ref.calls_per_s:.1f} (litellm {ref.version}, "
                f"{ref.cpu_ms:.2f} CPU ms per call; target >= 2x)")


def run(url_targets: Sequence[tuple[str, str]], *, drivers: Sequence[str] = DRIVERS,
        scenarios: Sequence[str] = SCENARIOS, concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
        calls: int = DEFAULT_CALLS, count_calls: int = DEFAULT_COUNT_CALLS,
        warmup: int = DEFAULT_WARMUP, count_tx: bool = True, floor_attempts: int = 300,
        litellm: bool = True, progress: Progress = quiet) -> Report:
    """The whole ``turn`` benchmark over ``(backend, url)`` targets (and LiteLLM Router's
    throughput beside the healthy async rows, when it is installed and ``litellm``)."""
    probe = MachineProbe()
    report = new_report()
    floors: dict[str, float] = {}
    with FakeServer(FAKE_DEFAULTS) as fake:
        for backend, url in url_targets:
            rows, floor_ms = bench_database(
                url, backend, fake, drivers=drivers, scenarios=scenarios,
                concurrency=concurrency, calls=calls, count_calls=count_calls, warmup=warmup,
                count_tx=count_tx, floor_attempts=floor_attempts, progress=progress)
            report.rows.extend(rows)
            floors[backend] = round(floor_ms, 4)
        if litellm and "healthy" in scenarios and "async" in drivers:
            _against_litellm(report, fake, max(concurrency), calls, warmup, progress)
    report.extra["floor_two_commit_ms"] = floors
    report.notes.append("floor two-commit time (ms, p50, c=1): "
                        + ", ".join(f"{b} {v:.3f}" for b, v in floors.items()))
    report.machine = probe.done()
    return report


__all__ = [
    "DEFAULT_CALLS",
    "DEFAULT_CONCURRENCY",
    "DRIVERS",
    "SCENARIOS",
    "TurnRow",
    "bench_database",
    "envelope",
    "failover_policy",
    "new_report",
    "plans",
    "run",
    "wire_requests",
]
