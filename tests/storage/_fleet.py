"""A worker process of the fleet tests (run as ``python -m tests.storage._fleet``).

``python -m tests.storage._fleet MODE URL ENDPOINT NAME DIR``: one process with its own ledger
(``MODE`` ``sync``: a :class:`~ledger.Ledger` and the blocking adapter; ``async``: an
:class:`~ledger.AsyncLedger` and the asyncio one) on ``URL`` (a URL naming every server), running
one turn per Run through the retry owner against the fake provider at ``ENDPOINT``, Run after
Run, until ``DIR/stop`` exists. It never stops on an error: it records it and goes on, as a
host's worker would.

What it saw goes to ``DIR/NAME.jsonl``, one JSON object a line, flushed at once, so the test
reads it while the worker runs:

* ``{"ack": ATTEMPT_ID, "promoted": BOOL}``: a turn the ledger acknowledged (``execute``
  returned; ``promoted``: ``DIR/promoted`` existed when the turn began);
* ``{"error": CLASS, "typed": BOOL, "fields": {...}, "promoted": BOOL}``: an error a call raised
  (``typed``: one of the ledger's, under ``LedgerError``);
* ``{"done": true, "deferred": [ATTEMPT_ID, ...]}``, last: the begins whose ``COMMIT``'s
  outcome was unknown while no primary answered, which the ledger kept to resolve itself
  (``fields["deferred"]``). The worker does nothing about them: the ledger settles each
  ``not_sent`` (it was never sent: sending waits for the begin's acknowledgement) once the
  database answers, at the latest when the worker closes it, and the test checks that it did.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from decimal import Decimal
from typing import Any

from ledger import AsyncLedger, Budget, Envelope, Grant, Ledger, Part, Price, Route
from ledger.adapters import HttpAdapter, SyncAdapter, async_sender, sync_sender
from ledger.api.turn import aexecute, execute
from ledger.domain.facts import WireProtocol
from ledger.errors import DatabaseUnavailable, LedgerError
from ledger.policy.model import StreamingPolicy

PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))
BUDGET = Budget(max_calls=4, max_retries=2, max_cost=Decimal("1"))
GRANT = Grant(recipients={"fake": ["user_input"]})
LIMITS = StreamingPolicy(connect_timeout_s=10.0, read_timeout_s=10.0,
                         first_token_timeout_s=10.0, idle_timeout_s=10.0, total_timeout_s=20.0)
TTL_S = 600.0
# Between two tries while no server takes writes: the worker waits for the database to come
# back, as a host's worker would; the test waits for what the workers report, never for time.
PAUSE_S = 0.05


def plan(endpoint: str) -> list[Route]:
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol=WireProtocol.OPENAI, endpoint=endpoint,
                  price=PRICE),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", protocol=WireProtocol.OPENAI, endpoint=endpoint,
                  price=PRICE)]


class _NoWait:
    def sleep(self, seconds: float) -> None:
        pass

    async def asleep(self, seconds: float) -> None:
        pass


class Report:
    """The worker's log, and the begins the ledger kept to resolve itself."""

    def __init__(self, path: str, flags: str) -> None:
        self.out = open(path, "a")  # noqa: SIM115 - open for the worker's life
        self.flags = flags
        self.deferred: list[str] = []

    def flag(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.flags, name))

    def write(self, **entry: Any) -> None:
        self.out.write(json.dumps(entry, default=str) + "\n")
        self.out.flush()

    def error(self, e: BaseException, promoted: bool) -> None:
        fields = dict(getattr(e, "fields", {}) or {})
        self.write(error=type(e).__name__, typed=isinstance(e, LedgerError), fields=fields,
                   promoted=promoted, text=str(e)[:300])
        if (isinstance(e, DatabaseUnavailable) and fields.get("operation") == "begin"
                and fields.get("deferred")):
            self.deferred.append(str(fields["attempt_id"]))


def run_sync(url: str, endpoint: str, name: str, rep: Report) -> None:
    env = Envelope(parts=[Part(content="Compare the filings.")])
    routes = plan(endpoint)
    led = Ledger.open(url, migrate_schema=False, executor_id=name)
    with SyncAdapter(limits=LIMITS) as adapter:
        send = sync_sender(adapter, limits=LIMITS)
        n = 0
        while not rep.flag("stop"):
            promoted = rep.flag("promoted")
            try:
                n += 1
                run_id = f"{name}-{n}"
                led.admit_run(run_id, plan=routes, budget=BUDGET, grant=GRANT)
                lease = led.acquire_lease(run_id, ttl_s=TTL_S)
                result = execute(led, lease, env, send, sleeper=_NoWait())
                rep.write(ack=result.attempt.attempt_id, promoted=promoted)
                led.release_lease(lease)
            except Exception as e:  # every error is recorded; the test says which are allowed
                rep.error(e, promoted)
                time.sleep(PAUSE_S)
    led.close()


async def run_async(url: str, endpoint: str, name: str, rep: Report) -> None:
    env = Envelope(parts=[Part(content="Compare the filings.")])
    routes = plan(endpoint)
    async with AsyncLedger.open(url, migrate_schema=False, executor_id=name) as led, \
            HttpAdapter(limits=LIMITS) as adapter:
        send = async_sender(adapter, limits=LIMITS)
        n = 0
        while not rep.flag("stop"):
            promoted = rep.flag("promoted")
            try:
                n += 1
                run_id = f"{name}-{n}"
                await led.admit_run(run_id, plan=routes, budget=BUDGET, grant=GRANT)
                lease = await led.acquire_lease(run_id, ttl_s=TTL_S)
                result = await aexecute(led, lease, env, send, sleeper=_NoWait())
                rep.write(ack=result.attempt.attempt_id, promoted=promoted)
                await led.release_lease(lease)
            except Exception as e:
                rep.error(e, promoted)
                await asyncio.sleep(PAUSE_S)


def main(argv: list[str]) -> int:
    mode, url, endpoint, name, flags = argv
    rep = Report(os.path.join(flags, f"{name}.jsonl"), flags)
    if mode == "sync":
        run_sync(url, endpoint, name, rep)
    else:
        asyncio.run(run_async(url, endpoint, name, rep))
    rep.write(done=True, deferred=rep.deferred)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
