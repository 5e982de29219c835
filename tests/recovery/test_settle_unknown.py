"""An operator settles an ``unknown`` Attempt with evidence (``Ledger.settle_unknown`` and
``failover-ledger attempt settle``): a late receipt that posts or voids the hold, once.

Both backends, through the public API and the real command line. What each test protects:
the state moves from ``unknown`` to the evidenced one exactly once and the ``late_receipt``
event keeps the previous state, who and why; the Run's counters, the debit and the reports
agree (reconcile holds); no lease is needed, yet a live executor's Attempt is never touched;
bad input is a typed error naming the field (or the state), and nothing recorded changes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ledger.api.facade import AsyncLedger, Ledger
from ledger.cli.main import main
from ledger.clock import ManualClock
from ledger.domain.records import AttemptState, DebitState, Lease
from ledger.domain.values import Budget, Price, Route
from ledger.errors import InvalidArgument, InvalidState, NotFound
from ledger.ops.audit import Audit
from ledger.ops.reconcile import reconcile
from ledger.storage.engine import normalize_url
from tests.storage.helpers import grant

REPO = Path(__file__).resolve().parents[2]
HOLD = Decimal("0.01")
ENV = "sha256:" + "e" * 64
# 1 per million prompt tokens, 2 per million completion tokens.
ROUTE = Route(id="a", provider="p1", model="m1", group="g", recipient="r1",
              price=Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2)))


def _unknown(led: Ledger, run_id: str = "r", *, token_budget: bool = False,
             close: bool = True) -> tuple[str, Lease]:
    """A Run whose one Attempt was sent and never answered (unknown, hold 0.01 and 100 tokens);
    with ``close`` the Run is finished and its lease released, as after a stopped turn."""
    led.admit_run(run_id, plan=[ROUTE], grant=grant(), budget=Budget(
        max_calls=3, max_retries=1, max_cost=Decimal("1"),
        max_tokens=10_000 if token_budget else None))
    lease = led.acquire_lease(run_id, ttl_s=60)
    att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve=HOLD,
                            reserve_tokens=100)
    led.settle_attempt(lease, att.attempt_id, outcome="unknown")
    if close:
        led.finish_run(lease, "failed")
        led.release_lease(lease)
    return att.attempt_id, lease


def _books(led: Ledger, run_id: str = "r") -> tuple[Any, ...]:
    """Everything a settle could change, to compare before and after."""
    [att] = led.timeline(run_id)
    return (att, led.get_run(run_id), led.debit(att.debit_id), led.events(run_id))


def _agree(led: Ledger, run_id: str = "r") -> None:
    run = led.get_run(run_id)
    tl = Audit(led).timeline(run_id)
    assert (tl.total_cost, tl.held) == (run.posted, run.reserved)
    books = reconcile(led)
    assert books.ok, books.violations


def test_an_operators_usage_replaces_the_cut_off_usage_whole(db_url: str) -> None:
    """An Attempt settled unknown may carry the usage of what arrived before the cut, with its
    cached and reasoning parts. The operator's evidence replaced the prompt and completion
    tokens but kept those parts, which could then exceed them (400 cached of 100 prompt
    tokens): the evidence now replaces the usage whole."""
    led = Ledger.open(db_url, clock=ManualClock(1000.0))
    led.admit_run("r", plan=[ROUTE], grant=grant(), budget=Budget(
        max_calls=3, max_retries=1, max_cost=Decimal("1")))
    lease = led.acquire_lease("r", ttl_s=60)
    att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve=HOLD)
    cut = led.settle_attempt(lease, att.attempt_id, outcome="unknown", prompt_tokens=500,
                             completion_tokens=20, cached_tokens=400, reasoning_tokens=15)
    assert (cut.cached_tokens, cut.reasoning_tokens) == (400, 15)
    done = led.settle_unknown(att.attempt_id, outcome="succeeded", prompt_tokens=100,
                              completion_tokens=10, note="invoice 12")
    assert (done.prompt_tokens, done.completion_tokens) == (100, 10)
    assert (done.cached_tokens, done.reasoning_tokens) == (None, None)
    [stored] = led.timeline("r")
    assert stored == done
    led.close()


def test_settle_with_usage_posts_the_priced_cost_and_releases_the_rest(db_url: str) -> None:
    led = Ledger.open(db_url, clock=ManualClock(1000.0))
    attempt_id, _ = _unknown(led, token_budget=True)
    before = led.get_run("r")
    assert (before.reserved, before.posted, before.tokens_reserved) == (HOLD, 0, 100)
    att = led.settle_unknown(attempt_id, outcome="succeeded", prompt_tokens=1000,
                             completion_tokens=500, note="console req 7a1", by="ops@host")
    assert att.state is AttemptState.SUCCEEDED and att.debit_state is DebitState.POSTED
    assert (att.prompt_tokens, att.completion_tokens, att.cost) == (1000, 500, Decimal("0.002"))
    run = led.get_run("r")
    assert (run.reserved, run.posted) == (0, Decimal("0.002"))
    # The token hold is released; what was used counts, capped at the hold (a token budget).
    assert (run.tokens_reserved, run.tokens_used) == (0, 100)
    debit = led.debit(att.debit_id)
    assert (debit.state, debit.posted) == (DebitState.POSTED, Decimal("0.002"))
    [ev] = led.events("r", ["late_receipt"])
    assert ev.attempt_id == attempt_id
    assert ev.data == {"applied": True, "by": "ops@host", "note": "console req 7a1",
                       "previous_state": "unknown", "outcome": "succeeded",
                       "prompt_tokens": 1000, "completion_tokens": 500, "cost": "0.002",
                       "posted": "0.002", "released": "0.008"}
    assert led.get_run("r").status.value == "failed"  # the Run's end is not rewritten
    _agree(led)
    led.close()


def test_settle_failed_with_a_cost_posts_it_and_without_one_posts_the_whole_hold(
        db_url: str) -> None:
    led = Ledger.open(db_url)
    first, _ = _unknown(led, "r1")
    second, _ = _unknown(led, "r2")
    att = led.settle_unknown(first, outcome="failed", cost="0.004", note="invoice 88")
    assert (att.state, att.cost) == (AttemptState.FAILED, Decimal("0.004"))
    assert (led.get_run("r1").posted, led.get_run("r1").reserved) == (Decimal("0.004"), 0)
    # Evidence of a failure without figures: it ran, the cost is unknown, so never zero.
    att = led.settle_unknown(second, outcome="failed", note="console: a 500")
    assert att.state is AttemptState.FAILED and led.debit(att.debit_id).posted == HOLD
    assert (led.get_run("r2").posted, led.get_run("r2").reserved) == (HOLD, 0)
    _agree(led, "r1")
    _agree(led, "r2")
    led.close()


def test_settle_not_sent_voids_the_hold_and_gives_the_call_back(db_url: str) -> None:
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)
    assert led.get_run("r").calls_used == 1
    att = led.settle_unknown(attempt_id, outcome="not_sent", note="provider: no such request")
    assert att.state is AttemptState.NOT_SENT and att.debit_state is DebitState.VOIDED
    run = led.get_run("r")
    assert (run.reserved, run.posted, run.calls_used, run.tokens_reserved) == (0, 0, 0, 0)
    [ev] = led.events("r", ["late_receipt"])
    assert (ev.data["previous_state"], ev.data["posted"], ev.data["released"]) == (
        "unknown", "0", "0.01")
    _agree(led)
    led.close()


def test_an_attempt_moves_out_of_unknown_exactly_once(db_url: str) -> None:
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)
    led.settle_unknown(attempt_id, outcome="succeeded", prompt_tokens=10, completion_tokens=5,
                       note="console")
    books = _books(led)
    for outcome in ("succeeded", "failed", "not_sent"):
        with pytest.raises(InvalidState, match="is succeeded, not unknown") as err:
            led.settle_unknown(attempt_id, outcome=outcome, note="console")
        assert err.value.fields["state"] == "succeeded"
    assert _books(led) == books
    led.close()


def test_a_live_executors_attempt_and_settled_ones_are_refused(db_url: str) -> None:
    """No lease is needed, so the guard is the state: a dispatching Attempt is its executor's
    to settle; a succeeded one is never rewritten."""
    led = Ledger.open(db_url)
    led.admit_run("r", plan=[ROUTE], grant=grant(),
                  budget=Budget(max_calls=3, max_retries=1, max_cost=Decimal("1")))
    lease = led.acquire_lease("r", ttl_s=60)
    att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve=HOLD)
    books = _books(led)
    with pytest.raises(InvalidState, match="is dispatching, not unknown"):
        led.settle_unknown(att.attempt_id, outcome="not_sent", note="console")
    assert _books(led) == books
    led.settle_attempt(lease, att.attempt_id, outcome="succeeded", prompt_tokens=1,
                       completion_tokens=1)
    books = _books(led)
    with pytest.raises(InvalidState, match="is succeeded, not unknown"):
        led.settle_unknown(att.attempt_id, outcome="failed", note="console")
    assert _books(led) == books
    led.close()


def test_the_executors_repeated_unknown_settle_after_the_receipt_changes_nothing(
        db_url: str) -> None:
    """An executor that retries its own unknown settle (a lost acknowledgement) after the
    operator's receipt is recognised as the same write: the receipt stands."""
    led = Ledger.open(db_url)
    attempt_id, lease = _unknown(led, close=False)
    led.settle_unknown(attempt_id, outcome="failed", cost="0.003", note="invoice")
    books = _books(led)
    again = led.settle_attempt(lease, attempt_id, outcome="unknown")
    assert again.state is AttemptState.FAILED
    assert _books(led) == books
    led.close()


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("outcome unknown", {"outcome": "unknown"}, "outcome"),
    ("outcome misspelled", {"outcome": "success"}, "outcome"),
    ("negative prompt tokens", {"outcome": "succeeded", "prompt_tokens": -1}, "prompt_tokens"),
    ("absurd completion tokens", {"outcome": "succeeded", "completion_tokens": 2**63},
     "completion_tokens"),
    ("tokens not a number", {"outcome": "succeeded", "prompt_tokens": "10"}, "prompt_tokens"),
    ("negative cost", {"outcome": "failed", "cost": "-0.01"}, "cost"),
    ("absurd cost", {"outcome": "failed", "cost": "1e13"}, "cost"),
    ("infinite cost", {"outcome": "failed", "cost": "Infinity"}, "cost"),
    ("usage with not_sent", {"outcome": "not_sent", "prompt_tokens": 5}, "prompt_tokens"),
    ("cost with not_sent", {"outcome": "not_sent", "cost": "0"}, "cost"),
    ("note missing", {"outcome": "not_sent"}, "note"),
    ("note None", {"outcome": "not_sent", "note": None}, "note"),
    ("note blank", {"outcome": "not_sent", "note": " \t"}, "note"),
    ("note too long", {"outcome": "failed", "note": "x" * 501}, "note"),
    ("note with control characters", {"outcome": "failed", "note": "a\x00b"}, "note"),
    ("by empty", {"outcome": "failed", "by": ""}, "by"),
]


