"""The test kit: what you need to test your own agent against the ledger, no network, no keys.

* :class:`FakeProvider` (:mod:`~ledger.testing.fakeprovider`): a real HTTP server on loopback
  speaking the OpenAI (chat completions and the Responses API), Anthropic and Gemini protocols,
  whose answers you script per request (:class:`Fault`, :class:`Behavior`: 429 with
  Retry-After, 503, resets, timeouts, broken streams, tool calls) and which records what it
  received (:class:`ReceivedRequest`, with its media as :class:`ReceivedMedia`); point a
  route's ``endpoint`` at it and your agent's turns, failovers and recoveries run as in
  production (``docs/adapters.md``).
* :func:`start_server` / :class:`PgServer` (:mod:`~ledger.testing.pgserver`): a throwaway
  PostgreSQL server on a free loopback port, started from the installed server binaries, for
  tests of a ledger shared by several processes.
* :class:`SharedClock` (:mod:`~ledger.testing.clock`): one clock several processes read and
  your test moves, for multi-process tests (leases that expire exactly when the test says).

In one process, :class:`ledger.ManualClock` is the clock to use. The benchmarks' own helpers
are not here: they live in ``benchmarks/`` beside the package, outside the wheel.
"""

from ledger.testing.clock import SharedClock
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault, ReceivedRequest
from ledger.testing.fakewire import ReceivedMedia
from ledger.testing.pgserver import PgServer, start_server

__all__ = [
    "Behavior", "FakeProvider", "Fault", "PgServer", "ReceivedMedia", "ReceivedRequest",
    "SharedClock", "start_server",
]
