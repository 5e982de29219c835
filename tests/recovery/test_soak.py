"""Soak: several worker processes run many Runs through the retry owner against one PostgreSQL,
with random provider faults, random SIGKILLs (signals and armed fault points), and periodic
recovery; then a reconciliation over the whole ledger.

The short form (~25 s) always runs; the full form (a few minutes) runs with ``pytest --soak``.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

from ledger.api.facade import Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState
from ledger.faults import KNOWN_POINTS
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import recover
from tests.recovery._workers import GROUPS
from tests.recovery.helpers import duplicates, sent, spawn

pytestmark = pytest.mark.postgres

TTL_S = 4
POINTS = [p for p in KNOWN_POINTS if not p.startswith("recover.")]


def soak(url: str, tmp: Path, *, seconds: float, workers: int, seed: int) -> dict[str, int]:
    rnd = random.Random(seed)
    led = Ledger.open(url)
    for i in range(GROUPS):  # small limits, so capacity refusals happen too
        led.configure_group(f"g{i}", max_in_flight=1)
        led.configure_group(f"h{i}", max_in_flight=2)
    log = tmp / "sent.log"
    end = time.monotonic() + seconds
    kills = armed_kills = recoveries = spawned = 0

    def start(i: int) -> subprocess.Popen[str]:
        nonlocal spawned, armed_kills
        spawned += 1
        left = max(1, int(end - time.monotonic()))
        fault = None
        if rnd.random() < 0.4:
            fault = f"{rnd.choice(POINTS)}@{rnd.randint(2, 40)}"
            armed_kills += 1
        return spawn("owner_soak", url, f"w{i}s{spawned}", left, log, rnd.randint(0, 2**31), TTL_S,
                     faults=fault)

    procs = {i: start(i) for i in range(workers)}
    next_kill = time.monotonic() + rnd.uniform(1, 3)
    next_recover = time.monotonic() + 1
    while time.monotonic() < end:
        time.sleep(0.2)  # the soak's wall-clock pacing; the workers' progress is real
        now = time.monotonic()
        for i, p in list(procs.items()):
            if p.poll() is not None:
                assert p.returncode in (0, -9), p.stderr.read() if p.stderr else ""
                if now < end - 1:
                    procs[i] = start(i)
        if now >= next_kill:
            victim = procs[rnd.choice(list(procs))]
            if victim.poll() is None:
                victim.send_signal(signal.SIGKILL)
                kills += 1
            next_kill = now + rnd.uniform(1, 3)
        if now >= next_recover:
            recoveries += len(recover(led, release=True).runs)
            next_recover = now + 1.5
    for p in procs.values():
        _out, err = p.communicate(timeout=120)
        assert p.returncode in (0, -9), err[-3000:]
    # Everything still leased belongs to a dead worker now: recover it all.
    late = Ledger.open(url, clock=ManualClock(time.time() + TTL_S + 1))
    recoveries += len(recover(late, release=True).runs)
    late.close()

    res = reconcile(led)
    violations = list(res.violations)
    lines = sent(log)
    violations += [f"sent twice: {a}" for a in duplicates([a for _r, _t, a in lines])]
    sent_ids = {a for _r, _t, a in lines}
    attempts = {}
    cursor = None
    while True:
        page = led.attempts(limit=10_000, cursor=cursor)
        attempts.update({a.attempt_id: a for a in page.items})
        cursor = page.next_cursor
        if cursor is None:
            break
    for a_id in sent_ids - set(attempts):
        violations.append(f"sent without an Attempt: {a_id}")
    by_turn: dict[tuple[str, str], list[int]] = defaultdict(list)
    for a in attempts.values():
        if a.state is AttemptState.DISPATCHING:
            violations.append(f"{a.attempt_id}: still dispatching after recovery")
        if a.attempt_id in sent_ids and a.state is AttemptState.REJECTED:
            violations.append(f"{a.attempt_id}: sent but recorded as rejected")
        if a.attempt_id in sent_ids and a.debit_state is DebitState.VOIDED:
            violations.append(f"{a.attempt_id}: sent but its hold was voided")
        by_turn[(a.run_id, a.turn_id)].append(a.seq)
    # An unknown Attempt is never followed by another send of its turn (default policy).
    for a in attempts.values():
        if a.state is AttemptState.UNKNOWN:
            later = [b for b in attempts.values() if b.run_id == a.run_id
                     and b.turn_id == a.turn_id and b.seq > a.seq and b.attempt_id in sent_ids]
            violations += [f"{b.attempt_id}: re-sent after unknown {a.attempt_id}"
                           for b in later]
    led.close()
    faults = sum(res.by_state.get(s, 0) for s in ("failed", "unknown", "rejected"))
    figures = {
        "runs": res.runs, "attempts": res.attempts, "sent": len(lines), "faults": faults,
        "kills": kills + armed_kills, "workers_started": spawned,
        "recoveries": res.recoveries, "violations": len(violations),
    }
    print("\nsoak figures: " + ", ".join(f"{k}: {v}" for k, v in figures.items()))
    print("  attempts by state:", dict(sorted(res.by_state.items())))
    for v in violations[:20]:
        print("  violation:", v)
    assert violations == [], violations[:20]
    assert res.runs > 0 and res.attempts > 0
    return figures


def test_soak_short(pg_url: str, tmp_path: Path) -> None:
    figs = soak(pg_url, tmp_path, seconds=20, workers=3, seed=7)
    assert figs["recoveries"] > 0 and figs["faults"] > 0


@pytest.mark.soak
def test_soak_full(pg_url: str, tmp_path: Path) -> None:
    soak(pg_url, tmp_path, seconds=180, workers=4, seed=11)