@pytest.mark.parametrize(("case", "kwargs", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_evidence_is_a_typed_error_naming_the_field_and_changes_nothing(
        db_url: str, case: str, kwargs: dict[str, Any], field: str) -> None:
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)
    books = _books(led)
    evidence = {} if "note" in case else {"note": "console"}
    with pytest.raises(InvalidArgument) as err:
        led.settle_unknown(attempt_id, **{**evidence, **kwargs})
    assert err.value.fields["field"] == field, case
    assert _books(led) == books
    led.close()


def test_usage_whose_price_is_beyond_any_amount_is_refused(db_url: str) -> None:
    led = Ledger.open(db_url)
    dear = ROUTE.model_copy(update={"price": Price(input_per_mtok=Decimal(1),
                                                   output_per_mtok=Decimal(5000))})
    led.admit_run("r", plan=[dear], grant=grant(),
                  budget=Budget(max_calls=3, max_retries=1, max_cost=Decimal("1")))
    lease = led.acquire_lease("r", ttl_s=60)
    att = led.begin_attempt(lease, route="a", envelope_hash=ENV, reserve=HOLD)
    led.settle_attempt(lease, att.attempt_id, outcome="unknown")
    books = _books(led)
    with pytest.raises(InvalidArgument,
                       match="at the price of route 'a', beyond any amount") as err:
        led.settle_unknown(att.attempt_id, outcome="succeeded", completion_tokens=10**15,
                           note="console")
    assert err.value.fields["field"] == "completion_tokens"
    assert _books(led) == books
    led.close()


def test_an_unknown_attempt_id_is_not_found(db_url: str) -> None:
    led = Ledger.open(db_url)
    _unknown(led)
    books = _books(led)
    with pytest.raises(NotFound, match="unknown attempt id 'att-nope'"):
        led.settle_unknown("att-nope", outcome="failed", note="console")
    with pytest.raises(NotFound):  # priced usage reads the attempt first: the same answer
        led.settle_unknown("att-nope", outcome="succeeded", prompt_tokens=1, note="console")
    assert _books(led) == books
    led.close()


@pytest.mark.postgres
def test_settle_unknown_locks_the_run_before_the_attempt_and_never_deadlocks_a_retention(
        pg_url: str) -> None:
    """Every writer locks `runs` before `attempts`; retention takes `runs` EXCLUSIVE, then
    `attempts` ACCESS EXCLUSIVE (``_lock_as_writers_do``). A second connection takes the two in
    that order around an operator's settle: the settle must hold nothing on `attempts` while
    it waits for its Run's row, so the second connection's `attempts` lock is granted, and the
    settle goes on once it commits (no deadlock reported as ``DatabaseUnavailable``)."""
    led = Ledger.open(pg_url)
    attempt_id, _ = _unknown(led)
    eng = create_engine(normalize_url(pg_url))
    retention = eng.connect()
    done: list[Any] = []

    def settle() -> None:
        try:
            done.append(led.settle_unknown(attempt_id, outcome="failed", cost="0.004",
                                           note="console"))
        except Exception as e:  # the deadlock, as the old order met it
            done.append(e)

    job = threading.Thread(target=settle, daemon=True)
    try:
        tx = retention.begin()
        # Bounded: a lock that would deadlock gives up in 10 s rather than hang the test.
        retention.execute(text("SET LOCAL lock_timeout = '10s'"))
        retention.execute(text("LOCK TABLE runs IN EXCLUSIVE MODE"))
        job.start()
        with eng.connect() as watch:
            for _ in range(600):  # until the settle waits for a lock on `runs`
                waiting = watch.execute(text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                    "WHERE c.relname = 'runs' AND NOT l.granted")).scalar_one()
                if waiting:
                    break
                job.join(0.05)
            assert waiting and not done
            held = watch.execute(text(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname LIKE 'attempts%' AND l.pid <> :me AND l.granted"),
                {"me": retention.execute(text("SELECT pg_backend_pid()")).scalar_one()}
            ).scalar_one()
        assert held == 0, "the waiting settle holds a lock on attempts"
        retention.execute(text("LOCK TABLE attempts, events IN ACCESS EXCLUSIVE MODE"))
        tx.commit()
        job.join(60)
        assert not job.is_alive()
        [att] = done
        assert not isinstance(att, Exception), att
        assert att.state is AttemptState.FAILED and att.cost == Decimal("0.004")
        _agree(led)
    finally:
        retention.close()
        eng.dispose()
        job.join(60)
        led.close()


def test_the_async_twin_settles_the_same_way(db_url: str) -> None:
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)

    async def main() -> Any:
        return await AsyncLedger(led).settle_unknown(attempt_id, outcome="succeeded",
                                                     cost="0.001", note="invoice")

    att = asyncio.run(main())
    assert att.state is AttemptState.SUCCEEDED and led.get_run("r").posted == Decimal("0.001")
    _agree(led)
    led.close()


