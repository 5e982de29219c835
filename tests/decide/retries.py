"""How many same-route retries a policy grants a failure, read through the real decision.

There is no separate "retry plan" in the library: :func:`ledger.decide.retry.retry_decision` is
the one rule, so the tests count its retries instead of asking a second function.
"""

from __future__ import annotations

import random

from ledger.decide.retry import retry_decision
from ledger.domain.facts import FailureFact
from ledger.policy.model import Policy

# Far above any rule's max: a decision that never ends would be a bug, not a long plan.
_CEILING = 1000


def same_route_retries(fact: FailureFact, policy: Policy) -> int:
    """The number of retries ``retry_decision`` allows ``fact`` before it says no."""
    rng = random.Random(0)
    for done in range(_CEILING):
        if not retry_decision(fact, policy, done, rng).retry:
            return done
    raise AssertionError(f"retry_decision never stops retrying {fact.category}")
