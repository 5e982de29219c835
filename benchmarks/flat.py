"""``python -m benchmarks turns-flat``: does a turn cost more when the Run is longer?

One Run, ``turns`` sequential healthy turns (default 1,000) through ``aexecute`` (or ``execute``)
and the shipped adapter against the local fake provider. The envelopes grow like a
conversation: turn *k* carries the user's questions 1..k and every earlier answer as a
``model_derived`` part with its provenance (:func:`ledger.adapters.output_part`: the Attempt
that produced it), so the grant, the disclosure check and the ledger's provenance lookups see
the whole history, as they would in a long research task.

Reported: mean latency and client CPU of turns 1..W and of the last W turns (W = 20), their
ratio, and beside each window a raw httpx call of the same request body right after each turn
(not inside its timing), so growth that comes from the larger request itself (encoding, the
fake's parsing, the network) is separated from the ledger's. Database transactions per turn are
counted over both windows (see :mod:`benchmarks.txcount`); on PostgreSQL the ledger is
closed after each counted window and reopened, which the counter needs to read the server's
statistics, and which no measured turn sees.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
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
    mean,
    percentile,
    quiet,
)
from benchmarks.fake import FakeServer
from benchmarks.turn import FAKE_DEFAULTS, EventLoopThread, plans
from benchmarks.txcount import TxCount, TxCounter, counting
from ledger.api.facade import AsyncLedger, Ledger
from ledger.domain.envelope import MODEL_DERIVED, USER_INPUT, Envelope, Part
from ledger.domain.values import Budget, Grant

DEFAULT_TURNS = defaults.FLAT_TURNS
DEFAULT_WINDOW = defaults.FLAT_WINDOW
FLAT_TOLERANCE = 1.25  # this bench's reading of "flat": last window <= 1.25 x the first


@dataclass(frozen=True)
class FlatRow:
    """One Run of ``turns`` turns on one backend."""

    backend: str
    driver: str
    turns: int
    window: int
    turn1_ms: float
    first_mean_ms: float
    last_mean_ms: float
    ratio: float
    first_p50_ms: float
    last_p50_ms: float
    raw_first_mean_ms: float
    raw_last_mean_ms: float
    raw_first_p50_ms: float
    raw_last_p50_ms: float
    overhead_first_ms: float
    overhead_last_ms: float
    overhead_ratio: float
    cpu_first_ms: float
    cpu_last_ms: float
    tx_first: float | None
    tx_last: float | None
    hash_first_ms: float
    hash_last_ms: float
    last_parts: int
    last_body_bytes: int
    flat: bool


COLUMNS = (
    Column("backend", lambda r: r.backend, left=True),
    Column("driver", lambda r: "aexecute" if r.driver == "async" else "execute", left=True),
    Column("turns", lambda r: str(r.turns)),
    Column("turn 1 ms", lambda r: fmt(r.turn1_ms, 1)),
    Column("mean first", lambda r: fmt(r.first_mean_ms, 2)),
    Column("mean last", lambda r: fmt(r.last_mean_ms, 2)),
    Column("ratio", lambda r: fmt(r.ratio, 2)),
    Column("p50 first", lambda r: fmt(r.first_p50_ms, 2)),
    Column("p50 last", lambda r: fmt(r.last_p50_ms, 2)),
    Column("ovh first", lambda r: fmt(r.overhead_first_ms, 2)),
    Column("ovh last", lambda r: fmt(r.overhead_last_ms, 2)),
    Column("ovh ratio", lambda r: fmt(r.overhead_ratio, 2)),
    Column("CPU first", lambda r: fmt(r.cpu_first_ms, 2)),
    Column("CPU last", lambda r: fmt(r.cpu_last_ms, 2)),
    Column("tx first", lambda r: fmt(r.tx_first, 2)),
    Column("tx last", lambda r: fmt(r.tx_last, 2)),
    Column("hash first", lambda r: fmt(r.hash_first_ms, 2)),
    Column("hash last", lambda r: fmt(r.hash_last_ms, 2)),
    Column("parts", lambda r: str(r.last_parts)),
    Column("", lambda r: "flat" if r.flat else "grows", left=True),
)


def question(k: int) -> Part:
    """The user's question of turn ``k``."""
    return Part(content=f"Turn {k}: given everything so far, what should we check next, and "
                        "which source supports it?", data_class=USER_INPUT)


@dataclass
class _Window:
    lat: list[float]
    cpu: list[float]
    raw_lat: list[float]
    raw_cpu: list[float]
    hash_ms: list[float]
    tx: TxCount | None = None


def _new_window() -> _Window:
    return _Window([], [], [], [], [])


