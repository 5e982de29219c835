"""``python -m benchmarks queue``: a long queue on one capacity group.

One :class:`~ledger.AsyncLedger`, ``sessions`` Run sessions open at once, each serving ``turns``
turns in a row through one route whose capacity group admits ``limit`` calls at a time; the
send answers after ``delay_ms`` (an in-process fake: ``asyncio.sleep``, then a fixed answer, so
the client CPU measured is the ledger's, not an HTTP stack's). Every session queues behind the
others: the group is a first come, first served queue (:mod:`ledger.storage.wake`).

Reported per backend, for the turns only (every session is open before the clock starts):

* wall time, and the **floor**: ``delay x sessions x turns / limit``, what the group's limit
  allows at best; their ratio;
* **begin transactions per turn**, counted at the driver (every transaction the store's
  driver runs, by the name of its flow: ``begin_tx``), and every hot-path transaction per
  turn. A turn that queues usually makes three begins: one that queues, one that registers
  for wake-ups and the one admitted (two when a slot came free before it registered); each
  wake-up or poll that is not admitted adds one;
* client CPU per turn (``time.process_time`` of this process: the ledger alone, the fake
  send costs next to nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from benchmarks import defaults
from benchmarks.common import Column, MachineProbe, Progress, Report, cpu_now, fmt, quiet
from ledger.api.facade import AsyncLedger
from ledger.api.face import storage_of
from ledger.api.turn import Dispatch, SendResult
from ledger.domain.envelope import Envelope, Part
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.policy.load import preset
from ledger.policy.model import Policy

DEFAULT_SESSIONS = defaults.QUEUE_SESSIONS
DEFAULT_TURNS = defaults.QUEUE_TURNS
DEFAULT_LIMIT = defaults.QUEUE_LIMIT
DEFAULT_DELAY_MS = defaults.QUEUE_DELAY_MS
GROUP = "bench-queue"
#: No turn gives up waiting: the benchmark measures the queue, not its bound.
PATIENCE_S = 3600.0
LEASE_TTL_S = 3600.0
BUDGET = Budget(max_calls=1_000_000, max_retries=1_000_000, max_cost=Decimal(1_000_000))
GRANT = Grant(recipients={"fake": ["user_input"]})


@dataclass(frozen=True)
class QueueRow:
    """One backend's measurement."""

    backend: str
    sessions: int
    turns: int
    limit: int
    delay_ms: float
    served: int
    queued: int
    wall_s: float
    floor_s: float
    x_floor: float
    begins: int
    begins_per_turn: float
    tx_per_turn: float
    cpu_ms_per_turn: float


COLUMNS = (
    Column("backend", lambda r: r.backend, left=True),
    Column("sessions", lambda r: str(r.sessions)),
    Column("turns", lambda r: str(r.turns)),
    Column("limit", lambda r: str(r.limit)),
    Column("delay ms", lambda r: fmt(r.delay_ms, 0)),
    Column("queued", lambda r: str(r.queued)),
    Column("wall s", lambda r: fmt(r.wall_s, 2)),
    Column("floor s", lambda r: fmt(r.floor_s, 2)),
    Column("x floor", lambda r: fmt(r.x_floor, 2)),
    Column("begins", lambda r: str(r.begins)),
    Column("begins/turn", lambda r: fmt(r.begins_per_turn, 2)),
    Column("tx/turn", lambda r: fmt(r.tx_per_turn, 2)),
    Column("CPU ms/turn", lambda r: fmt(r.cpu_ms_per_turn, 2)),
)


