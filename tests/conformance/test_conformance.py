"""The shared conformance vectors, one pytest case per vector case, reported by its ``id``.

Reads every ``*.json`` in ``vectors/`` beside this file, or in ``$LEDGER_CONFORMANCE_DIR`` when
set. A case passes only if every field present under ``expect`` matches. Nothing here branches
on a case id or a file name: the file's ``kind`` picks the runner, its ``preset`` and the merged
``policy`` overrides pick the policy.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest

from ledger.decide.classify import classify
from ledger.decide.health import is_available, record_failure, record_success
from ledger.decide.retry import retry_decision
from ledger.domain.facts import Category, Observation
from ledger.domain.values import Health
from ledger.policy.load import apply_overrides, preset
from ledger.policy.model import Policy
from tests.decide.retries import same_route_retries

VECTOR_DIR = Path(os.environ.get("LEDGER_CONFORMANCE_DIR") or Path(__file__).parent / "vectors")
JITTER_SEEDS = 200
_EPS = 1e-9


def _cases() -> list[Any]:
    files = sorted(VECTOR_DIR.glob("*.json"))
    if not files:
        raise RuntimeError(f"no conformance vectors (*.json) in {VECTOR_DIR}")
    params = []
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        for case in doc["cases"]:
            params.append(pytest.param(doc, case, id=str(case["id"])))
    return params


def _policy(doc: dict[str, Any], case: dict[str, Any]) -> Policy:
    overrides = {**doc.get("policy", {}), **case.get("policy", {})}
    return apply_overrides(preset(doc["preset"]), overrides)


def _value(v: Any) -> Any:
    return getattr(v, "value", v)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, bool) or want is None:
        return bool(got is want)
    if isinstance(want, int | float) and isinstance(got, int | float):
        return math.isclose(got, want, rel_tol=0, abs_tol=_EPS)
    return bool(got == want)


def run_classify(doc: dict[str, Any], case: dict[str, Any]) -> None:
    policy = _policy(doc, case)
    fact = classify(Observation.model_validate(case["observe"]), policy)
    expect = case["expect"]
    problems = [
        f"{k}: got {_value(getattr(fact, k))!r}, expected {expect[k]!r}"
        for k in ("category", "moves_on", "cooldown", "scope", "resubmit")
        if k in expect and not _same(_value(getattr(fact, k)), expect[k])
    ]
    if "retry" in expect:
        problems += _retry_problems(fact, policy, expect["retry"])
    assert not problems, "; ".join(problems) + f"\nfact: {fact.to_json()}"


def _retry_problems(fact: Any, policy: Policy, want: dict[str, Any]) -> list[str]:
    problems = []
    allowed = same_route_retries(fact, policy)
    if "max" in want and allowed != want["max"]:
        problems.append(f"retry.max: got {allowed}, expected {want['max']}")
    if want.get("max") == 0:
        first = retry_decision(fact, policy, 0, random.Random(0))
        if first.retry:
            problems.append(f"retry: expected none, decided {first}")
    if "delay_s" in want:
        jitter = float(want.get("jitter", 0.0))
        lo, hi = want["delay_s"] * (1 - jitter), want["delay_s"] * (1 + jitter)
        for seed in range(JITTER_SEEDS):
            d = retry_decision(fact, policy, 0, random.Random(seed))
            if not d.retry or d.delay_s is None or not lo - _EPS <= d.delay_s <= hi + _EPS:
                problems.append(f"first wait under seed {seed}: {d}, expected in [{lo}, {hi}]")
                break
    return problems


def run_cooldown(doc: dict[str, Any], case: dict[str, Any]) -> None:
    policy = _policy(doc, case)
    key = case.get("key", {})
    provider = key.get("provider")
    health = Health(key=key.get("profile") or key.get("route") or "key")
    problems = []
    for i, step in enumerate(case["steps"]):
        t = float(step["t"])
        event = step.get("event")
        if event == "failure":
            reason = Category(step["reason"])
            health = record_failure(health, reason, provider=provider, now=t, policy=policy)
        elif event == "success":
            health = record_success(health, t, policy)
        elif event is not None:
            raise AssertionError(f"step {i}: unknown event {event!r}")
        for field, want in step.get("expect", {}).items():
            got = is_available(health, t) if field == "available" else getattr(health, field)
            if not _same(got, want):
                problems.append(f"step {i} (t={t:g}) {field}: got {got!r}, expected {want!r}")
    assert not problems, "; ".join(problems) + f"\nfinal health: {health.model_dump()}"


def run_select(doc: dict[str, Any], case: dict[str, Any]) -> None:
    try:
        from tests.conformance.select_runner import run_select_case
    except ModuleNotFoundError as e:
        if e.name != "tests.conformance.select_runner":
            raise
        pytest.xfail("selector not implemented yet")
    run_select_case(case, doc.get("policy", {}), doc["preset"])


RUNNERS = {"classify": run_classify, "cooldown": run_cooldown, "select": run_select}


@pytest.mark.parametrize(("doc", "case"), _cases())
def test_vector(doc: dict[str, Any], case: dict[str, Any]) -> None:
    runner = RUNNERS.get(doc["kind"])
    assert runner is not None, f"unknown vector kind {doc['kind']!r}"
    runner(doc, case)