async def _drive(url: str, backend: str, fake: FakeServer, turns: int, window: int,
                 driver: str, counter: TxCounter | None, progress: Progress
                 ) -> tuple[_Window, _Window, int, int]:
    from ledger.adapters import (
        HttpAdapter,
        StaticSecretProvider,
        SyncAdapter,
        async_sender,
        codec_for,
        output_part,
        sync_sender,
    )
    from ledger.api.turn import aexecute, execute

    route = plans(fake)["healthy"].routes[0]
    codec = codec_for(route.protocol)
    run_id = f"bench-flat-{uuid.uuid4().hex[:8]}"
    grant = Grant(recipients={route.recipient: [USER_INPUT, MODEL_DERIVED]})
    budget = Budget(max_calls=turns + 10, max_retries=10, max_cost=Decimal(1_000_000))
    with Ledger.open(url) as setup:
        setup.admit_run(run_id, plan=[route], budget=budget, grant=grant)
        lease = setup.acquire_lease(run_id, ttl_s=24 * 3600.0)
    raw_async = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(retries=0), timeout=60.0)
    raw_sync = httpx.Client(transport=httpx.HTTPTransport(retries=0), timeout=60.0)
    adapter = HttpAdapter(secrets=StaticSecretProvider({}))
    sadapter = SyncAdapter(secrets=StaticSecretProvider({})) if driver == "sync" else None
    aled: AsyncLedger | None = None
    sled: Ledger | None = None

    async def open_ledger() -> None:
        nonlocal aled, sled
        if driver == "async":
            aled = await AsyncLedger.open(url)
        else:
            sled = await asyncio.to_thread(Ledger.open, url)

    async def close_ledger() -> None:
        nonlocal aled, sled
        if aled is not None:
            await aled.close()
            aled = None
        if sled is not None:
            sled.close()
            sled = None

    asend = async_sender(adapter)
    ssend = sync_sender(sadapter) if sadapter is not None else None

    async def one_turn(env: Envelope, k: int) -> Any:
        if aled is not None:
            return await aexecute(aled, lease, env, asend, turn_id=f"turn-{k}")
        assert sled is not None and ssend is not None
        return execute(sled, lease, env, ssend, turn_id=f"turn-{k}")

    async def raw(env: Envelope) -> None:
        w = codec.build_request(route, env)
        if driver == "async":
            resp = await raw_async.post(w.url, json=w.body, headers=w.headers)
        else:
            resp = raw_sync.post(w.url, json=w.body, headers=w.headers)
        resp.json()
        if resp.status_code != 200:
            raise BenchError(f"raw reference got HTTP {resp.status_code}")

    first, last = _new_window(), _new_window()
    history: list[Part] = []
    body_bytes = 0
    parts = 0
    try:
        await open_ledger()
        for k in range(1, turns + 1):
            win = first if k <= window else last if k > turns - window else None
            if counter is not None and k in (1, turns - window + 1):
                counter.start()
            env = Envelope(parts=[*history, question(k)], max_output_tokens=256)
            c0, t0 = cpu_now(), time.perf_counter()
            res = await one_turn(env, k)
            dt, dc = (time.perf_counter() - t0) * 1000, (cpu_now() - c0) * 1000
            if res.route.id != route.id:
                raise BenchError(f"turn {k} was served by {res.route.id!r}")
            if win is not None:
                win.lat.append(dt)
                win.cpu.append(dc)
                c0, t0 = cpu_now(), time.perf_counter()
                await raw(env)
                win.raw_lat.append((time.perf_counter() - t0) * 1000)
                win.raw_cpu.append((cpu_now() - c0) * 1000)
                # One hash of the whole envelope, which every Attempt records: pure CPU that
                # grows with the envelope, shown apart from the ledger's other costs.
                t0 = time.perf_counter()
                _ = env.hash
                win.hash_ms.append((time.perf_counter() - t0) * 1000)
            if counter is not None and k in (window, turns):
                await close_ledger()
                (first if k == window else last).tx = counter.finish()
                if k != turns:
                    await open_ledger()
            history += [question(k), output_part(res.output, res.attempt.attempt_id)]
            if k == turns:
                parts = len(env.parts)
                body_bytes = len(json.dumps(codec.build_request(route, env).body))
            if k % 100 == 0:
                progress(f"bench turns-flat: {backend}: turn {k}/{turns}")
    finally:
        await close_ledger()
        await raw_async.aclose()
        raw_sync.close()
        await adapter.aclose()
        if sadapter is not None:
            sadapter.close()
    return first, last, parts, body_bytes


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def bench_database(url: str, backend: str, fake: FakeServer, *, turns: int = DEFAULT_TURNS,
                   window: int = DEFAULT_WINDOW, driver: str = "async", count_tx: bool = True,
                   progress: Progress = quiet) -> FlatRow:
    """One Run of ``turns`` turns on one database."""
    if window < 1 or turns < 2 * window:
        raise BenchError(f"need turns >= 2 x window (turns {turns}, window {window})")
    Ledger.open(url).close()  # migrate before the counter sees anything
    with counting(backend, url, enabled=count_tx) as counter, EventLoopThread() as loop:
        coro = _drive(url, backend, fake, turns, window, driver, counter, progress)
        got: tuple[_Window, _Window, int, int] = asyncio.run_coroutine_threadsafe(
            coro, loop).result()
    first, last, parts, body = got
    m1, m2 = mean(first.lat), mean(last.lat)
    r1, r2 = mean(first.raw_lat), mean(last.raw_lat)
    # The overhead compares medians: turn 1 (a cold ledger) would dominate a mean of 20 turns.
    o1 = percentile(first.lat, 0.5) - percentile(first.raw_lat, 0.5)
    o2 = percentile(last.lat, 0.5) - percentile(last.raw_lat, 0.5)

    def tx(w: _Window) -> float | None:
        return w.tx.per(window) if w.tx is not None else None

    return FlatRow(
        backend=backend, driver=driver, turns=turns, window=window,
        turn1_ms=round(first.lat[0], 3), first_mean_ms=round(m1, 3), last_mean_ms=round(m2, 3),
        ratio=round(_ratio(m2, m1), 3), first_p50_ms=round(percentile(first.lat, 0.5), 3),
        last_p50_ms=round(percentile(last.lat, 0.5), 3), raw_first_mean_ms=round(r1, 3),
        raw_last_mean_ms=round(r2, 3),
        raw_first_p50_ms=round(percentile(first.raw_lat, 0.5), 3),
        raw_last_p50_ms=round(percentile(last.raw_lat, 0.5), 3), overhead_first_ms=round(o1, 3),
        overhead_last_ms=round(o2, 3), overhead_ratio=round(_ratio(o2, o1), 3),
        cpu_first_ms=round(mean(first.cpu), 3), cpu_last_ms=round(mean(last.cpu), 3),
        tx_first=None if tx(first) is None else round(tx(first) or 0.0, 2),
        tx_last=None if tx(last) is None else round(tx(last) or 0.0, 2),
        hash_first_ms=round(percentile(first.hash_ms, 0.5), 3),
        hash_last_ms=round(percentile(last.hash_ms, 0.5), 3),
        last_parts=parts, last_body_bytes=body, flat=_ratio(o2, o1) <= FLAT_TOLERANCE,
    )


