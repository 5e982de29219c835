"""Invariant 5: a Run is read and decided by the policy it was admitted with. A rule the loader
gained after the Run was admitted (e.g. a total time limit below the first-token limit, a
blank name, the caller's facts in a rule, a zero probe interval or group-fact age, a provider's
failure classified `unusable`, a retry cap without honor_retry_after, a retry rule's transport
kind an earlier rule's category takes) refuses new policies, never a frozen one read back."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import update

from ledger.api.facade import Ledger
from ledger.errors import InvalidArgument
from ledger.ops.replay import replay
from ledger.policy.load import preset
from ledger.policy.model import Policy
from ledger.storage import schema as s
from tests.storage.helpers import budget, grant, routes, sql_context


def _admitted_before_the_rule(led: Ledger) -> dict[str, object]:
    """A Run whose frozen policy a later loader refuses (written as an older ledger did)."""
    led.admit_run("r", plan=routes(), budget=budget(), grant=grant(), policy=preset("goclaw"))
    text = dict(led.frozen_run("r").policy)
    text["name"] = "   "
    text["streaming"]["total_timeout_s"] = text["streaming"]["first_token_timeout_s"] / 2
    text["moves_on"][0]["categories"].append("cancelled")
    text["probe"].update(enabled=True, interval_s=0)
    text["failover"].update(group_aware=True, group_fact_max_age_s=0)
    text["classification"]["status"]["401"] = "unusable"
    text["same_route_retry"][0].update(honor_retry_after=False)  # its retry_after_cap_s kept
    text["same_route_retry"][0]["categories"].append("network")  # before connect_refused
    with sql_context(led).engine.begin() as conn:
        conn.execute(update(s.runs).where(s.runs.c.run_id == "r").values(
            policy=json.dumps(text)))
    return text


def test_a_frozen_policy_the_loader_now_refuses_is_still_read_and_used(db_url: str) -> None:
    with Ledger.open(db_url) as led:
        text = _admitted_before_the_rule(led)
    with pytest.raises(InvalidArgument):  # a new policy like it is refused
        Policy.model_validate(text)
    with Ledger.open(db_url) as led:  # a process that has not read the Run yet
        pol = led.run_policy("r")
        assert pol.name == "   " and "cancelled" in [
            c.value for c in pol.moves_on[0].categories]
        assert (pol.probe.interval_s, pol.failover.group_fact_max_age_s) == (0, 0)
        assert pol.classification.status[401].value == "unusable"
        assert pol.same_route_retry[0].retry_after_cap_s == 20
        lease = led.acquire_lease("r", ttl_s=30)  # the Run goes on under it
        att = led.begin_attempt(lease, route="a", envelope_hash="sha256:1", reserve="0.1")
        led.settle_attempt(lease, att.attempt_id, outcome="succeeded", cost="0.01")
        led.release_lease(lease)
        assert replay(led, "goclaw", run="r").runs == 1
