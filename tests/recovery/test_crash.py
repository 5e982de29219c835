"""Crash tests: workers killed with SIGKILL at every fault point, then recovery, then proofs.

One run per fault point, all killed in parallel (the 3rd time the point is reached, so each
run has settled history before the crash); three recovering processes race over all of them;
a continuing worker finishes every run. Then, from the shared ``sent.log`` and the ledger:

* no Attempt lost: every sent request has its Attempt (committed before the send);
* none duplicated: no attempt id and no (run, turn) was sent twice — in particular the Attempts
  recovery marked unknown were never re-sent by the continuing worker;
* each kill point leaves exactly the state it must (see ``EXPECT``);
* a write whose commit succeeded but whose acknowledgement was lost (``*.after_commit``) is
  recognised as the same write when retried with the same attempt id and content;
* every run was recovered exactly once although three processes recovered at the same time;
* stale executors are refused; and the reconciliation (debits vs counters, budgets, group
  limits) finds no violation.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from ledger.api.facade import Ledger
from ledger.domain.records import AttemptState, DebitState, Lease
from ledger.errors import FencedOut
from ledger.ops.reconcile import reconcile
from tests.recovery.helpers import duplicates, finish, sent, spawn
from tests.storage.helpers import budget, grant, routes

TURNS = 5
KILL_AT = 3  # the 3rd time the point is reached = turn t3

# point -> (is the t3 attempt recorded?, was it sent?, its state after recovery)
EXPECT: dict[str, tuple[bool, bool, AttemptState | None]] = {
    "begin.before_commit": (False, False, None),
    "begin.after_commit": (True, False, AttemptState.UNKNOWN),
    "dispatch.before_send": (True, False, AttemptState.UNKNOWN),
    "dispatch.after_send": (True, True, AttemptState.UNKNOWN),
    "settle.before_commit": (True, True, AttemptState.UNKNOWN),
    "settle.after_commit": (True, True, AttemptState.SUCCEEDED),
}


def test_kill_at_every_fault_point_then_recover(db_url: str, tmp_path: Path) -> None:
    led = Ledger.open(db_url)
    led.configure_group("g", max_in_flight=len(EXPECT))
    log = tmp_path / "sent.log"
    runs = {point: f"run-{i}" for i, point in enumerate(EXPECT)}
    for run_id in runs.values():
        led.admit_run(run_id, plan=routes(), budget=budget(calls=10, cost="1.00"),
                      grant=grant())
    procs = {
        point: spawn("crash", db_url, run_id, TURNS, log, tmp_path / f"{run_id}.json",
                     faults=f"{point}@{KILL_AT}")
        for point, run_id in runs.items()
    }
    for point, p in procs.items():
        code, _ = finish(p)
        assert code == -9, f"{point}: the worker was not killed at its fault point"
    before = sent(log)
    stale: dict[str, Lease] = {}
    for point, run_id in runs.items():
        st = json.loads((tmp_path / f"{run_id}.json").read_text())
        stale[point] = Lease(run_id, st["executor"], st["fence"], 0.0)
        recorded, was_sent, _state = EXPECT[point]
        t3 = f"{run_id}-t3-{st['fence']}"
        assert (run_id, "t3", t3) in before if was_sent else (run_id, "t3", t3) not in before
        ids = {a.attempt_id for a in led.timeline(run_id)}
        assert (t3 in ids) == recorded, point
        # Lost acknowledgement: the retried call with the same id is the same write.
        if point == "begin.after_commit":
            again = led.begin_attempt(stale[point], route="a", envelope_hash="sha256:t3",
                                      reserve=Decimal("0.01"), turn_id="t3", attempt_id=t3)
            assert again.seq == 3 and again.state is AttemptState.DISPATCHING
            assert len(led.timeline(run_id)) == 3
        if point == "settle.after_commit":
            posted = led.get_run(run_id).posted
            again = led.settle_attempt(stale[point], t3, outcome="succeeded",
                                       cost=Decimal("0.01"))
            assert again.state is AttemptState.SUCCEEDED
            assert led.get_run(run_id).posted == posted  # not posted twice

    # Three recovering processes at once, with clocks past every lease's expiry.
    recs = [spawn("recover", db_url, 3600) for _ in range(3)]
    reports = [finish(p)[1] for p in recs]
    taken: dict[str, list[str]] = {}
    for rep in reports:
        for run_id, unknown in rep["runs"].items():  # type: ignore[union-attr]
            assert run_id not in taken, f"{run_id} was recovered twice"
            taken[run_id] = unknown
    assert set(taken) == set(runs.values())
    for point, run_id in runs.items():
        recorded, was_sent, state = EXPECT[point]
        t3 = f"{run_id}-t3-{stale[point].fence}"
        assert taken[run_id] == ([t3] if state is AttemptState.UNKNOWN else []), point
        if recorded:
            att = led.get_attempt(t3)
            assert att.state is state, point
            assert att.debit_state is (DebitState.RESERVED if state is AttemptState.UNKNOWN
                                       else DebitState.POSTED)
        # The dead executor can write nothing any more.
        with pytest.raises(FencedOut):
            led.begin_attempt(stale[point], route="a", envelope_hash="sha256:x", reserve="0",
                              turn_id="t9")

    # A continuing worker finishes every run, never re-sending an unknown turn.
    cont = spawn("continue", db_url, ",".join(runs.values()), TURNS, log)
    code, out = finish(cont)
    assert code == 0
    # t1 and t2 are done everywhere; t3 is skipped wherever it is settled or unknown: an unknown
    # turn is never sent again.
    t3_kept = sum(1 for _rec, _sent, st in EXPECT.values() if st is not None)
    assert out["skipped"] == len(runs) * 2 + t3_kept
    lines = sent(log)
    assert duplicates([a for _r, _t, a in lines]) == []
    assert duplicates([f"{r}/{t}" for r, t, _a in lines]) == [], "a turn was sent twice"
    for point, run_id in runs.items():
        tl = led.timeline(run_id)
        by_id = {a.attempt_id: a for a in tl}
        for r, _t, a in lines:
            if r == run_id:
                assert a in by_id, f"{point}: sent {a} has no Attempt"
                assert by_id[a].state in (AttemptState.SUCCEEDED, AttemptState.UNKNOWN)
        done = [a for a in tl if a.state is AttemptState.SUCCEEDED]
        unknown = [a for a in tl if a.state is AttemptState.UNKNOWN]
        expect_unknown = 1 if EXPECT[point][2] is AttemptState.UNKNOWN else 0
        assert len(unknown) == expect_unknown, point
        assert len(done) == TURNS - expect_unknown, point
        assert not [a for a in tl if a.state is AttemptState.DISPATCHING]
        run = led.get_run(run_id)
        assert run.posted == Decimal("0.01") * len(done)
        assert run.reserved == Decimal("0.01") * expect_unknown  # the unknown keeps its hold
    rec = reconcile(led)
    assert rec.violations == [], rec.violations
    led.close()