# -- the command line -----------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("LEDGER_URL", None)
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], capture_output=True,
                          text=True, env=env, cwd=str(REPO), timeout=120)


def test_cli_settles_with_usage_and_says_what_it_did(db_url: str) -> None:
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)
    res = cli("--db", db_url, "attempt", "settle", attempt_id, "--outcome", "succeeded",
              "--usage", "1000,500", "--note", "console req 7a1", "--by", "ops@host")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"attempt {attempt_id} of run r: unknown -> succeeded; debit posted, posted 0.002 of "
        "the hold 0.01",
        "run r: charged 0.002, held 0"]
    [ev] = led.events("r", ["late_receipt"])
    assert (ev.data["by"], ev.data["note"], ev.data["cost"]) == ("ops@host", "console req 7a1",
                                                                  "0.002")
    _agree(led)
    # Settled once: again is the state's error, one line, exit 1, nothing changed.
    books = _books(led)
    res = cli("--db", db_url, "attempt", "settle", attempt_id, "--outcome", "failed",
              "--reason", "a second look")
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1
    assert "is succeeded, not unknown" in res.stderr
    assert _books(led) == books
    led.close()


def test_cli_json_and_separate_token_options(db_url: str) -> None:
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)
    res = cli("--db", db_url, "attempt", "settle", attempt_id, "--outcome", "failed",
              "--prompt-tokens", "1000", "--completion-tokens", "0", "--json",
              "--reason", "billing export")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["state"], doc["cost"], doc["prompt_tokens"]) == ("failed", "0.001", 1000)
    [ev] = led.events("r", ["late_receipt"])
    assert ev.data["by"] and "@" in ev.data["by"]  # who: the operating-system user @ host
    _agree(led)
    led.close()


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--outcome", "succeeded", "--usage", "12"], 2, "is not PROMPT,COMPLETION"),
    (["--outcome", "succeeded", "--usage", "a,b"], 2, "is not PROMPT,COMPLETION"),
    (["--outcome", "succeeded", "--usage", "1,2", "--prompt-tokens", "1"], 2, "not both"),
    (["--outcome", "succeeded", "--usage=-5,2"], 2, "'-5,2' has a negative token count"),
    (["--outcome", "succeeded", "--usage", "-5,2"], 2, "'-5,2' has a negative token count"),
    (["--outcome", "succeeded", "--usage", "5,-2"], 2, "'5,-2' has a negative token count"),
    (["--outcome", "succeeded", "--prompt-tokens", "-5"], 2, "--prompt-tokens"),
    (["--outcome", "failed", "--cost=-1"], 2, "cost"),
    (["--outcome", "failed", "--cost", "-1"], 2, "cost"),
    (["--outcome", "not_sent", "--usage", "1,1"], 2,
     "--usage given with --outcome not_sent: a request that never ran"),
    (["--outcome", "not_sent", "--prompt-tokens", "3", "--cost", "0"], 2,
     "--prompt-tokens and --cost given with --outcome not_sent"),
], ids=["one-count", "not-numbers", "both-forms", "negative", "negative-spaced",
        "negative-completion", "negative-prompt-tokens", "negative-cost", "negative-cost-spaced",
        "not-sent-usage", "not-sent-tokens-and-cost"])
