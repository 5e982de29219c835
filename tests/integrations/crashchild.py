"""The executor the integrations' crash tests kill: it opens the ledger named by its first
argument and enters Run ``in-call`` with the plan, budget and grant of the environment
(``PLAN``, ``BUDGET``, ``GRANT``), then lets the test's agent make a call, during which a
named crash point (``LEDGER_FAULTS``) kills the process."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ledger import AsyncLedger, Budget, Grant, Route


async def in_call_run() -> Any:
    """The entered session of Run ``in-call`` (never left: the process dies in it)."""
    routes = [Route.model_validate(r) for r in json.loads(os.environ["PLAN"])]
    led = await AsyncLedger.open(sys.argv[1])
    return await led.run("in-call", plan=routes,
                         budget=Budget.model_validate_json(os.environ["BUDGET"]),
                         grant=Grant.model_validate_json(os.environ["GRANT"])).__aenter__()
