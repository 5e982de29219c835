"""Test helpers that ship with the package (the demo uses them too): a fault-injecting fake
provider speaking the OpenAI, Anthropic and Gemini protocols on loopback."""

from ledger.testing.fakeprovider import Behavior, FakeProvider, Fault, ReceivedRequest

__all__ = ["Behavior", "FakeProvider", "Fault", "ReceivedRequest"]
