"""Test helpers that ship with the package (the demo uses them too).

A fault-injecting fake provider speaking the OpenAI (chat completions and the Responses API),
Anthropic and Gemini protocols on loopback (:mod:`~ledger.testing.fakeprovider`), a clock
several processes share (:mod:`~ledger.testing.clock`) and a throwaway PostgreSQL server
(:mod:`~ledger.testing.pgserver`).
"""

from ledger.testing.clock import SharedClock
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault, ReceivedRequest
from ledger.testing.fakewire import ReceivedMedia

__all__ = [
    "Behavior", "FakeProvider", "Fault", "ReceivedMedia", "ReceivedRequest", "SharedClock",
]
