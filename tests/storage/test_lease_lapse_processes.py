"""Invariants 3 and 8 across OS processes: workers paused past their lease (SIGSTOP/SIGCONT)
start nothing when they wake, and a capacity group's limit is never exceeded.

Time is a :class:`~ledger.testing.SharedClock` the test moves; the workers never renew, so
their leases lapse while they are stopped (and, often, while they work). Afterwards the ledger's
own records are replayed: every Attempt was begun under a live lease, and the Attempts counted
against the group (from begin until settle or until their lease ended) never overlap beyond
the limit.

That is what invariant 8 promises as the ledger records it: a slot counts from the begin's
``created_at`` until its settle or the end of its lease, whichever comes first (a lapsed
lease's slot stops counting at once: docs/operations.md). A begin's ``created_at`` is read
after its slot is taken, so a begin paused between its count and its claim (a SIGSTOP or the
scheduler landing there) is recorded after the settle that freed its slot, never beside it
(``test_group_ceiling``'s ``..._recorded_at_its_slot_...`` pins that interleaving). On a
failure the overlapping Attempts are printed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ledger.api.facade import Ledger
from ledger.domain.records import AttemptState
from ledger.testing.clock import SharedClock

from .helpers import budget, collect, routes, spawn

WORKERS = 4
ATTEMPTS = 25
TTL = 3.0
MARGIN = 1.0
STEP = 0.02  # clock seconds per tick of the test's loop


def _signal(proc: subprocess.Popen[str], sig: int) -> bool:
    """Signal a worker that may just have finished (then there is nobody to pause)."""
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def _leases(log: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in log.read_text().splitlines():
        item = json.loads(line)
        out[item["fence"]] = max(out.get(item["fence"], 0.0), item["expires_at"])
    return out


@pytest.mark.slow
def test_invariant8_group_limit_holds_while_workers_pause_past_their_lease(
        db_url: str, tmp_path: Path) -> None:
    clock = SharedClock(tmp_path / "clock", start=1_700_000_000.0)
    with Ledger.open(db_url, clock=clock) as led:
        for i in range(WORKERS):
            led.admit_run(f"w{i}", plan=routes(), budget=budget(calls=1000, retries=10))
        led.configure_group("g", max_in_flight=1)
    logs = [tmp_path / f"w{i}.log" for i in range(WORKERS)]
    procs = [spawn("lapse", db_url, clock.path, f"w{i}", logs[i], ATTEMPTS, TTL, MARGIN)
             for i in range(WORKERS)]
    rng = random.Random(11)
    paused: tuple[int, float] | None = None
    pauses = 0
    started = time.monotonic()
    try:
        tick = 0
        while any(p.poll() is None for p in procs):
            assert time.monotonic() - started < 240, "workers did not finish"
            clock.advance(STEP)
            tick += 1
            if paused is None and tick % 40 == 0:
                alive = [i for i, p in enumerate(procs) if p.poll() is None]
                victim = rng.choice(alive)
                if _signal(procs[victim], signal.SIGSTOP):
                    paused = (victim, clock.now() + TTL + 1.0)  # past its lease
                    pauses += 1
            elif paused is not None and clock.now() >= paused[1]:
                _signal(procs[paused[0]], signal.SIGCONT)
                paused = None
            # Let the workers run between ticks; the ledger's time is the shared clock.
            time.sleep(0.002)
    finally:
        if paused is not None:
            _signal(procs[paused[0]], signal.SIGCONT)
    results = collect(procs)
    assert pauses >= 3
    assert sum(r["lapsed"] for r in results) > 0  # leases did lapse, and were refused

    limit = 1
    intervals: list[tuple[float, float, str]] = []
    with Ledger.open(db_url, clock=clock) as led:
        for i in range(WORKERS):
            expiry = _leases(logs[i])
            for att in led.timeline(f"w{i}"):
                if att.state is AttemptState.REJECTED:
                    continue
                ends = expiry[att.fence]
                # Begun under a live lease: before its end (invariant 3).
                assert att.created_at < ends, (att.attempt_id, att.created_at, ends)
                assert att.state is AttemptState.SUCCEEDED and att.settled_at is not None
                intervals.append((att.created_at, min(att.settled_at, ends),
                                  f"{att.attempt_id} of w{i} (fence {att.fence}): begun "
                                  f"{att.created_at:.3f}, settled {att.settled_at:.3f}, "
                                  f"lease ended {ends:.3f}"))
    points = sorted([(a, 1) for a, _, _ in intervals] + [(b, -1) for _, b, _ in intervals],
                    key=lambda p: (p[0], p[1]))
    live = peak = 0
    for _t, delta in points:
        live += delta
        peak = max(peak, live)
    intervals.sort()
    overlaps = [f"{x[2]}\n  and {y[2]}" for j, x in enumerate(intervals)
                for y in intervals[j + 1:] if y[0] < x[1]]
    assert peak <= limit, "counted in flight at once:\n" + "\n".join(overlaps)
    assert len(intervals) == WORKERS * ATTEMPTS