class CountingDriver:
    """The store's driver, counting the transactions it runs by the name of their flow
    (``begin_tx``, ``settle_tx``, ...): what the ledger asked of the database, however the
    driver batches them (SQLite's group commit)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()

    def _count(self, tx: Any) -> None:
        self.counts[getattr(tx, "__name__", "?")] += 1

    def run(self, tx: Any, *, write: bool, again: Any = None) -> Any:
        self._count(tx)
        return self.inner.run(tx, write=write, again=again)

    async def arun(self, tx: Any, *, write: bool, again: Any = None) -> Any:
        self._count(tx)
        return await self.inner.arun(tx, write=write, again=again)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _policy() -> Policy:
    base = preset("failure-domain")
    return base.model_copy(update={"admission": base.admission.model_copy(
        update={"max_capacity_wait_s": PATIENCE_S})})


def _route() -> Route:
    # Never called over the network: the benchmark's send answers in process.
    return Route(id="bench-queue", provider="fake", model="bench-ok", group=GROUP,
                 recipient="fake", endpoint="http://127.0.0.1:9/v1",
                 price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2)))


def _send(delay_s: float) -> Any:
    async def send(_d: Dispatch) -> SendResult:
        await asyncio.sleep(delay_s)
        return SendResult(ok=True, output="ok", prompt_tokens=10, completion_tokens=5,
                          cost=Decimal("0.00001"), model_reported="bench-ok")

    return send


async def _measure(url: str, backend: str, *, sessions: int, turns: int, limit: int,
                   delay_ms: float, progress: Progress) -> QueueRow:
    route, policy, send = _route(), _policy(), _send(delay_ms / 1000.0)
    tag = uuid.uuid4().hex[:8]
    queued = 0

    def on_notice(n: Any) -> None:
        nonlocal queued
        if n.kind == "queued":
            queued += 1

    async with AsyncLedger.open(url) as led:
        await led.configure_group(GROUP, max_in_flight=limit)
        store = storage_of(led)
        counting = CountingDriver(store.runner.driver)
        async with contextlib.AsyncExitStack() as stack:
            progress(f"bench queue: {backend}: opening {sessions} sessions")
            runs = [await stack.enter_async_context(led.run(
                f"bench-queue-{tag}-{i}", plan=[route], budget=BUDGET, grant=GRANT, policy=policy,
                lease_ttl_s=LEASE_TTL_S)) for i in range(sessions)]

            async def serve(i: int) -> int:
                for k in range(turns):
                    await runs[i].turn(Envelope(parts=[Part(content=f"turn {k} of {i}")]),
                                       send=send, turn_id=f"t{k}", on_notice=on_notice)
                return turns

            progress(f"bench queue: {backend}: {sessions} sessions x {turns} turns, "
                     f"limit {limit}")
            store.runner.driver = counting
            try:
                c0, t0 = cpu_now(), time.perf_counter()
                served = sum(await asyncio.gather(*(serve(i) for i in range(sessions))))
                wall, cpu = time.perf_counter() - t0, cpu_now() - c0
            finally:
                store.runner.driver = counting.inner
    n = sessions * turns
    floor = delay_ms / 1000.0 * n / limit
    begins = counting.counts["begin_tx"]
    return QueueRow(
        backend=backend, sessions=sessions, turns=turns, limit=limit, delay_ms=delay_ms,
        served=served, queued=queued, wall_s=round(wall, 6), floor_s=round(floor, 6),
        x_floor=round(wall / floor, 2) if floor > 0 else math.nan, begins=begins,
        begins_per_turn=round(begins / n, 2),
        tx_per_turn=round(sum(counting.counts.values()) / n, 2),
        cpu_ms_per_turn=round(cpu / n * 1000, 3))


def new_report() -> Report:
    """An empty ``queue`` report with its columns and notes."""
    return Report(
        bench="queue", columns=COLUMNS,
        notes=["one AsyncLedger; every session open before the clock starts; each serves its "
               "turns in a row; the send answers after the delay, in process",
               "floor = delay x sessions x turns / limit; queued = turns that waited",
               "begins/turn and tx/turn: transactions the store's driver ran during the turns, "
               "by flow (a queued turn makes 3 begins: queued, registered, admitted; 2 if a slot "
               "came free before it registered)",
               "CPU ms/turn = this process's CPU (time.process_time) per turn"])


def run(url_targets: Sequence[tuple[str, str]], *, sessions: int = DEFAULT_SESSIONS,
        turns: int = DEFAULT_TURNS, limit: int = DEFAULT_LIMIT,
        delay_ms: float = DEFAULT_DELAY_MS, progress: Progress = quiet) -> Report:
    """The ``queue`` benchmark over ``(backend, url)`` targets."""
    probe = MachineProbe()
    report = new_report()
    for backend, url in url_targets:
        report.rows.append(asyncio.run(_measure(
            url, backend, sessions=sessions, turns=turns, limit=limit, delay_ms=delay_ms,
            progress=progress)))
    report.machine = probe.done()
    return report


__all__ = ["CountingDriver", "QueueRow", "new_report", "run"]
