"""Test helpers that ship with the package (the demo uses them too): a fault-injecting fake
provider speaking the OpenAI, Anthropic and Gemini protocols on loopback, and a clock several
processes share."""

from ledger.testing.clock import SharedClock
from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault, ReceivedRequest

__all__ = ["Behavior", "FakeProvider", "Fault", "ReceivedRequest", "SharedClock"]