def test_cli_bad_input_is_one_line_and_changes_nothing(
        db_url: str, args: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # In this process (main() is the console script's body; the other tests here run the real
    # entry point): one interpreter start per case would be most of this test's time.
    monkeypatch.delenv("LEDGER_URL", raising=False)
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)
    books = _books(led)
    capsys.readouterr()
    assert main(["--db", db_url, "attempt", "settle", attempt_id, *args,
                 "--reason", "evidence"]) == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err, err
    assert _books(led) == books
    assert main(["--db", db_url, "attempt", "settle", "att-nope", "--outcome", "failed",
                 "--reason", "evidence"]) == 1
    assert "unknown attempt id 'att-nope'" in capsys.readouterr().err
    assert _books(led) == books
    led.close()


def test_an_operators_receipt_always_says_why_and_one_without_a_note_changes_nothing(
        db_url: str) -> None:
    led = Ledger.open(db_url)
    attempt_id, _ = _unknown(led)
    books = _books(led)

    async def main() -> None:
        for kwargs in ({}, {"note": None}, {"note": "  "}):
            with pytest.raises(InvalidArgument) as err:
                await AsyncLedger(led).settle_unknown(attempt_id, outcome="not_sent", **kwargs)
            assert err.value.fields["field"] == "note"

    asyncio.run(main())
    with pytest.raises(InvalidArgument, match="'note'") as err:
        led.settle_unknown(attempt_id, outcome="not_sent")  # type: ignore[call-arg]
    assert err.value.fields["field"] == "note"
    assert _books(led) == books and led.events("r", ["late_receipt"]) == []
    assert led.get_attempt(attempt_id).state is AttemptState.UNKNOWN
    led.close()
