"""Recovery in-process, on both backends: takeover, unknown with hold, slots, idempotence."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from ledger import faults
from ledger.api.facade import AsyncLedger, Ledger
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState
from ledger.errors import DatabaseUnavailable, FencedOut, InvalidArgument
from ledger.faults import FaultInjected
from ledger.ops.reconcile import reconcile
from ledger.ops.recovery import arecover, recover
from tests.storage.helpers import budget, grant, routes, stray_never_sent_hold


def _setup(url: str, clock: ManualClock) -> tuple[Ledger, str]:
    led = Ledger.open(url, clock=clock, executor_id="worker-1")
    led.configure_group("g", max_in_flight=1)
    led.admit_run("r1", plan=routes(), budget=budget(), grant=grant())
    return led, "r1"


def test_takeover_marks_unknown_keeps_hold_and_fences(db_url: str) -> None:
    clock = ManualClock()
    led, run = _setup(db_url, clock)
    lease = led.acquire_lease(run, ttl_s=10)
    ok = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.10",
                           turn_id="t1")
    led.settle_attempt(lease, ok.attempt_id, outcome="succeeded", cost="0.05")
    lost = led.begin_attempt(lease, route="c", envelope_hash="sha256:2", reserve="0.20",
                             turn_id="t2")
    inflight = led.begin_attempt(lease, route="a", envelope_hash="sha256:3", reserve="0.30",
                                 turn_id="t3")
    led.set_group_state("h", "cooldown", until=clock.now() + 1000, reason="rate_limit")
    health_before = led.health()
    # Not expired yet: recovery takes nothing.
    assert recover(led).runs == []
    clock.advance(11)
    # The group slot of the dead executor came back at lease expiry already.
    assert led.group_projections(["g"])["g"].in_flight == 0
    rep = recover(led, executor_id="rec")
    assert [r.run_id for r in rep.runs] == [run]
    rr = rep.runs[0]
    assert sorted(rr.newly_unknown) == sorted([lost.attempt_id, inflight.attempt_id])
    assert rr.route == "a" and rr.selected_route == "a"
    assert [a.attempt_id for a in rr.settled] == [ok.attempt_id]
    assert rr.lease is not None and rr.lease.fence == lease.fence + 1
    assert rr.slots_released == 2
    for att in (lost, inflight):
        rec = led.get_attempt(att.attempt_id)
        assert rec.state is AttemptState.UNKNOWN and rec.debit_state is DebitState.RESERVED
    r = led.get_run(run)
    assert r.reserved == Decimal("0.50") and r.posted == Decimal("0.05")
    proj = led.group_projections(["h"])["h"]  # cooldown and health stay as they were
    assert (proj.mode.value, proj.until) == ("cooldown", clock.now() + 989)
    assert led.health() == health_before
    # The dead executor can write nothing.
    with pytest.raises(FencedOut):
        led.settle_attempt(lease, lost.attempt_id, outcome="succeeded", cost="0.2")
    with pytest.raises(FencedOut):
        led.begin_attempt(lease, route="a", envelope_hash="sha256:4", reserve="0")
    with pytest.raises(FencedOut):
        led.renew_lease(lease)
    # Idempotent: a second pass finds nothing (the recovery lease is live).
    assert recover(led).runs == []
    # Once the recovery lease also expires, another pass retakes it, marking nothing new.
    clock.advance(60)
    again = recover(led, release=True)
    assert again.runs[0].newly_unknown == []
    assert len(again.runs[0].unknown) == 2 and again.runs[0].lease is None
    assert recover(led).runs == []  # released: nothing expired to take
    assert reconcile(led).violations == []
    led.close()


def test_interrupted_takeover_rolls_back_and_resumes(db_url: str) -> None:
    clock = ManualClock()
    led, run = _setup(db_url, clock)
    lease = led.acquire_lease(run, ttl_s=5)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.1")
    clock.advance(6)
    faults.arm("recover.before_commit", "raise")
    try:
        with pytest.raises(FaultInjected):
            recover(led)
    finally:
        faults.disarm()
    assert led.get_attempt(att.attempt_id).state is AttemptState.DISPATCHING
    assert led.get_run(run).fence == lease.fence
    rep = recover(led)
    assert rep.runs[0].newly_unknown == [att.attempt_id]
    # Lost acknowledgement of a committed takeover: the retry recognises it as its own.
    clock.advance(100)
    faults.arm("recover.after_commit", "raise")
    try:
        with pytest.raises(FaultInjected):
            recover(led, executor_id="rec-2")
    finally:
        faults.disarm()
    fence = led.get_run(run).fence
    assert led.get_run(run).lease_holder == "rec-2"
    assert recover(led, executor_id="rec-2").runs == []  # live lease: nothing to take
    assert led.get_run(run).fence == fence
    assert reconcile(led).violations == []
    led.close()


def test_async_twin(db_url: str) -> None:
    clock = ManualClock()
    led, run = _setup(db_url, clock)
    lease = led.acquire_lease(run, ttl_s=5)
    att = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.1")
    clock.advance(6)
    rep = asyncio.run(arecover(AsyncLedger(led)))
    assert rep.runs[0].newly_unknown == [att.attempt_id]
    led.close()


def test_a_kept_recovery_lease_must_outlast_the_lease_margin(db_url: str) -> None:
    # A lease no longer than the margin could start nothing: refused as acquire_lease refuses
    # it, before anything is read or written. Released at once, its length does not matter.
    clock = ManualClock()
    led, run = _setup(db_url, clock)
    lease = led.acquire_lease(run, ttl_s=5)
    clock.advance(6)
    for kwargs in ({"lease_ttl_s": led.lease_margin_s}, {"lease_ttl_s": 0.3}):
        with pytest.raises(InvalidArgument) as e:
            recover(led, **kwargs)
        assert e.value.field == "lease_ttl_s" and "lease margin" in str(e.value)
        with pytest.raises(InvalidArgument):
            asyncio.run(arecover(AsyncLedger(led), **kwargs))
    assert led.get_run(run).fence == lease.fence  # nothing was taken over
    rep = recover(led, lease_ttl_s=0.3, release=True)
    assert [r.run_id for r in rep.runs] == [run]
    led.close()


def test_orphans_of_a_directly_reacquired_run(db_url: str) -> None:
    """A host that re-acquires an expired lease without recovery leaves the old executor's
    dispatching Attempt behind; recovery marks it unknown without taking the run away."""
    clock = ManualClock()
    led, run = _setup(db_url, clock)
    old = led.acquire_lease(run, ttl_s=5)
    att = led.begin_attempt(old, route="a", envelope_hash="sha256:1", reserve="0.1")
    clock.advance(6)
    new = led.acquire_lease(run, ttl_s=60, executor_id="worker-2")
    rep = recover(led)
    assert rep.runs == [] and rep.orphans == {run: [att.attempt_id]}
    rec = led.get_attempt(att.attempt_id)
    assert rec.state is AttemptState.UNKNOWN and rec.debit_state is DebitState.RESERVED
    assert led.get_run(run).fence == new.fence and led.get_run(run).lease_holder == "worker-2"
    assert recover(led).orphans == {}
    assert reconcile(led).violations == []
    led.close()


@pytest.mark.parametrize("end", ["succeeded", "failed", "stopped", "cancelled"])
def test_recovery_takes_expired_runs_only_if_unfinished_or_dispatching(db_url: str,
                                                                        end: str) -> None:
    """Candidates come from unsettled work: an unfinished run, or a finished one with an
    attempt still dispatching; a finished run with nothing in flight is never retaken."""
    clock = ManualClock()
    led = Ledger.open(db_url, clock=clock, executor_id="worker-1")
    for run_id in ("done", "open", "done-inflight"):
        led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
    done = led.acquire_lease("done", ttl_s=10)
    led.finish_run(done, end)
    led.acquire_lease("open", ttl_s=10)
    inflight = led.acquire_lease("done-inflight", ttl_s=10)
    att = led.begin_attempt(inflight, route="a", envelope_hash="sha256:1", reserve="0.10",
                            turn_id="t1")
    led.finish_run(inflight, end)
    assert recover(led).runs == []  # nothing expired yet
    clock.advance(11)
    rep = recover(led, executor_id="rec", release=True)
    assert sorted(r.run_id for r in rep.runs) == ["done-inflight", "open"]
    assert led.get_attempt(att.attempt_id).state is AttemptState.UNKNOWN
    assert recover(led).runs == []
    led.close()


def test_batched_takeover_gives_each_run_its_own_fence_and_record(db_url: str) -> None:
    """Runs taken over together in one transaction are reported exactly as one at a time:
    each its own new fence, its own unknown attempts and its own recover event."""
    clock = ManualClock()
    led = Ledger.open(db_url, clock=clock, executor_id="worker-1")
    atts: dict[str, list[str]] = {}
    for i in range(5):
        run_id = f"b{i}"
        led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease(run_id, ttl_s=10)
        if i == 3:  # a fence already bumped once: the new one is its own, not the batch's
            led.release_lease(lease)
            lease = led.acquire_lease(run_id, ttl_s=10)
        atts[run_id] = [led.begin_attempt(lease, route="a", envelope_hash=f"sha256:{i}{k}",
                                          reserve="0.01", turn_id=f"t{k}").attempt_id
                        for k in range(i % 3)]
    fences = {r: led.get_run(r).fence for r in atts}
    clock.advance(11)
    seen: list[tuple[int, int]] = []
    rep = recover(led, executor_id="rec", batch=2, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(2, 5), (4, 5), (5, 5)]
    assert sorted(r.run_id for r in rep.runs) == sorted(atts)
    for r in rep.runs:
        assert r.fence == fences[r.run_id] + 1 == led.get_run(r.run_id).fence
        assert r.newly_unknown == atts[r.run_id]
        assert r.lease is not None and r.lease.fence == r.fence
        (event,) = led.events(r.run_id, ["recover"])
        assert event.data["unknown"] == atts[r.run_id] and event.data["fence"] == r.fence
    assert reconcile(led).violations == []
    with pytest.raises(InvalidArgument) as err:
        recover(led, batch=0)
    assert err.value.field == "batch"
    led.close()


@pytest.mark.parametrize("state", ["not_sent", "rejected"])
def test_recovery_repair_of_a_never_sent_hold_releases_its_token_reserve_too(
        db_url: str, state: str) -> None:
    clock = ManualClock()
    led, run = _setup(db_url, clock)
    lease = led.acquire_lease(run, ttl_s=10)
    stray_never_sent_hold(led, lease, state, tokens=40)
    led.begin_attempt(lease, route="b", envelope_hash="sha256:e", reserve="0.05",
                      reserve_tokens=20, turn_id="t")
    clock.advance(11)
    [rr] = recover(led, release=True).runs
    assert len(rr.voided) == 1
    r = led.get_run(run)
    # Only the in-flight call's holds stay, money and tokens alike.
    assert (r.reserved, r.tokens_reserved) == (Decimal("0.05"), 20)
    books = reconcile(led)
    assert books.ok, books.violations
    led.close()


def _lose_ack(_name: str) -> None:
    raise DatabaseUnavailable("simulated: the connection was lost after COMMIT")


class _SlowSleeper:
    """Waits ``extra`` seconds longer than asked: a retry that outlasts the kept lease."""

    def __init__(self, clock: ManualClock, extra: float) -> None:
        self.clock, self.extra = clock, extra

    def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds + self.extra)


@pytest.mark.parametrize(("release", "late"), [(False, 0.0), (True, 0.0), (False, 31.0)],
                         ids=["keep-lease", "release", "kept-lease-expired-meanwhile"])
def test_a_takeover_whose_acknowledgement_is_lost_is_reported_as_the_recoverers_own(
        db_url: str, release: bool, late: float) -> None:
    """The takeover committed, then DatabaseUnavailable: the in-pass retry reports the Runs as
    taken over by this pass, with the Attempts it marked unknown, the holds it voided and the
    slots it freed, whether it kept the leases or released them (the command's default), and
    also when the kept lease expired before the retry and the retry took the Runs again."""
    clock = ManualClock()
    led = Ledger.open(db_url, clock=clock, executor_id="worker-1")
    led.configure_group("g", max_in_flight=5)
    inflight: dict[str, list[str]] = {}
    fences: dict[str, int] = {}
    for i, n in enumerate((1, 1, 2)):
        run_id = f"r{i}"
        led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease(run_id, ttl_s=10)
        fences[run_id] = lease.fence
        if i == 2:
            stray_never_sent_hold(led, lease, "not_sent")
        inflight[run_id] = [led.begin_attempt(lease, route="a", envelope_hash=f"sha256:{i}{k}",
                                              reserve="0.01", turn_id=f"t{k}").attempt_id
                            for k in range(n)]
    clock.advance(11)
    faults.arm("recover.after_commit", _lose_ack)
    try:
        rep = recover(led, executor_id="rec", release=release, lease_ttl_s=30,
                      sleeper=_SlowSleeper(clock, late))
    finally:
        faults.disarm()
    assert rep.retries == 1 and rep.skipped == []
    assert sorted(r.run_id for r in rep.runs) == sorted(inflight)
    assert rep.unknown_attempts == 4
    takeovers = 2 if late else 1  # a kept lease that expired was taken again, by this pass
    for r in rep.runs:
        event, *_ = led.events(r.run_id, ["recover"])
        assert len(_) == takeovers - 1
        assert r.newly_unknown == inflight[r.run_id] == event.data["unknown"]
        assert r.voided == event.data["voided"] and len(r.voided) == (r.run_id == "r2")
        assert r.slots_released == len(inflight[r.run_id]) == event.data["slots_released"]
        assert (r.previous_executor, r.previous_fence) == ("worker-1", fences[r.run_id])
        assert r.fence == fences[r.run_id] + takeovers == led.get_run(r.run_id).fence
        assert (r.lease is None) is release
        if r.lease is not None:
            assert (r.lease.executor, r.lease.fence) == ("rec", r.fence)
    assert reconcile(led).violations == []
    led.close()


def test_a_takeover_by_another_pass_under_the_same_executor_id_is_not_adopted(
        db_url: str) -> None:
    """A retry adopts only its own pass's takeovers: a Run another pass (reusing the executor
    id) took over between the listing and the retried claim is skipped, not reported as ours."""
    clock = ManualClock()
    led = Ledger.open(db_url, clock=clock, executor_id="worker-1")
    for run_id in ("p1", "p2"):
        led.admit_run(run_id, plan=routes(), budget=budget(), grant=grant())
        lease = led.acquire_lease(run_id, ttl_s=10)
        led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.01")
    clock.advance(11)

    def meanwhile(done: int, _total: int) -> None:
        if done == 1:  # after the first batch: another pass takes p2 over, then a lost commit
            other = recover(led, executor_id="rec", run_ids=["p2"], lease_ttl_s=60)
            assert [r.run_id for r in other.runs] == ["p2"]
            faults.arm("recover.before_commit", _lose_ack)

    try:
        rep = recover(led, executor_id="rec", batch=1, progress=meanwhile, sleeper=clock)
    finally:
        faults.disarm()
    assert rep.retries == 1
    assert [r.run_id for r in rep.runs] == ["p1"] and rep.skipped == ["p2"]
    assert rep.unknown_attempts == 1
    assert len(led.events("p2", ["recover"])) == 1
    led.close()