def new_report(window: int = DEFAULT_WINDOW) -> Report:
    """An empty ``turns-flat`` report."""
    return Report(
        bench="turns-flat", columns=COLUMNS,
        targets={"flat": "a turn's cost is flat over a Run of 1,000 turns (issue 13); this "
                         f"bench calls it flat when ovh last <= {FLAT_TOLERANCE} x ovh first "
                         "(the issue gives no number)"},
        notes=[f"first W / last W = mean latency of turns 1..{window} and of the last {window} "
               "turns; raw = a bare httpx call of the same body right after each of those "
               "turns; tx = transactions per turn in each window; hash = one Envelope.hash of "
               "that turn's envelope (p50, ms, timed apart), which every Attempt records; "
               "parts = envelope parts at the last turn",
               "turn 1 includes the cold start of a freshly opened ledger, which weighs on the "
               "first window's mean; ovh = p50 ledger - p50 raw per window, so the verdict "
               "does not hinge on that one turn; CPU = mean client CPU per turn"],
    )


def run(url_targets: Sequence[tuple[str, str]], *, turns: int = DEFAULT_TURNS,
        window: int = DEFAULT_WINDOW, drivers: Sequence[str] = ("async",),
        count_tx: bool = True, progress: Progress = quiet) -> Report:
    """The whole ``turns-flat`` benchmark over ``(backend, url)`` targets."""
    probe = MachineProbe()
    report = new_report(window)
    with FakeServer(FAKE_DEFAULTS) as fake:
        for backend, url in url_targets:
            for driver in drivers:
                progress(f"bench turns-flat: {backend}: {driver}, {turns} turns")
                report.rows.append(bench_database(url, backend, fake, turns=turns,
                                                  window=window, driver=driver,
                                                  count_tx=count_tx, progress=progress))
    report.machine = probe.done()
    return report

__all__ = ["DEFAULT_TURNS", "DEFAULT_WINDOW", "FlatRow", "bench_database", "new_report", "run"]
